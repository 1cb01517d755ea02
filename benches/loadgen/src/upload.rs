//! `--upload FILE`: a thread that uploads a policy component back to back while a phase runs, to
//! measure routes while the server compiles (issue 18, finding 9).
//!
//! Every upload is `PUT /v1/policies/loadgen-upload?activate=false` of the component with one more
//! custom section carrying a counter, so its digest is new and the server compiles it instead of
//! reusing the compiled component of identical bytes. Not activated, so the routes are answered by
//! the same policy throughout; each upload replaces the previous version of the name.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crate::client::Conn;

/// Uploads running on their own thread until [`Uploader::stop`].
pub struct Uploader {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<UploadStats>,
}

/// What the uploads of one phase did.
#[derive(Debug, Default)]
pub struct UploadStats {
    /// Uploads answered 201.
    pub done: u64,
    /// Uploads answered otherwise (or failed), with the first answer.
    pub failed: u64,
    pub first_error: Option<String>,
    /// Wall time of the uploads answered 201, ms.
    pub total_ms: f64,
    pub max_ms: f64,
}

impl UploadStats {
    /// One line for the report.
    pub fn line(&self) -> String {
        let mean = if self.done > 0 {
            self.total_ms / self.done as f64
        } else {
            0.0
        };
        format!(
            "# uploads during the phase: {} (mean {mean:.0} ms, max {:.0} ms), {} failed{}",
            self.done,
            self.max_ms,
            self.failed,
            self.first_error
                .as_ref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        )
    }
}

impl Uploader {
    /// Starts uploading `component` to the server at `addr`.
    pub fn start(addr: SocketAddr, component: Arc<Vec<u8>>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut conn = Conn::new(addr);
                let mut stats = UploadStats::default();
                let mut n: u64 = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let req = put_request(&addr.to_string(), &component, n);
                    let t = Instant::now();
                    match conn.call(&req) {
                        Ok((201, _)) => {
                            let ms = t.elapsed().as_secs_f64() * 1e3;
                            stats.done += 1;
                            stats.total_ms += ms;
                            stats.max_ms = stats.max_ms.max(ms);
                        }
                        other => {
                            stats.failed += 1;
                            if stats.first_error.is_none() {
                                stats.first_error = Some(match other {
                                    Ok((s, body)) => {
                                        format!("HTTP {s}: {}", String::from_utf8_lossy(body))
                                    }
                                    Err(e) => e.to_string(),
                                });
                            }
                        }
                    }
                }
                stats
            })
        };
        Self { stop, thread }
    }

    /// Stops after the upload in flight and says what the uploads did.
    pub fn stop(self) -> UploadStats {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The upload request: `component` with a custom section `loadgen-upload` holding `n`.
fn put_request(host: &str, component: &[u8], n: u64) -> Vec<u8> {
    const NAME: &[u8] = b"loadgen-upload";
    let mut section = vec![NAME.len() as u8];
    section.extend_from_slice(NAME);
    section.extend_from_slice(&n.to_le_bytes());
    let mut body = component.to_vec();
    body.push(0); // custom section id
    body.push(section.len() as u8); // fits one LEB128 byte
    body.extend_from_slice(&section);
    let mut out = format!(
        "PUT /v1/policies/loadgen-upload?activate=false HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/wasm\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

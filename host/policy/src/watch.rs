//! A polled policy directory: drop `NAME.wasm` (and optionally `NAME.json`, its configuration)
//! in it, and it is validated, loaded and activated; `NAME.pipeline.json` declares a pipeline.
//!
//! Polling (every 500 ms by default) compares each file's modification time and length, and
//! loads a file only once it has been seen unchanged by two consecutive scans (so a file being
//! copied in is not loaded half-written). A file whose bytes and configuration equal the loaded
//! version's is skipped. An invalid file leaves the current policy serving: the reason is logged,
//! `watch_rejected` is bumped, and the file is not retried until it changes. Deleting a file
//! unloads nothing. When several files change in one scan, they are loaded oldest first, so the
//! newest ends up active.
//!
//! When the server was also told which policy to start with (`--policy`), the files already in the
//! directory at start are loaded but not activated: the explicit choice stays active, and a file
//! dropped in (or changed) afterwards is activated as usual.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use super::error::PolicyError;
use super::pipeline::PipelineSpec;
use super::plugin::sha256_hex;
use super::registry::PolicyRegistry;

/// Modification time and length of a policy file and of its configuration file.
type Stamp = (Option<SystemTime>, u64, Option<(Option<SystemTime>, u64)>);

/// What one scan did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScanReport {
    /// Names loaded (and activated, but for files kept inactive at start:
    /// [`DirectoryScanner::keep_active_at_start`]).
    pub loaded: Vec<String>,
    /// Names refused, with the reason.
    pub rejected: Vec<(String, String)>,
}

/// The scanning state of a watched directory; [`Self::scan`] is one poll (the watcher thread
/// calls it periodically; tests can call it directly).
pub struct DirectoryScanner {
    dir: PathBuf,
    /// Stamps already handled (loaded, skipped or refused).
    done: HashMap<String, Stamp>,
    /// Stamps seen once, waiting to be seen unchanged again.
    pending: HashMap<String, Stamp>,
    /// Files present at the first scan whose first load must not activate them
    /// ([`Self::keep_active_at_start`]).
    initial: std::collections::HashSet<String>,
    keep_active_at_start: bool,
    scanned: bool,
}

enum Kind {
    Component,
    Pipeline,
}

fn stamp_of(path: &Path) -> Option<(Option<SystemTime>, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    meta.is_file().then(|| (meta.modified().ok(), meta.len()))
}

impl DirectoryScanner {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            done: HashMap::new(),
            pending: HashMap::new(),
            initial: Default::default(),
            keep_active_at_start: false,
            scanned: false,
        }
    }

    /// Loads the files present at the first scan without activating them, so a policy chosen
    /// explicitly at start stays active; later files are activated as usual.
    pub fn keep_active_at_start(mut self, keep: bool) -> Self {
        self.keep_active_at_start = keep;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// One poll of the directory.
    pub fn scan(&mut self, registry: &PolicyRegistry) -> ScanReport {
        let mut report = ScanReport::default();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot read the policy directory");
                return report;
            }
        };
        let mut ready = Vec::new();
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(file_name) = file_name.to_str() else {
                continue;
            };
            let (name, kind) = if let Some(n) = file_name.strip_suffix(".pipeline.json") {
                (n, Kind::Pipeline)
            } else if let Some(n) = file_name.strip_suffix(".wasm") {
                (n, Kind::Component)
            } else {
                continue;
            };
            let path = entry.path();
            let Some((mtime, len)) = stamp_of(&path) else {
                continue;
            };
            let config_stamp = match kind {
                Kind::Component => stamp_of(&self.dir.join(format!("{name}.json"))),
                Kind::Pipeline => None,
            };
            let stamp: Stamp = (mtime, len, config_stamp);
            let key = file_name.to_string();
            if !self.scanned && self.keep_active_at_start {
                self.initial.insert(key.clone());
            }
            if self.done.get(&key) == Some(&stamp) {
                continue;
            }
            if self.pending.get(&key) != Some(&stamp) {
                self.pending.insert(key, stamp);
                continue;
            }
            self.pending.remove(&key);
            ready.push((mtime, key, name.to_string(), kind, path, stamp));
        }
        self.scanned = true;
        ready.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
        for (_, key, name, kind, path, stamp) in ready {
            // A file from before the start loads unchanged; only a later one (or a change) activates.
            // (`initial` loses a key at its first load, so a key still in it was never loaded.)
            let activate = !self.initial.remove(&key);
            self.done.insert(key, stamp);
            let result = match kind {
                Kind::Component => self.load_component(registry, &name, &path, activate),
                Kind::Pipeline => self.load_pipeline(registry, &name, &path, activate),
            };
            match result {
                Ok(true) => {
                    registry.counters().watch_loaded.fetch_add(1, Relaxed);
                    report.loaded.push(name);
                }
                Ok(false) => {}
                Err(e) => {
                    registry.counters().watch_rejected.fetch_add(1, Relaxed);
                    tracing::warn!(
                        file = %path.display(),
                        error = %e,
                        "policy file refused; the current policy keeps serving"
                    );
                    report.rejected.push((name, e.to_string()));
                }
            }
        }
        report
    }

    /// Loads `NAME.wasm` (+ `NAME.json`); `Ok(false)` when it equals the loaded version.
    fn load_component(
        &self,
        registry: &PolicyRegistry,
        name: &str,
        path: &Path,
        activate: bool,
    ) -> Result<bool, PolicyError> {
        let io = |p: &Path, e: std::io::Error| PolicyError::Io {
            path: p.display().to_string(),
            message: e.to_string(),
        };
        let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
        let config_path = self.dir.join(format!("{name}.json"));
        let config = match std::fs::read_to_string(&config_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io(&config_path, e)),
        };
        if let Some(current) = registry.get(name) {
            let same_config = current.config() == config.as_deref().unwrap_or("{}");
            if !current.is_pipeline() && same_config && current.digest() == sha256_hex(&bytes) {
                return Ok(false);
            }
        }
        registry.load(name, &bytes, config.as_deref(), activate)?;
        Ok(true)
    }

    fn load_pipeline(
        &self,
        registry: &PolicyRegistry,
        name: &str,
        path: &Path,
        activate: bool,
    ) -> Result<bool, PolicyError> {
        let json = std::fs::read_to_string(path).map_err(|e| PolicyError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let spec = PipelineSpec::from_json(&json)?;
        registry.load_pipeline(name, &spec, Some(&self.dir), activate)?;
        Ok(true)
    }
}

/// A thread polling a policy directory; dropping it stops the thread.
pub struct DirectoryWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl DirectoryWatcher {
    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for DirectoryWatcher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn require_dir(dir: &Path) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!(
            "policy directory {} does not exist or is not a directory",
            dir.display()
        ),
    ))
}

impl PolicyRegistry {
    /// [`Self::watch_directory_with`], after loading what the directory holds now, before
    /// returning: a server that answers only after this never serves a policy the directory is
    /// about to replace. A file counts once it looks the same on two scans (it is not being
    /// written), so the two scans here are 100 ms apart.
    pub fn load_and_watch_directory(
        self: &Arc<Self>,
        mut scanner: DirectoryScanner,
        interval: Duration,
    ) -> std::io::Result<DirectoryWatcher> {
        require_dir(&scanner.dir)?;
        scanner.scan(self);
        std::thread::sleep(Duration::from_millis(100));
        scanner.scan(self);
        self.watch_directory_with(scanner, interval)
    }

    /// Polls `dir` every `interval` (500 ms is a good default) in a background thread; see the
    /// [module docs](self) for the rules. The thread ends when the watcher or the registry is dropped.
    pub fn watch_directory(
        self: &Arc<Self>,
        dir: impl Into<PathBuf>,
        interval: Duration,
    ) -> std::io::Result<DirectoryWatcher> {
        self.watch_directory_with(DirectoryScanner::new(dir), interval)
    }

    /// [`Self::watch_directory`] with a configured scanner (e.g.
    /// [`DirectoryScanner::keep_active_at_start`]).
    pub fn watch_directory_with(
        self: &Arc<Self>,
        scanner: DirectoryScanner,
        interval: Duration,
    ) -> std::io::Result<DirectoryWatcher> {
        let dir = scanner.dir.clone();
        require_dir(&dir)?;
        let registry: Weak<Self> = Arc::downgrade(self);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("kvroute-policy-watch".into())
                .spawn(move || {
                    let mut scanner = scanner;
                    while !stop.load(Relaxed) {
                        let Some(registry) = registry.upgrade() else {
                            break;
                        };
                        scanner.scan(&registry);
                        drop(registry);
                        std::thread::park_timeout(interval);
                    }
                })?
        };
        Ok(DirectoryWatcher {
            stop,
            thread: Some(thread),
        })
    }
}

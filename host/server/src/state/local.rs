//! [`LocalDirStore`]: the state in a local directory.
//!
//! ```text
//! DIR/lock                      held (flock) while a server uses the directory
//! DIR/workers.json              {"format": 1, "workers": {"ID": {"spec": {...}, "draining": b}}}
//! DIR/policies.json             {"format": 1, "image": {current, active, history, last_versions}}
//! DIR/rollout.json              {"format": 1, "rollout": {shadows, canary, records}}
//! DIR/components/SHA256.wasm    component bytes, by digest
//! ```
//!
//! Each write goes to a temporary file beside its target, is flushed to disk (`fsync`), renamed
//! over the target and the directory is flushed: a crash leaves the old file or the new one, never
//! a mix. A temporary file left by a crash is removed at start; any other file the store did not
//! write, a file that does not parse, or a component whose bytes do not match its digest refuses
//! the start with an error naming the file.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::{Revision, StateError, StateStore, StoredState, StoredWorker};
use kvroute_policy::{sha256_hex, RegistryImage, RolloutImage};

/// The layout version written in every manifest.
const FORMAT: u32 = 1;
const WORKERS: &str = "workers.json";
const POLICIES: &str = "policies.json";
const ROLLOUT: &str = "rollout.json";
const COMPONENTS: &str = "components";
const LOCK: &str = "lock";
/// Temporary files: `.NAME.tmp` beside their target.
const TMP_SUFFIX: &str = ".tmp";

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkersFile {
    format: u32,
    workers: BTreeMap<u64, StoredWorker>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoliciesFile {
    format: u32,
    image: RegistryImage,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RolloutFile {
    format: u32,
    rollout: RolloutImage,
}

/// The state in a local directory (created if missing).
pub struct LocalDirStore {
    dir: PathBuf,
    /// What `workers.json` holds: each worker write rewrites the file from it.
    workers: Mutex<BTreeMap<u64, StoredWorker>>,
    /// Held for the store's lifetime: a second server on the same directory is refused.
    _lock: File,
}

fn io_error(path: &Path, e: impl std::fmt::Display) -> StateError {
    StateError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn corrupt(path: &Path, message: impl Into<String>) -> StateError {
    StateError::Corrupt {
        path: path.display().to_string(),
        message: message.into(),
    }
}

fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Writes `bytes` to `path` atomically and durably.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("state");
    let tmp = dir.join(format!(".{name}{TMP_SUFFIX}"));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        io_error(path, e)
    })
}

impl LocalDirStore {
    /// Opens (creating it if needed) the state directory and takes its lock.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        fs::create_dir_all(dir.join(COMPONENTS)).map_err(|e| io_error(dir, e))?;
        let lock_path = dir.join(LOCK);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_error(&lock_path, e))?;
        lock.try_lock().map_err(|e| {
            io_error(
                &lock_path,
                format!("{e}: is another kvroute serving this state directory?"),
            )
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            workers: Mutex::new(BTreeMap::new()),
            _lock: lock,
        })
    }

    fn component_path(&self, digest: &str) -> PathBuf {
        self.dir.join(COMPONENTS).join(format!("{digest}.wasm"))
    }

    /// Removes temporary files a crash left, and refuses any file the store did not write.
    fn check_entries(&self) -> Result<(), StateError> {
        let listing = |dir: &Path| -> Result<Vec<(PathBuf, String, bool)>, StateError> {
            let mut out = Vec::new();
            for e in fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
                let e = e.map_err(|e| io_error(dir, e))?;
                let path = e.path();
                let is_dir = e.file_type().map_err(|e| io_error(&path, e))?.is_dir();
                let name = e.file_name().to_string_lossy().into_owned();
                out.push((path, name, is_dir));
            }
            Ok(out)
        };
        for (path, name, is_dir) in listing(&self.dir)? {
            match (name.as_str(), is_dir) {
                (WORKERS | POLICIES | ROLLOUT | LOCK, false) | (COMPONENTS, true) => {}
                (n, false) if n.starts_with('.') && n.ends_with(TMP_SUFFIX) => {
                    fs::remove_file(&path).map_err(|e| io_error(&path, e))?;
                }
                _ => {
                    return Err(corrupt(
                        &path,
                        "not a file kvroute's state store writes; move it out of the state \
                         directory",
                    ))
                }
            }
        }
        for (path, name, is_dir) in listing(&self.dir.join(COMPONENTS))? {
            if !is_dir && name.starts_with('.') && name.ends_with(TMP_SUFFIX) {
                fs::remove_file(&path).map_err(|e| io_error(&path, e))?;
                continue;
            }
            let ok = !is_dir && name.strip_suffix(".wasm").is_some_and(is_digest);
            if !ok {
                return Err(corrupt(
                    &path,
                    "not a component the state store wrote (SHA256.wasm)",
                ));
            }
        }
        Ok(())
    }

    fn read_json<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<T>, StateError> {
        let path = self.dir.join(name);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(&path, e)),
        };
        let format = serde_json::from_slice::<serde_json::Value>(&bytes)
            .map_err(|e| corrupt(&path, format!("not JSON: {e}")))?
            .get("format")
            .and_then(serde_json::Value::as_u64);
        if format != Some(u64::from(FORMAT)) {
            return Err(corrupt(
                &path,
                format!("format {format:?} is not the format this kvroute writes ({FORMAT})"),
            ));
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| corrupt(&path, e.to_string()))
    }

    fn write_workers(&self, workers: &BTreeMap<u64, StoredWorker>) -> Result<(), StateError> {
        let file = WorkersFile {
            format: FORMAT,
            workers: workers.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| io_error(&self.dir, e))?;
        write_atomic(&self.dir.join(WORKERS), &bytes)
    }
}

impl StateStore for LocalDirStore {
    fn load(&self) -> Result<StoredState, StateError> {
        self.check_entries()?;
        let workers = self
            .read_json::<WorkersFile>(WORKERS)?
            .map(|f| f.workers)
            .unwrap_or_default();
        let policies = self.read_json::<PoliciesFile>(POLICIES)?.map(|f| f.image);
        if let Some(image) = &policies {
            for digest in image.digests() {
                let path = self.component_path(digest);
                let bytes = fs::read(&path).map_err(|e| {
                    corrupt(
                        &path,
                        format!("the component of a kept policy version cannot be read: {e}"),
                    )
                })?;
                if sha256_hex(&bytes) != digest {
                    return Err(corrupt(&path, "its bytes do not match its digest"));
                }
            }
        }
        *self.workers.lock() = workers.clone();
        let rollout = self.read_json::<RolloutFile>(ROLLOUT)?.map(|f| f.rollout);
        Ok(StoredState {
            workers,
            policies,
            rollout,
            revisions: Default::default(),
        })
    }

    fn put_worker(&self, worker_id: u64, worker: &StoredWorker) -> Result<Revision, StateError> {
        let mut workers = self.workers.lock();
        let mut next = workers.clone();
        next.insert(worker_id, worker.clone());
        self.write_workers(&next)?;
        *workers = next;
        Ok(0)
    }

    fn delete_worker(&self, worker_id: u64) -> Result<Revision, StateError> {
        let mut workers = self.workers.lock();
        let mut next = workers.clone();
        if next.remove(&worker_id).is_none() {
            return Ok(0);
        }
        self.write_workers(&next)?;
        *workers = next;
        Ok(0)
    }

    fn has_policy_bytes(&self, digest: &str) -> bool {
        is_digest(digest) && self.component_path(digest).is_file()
    }

    fn put_policy_bytes(&self, digest: &str, bytes: &[u8]) -> Result<(), StateError> {
        if !is_digest(digest) || sha256_hex(bytes) != digest {
            return Err(corrupt(
                &self.component_path(digest),
                "the bytes do not match the digest",
            ));
        }
        write_atomic(&self.component_path(digest), bytes)
    }

    fn policy_bytes(&self, digest: &str) -> Result<Vec<u8>, StateError> {
        let path = self.component_path(digest);
        fs::read(&path).map_err(|e| io_error(&path, e))
    }

    fn put_policies(&self, image: &RegistryImage) -> Result<Revision, StateError> {
        let file = PoliciesFile {
            format: FORMAT,
            image: image.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| io_error(&self.dir, e))?;
        write_atomic(&self.dir.join(POLICIES), &bytes).map(|()| 0)
    }

    fn put_rollout(
        &self,
        image: &RolloutImage,
        _expected: Option<Revision>,
    ) -> Result<Revision, StateError> {
        let file = RolloutFile {
            format: FORMAT,
            rollout: image.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| io_error(&self.dir, e))?;
        write_atomic(&self.dir.join(ROLLOUT), &bytes).map(|()| 0)
    }

    fn rollout(&self) -> Result<Option<(RolloutImage, Revision)>, StateError> {
        Ok(self
            .read_json::<RolloutFile>(ROLLOUT)?
            .map(|f| (f.rollout, 0)))
    }

    fn retain_policy_bytes(&self, keep: &[&str]) -> Result<(), StateError> {
        let dir = self.dir.join(COMPONENTS);
        for e in fs::read_dir(&dir).map_err(|e| io_error(&dir, e))? {
            let e = e.map_err(|e| io_error(&dir, e))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(d) = name.strip_suffix(".wasm") {
                if is_digest(d) && !keep.contains(&d) {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.dir.display().to_string()
    }
}

#[cfg(test)]
mod tests;

//! Unit tests of the crate, one file per piece, on the test tokenizer of [`crate::testing`].

mod agent_apis;
mod cache;
mod chat;
mod completion;
mod parity;
mod properties;
mod registry;
mod template;
mod tokenizer;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::testing::write_test_model;
use crate::{Model, ModelSpec, TokenizeError};

/// A directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvroute-tokenize-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The test model, loaded as `test`, and the directory its files are in.
pub(crate) fn test_model() -> (Model, TempDir) {
    let dir = TempDir::new();
    let path = write_test_model(dir.path()).unwrap();
    (Model::load("test", &ModelSpec::new(path)).unwrap(), dir)
}

/// The error's field and reason, with the reason checked to contain `needle`.
#[track_caller]
pub(crate) fn assert_error(err: TokenizeError, field: &str, needle: &str) {
    assert_eq!(err.field(), field, "{err}");
    assert!(
        err.reason().contains(needle),
        "reason {:?} does not contain {needle:?}",
        err.reason()
    );
}

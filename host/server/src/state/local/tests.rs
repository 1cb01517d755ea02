use super::*;
use kvroute_core::workers::WorkerSpec;
use kvroute_policy::VersionImage;

/// A fresh directory under the system's temporary directory (removed on drop).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "kvroute-state-{tag}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn worker(taint: &str) -> StoredWorker {
    StoredWorker {
        spec: WorkerSpec {
            dp_size: 2,
            taints: vec![taint.into()],
            endpoint: Some("http://127.0.0.1:9".into()),
            ..Default::default()
        },
        draining: true,
    }
}

#[test]
fn workers_and_policies_survive_reopening() {
    let dir = TempDir::new("roundtrip");
    let bytes = b"\0asm not really a component".to_vec();
    let digest = sha256_hex(&bytes);
    let v = VersionImage {
        name: "p".into(),
        version: 3,
        digest: digest.clone(),
        config: "{\"a\":1}".into(),
        loaded_at_secs: 1_700_000_000,
    };
    let image = RegistryImage {
        current: vec![v.clone()],
        active: Some(v.clone()),
        history: vec![],
        last_versions: [("p".to_string(), 3)].into(),
    };
    {
        let store = LocalDirStore::open(&dir.0).unwrap();
        assert_eq!(store.load().unwrap(), StoredState::default());
        store.put_worker(7, &worker("a")).unwrap();
        store.put_worker(8, &worker("b")).unwrap();
        store.delete_worker(8).unwrap();
        store.put_policy_bytes(&digest, &bytes).unwrap();
        store.put_policies(&image).unwrap();
    }
    let store = LocalDirStore::open(&dir.0).unwrap();
    let loaded = store.load().unwrap();
    assert_eq!(loaded.workers.len(), 1);
    assert_eq!(loaded.workers[&7], worker("a"));
    assert_eq!(loaded.policies, Some(image));
    assert_eq!(store.policy_bytes(&digest).unwrap(), bytes);
}

#[test]
fn a_second_store_on_the_same_directory_is_refused() {
    let dir = TempDir::new("lock");
    let _first = LocalDirStore::open(&dir.0).unwrap();
    let err = LocalDirStore::open(&dir.0)
        .err()
        .expect("second open refused");
    assert!(err.to_string().contains("another kvroute"), "{err}");
}

#[test]
fn unknown_corrupt_or_mismatched_files_refuse_the_start_naming_the_file() {
    let dir = TempDir::new("corrupt");
    {
        let store = LocalDirStore::open(&dir.0).unwrap();
        store.put_worker(1, &worker("a")).unwrap();
    }
    // A crash's leftover temporary file is removed, not refused.
    fs::write(dir.0.join(".workers.json.tmp"), b"half").unwrap();
    assert_eq!(
        LocalDirStore::open(&dir.0)
            .unwrap()
            .load()
            .unwrap()
            .workers
            .len(),
        1
    );
    assert!(!dir.0.join(".workers.json.tmp").exists());

    fs::write(dir.0.join("notes.txt"), b"hi").unwrap();
    let err = LocalDirStore::open(&dir.0).unwrap().load().unwrap_err();
    assert!(err.to_string().contains("notes.txt"), "{err}");
    fs::remove_file(dir.0.join("notes.txt")).unwrap();

    fs::write(
        dir.0.join(WORKERS),
        b"{\"format\": 1, \"workers\": {\"1\": 5}}",
    )
    .unwrap();
    let err = LocalDirStore::open(&dir.0).unwrap().load().unwrap_err();
    assert!(
        matches!(&err, StateError::Corrupt { path, .. } if path.ends_with(WORKERS)),
        "{err}"
    );
    fs::write(dir.0.join(WORKERS), b"{\"format\": 9, \"workers\": {}}").unwrap();
    let err = LocalDirStore::open(&dir.0).unwrap().load().unwrap_err();
    assert!(err.to_string().contains("format"), "{err}");
    fs::remove_file(dir.0.join(WORKERS)).unwrap();

    // A component whose bytes are not its digest.
    let digest = sha256_hex(b"x");
    fs::write(dir.0.join(COMPONENTS).join(format!("{digest}.wasm")), b"y").unwrap();
    let v = VersionImage {
        name: "p".into(),
        version: 1,
        digest: digest.clone(),
        config: "{}".into(),
        loaded_at_secs: 0,
    };
    let file = PoliciesFile {
        format: FORMAT,
        image: RegistryImage {
            current: vec![v],
            ..Default::default()
        },
    };
    fs::write(dir.0.join(POLICIES), serde_json::to_vec(&file).unwrap()).unwrap();
    let err = LocalDirStore::open(&dir.0).unwrap().load().unwrap_err();
    assert!(
        err.to_string().contains(&format!("{digest}.wasm")) && err.to_string().contains("digest"),
        "{err}"
    );
}

#[test]
fn a_failed_write_keeps_the_previous_file_and_the_store_consistent() {
    let dir = TempDir::new("fail");
    let store = LocalDirStore::open(&dir.0).unwrap();
    store.put_worker(1, &worker("a")).unwrap();
    // A directory where the temporary file goes: the write fails (root or not).
    fs::create_dir(dir.0.join(".workers.json.tmp")).unwrap();
    assert!(matches!(
        store.put_worker(2, &worker("b")),
        Err(StateError::Io { .. })
    ));
    fs::remove_dir(dir.0.join(".workers.json.tmp")).unwrap();
    // The failed worker was not remembered: the next write does not carry it.
    store.put_worker(3, &worker("c")).unwrap();
    drop(store);
    let loaded = LocalDirStore::open(&dir.0).unwrap().load().unwrap();
    assert_eq!(
        loaded.workers.keys().copied().collect::<Vec<_>>(),
        vec![1, 3]
    );
}

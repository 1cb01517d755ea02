//! [`Persisted`]: write-through of the registry and policy changes to a [`StateStore`], with undo.
//!
//! Writes are serialised (one lock): an API change is applied in memory, persisted, and reverted
//! in memory if the store refuses it, before anyone else may write. Changes not made through the
//! API (a policy taken out by the automatic restore, a file of `policy_dir`) are persisted by
//! [`Persisted::sync_policies`], which the maintenance ticker calls every second.
//!
//! With a shared store (cluster mode) the lock also orders the other replicas' changes against
//! this one's: each record's [`Revision`] last written or applied here is kept, and a change
//! from elsewhere older than it is skipped (last writer wins, every replica converges on what
//! the store holds). [`Persisted::reconcile`] makes this replica what the store holds after it
//! was cut off from it.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Record, Revision, StateError, StateStore, StoredState, StoredWorker};
use kvroute_core::router::Router;
use kvroute_core::workers::WorkerPatch;
use kvroute_policy::{PolicyRegistry, RegistryImage, RolloutImage};

/// A store and the write lock around it.
pub struct Persisted {
    store: Box<dyn StateStore>,
    /// Serialises writes; what was last written or applied.
    written: Mutex<Written>,
    /// The store held policies when it was loaded (they are restored: a policy directory's files
    /// then do not replace the restored active policy at start).
    restored_policies: std::sync::atomic::AtomicBool,
}

/// What the write lock guards.
#[derive(Default)]
struct Written {
    /// The policy image last written or applied (to skip unchanged ones).
    image: Option<RegistryImage>,
    /// The rollout state last written or applied (`None`: never written).
    rollout: Option<RolloutImage>,
    /// Each record's revision last written or applied here.
    revisions: HashMap<Record, Revision>,
}

impl Written {
    /// Notes a record written or applied at `revision`.
    fn note(&mut self, record: Record, revision: Revision) {
        let r = self.revisions.entry(record).or_default();
        *r = (*r).max(revision);
    }

    /// Whether a change from elsewhere at `revision` is newer than what this replica holds (a
    /// store without revisions, 0, always is).
    fn newer(&self, record: Record, revision: Revision) -> bool {
        revision == 0 || self.revisions.get(&record).is_none_or(|&r| revision > r)
    }
}

/// What [`Persisted::reconcile`] changed.
#[derive(Debug, Default, PartialEq)]
pub struct Reconciled {
    /// Workers registered, replaced or removed to match the store.
    pub workers: usize,
    /// Whether the policy registry was replaced by the store's.
    pub policies: bool,
}

impl Persisted {
    pub fn new(store: Box<dyn StateStore>) -> Arc<Self> {
        Arc::new(Self {
            store,
            written: Mutex::new(Written::default()),
            restored_policies: Default::default(),
        })
    }

    pub fn store(&self) -> &dyn StateStore {
        &*self.store
    }

    /// Loads the store (at start).
    pub fn load(&self) -> Result<StoredState, StateError> {
        let state = self.store.load()?;
        let mut written = self.written.lock();
        written.image = state.policies.clone();
        written.rollout = state.rollout.clone();
        written.revisions = state.revisions.iter().map(|(&k, &v)| (k, v)).collect();
        drop(written);
        self.restored_policies.store(
            state.policies.is_some(),
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(state)
    }

    /// Whether the store held policies when it was loaded.
    pub fn restored_policies(&self) -> bool {
        self.restored_policies
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs a change to worker `worker_id` (`op`, which applies it to the router) and persists
    /// the worker as it then is. If the store fails, the worker is put back as it was and the
    /// store's error is returned; `op`'s own error changes nothing and is returned as is.
    pub fn worker_write<T, E>(
        &self,
        router: &Router,
        worker_id: u64,
        op: impl FnOnce() -> Result<T, E>,
    ) -> Result<Result<T, E>, StateError> {
        let mut written = self.written.lock();
        let before = router
            .registry()
            .snapshot()
            .workers
            .get(&worker_id)
            .map(StoredWorker::of);
        let out = match op() {
            Ok(v) => v,
            Err(e) => return Ok(Err(e)),
        };
        let after = router
            .registry()
            .snapshot()
            .workers
            .get(&worker_id)
            .cloned();
        let persisted = match &after {
            Some(w) => self.store.put_worker(worker_id, &StoredWorker::of(w)),
            None => self.store.delete_worker(worker_id),
        };
        match persisted {
            Ok(revision) => written.note(Record::Worker(worker_id), revision),
            Err(e) => {
                restore_worker(router, worker_id, before.as_ref());
                tracing::error!(worker_id, error = %e, "worker change not persisted: undone");
                return Err(e);
            }
        }
        Ok(Ok(out))
    }

    /// Runs a policy registry operation and persists the registry's image. If the store fails,
    /// the registry is reverted to what it was before `op` and the store's error is returned.
    pub fn policy_write<T, E>(
        &self,
        registry: &PolicyRegistry,
        op: impl FnOnce() -> Result<T, E>,
    ) -> Result<Result<T, E>, StateError> {
        let mut written = self.written.lock();
        let checkpoint = registry.checkpoint();
        let out = match op() {
            Ok(v) => v,
            Err(e) => return Ok(Err(e)),
        };
        // The rollout first: it is the record a concurrent change can conflict on (compare and
        // set), and a promotion's record must not be lost after its activation was written.
        if let Err(e) = self.write_rollout(registry, &mut written) {
            registry.revert(checkpoint);
            if matches!(e, StateError::Conflict { .. }) {
                // Take up what the other replica wrote, so a retry starts from it.
                if let Err(e) = self.catch_up_rollout(registry, &mut written) {
                    tracing::warn!(error = %e, "cannot read the rollout state after a conflict");
                }
            }
            tracing::error!(error = %e, "policy change not persisted: undone");
            return Err(e);
        }
        if let Err(e) = self.write_image(registry, &mut written) {
            registry.revert(checkpoint);
            // The rollout state was written with the change: put it back as it was.
            if let Err(e) = self.write_rollout(registry, &mut written) {
                tracing::error!(error = %e, "cannot put the rollout state back; retrying in a second");
            }
            tracing::error!(error = %e, "policy change not persisted: undone");
            return Err(e);
        }
        Ok(Ok(out))
    }

    /// Persists the policy registry's image if it changed since the last write (changes made
    /// outside the API). A failure is logged and retried on the next call.
    ///
    /// The rollout state goes first (a guardrail's rollback or promotion decided here), by
    /// compare-and-set: if another replica wrote it meanwhile, its record is read and applied
    /// ([`kvroute_policy::merge_rollout`]: a canary another replica ended first keeps that
    /// replica's record everywhere, and a promotion of this one that lost is undone) and what
    /// remains of this replica's change is written on top. The image is written only once the
    /// rollout state is.
    pub fn sync_policies(&self, registry: &PolicyRegistry) {
        let mut written = self.written.lock();
        let mut rollout = self.write_rollout(registry, &mut written);
        if matches!(rollout, Err(StateError::Conflict { .. })) {
            rollout = self
                .catch_up_rollout(registry, &mut written)
                .and_then(|()| self.write_rollout(registry, &mut written));
        }
        if let Err(e) = rollout {
            tracing::warn!(error = %e, "rollout state not persisted; retrying in a second");
            return;
        }
        if let Err(e) = self.write_image(registry, &mut written) {
            tracing::warn!(error = %e, "policy state not persisted; retrying in a second");
        }
    }

    /// Whether the registry's rollout state differs from what was last written or applied: a
    /// guardrail ended a canary here and [`Self::sync_policies`] has yet to write it.
    pub fn rollout_dirty(&self, registry: &PolicyRegistry) -> bool {
        let image = registry.rollout_image();
        match &self.written.lock().rollout {
            Some(w) => *w != image,
            None => image != RolloutImage::default(),
        }
    }

    /// Applies the rollout state another replica wrote at `revision` (the watch), under the
    /// write lock; an older one than held here is skipped. Returns whether anything changed.
    pub fn apply_remote_rollout(
        &self,
        registry: &PolicyRegistry,
        image: &RolloutImage,
        revision: Revision,
    ) -> bool {
        let mut written = self.written.lock();
        if !written.newer(Record::Rollout, revision) {
            return false;
        }
        self.apply_rollout(registry, image, revision, &mut written)
    }

    /// Reads the store's rollout state and applies it (after a write refused as a conflict).
    fn catch_up_rollout(
        &self,
        registry: &PolicyRegistry,
        written: &mut Written,
    ) -> Result<(), StateError> {
        if let Some((image, revision)) = self.store.rollout()? {
            self.apply_rollout(registry, &image, revision, written);
        }
        Ok(())
    }

    /// Makes the registry's rollout state the store's `image` (at `revision`), keeping what this
    /// replica decided and has not written yet unless the store already decided otherwise
    /// ([`kvroute_policy::merge_rollout`]).
    fn apply_rollout(
        &self,
        registry: &PolicyRegistry,
        image: &RolloutImage,
        revision: Revision,
        written: &mut Written,
    ) -> bool {
        let before = written.rollout.clone().unwrap_or_default();
        let (target, overridden) =
            kvroute_policy::merge_rollout(image, &registry.rollout_image(), &before);
        for r in &overridden {
            registry.undo_promotion(r);
        }
        let changed = registry.set_rollout(&target);
        written.rollout = Some(image.clone());
        written.note(Record::Rollout, revision);
        changed
    }

    /// Writes the registry's rollout state if it changed since it was last written or applied,
    /// compare-and-set on the revision last seen.
    fn write_rollout(
        &self,
        registry: &PolicyRegistry,
        written: &mut Written,
    ) -> Result<(), StateError> {
        let image = registry.rollout_image();
        let unchanged = match &written.rollout {
            Some(w) => *w == image,
            None => image == RolloutImage::default(),
        };
        if unchanged {
            return Ok(());
        }
        let expected = written.rollout.as_ref().map(|_| {
            written
                .revisions
                .get(&Record::Rollout)
                .copied()
                .unwrap_or(0)
        });
        let revision = self.store.put_rollout(&image, expected)?;
        written.note(Record::Rollout, revision);
        written.rollout = Some(image);
        Ok(())
    }

    /// Persists every registered worker (at start, after the configuration file's are applied).
    pub fn put_all_workers(&self, router: &Router) -> Result<(), StateError> {
        let mut written = self.written.lock();
        for w in router.registry().snapshot().workers.values() {
            let revision = self.store.put_worker(w.worker_id, &StoredWorker::of(w))?;
            written.note(Record::Worker(w.worker_id), revision);
        }
        Ok(())
    }

    /// Applies a worker change another replica made (`None`: removed) at `revision` under the
    /// write lock, so it never falls inside a local write's undo window; a change older than
    /// the worker's last one written or applied here is skipped. Nothing is written back.
    /// Returns whether the worker changed here.
    pub fn apply_remote_worker(
        &self,
        router: &Router,
        worker_id: u64,
        worker: Option<&StoredWorker>,
        revision: Revision,
    ) -> bool {
        let mut written = self.written.lock();
        if !written.newer(Record::Worker(worker_id), revision) {
            return false;
        }
        written.note(Record::Worker(worker_id), revision);
        let now = router
            .registry()
            .snapshot()
            .workers
            .get(&worker_id)
            .map(StoredWorker::of);
        if now.as_ref() == worker {
            return false;
        }
        restore_worker(router, worker_id, worker);
        true
    }

    /// Makes the policy registry what `image` (another replica's write at `revision`) says,
    /// loading the components it does not hold from the store; versions it holds unchanged are
    /// kept. An image older than the last one written or applied here is skipped. The image is
    /// then the one written, so it is not written back. A version this replica's runtime refuses
    /// leaves the registry as it was and returns the error. Returns whether the registry changed.
    pub fn apply_remote_policies(
        &self,
        registry: &PolicyRegistry,
        image: &RegistryImage,
        revision: Revision,
    ) -> Result<bool, kvroute_policy::PolicyError> {
        let mut written = self.written.lock();
        if !written.newer(Record::Policies, revision) {
            return Ok(false);
        }
        let changed = self.apply_image(registry, image, &mut written)?;
        written.note(Record::Policies, revision);
        Ok(changed)
    }

    /// Makes this replica what the store holds (after it was cut off from it: NATS came back),
    /// under the write lock so no local write falls in between: every stored worker registered
    /// as stored, every worker the store does not hold removed, the store's policy image applied
    /// (a version this replica's runtime refuses leaves the policies as they were and is
    /// logged). The revisions read replace the ones held. Nothing is written back.
    pub fn reconcile(
        &self,
        router: &Router,
        registry: &PolicyRegistry,
    ) -> Result<Reconciled, StateError> {
        let mut written = self.written.lock();
        let StoredState {
            workers,
            policies,
            rollout,
            revisions,
        } = self.store.load()?;
        let mut out = Reconciled::default();
        let held = router.registry().snapshot();
        let ids: BTreeSet<u64> = held.workers.keys().chain(workers.keys()).copied().collect();
        for id in ids {
            let now = held.workers.get(&id).map(StoredWorker::of);
            let stored = workers.get(&id);
            if now.as_ref() != stored {
                restore_worker(router, id, stored);
                out.workers += 1;
            }
        }
        if let Some(image) = &policies {
            match self.apply_image(registry, image, &mut written) {
                Ok(changed) => out.policies = changed,
                Err(e) => tracing::error!(
                    error = %e,
                    "the cluster's policies are refused by this replica's runtime: this replica \
                     keeps its policies as they were"
                ),
            }
        }
        if let Some(image) = &rollout {
            let revision = revisions.get(&Record::Rollout).copied().unwrap_or(0);
            // Not "newer" checked: the store's record is the one to hold now.
            written.revisions.remove(&Record::Rollout);
            self.apply_rollout(registry, image, revision, &mut written);
        }
        written.revisions = revisions.into_iter().collect();
        Ok(out)
    }

    fn apply_image(
        &self,
        registry: &PolicyRegistry,
        image: &RegistryImage,
        written: &mut Written,
    ) -> Result<bool, kvroute_policy::PolicyError> {
        if &registry.image() == image {
            written.image = Some(image.clone());
            return Ok(false);
        }
        registry.restore(image, |digest| match registry.component_bytes(digest) {
            Some(b) => Ok(b.to_vec()),
            None => self
                .store
                .policy_bytes(digest)
                .map_err(|e| kvroute_policy::PolicyError::Io {
                    path: format!("component {digest}"),
                    message: e.to_string(),
                }),
        })?;
        written.image = Some(registry.image());
        Ok(true)
    }

    fn write_image(
        &self,
        registry: &PolicyRegistry,
        written: &mut Written,
    ) -> Result<(), StateError> {
        let image = registry.image();
        if written.image.as_ref() == Some(&image) {
            return Ok(());
        }
        for digest in image.digests() {
            if !self.store.has_policy_bytes(digest) {
                let bytes = registry
                    .component_bytes(digest)
                    .ok_or_else(|| StateError::Io {
                        path: self.store.describe(),
                        message: format!("the bytes of component {digest} are not loaded"),
                    })?;
                self.store.put_policy_bytes(digest, &bytes)?;
            }
        }
        let revision = self.store.put_policies(&image)?;
        written.note(Record::Policies, revision);
        let _ = self.store.retain_policy_bytes(&image.digests());
        written.image = Some(image);
        Ok(())
    }
}

/// Puts a worker back as it was (`None`: not registered).
fn restore_worker(router: &Router, worker_id: u64, before: Option<&StoredWorker>) {
    match before {
        None => {
            router.remove_worker(worker_id);
        }
        Some(stored) => {
            if let Err(e) = router.upsert_worker(worker_id, stored.spec.clone()) {
                tracing::error!(worker_id, error = %e, "cannot put the worker back");
                return;
            }
            let _ = router.patch_worker_with(
                worker_id,
                WorkerPatch {
                    draining: Some(stored.draining),
                    ..Default::default()
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_policy::{CanarySpec, PolicyRuntimeConfig, ShadowSpec};

    /// A store with revisions in memory, as the cluster's bucket numbers its writes: a rollout
    /// write is refused unless the record is still at the revision the writer expects.
    #[derive(Default)]
    struct Shared {
        seq: u64,
        image: Option<RegistryImage>,
        rollout: Option<(RolloutImage, Revision)>,
        rollout_writes: Vec<RolloutImage>,
    }

    struct MemStore(Arc<Mutex<Shared>>);

    impl StateStore for MemStore {
        fn load(&self) -> Result<StoredState, StateError> {
            let s = self.0.lock();
            Ok(StoredState {
                workers: Default::default(),
                policies: s.image.clone(),
                rollout: s.rollout.as_ref().map(|r| r.0.clone()),
                revisions: s
                    .rollout
                    .as_ref()
                    .map(|r| (Record::Rollout, r.1))
                    .into_iter()
                    .collect(),
            })
        }
        fn put_worker(&self, _: u64, _: &StoredWorker) -> Result<Revision, StateError> {
            let mut s = self.0.lock();
            s.seq += 1;
            Ok(s.seq)
        }
        fn delete_worker(&self, _: u64) -> Result<Revision, StateError> {
            let mut s = self.0.lock();
            s.seq += 1;
            Ok(s.seq)
        }
        fn has_policy_bytes(&self, _: &str) -> bool {
            true
        }
        fn put_policy_bytes(&self, _: &str, _: &[u8]) -> Result<(), StateError> {
            Ok(())
        }
        fn policy_bytes(&self, digest: &str) -> Result<Vec<u8>, StateError> {
            Err(StateError::Io {
                path: digest.into(),
                message: "not kept".into(),
            })
        }
        fn put_policies(&self, image: &RegistryImage) -> Result<Revision, StateError> {
            let mut s = self.0.lock();
            s.seq += 1;
            s.image = Some(image.clone());
            Ok(s.seq)
        }
        fn put_rollout(
            &self,
            image: &RolloutImage,
            expected: Option<Revision>,
        ) -> Result<Revision, StateError> {
            let mut s = self.0.lock();
            if s.rollout.as_ref().map(|r| r.1) != expected {
                return Err(StateError::Conflict {
                    path: "memory".into(),
                    message: format!("expected {expected:?}"),
                });
            }
            s.seq += 1;
            s.rollout = Some((image.clone(), s.seq));
            s.rollout_writes.push(image.clone());
            Ok(s.seq)
        }
        fn rollout(&self) -> Result<Option<(RolloutImage, Revision)>, StateError> {
            Ok(self.0.lock().rollout.clone())
        }
        fn retain_policy_bytes(&self, _: &[&str]) -> Result<(), StateError> {
            Ok(())
        }
        fn describe(&self) -> String {
            "memory".into()
        }
    }

    fn replica(shared: &Arc<Mutex<Shared>>) -> (Arc<Persisted>, PolicyRegistry) {
        let reg = PolicyRegistry::new(PolicyRuntimeConfig::default()).unwrap();
        reg.set_shared_rollout(true);
        reg.load("default", kvroute_policy::DEFAULT_POLICY_WASM, None, true)
            .unwrap();
        reg.load("dynamo", kvroute_policy::DYNAMO_POLICY_WASM, None, false)
            .unwrap();
        let p = Persisted::new(Box::new(MemStore(shared.clone())));
        p.load().unwrap();
        (p, reg)
    }

    fn spec() -> CanarySpec {
        CanarySpec::from_json(r#"{"fraction": 0.3}"#).unwrap()
    }

    /// Two replicas end the same canary at once, one rolling it back (here: stopped), the other
    /// promoting it. The first to write wins; the other's compare-and-set is refused, it takes the
    /// winner's record up and undoes its own promotion. One end is written, the same record is
    /// held by both, the active version is the same on both.
    #[test]
    fn two_replicas_ending_one_canary_at_once_write_one_record() {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let ((pa, a), (pb, b)) = (replica(&shared), replica(&shared));
        pa.policy_write(&a, || a.start_canary("dynamo", &spec()))
            .unwrap()
            .unwrap();
        let (image, rev) = shared.lock().rollout.clone().unwrap();
        assert!(pb.apply_remote_rollout(&b, &image, rev));
        assert_eq!(b.rollout_image(), image);
        // Applied again (the watch and a catch-up both deliver it): skipped.
        assert!(!pb.apply_remote_rollout(&b, &image, rev));

        // Both decide, in memory, before either writes.
        a.stop_canary("dynamo").unwrap();
        b.promote("dynamo").unwrap();
        assert_eq!(b.active_info().unwrap().name, "dynamo");
        pa.sync_policies(&a);
        pb.sync_policies(&b);

        let s = shared.lock();
        assert_eq!(s.rollout_writes.len(), 2, "the start and one end");
        let stored = s.rollout.as_ref().unwrap().0.clone();
        drop(s);
        assert!(stored.canary.is_none());
        assert_eq!(stored.records.len(), 1);
        assert_eq!(stored.records[0].outcome, "stopped");
        assert_eq!(a.rollout_image(), stored);
        assert_eq!(b.rollout_image(), stored, "B took A's record up");
        assert_eq!(
            b.active_info().unwrap().name,
            "default",
            "B's promotion that lost was undone"
        );
        assert!(b.canary_report("dynamo").0.is_none());
    }

    /// A replica whose view of the rollout is stale (another replica wrote since) is refused its
    /// change: undone here (no canary half started), the other's change taken up, and a retry
    /// then goes through.
    #[test]
    fn a_rollout_change_on_a_stale_replica_is_refused_and_undone() {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let ((pa, a), (pb, b)) = (replica(&shared), replica(&shared));
        pa.policy_write(&a, || {
            a.start_shadow(
                "dynamo",
                &ShadowSpec {
                    version: None,
                    sample: 0.5,
                },
            )
        })
        .unwrap()
        .unwrap();
        // B has not heard of it: its write must not erase A's shadow.
        let e = pb
            .policy_write(&b, || b.start_canary("dynamo", &spec()))
            .unwrap_err();
        assert!(matches!(e, StateError::Conflict { .. }), "{e}");
        assert!(b.canary_report("dynamo").0.is_none(), "undone");
        assert_eq!(b.shadow_report("dynamo").map(|s| s.sample), Some(0.5));
        // Retried, it goes through on top of A's change.
        pb.policy_write(&b, || b.start_canary("dynamo", &spec()))
            .unwrap()
            .unwrap();
        let stored = shared.lock().rollout.clone().unwrap().0;
        assert_eq!(stored.shadows.len(), 1);
        assert_eq!(stored.canary.as_ref().map(|c| c.spec.fraction), Some(0.3));
    }
}

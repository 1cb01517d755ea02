use super::*;

fn spec(taints: &[&str], dp: u32) -> WorkerSpec {
    WorkerSpec {
        dp_size: dp,
        taints: taints.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[test]
fn ranks_are_candidates_and_taints_are_interned() {
    let idx = Indexer::new();
    let reg = Registry::new(RegistryLimits::default());
    reg.upsert(2, spec(&["zone=a", "gpu=h100"], 2), &idx)
        .unwrap();
    reg.upsert(1, spec(&["zone=b"], 1), &idx).unwrap();
    let s = reg.snapshot();
    let keys: Vec<_> = s.candidates.iter().map(|c| c.key).collect();
    assert_eq!(
        keys,
        vec![
            CandidateKey::new(1, 0),
            CandidateKey::new(2, 0),
            CandidateKey::new(2, 1)
        ]
    );
    let a = s.taint_id("zone=a").unwrap();
    assert!(s.candidates[1].has_taint(a) && !s.candidates[0].has_taint(a));
    assert_eq!(s.taints.version, 3);
    assert_eq!(s.taint_name(a), Some("zone=a"));
}

#[test]
fn patch_replaces_taints_and_drains() {
    let idx = Indexer::new();
    let reg = Registry::new(RegistryLimits::default());
    reg.upsert(1, spec(&["a"], 1), &idx).unwrap();
    let w = reg
        .patch(1, Some(vec!["b".into()]), Some(true), &idx)
        .unwrap()
        .unwrap();
    assert_eq!(w.taints, vec!["b".to_string()]);
    let s = reg.snapshot();
    assert!(s.candidates[0].draining);
    assert!(!s.candidates[0].has_taint(s.taint_id("a").unwrap()));
    assert!(reg.patch(9, None, Some(true), &idx).unwrap().is_none());
    // Draining survives a re-registration.
    reg.upsert(1, spec(&["b"], 1), &idx).unwrap();
    assert!(reg.snapshot().candidates[0].draining);
}

#[test]
fn invalid_specs_name_the_field_and_change_nothing() {
    let idx = Indexer::new();
    let reg = Registry::new(RegistryLimits::default());
    let e = reg.upsert(1, spec(&["kvroute.x"], 1), &idx).unwrap_err();
    assert_eq!(e.field, "taints[0]");
    let e = reg.upsert(1, spec(&[], 0), &idx).unwrap_err();
    assert_eq!(e.field, "dp_size");
    assert!(reg.snapshot().workers.is_empty());
}

#[test]
fn shrinking_ranks_and_removal_clear_the_index() {
    use crate::indexer::{KvEvent, KvEventData, StoredBlock, Tier};
    let idx = Indexer::new();
    let reg = Registry::new(RegistryLimits::default());
    reg.upsert(1, spec(&[], 2), &idx).unwrap();
    let store = |rank| KvEvent {
        candidate: CandidateKey::new(1, rank),
        tier: Tier::Device,
        event_id: 0,
        data: KvEventData::Stored {
            parent_hash: None,
            blocks: vec![StoredBlock {
                block_hash: 1,
                tokens_hash: 1,
            }],
        },
    };
    idx.apply(&store(0)).unwrap();
    idx.apply(&store(1)).unwrap();
    let (_, dropped) = reg.upsert(1, spec(&[], 1), &idx).unwrap();
    assert_eq!(dropped, vec![CandidateKey::new(1, 1)]);
    assert_eq!(idx.find_matches(&[1]).device.len(), 1);
    assert!(reg.remove(1, &idx).is_some());
    assert!(idx.find_matches(&[1]).device.is_empty());
    assert!(reg.remove(1, &idx).is_none());
}

fn with_events(dp: u32, endpoint: &str, replay: Option<&str>) -> WorkerSpec {
    WorkerSpec {
        dp_size: dp,
        kv_events: Some(KvEventsSpec {
            endpoint: endpoint.into(),
            replay_endpoint: replay.map(Into::into),
            topic: String::new(),
        }),
        ..Default::default()
    }
}

/// The README once registered `dp_size = 2` with endpoint :5557 and replay :5558: rank 1's
/// publisher is at 5557 + 1, so rank 0 would have replayed from rank 1's publisher.
#[test]
fn a_workers_ranks_may_not_share_an_endpoint() {
    let idx = Indexer::new();
    let reg = Registry::new(RegistryLimits::default());
    let e = reg
        .upsert(
            1,
            with_events(2, "tcp://10.0.0.5:5557", Some("tcp://10.0.0.5:5558")),
            &idx,
        )
        .unwrap_err();
    assert_eq!(e.field, "kv_events.replay_endpoint");
    assert!(
        e.message.contains(
            "rank 0's replay endpoint tcp://10.0.0.5:5558 is rank 1's publisher endpoint"
        ),
        "{e}"
    );
    assert!(e.message.contains("gap of dp_size (2)"), "{e}");
    // The same port for both sockets of one rank.
    let e = reg
        .upsert(
            1,
            with_events(1, "tcp://*:5557", Some("tcp://127.0.0.1:5557")),
            &idx,
        )
        .unwrap_err();
    assert!(
        e.message
            .contains("rank 0's replay endpoint tcp://127.0.0.1:5557 is rank 0's publisher"),
        "{e}"
    );
    // Replay below the publisher, overlapping from the other side (ranks 2..6 from dp_start 2).
    let mut s = with_events(4, "tcp://h:6000", Some("tcp://h:5998"));
    s.dp_start = 2;
    let e = reg.upsert(1, s, &idx).unwrap_err();
    assert!(
        e.message
            .contains("rank 4's replay endpoint tcp://h:6002 is rank 2's publisher"),
        "{e}"
    );
    assert!(reg.snapshot().workers.is_empty());
    // A gap of dp_size is enough, and another host is another socket.
    reg.upsert(
        1,
        with_events(2, "tcp://10.0.0.5:5557", Some("tcp://10.0.0.5:5559")),
        &idx,
    )
    .unwrap();
    reg.upsert(
        2,
        with_events(2, "tcp://10.0.0.6:5557", Some("tcp://10.0.0.6:5558")),
        &idx,
    )
    .unwrap_err();
    reg.upsert(
        2,
        with_events(2, "tcp://10.0.0.6:5557", Some("tcp://10.0.0.6:5559")),
        &idx,
    )
    .unwrap();
}

#[test]
fn workers_may_not_share_an_endpoint_and_freed_ones_are_reusable() {
    let idx = Indexer::new();
    let reg = Registry::new(RegistryLimits::default());
    reg.upsert(
        7,
        with_events(2, "tcp://h:5557", Some("tcp://h:5560")),
        &idx,
    )
    .unwrap();
    // Worker 8's publisher for rank 0 is worker 7's rank 1 publisher.
    let e = reg
        .upsert(8, with_events(1, "tcp://h:5558", None), &idx)
        .unwrap_err();
    assert_eq!(e.field, "kv_events.endpoint");
    assert!(
        e.message.contains(
            "rank 0's publisher endpoint tcp://h:5558 is already worker 7's rank 1 publisher \
             endpoint"
        ),
        "{e}"
    );
    // Worker 8's replay on worker 7's replay.
    let e = reg
        .upsert(
            8,
            with_events(1, "tcp://h:6000", Some("tcp://h:5561")),
            &idx,
        )
        .unwrap_err();
    assert_eq!(e.field, "kv_events.replay_endpoint");
    assert!(
        e.message.contains("worker 7's rank 1 replay endpoint"),
        "{e}"
    );
    assert!(!reg.snapshot().workers.contains_key(&8));
    // Re-registering worker 7 on its own endpoints is no clash; moving it frees the old ones.
    reg.upsert(
        7,
        with_events(2, "tcp://h:5557", Some("tcp://h:5560")),
        &idx,
    )
    .unwrap();
    reg.upsert(7, with_events(1, "tcp://h:7000", None), &idx)
        .unwrap();
    reg.upsert(8, with_events(1, "tcp://h:5558", None), &idx)
        .unwrap();
    // Removal frees them too.
    assert!(reg
        .upsert(9, with_events(1, "tcp://h:7000", None), &idx)
        .is_err());
    reg.remove(7, &idx).unwrap();
    reg.upsert(9, with_events(1, "tcp://h:7000", None), &idx)
        .unwrap();
}

#[test]
fn role_and_topology_derive_taints_and_patch_like_taints() {
    let idx = Indexer::new();
    let reg = Registry::new(RegistryLimits::default());
    let zoned = WorkerSpec {
        role: Role::Prefill,
        topology: [("zone".to_string(), "a".to_string())].into(),
        ..spec(&["gpu"], 2)
    };
    let w = reg.upsert(1, zoned, &idx).unwrap().0;
    assert_eq!(
        (w.role, w.taints.clone()),
        (Role::Prefill, vec!["gpu".to_string()])
    );
    let s = reg.snapshot();
    let zone_a = s.taint_id("topology/zone=a").unwrap();
    assert!(s
        .candidates
        .iter()
        .all(|c| c.has_taint(zone_a) && c.role == Role::Prefill));
    assert_eq!(s.prefill_role_workers, 1);
    // A client cannot set a taint in the host's namespace.
    let e = reg
        .upsert(2, spec(&["ok", "topology/zone=a"], 1), &idx)
        .unwrap_err();
    assert_eq!(e.field, "taints[1]");
    assert!(e.message.contains("topology/"), "{}", e.message);
    // PATCH changes role and topology; the derived taint follows.
    let patch = WorkerPatch {
        role: Some(Role::Decode),
        topology: Some([("zone".to_string(), "b".to_string())].into()),
        ..Default::default()
    };
    let w = reg.patch_with(1, patch, &idx).unwrap().unwrap();
    assert_eq!(w.role, Role::Decode);
    let s = reg.snapshot();
    let zone_b = s.taint_id("topology/zone=b").unwrap();
    assert!(s
        .candidates
        .iter()
        .all(|c| c.has_taint(zone_b) && !c.has_taint(zone_a)));
    assert!(s
        .candidates
        .iter()
        .all(|c| c.has_taint(s.taint_id("gpu").unwrap())));
    assert_eq!(s.prefill_role_workers, 0);
    // A refused patch changes nothing.
    let bad = WorkerPatch {
        role: Some(Role::Prefill),
        topology: Some([("zone".to_string(), String::new())].into()),
        ..Default::default()
    };
    assert_eq!(
        reg.patch_with(1, bad, &idx).unwrap_err().field,
        "topology.zone"
    );
    assert_eq!(reg.snapshot().workers[&1].role, Role::Decode);
}

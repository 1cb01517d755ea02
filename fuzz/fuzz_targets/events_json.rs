//! The body of `POST /v1/events`, read as the handler reads it: a JSON array parsed with
//! `parse_json`, each item read by `EventEnvelope::read_item` (the handler's own function: the
//! envelope through `serde_path_to_error`, then its tier), turned into the core's event and
//! applied to an index (a clear to every tier, as the handler does).
//!
//! Asserts: no panic; every refused item has one of the handler's drop codes and a message; a
//! `stored` event keeps its blocks in order; the index keeps its structural invariants after
//! every event.
#![no_main]

use kvroute_core::candidate::CandidateKey;
use kvroute_core::indexer::{Indexer, KvEvent, KvEventData, Tier};
use kvroute_server::http::dto::{EventData, EventEnvelope};
use kvroute_server::http::error::parse_json;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(items) = parse_json::<Vec<&serde_json::value::RawValue>>(data) else {
        return;
    };
    let index = Indexer::new();
    for item in items {
        let (env, tier) = match EventEnvelope::read_item(item) {
            Ok(read) => read,
            Err((code, message)) => {
                assert!(
                    matches!(code, "invalid_event" | "unknown_storage_tier"),
                    "{code}"
                );
                assert!(!message.is_empty());
                continue;
            }
        };
        let want: Option<Vec<(u64, u64)>> = match &env.event.data {
            EventData::Stored(s) => Some(
                s.blocks
                    .iter()
                    .map(|b| (b.block_hash, b.tokens_hash))
                    .collect(),
            ),
            _ => None,
        };
        // A few candidates, so that events meet each other's blocks.
        let candidate = CandidateKey::new(env.worker_id % 4, env.event.dp_rank.unwrap_or(0) % 4);
        let event_id = env.event.event_id;
        let data = env.into_data();
        if let (Some(want), KvEventData::Stored { blocks, .. }) = (&want, &data) {
            let got: Vec<(u64, u64)> = blocks
                .iter()
                .map(|b| (b.block_hash, b.tokens_hash))
                .collect();
            assert_eq!(&got, want);
        }
        let tiers: &[Tier] = if data == KvEventData::Cleared {
            &Tier::ALL
        } else {
            &[tier]
        };
        for &tier in tiers {
            let _ = index.apply(&KvEvent {
                candidate,
                tier,
                event_id,
                data: data.clone(),
            });
            index.check_invariants();
        }
    }
});

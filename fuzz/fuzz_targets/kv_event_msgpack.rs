//! The ZMQ KV event payload decoder (vLLM / SGLang MessagePack, `kvroute_events::decode`: the
//! serde model read by `rmp-serde`, and the depth-capped second read of payloads nested past
//! rmp-serde's limit).
//!
//! The first byte picks the router block size (1..=16), the rest is the payload. Asserts: no
//! panic; a decoder reused with a dirty batch gives what a fresh one gives; a refused payload
//! leaves no events; a decoded batch's events satisfy the decoder's contract (stored events have
//! blocks, removals have hashes, a clear covers every tier once, `stored_blocks` is their sum);
//! and applying the events to an index keeps its structural invariants.
#![no_main]

use kvroute_core::candidate::CandidateKey;
use kvroute_core::indexer::{Indexer, KvEvent, KvEventData, Tier};
use kvroute_events::decode::{Batch, Decoder};
use libfuzzer_sys::fuzz_target;

fn same(a: &Batch, b: &Batch) -> bool {
    a.ts.to_bits() == b.ts.to_bits()
        && a.dp_rank == b.dp_rank
        && a.events == b.events
        && a.dropped == b.dropped
        && a.stored_blocks == b.stored_blocks
}

fuzz_target!(|data: &[u8]| {
    let Some((&bs, payload)) = data.split_first() else {
        return;
    };
    let block_size = u32::from(bs % 16) + 1;
    let fresh = Decoder::new(block_size).decode(payload);

    // A decoder that has decoded something else, into a batch holding other events.
    let mut reused = Decoder::new(block_size);
    let mut batch = Batch::default();
    let warm = [0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0];
    let _ = reused.decode_into(&warm, &mut batch);
    let _ = reused.decode_into(b"\x92\x00\x91\x91\xb0AllBlocksCleared", &mut batch);
    let again = reused.decode_into(payload, &mut batch);
    match (&fresh, again) {
        (Ok(f), Ok(())) => assert!(
            same(f, &batch),
            "reused decoder differs: {f:?} vs {batch:?}"
        ),
        (Err(a), Err(b)) => {
            assert_eq!(*a, b);
            assert!(batch.events.is_empty() && batch.stored_blocks == 0);
            return;
        }
        (f, a) => panic!("fresh {f:?} vs reused {a:?}"),
    }
    let batch = fresh.unwrap();

    let mut stored = 0u64;
    let mut i = 0;
    while i < batch.events.len() {
        match &batch.events[i].data {
            KvEventData::Stored { blocks, .. } => {
                assert!(!blocks.is_empty(), "a stored event without blocks");
                stored += blocks.len() as u64;
            }
            KvEventData::Removed { block_hashes } => {
                assert!(!block_hashes.is_empty(), "a removal without hashes");
            }
            KvEventData::Cleared => {
                let tiers: Vec<Tier> = batch.events[i..(i + 4).min(batch.events.len())]
                    .iter()
                    .filter(|e| e.data == KvEventData::Cleared)
                    .map(|e| e.tier)
                    .collect();
                assert_eq!(tiers, Tier::ALL, "a clear must cover every tier once");
                i += 3;
            }
        }
        i += 1;
    }
    assert_eq!(stored, batch.stored_blocks);

    let index = Indexer::new();
    let candidate = CandidateKey::new(1, batch.dp_rank.unwrap_or(0));
    for (event_id, e) in batch.events.iter().enumerate() {
        let _ = index.apply(&KvEvent {
            candidate,
            tier: e.tier,
            event_id: event_id as u64,
            data: e.data.clone(),
        });
    }
    index.check_invariants();
});

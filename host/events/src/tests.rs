//! Tests of the decoder (every SPEC §4 golden payload, every drop reason, arbitrary and mutated
//! input), of sequence tracking and replay (over a scripted replayer), and of the manager's
//! endpoint handling.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;

use super::decode::{Batch, DecodedEvent, Decoder, DropReason, Reader};
use super::subscriber::{PayloadApplier, ReplayError, Replayer, Session};
use super::*;
use kvroute_core::hashing::{local_hash, request_seed, BASE_SEED};
use kvroute_core::indexer::{KvEventData, StoredBlock, Tier};
use kvroute_core::router::RouterConfig;
use kvroute_core::workers::{KvEventsSpec, WorkerSpec};

// ---- a tiny MessagePack writer for building test payloads --------------------------------------

#[derive(Clone, Debug)]
pub(crate) enum V {
    Nil,
    U(u64),
    I(i64),
    F(f64),
    S(String),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

fn s(x: &str) -> V {
    V::S(x.to_string())
}

fn ua(xs: &[u64]) -> V {
    V::A(xs.iter().map(|&x| V::U(x)).collect())
}

fn m(pairs: &[(&str, V)]) -> V {
    V::M(pairs.iter().map(|(k, v)| (s(k), v.clone())).collect())
}

pub(crate) fn enc(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc_into(v, &mut out);
    out
}

fn enc_into(v: &V, out: &mut Vec<u8>) {
    use rmp::encode::*;
    match v {
        V::Nil => write_nil(out).unwrap(),
        V::U(x) => {
            write_uint(out, *x).unwrap();
        }
        V::I(x) => {
            write_sint(out, *x).unwrap();
        }
        V::F(x) => write_f64(out, *x).unwrap(),
        V::S(x) => write_str(out, x).unwrap(),
        V::B(x) => write_bin(out, x).unwrap(),
        V::A(xs) => {
            write_array_len(out, xs.len() as u32).unwrap();
            for x in xs {
                enc_into(x, out);
            }
        }
        V::M(kv) => {
            write_map_len(out, kv.len() as u32).unwrap();
            for (k, x) in kv {
                enc_into(k, out);
                enc_into(x, out);
            }
        }
    }
}

fn hex(h: &str) -> Vec<u8> {
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
        .collect()
}

// ---- SPEC §4 golden payloads -----------------------------------------------------------------

const GOLDEN_MAP_ONE: &str = "93cb3ff00000000000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739107b1706172656e745f626c6f636b5f6861736805a9746f6b656e5f696473920a0baa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000";
const GOLDEN_ARRAY_ONE: &str =
    "93cb3ff00000000000009198ab426c6f636b53746f726564910705920a0b02c0a3475055c000";
const GOLDEN_MAP_THREE: &str = "93cb3ff800000000000093de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf1111111111111111cff000000000000002b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739103a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
const GOLDEN_ARRAY_THREE: &str = "93cb3ff8000000000000939aab426c6f636b53746f72656492cf1111111111111111cff000000000000002c098010203040506070804c0a3475055c0c0c094ac426c6f636b52656d6f7665649103a3475055c091b0416c6c426c6f636b73436c656172656400";
const GOLDEN_V09: &str = "92cb3ff80000000000009296ab426c6f636b53746f72656492cf1111111111111111cff000000000000002c098010203040506070804c092ac426c6f636b52656d6f7665649103";
const GOLDEN_OUTER_MAP: &str = "83a27473cb3ff0000000000000a66576656e74739181a474797065b0416c6c426c6f636b73436c6561726564b2646174615f706172616c6c656c5f72616e6b00";

pub(crate) const GOLDENS: [(&str, &str, u32); 6] = [
    ("map_one", GOLDEN_MAP_ONE, 2),
    ("array_one", GOLDEN_ARRAY_ONE, 2),
    ("map_three", GOLDEN_MAP_THREE, 4),
    ("array_three", GOLDEN_ARRAY_THREE, 4),
    ("v0_9", GOLDEN_V09, 4),
    ("outer_map", GOLDEN_OUTER_MAP, 4),
];

fn cleared_all_tiers() -> Vec<DecodedEvent> {
    Tier::ALL
        .iter()
        .map(|&tier| DecodedEvent {
            tier,
            data: KvEventData::Cleared,
        })
        .collect()
}

fn one_block_event() -> DecodedEvent {
    DecodedEvent {
        tier: Tier::Device,
        data: KvEventData::Stored {
            parent_hash: Some(5),
            blocks: vec![StoredBlock {
                block_hash: 7,
                tokens_hash: local_hash(&[10, 11], BASE_SEED),
            }],
        },
    }
}

fn two_block_event() -> DecodedEvent {
    DecodedEvent {
        tier: Tier::Device,
        data: KvEventData::Stored {
            parent_hash: None,
            blocks: vec![
                StoredBlock {
                    block_hash: 0x1111111111111111,
                    // SPEC §2 vectors: local([1,2,3,4]) and local([5,6,7,8]).
                    tokens_hash: 14643705804678351452,
                },
                StoredBlock {
                    block_hash: 0xF000000000000002,
                    tokens_hash: 16777012769546811212,
                },
            ],
        },
    }
}

fn removed_3() -> DecodedEvent {
    DecodedEvent {
        tier: Tier::Device,
        data: KvEventData::Removed {
            block_hashes: vec![3],
        },
    }
}

fn decode_hex(h: &str, block_size: u32) -> Batch {
    Decoder::new(block_size)
        .decode(&hex(h))
        .unwrap_or_else(|e| panic!("golden payload dropped: {e:?}"))
}

#[test]
fn golden_map_one_block() {
    let b = decode_hex(GOLDEN_MAP_ONE, 2);
    assert_eq!(b.ts, 1.0);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![one_block_event()]);
    assert_eq!(b.dropped.total(), 0);
    assert_eq!(b.stored_blocks, 1);
}

#[test]
fn golden_array_one_block() {
    let b = decode_hex(GOLDEN_ARRAY_ONE, 2);
    assert_eq!(b.ts, 1.0);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![one_block_event()]);
    assert_eq!(b.dropped.total(), 0);
}

#[test]
fn golden_map_stored_removed_cleared() {
    let b = decode_hex(GOLDEN_MAP_THREE, 4);
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.dp_rank, Some(0));
    let mut want = vec![two_block_event(), removed_3()];
    want.extend(cleared_all_tiers());
    assert_eq!(b.events, want);
    assert_eq!(b.dropped.total(), 0);
    assert_eq!(b.stored_blocks, 2);
}

#[test]
fn golden_array_stored_removed_cleared() {
    let b = decode_hex(GOLDEN_ARRAY_THREE, 4);
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.dp_rank, Some(0));
    let mut want = vec![two_block_event(), removed_3()];
    want.extend(cleared_all_tiers());
    assert_eq!(b.events, want);
    assert_eq!(b.dropped.total(), 0);
}

#[test]
fn golden_v0_9_two_element_batch() {
    let b = decode_hex(GOLDEN_V09, 4);
    assert_eq!(b.ts, 1.5);
    assert_eq!(
        b.dp_rank, None,
        "a v0.9 batch has no rank: the subscription's applies"
    );
    assert_eq!(b.events, vec![two_block_event(), removed_3()]);
    assert_eq!(b.dropped.total(), 0);
}

#[test]
fn golden_outer_map_batch() {
    let b = decode_hex(GOLDEN_OUTER_MAP, 4);
    assert_eq!(b.ts, 1.0);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, cleared_all_tiers());
}

#[test]
fn golden_payloads_at_the_wrong_block_size_drop_only_their_stores() {
    let b = decode_hex(GOLDEN_ARRAY_THREE, 2);
    assert_eq!(b.dropped.get(DropReason::BlockSizeMismatch), 1);
    assert_eq!(b.events.len(), 1 + 4, "the removal and the clears stay");
    let b = decode_hex(GOLDEN_MAP_ONE, 4);
    assert_eq!(b.dropped.get(DropReason::BlockSizeMismatch), 1);
    assert!(b.events.is_empty());
}

/// The golden payloads applied to a router land where SPEC says: a route query for tokens 1..8 at
/// block size 4 matches both blocks.
#[test]
fn golden_stores_match_route_queries() {
    let router = router_with_worker(4, 1);
    let stats = Arc::new(IngestStats::default());
    let mut a = PayloadApplier::new(router.clone(), stats, 1, 0);
    let stop = AtomicBool::new(false);
    let v09 = hex(GOLDEN_V09);
    let o = a.apply(0, &v09, &stop);
    assert_eq!((o.applied, o.refused, o.blocks), (2, 0, 2));
    let local =
        kvroute_core::hashing::local_block_hashes(&(1..=8).collect::<Vec<u32>>(), 4, BASE_SEED);
    assert_eq!(
        router.indexer().find_matches(&local).device,
        vec![(CandidateKey::new(1, 0), 2)]
    );
    // The full golden (store, remove [3] — unknown, no-op — then clear) leaves nothing.
    let o = a.apply(1, &hex(GOLDEN_MAP_THREE), &stop);
    assert_eq!(o.applied, 6);
    assert!(router.indexer().find_matches(&local).device.is_empty());
}

// ---- field handling --------------------------------------------------------------------------

fn batch(events: Vec<V>) -> Vec<u8> {
    enc(&V::A(vec![V::F(2.0), V::A(events), V::Nil]))
}

#[allow(clippy::too_many_arguments)]
fn stored_array(
    hashes: V,
    parent: V,
    tokens: V,
    bs: V,
    medium: V,
    lora: V,
    extra: V,
    tail: Vec<V>,
) -> V {
    let mut a = vec![
        s("BlockStored"),
        hashes,
        parent,
        tokens,
        bs,
        V::Nil,
        medium,
        lora,
        extra,
    ];
    a.extend(tail);
    V::A(a)
}

fn simple_stored(tail: Vec<V>) -> V {
    stored_array(
        ua(&[1]),
        V::Nil,
        ua(&[1, 2]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        tail,
    )
}

fn decode2(p: &[u8]) -> Batch {
    Decoder::new(2).decode(p).expect("batch decodes")
}

fn stored_blocks(ev: &DecodedEvent) -> (&Option<u64>, &Vec<StoredBlock>) {
    match &ev.data {
        KvEventData::Stored {
            parent_hash,
            blocks,
        } => (parent_hash, blocks),
        other => panic!("not a store: {other:?}"),
    }
}

#[test]
fn hashes_as_unsigned_signed_and_bytes() {
    let digest = vec![0xab; 32];
    let p = batch(vec![stored_array(
        V::A(vec![V::I(-2), V::B(digest.clone())]),
        V::I(-1),
        ua(&[1, 2, 3, 4]),
        V::U(2),
        V::Nil,
        V::Nil,
        V::Nil,
        vec![],
    )]);
    let b = decode2(&p);
    let (parent, blocks) = stored_blocks(&b.events[0]);
    assert_eq!(*parent, Some(u64::MAX), "-1 bit-cast");
    assert_eq!(blocks[0].block_hash, (-2i64) as u64);
    assert_eq!(blocks[1].block_hash, xxhash_rust::xxh3::xxh3_64(&digest));
    assert_eq!(b.events[0].tier, Tier::Device, "nil medium = device");
    // The same digest as a removal handle maps to the same handle.
    let p = batch(vec![V::A(vec![
        s("BlockRemoved"),
        V::A(vec![V::B(digest.clone())]),
    ])]);
    assert_eq!(
        decode2(&p).events[0].data,
        KvEventData::Removed {
            block_hashes: vec![xxhash_rust::xxh3::xxh3_64(&digest)]
        }
    );
    // Empty or oversized byte strings are not hashes.
    for bad in [vec![], vec![1u8; 65]] {
        let p = batch(vec![V::A(vec![s("BlockRemoved"), V::A(vec![V::B(bad)])])]);
        assert_eq!(decode2(&p).dropped.get(DropReason::MalformedEvent), 1);
    }
}

#[test]
fn lora_name_and_cache_salt_seed_the_local_hash() {
    let tokens = ua(&[1, 2, 3, 4]);
    let lora = batch(vec![stored_array(
        ua(&[9]),
        V::Nil,
        tokens.clone(),
        V::U(4),
        s("GPU"),
        s("my-lora"),
        V::Nil,
        vec![],
    )]);
    let b = Decoder::new(4).decode(&lora).unwrap();
    // SPEC §2: local([1,2,3,4]) with lora "my-lora".
    assert_eq!(
        stored_blocks(&b.events[0]).1[0].tokens_hash,
        15671544057904749233
    );

    // SGLang: a {cache_salt} map at position 7.
    let salt = batch(vec![stored_array(
        ua(&[9]),
        V::Nil,
        tokens.clone(),
        V::U(4),
        V::Nil,
        m(&[("cache_salt", s("tenant-a"))]),
        V::Nil,
        vec![],
    )]);
    let b = Decoder::new(4).decode(&salt).unwrap();
    assert_eq!(
        stored_blocks(&b.events[0]).1[0].tokens_hash,
        5738685477468498325
    );

    // The same map at position 8, and a short SGLang tuple ending at the map.
    let salt8 = batch(vec![stored_array(
        ua(&[9]),
        V::Nil,
        tokens.clone(),
        V::U(4),
        V::Nil,
        V::Nil,
        m(&[("cache_salt", s("tenant-a"))]),
        vec![],
    )]);
    let b = Decoder::new(4).decode(&salt8).unwrap();
    assert_eq!(
        stored_blocks(&b.events[0]).1[0].tokens_hash,
        5738685477468498325
    );
    let short = batch(vec![V::A(vec![
        s("BlockStored"),
        ua(&[9]),
        V::Nil,
        tokens.clone(),
        V::U(4),
        V::Nil,
        V::Nil,
        m(&[("cache_salt", s("tenant-a")), ("other", V::U(1))]),
    ])]);
    let b = Decoder::new(4).decode(&short).unwrap();
    assert_eq!(
        stored_blocks(&b.events[0]).1[0].tokens_hash,
        5738685477468498325
    );

    // Map form: both by name, plus unknown keys in any order.
    let map = batch(vec![m(&[
        ("future_field", V::A(vec![V::U(1), m(&[("x", V::Nil)])])),
        ("token_ids", tokens),
        ("cache_salt", s("tenant-a")),
        ("lora_name", s("my-lora")),
        ("block_hashes", ua(&[9])),
        ("type", s("BlockStored")),
        ("block_size", V::U(4)),
    ])]);
    let b = Decoder::new(4).decode(&map).unwrap();
    let seed = request_seed(Some("my-lora"), Some("tenant-a"));
    assert_eq!(
        stored_blocks(&b.events[0]).1[0].tokens_hash,
        local_hash(&[1, 2, 3, 4], seed)
    );
}

// ---- vLLM's extra_keys: cache salt, LoRA, multimodal (issue 34) ---------------------------------

/// A vLLM 0.32 store in map form, with `extra_keys` (one entry per block) and `lora_name`.
fn vllm_store(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u64],
    lora: Option<&str>,
    extra: V,
) -> V {
    m(&[
        ("type", s("BlockStored")),
        ("block_hashes", ua(hashes)),
        ("parent_block_hash", parent.map_or(V::Nil, V::U)),
        ("token_ids", ua(tokens)),
        ("block_size", V::U(2)),
        ("lora_id", lora.map_or(V::Nil, |_| V::U(1))),
        ("medium", s("GPU")),
        ("lora_name", lora.map_or(V::Nil, s)),
        ("extra_keys", extra),
        ("group_idx", V::U(0)),
        ("kv_cache_spec_kind", s("full_attention")),
    ])
}

fn keys(entries: Vec<Vec<V>>) -> V {
    V::A(
        entries
            .into_iter()
            .map(|e| if e.is_empty() { V::Nil } else { V::A(e) })
            .collect(),
    )
}

fn tokens_hashes(b: &Batch) -> Vec<u64> {
    b.events
        .iter()
        .flat_map(|e| stored_blocks(e).1.iter().map(|x| x.tokens_hash))
        .collect()
}

#[test]
fn a_salt_on_the_first_block_seeds_every_block_and_continuations_inherit_it() {
    let salted = request_seed(None, Some("tenant-a"));
    let mut d = Decoder::new(2);
    // The request's first event: the salt in block 0's extra keys only, as vLLM sends it.
    let p = batch(vec![vllm_store(
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        None,
        keys(vec![vec![s("tenant-a")], vec![]]),
    )]);
    let b = d.decode(&p).unwrap();
    assert_eq!(
        tokens_hashes(&b),
        vec![local_hash(&[1, 2], salted), local_hash(&[3, 4], salted)]
    );
    // Decode's next block, or another request of the tenant extending the prefix: the event
    // names no salt; the parent block had it.
    let p = batch(vec![vllm_store(
        &[12],
        Some(11),
        &[5, 6],
        None,
        keys(vec![vec![]]),
    )]);
    assert_eq!(
        tokens_hashes(&d.decode(&p).unwrap()),
        vec![local_hash(&[5, 6], salted)]
    );
    // extra_keys nil altogether (older vLLM, or a plain request): the same inheritance.
    let p = batch(vec![vllm_store(&[13], Some(12), &[7, 8], None, V::Nil)]);
    assert_eq!(
        tokens_hashes(&d.decode(&p).unwrap()),
        vec![local_hash(&[7, 8], salted)]
    );
    // A plain request's blocks, and blocks under a plain parent, are plain.
    let p = batch(vec![
        vllm_store(&[20], None, &[1, 2], None, V::Nil),
        vllm_store(&[21], Some(20), &[3, 4], None, keys(vec![vec![]])),
    ]);
    assert_eq!(
        tokens_hashes(&d.decode(&p).unwrap()),
        vec![
            local_hash(&[1, 2], BASE_SEED),
            local_hash(&[3, 4], BASE_SEED)
        ]
    );
    // Evicting the salted blocks forgets them; a clear forgets everything.
    let p = batch(vec![m(&[
        ("type", s("BlockRemoved")),
        ("block_hashes", ua(&[12, 13])),
        ("medium", s("GPU")),
    ])]);
    d.decode(&p).unwrap();
    assert_eq!(d.em_identities(), 2);
    d.decode(&batch(vec![m(&[("type", s("AllBlocksCleared"))])]))
        .unwrap();
    assert_eq!(d.em_identities(), 0);
}

#[test]
fn lora_name_and_salt_in_extra_keys_give_the_route_sides_seed() {
    let seed = request_seed(Some("my-lora"), Some("tenant-a"));
    let mut d = Decoder::new(2);
    let p = batch(vec![vllm_store(
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        Some("my-lora"),
        keys(vec![vec![s("my-lora"), s("tenant-a")], vec![s("my-lora")]]),
    )]);
    assert_eq!(
        tokens_hashes(&d.decode(&p).unwrap()),
        vec![local_hash(&[1, 2], seed), local_hash(&[3, 4], seed)]
    );
    let p = batch(vec![vllm_store(
        &[12],
        Some(11),
        &[5, 6],
        Some("my-lora"),
        keys(vec![vec![s("my-lora")]]),
    )]);
    assert_eq!(
        tokens_hashes(&d.decode(&p).unwrap()),
        vec![local_hash(&[5, 6], seed)]
    );
    // An adapter without a salt: the SPEC §2 vector.
    let p = batch(vec![vllm_store(
        &[30],
        None,
        &[1, 2],
        Some("my-lora"),
        keys(vec![vec![s("my-lora")]]),
    )]);
    assert_eq!(
        tokens_hashes(&d.decode(&p).unwrap()),
        vec![local_hash(&[1, 2], request_seed(Some("my-lora"), None))]
    );
    // The same in the array form (position 8).
    let p = batch(vec![stored_array(
        ua(&[40]),
        V::Nil,
        ua(&[1, 2]),
        V::U(2),
        s("GPU"),
        s("my-lora"),
        keys(vec![vec![s("my-lora"), s("tenant-a")]]),
        vec![V::U(0), s("full_attention")],
    )]);
    assert_eq!(
        tokens_hashes(&Decoder::new(2).decode(&p).unwrap()),
        vec![local_hash(&[1, 2], seed)]
    );
}

#[test]
fn multimodal_keys_make_a_block_unmatchable_by_text() {
    let mut d = Decoder::new(2);
    let image = |h: &str, off: u64| V::A(vec![s(h), V::U(off)]);
    let p = batch(vec![vllm_store(
        &[10, 11, 12],
        None,
        &[1, 2, 3, 4, 5, 6],
        None,
        keys(vec![vec![], vec![image("img-a", 1)], vec![]]),
    )]);
    let h = tokens_hashes(&d.decode(&p).unwrap());
    assert_eq!(
        h[0],
        local_hash(&[1, 2], BASE_SEED),
        "text before the image"
    );
    assert_ne!(h[1], local_hash(&[3, 4], BASE_SEED), "the image's block");
    assert_eq!(
        h[2],
        local_hash(&[5, 6], BASE_SEED),
        "hangs under the image"
    );
    // Another image, or the same at another offset, is another identity; the same is the same.
    let other = |k: V| {
        let p = batch(vec![vllm_store(
            &[10, 11],
            None,
            &[1, 2, 3, 4],
            None,
            keys(vec![vec![], vec![k]]),
        )]);
        tokens_hashes(&Decoder::new(2).decode(&p).unwrap())[1]
    };
    assert_eq!(other(image("img-a", 1)), h[1]);
    assert_ne!(other(image("img-b", 1)), h[1]);
    assert_ne!(other(image("img-a", 0)), h[1]);
    // A prompt-embedding digest (bytes) too.
    assert_ne!(other(V::B(vec![7; 32])), local_hash(&[3, 4], BASE_SEED));
    // A string the router cannot place (not the adapter, not on the first block): unmatchable.
    assert_ne!(other(s("what")), local_hash(&[3, 4], BASE_SEED));
    // Dynamo's block_mm_infos at position 9: a non-nil entry is the same kind of key.
    let p = batch(vec![stored_array(
        ua(&[50, 51]),
        V::Nil,
        ua(&[1, 2, 3, 4]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![
            V::A(vec![V::Nil, m(&[("mm_objects", V::A(vec![V::U(99)]))])]),
            V::U(0),
            s("full_attention"),
        ],
    )]);
    let h = tokens_hashes(&Decoder::new(2).decode(&p).unwrap());
    assert_eq!(h[0], local_hash(&[1, 2], BASE_SEED));
    assert_ne!(h[1], local_hash(&[3, 4], BASE_SEED));
}

#[test]
fn extra_keys_of_the_wrong_length_or_a_conflicting_salt_are_malformed() {
    let p = batch(vec![vllm_store(
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        None,
        keys(vec![vec![s("a")]]),
    )]);
    let b = Decoder::new(2).decode(&p).unwrap();
    assert_eq!(b.dropped.get(DropReason::MalformedEvent), 1);
    // SGLang's explicit salt and vLLM's first-block salt disagree.
    let mut ev = vllm_store(&[10], None, &[1, 2], None, keys(vec![vec![s("a")]]));
    if let V::M(kv) = &mut ev {
        kv.push((s("cache_salt"), s("b")));
    }
    let b = Decoder::new(2).decode(&batch(vec![ev])).unwrap();
    assert_eq!(b.dropped.get(DropReason::MalformedEvent), 1);
}

/// The isolation rule (SPEC §2) end to end through the router: a tenant's blocks match only that
/// tenant's prompts.
#[test]
fn salted_blocks_match_only_the_same_salt() {
    use kvroute_core::router::RouteRequest;
    let router = router_with_worker(2, 1);
    let stats = Arc::new(IngestStats::default());
    let mut a = PayloadApplier::new(router.clone(), stats, 1, 0);
    let stop = AtomicBool::new(false);
    // Tenant a's request: 2 blocks, then its decode adds a third under them.
    a.apply(
        0,
        &batch(vec![vllm_store(
            &[10, 11],
            None,
            &[1, 2, 3, 4],
            None,
            keys(vec![vec![s("tenant-a")], vec![]]),
        )]),
        &stop,
    );
    a.apply(
        1,
        &batch(vec![vllm_store(
            &[12],
            Some(11),
            &[5, 6],
            None,
            keys(vec![vec![]]),
        )]),
        &stop,
    );
    let cached = |salt: Option<&str>| {
        let mut r = RouteRequest::tokens(vec![1, 2, 3, 4, 5, 6, 7]);
        r.cache_salt = salt.map(str::to_string);
        r.book = false;
        router.route_now(r).unwrap().cached_tokens
    };
    assert_eq!(cached(Some("tenant-a")), 6);
    assert_eq!(cached(Some("tenant-b")), 0, "another tenant");
    assert_eq!(cached(None), 0, "no salt");
    // And the reverse: plain blocks are no hit for a salted prompt.
    a.apply(
        2,
        &batch(vec![vllm_store(
            &[20, 21],
            None,
            &[1, 2, 3, 4],
            None,
            V::Nil,
        )]),
        &stop,
    );
    assert_eq!(cached(None), 4);
    assert_eq!(cached(Some("tenant-b")), 0);
    assert_eq!(cached(Some("tenant-a")), 6);
}

#[test]
fn a_block_size_mismatch_shows_in_the_feed_state_until_the_sizes_agree() {
    use kvroute_core::feeds::{FeedConfig, Feeds};
    let router = router_with_worker(2, 1);
    let feeds = Feeds::new(FeedConfig::default());
    let cell = feeds.open(CandidateKey::new(1, 0));
    let mut a = PayloadApplier::new(router.clone(), Arc::new(IngestStats::default()), 1, 0)
        .with_feed(cell.clone());
    let stop = AtomicBool::new(false);
    let store = |bs: u64, n: usize| {
        batch(vec![stored_array(
            ua(&[7]),
            V::Nil,
            ua(&(1..=n as u64).collect::<Vec<_>>()),
            V::U(bs),
            s("GPU"),
            V::Nil,
            V::Nil,
            vec![],
        )])
    };
    assert_eq!(cell.status().engine_block_size, None);
    let o = a.apply(0, &store(128, 128), &stop);
    assert_eq!(o.dropped, 1);
    assert_eq!(cell.status().engine_block_size, Some(128));
    // A removal says nothing about the block size.
    a.apply(
        1,
        &batch(vec![V::A(vec![s("BlockRemoved"), ua(&[7])])]),
        &stop,
    );
    assert_eq!(cell.status().engine_block_size, Some(128));
    a.apply(2, &store(2, 2), &stop);
    assert_eq!(cell.status().engine_block_size, None);
}

/// Bytes a real vLLM 0.32 published for salted, plain and LoRA requests (testdata/): every block
/// hashes as the route side hashes the same request, and the salted prompt's continuation (whose
/// event names no salt) inherits the salt from its parent.
#[test]
fn real_vllm_payloads_hash_as_the_route_side() {
    let payloads: BTreeMap<u64, Vec<u8>> = include_str!("testdata/vllm-0.32-salt-lora.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (seq, h) = l.split_once(' ').unwrap();
            (seq.parse().unwrap(), hex(h))
        })
        .collect();
    let prompt: Vec<u32> = (10..310).chain(400..500).collect();
    let want = |seed: u64, blocks: std::ops::Range<usize>| -> Vec<u64> {
        blocks
            .map(|i| local_hash(&prompt[i * 128..(i + 1) * 128], seed))
            .collect()
    };
    let salted = request_seed(None, Some("tenant-a"));
    let mut d = Decoder::new(128);
    let b = d.decode(&payloads[&0]).unwrap();
    assert_eq!(tokens_hashes(&b), want(salted, 0..2));
    let b = d.decode(&payloads[&1]).unwrap();
    assert_eq!(tokens_hashes(&b), want(BASE_SEED, 0..2));
    let b = d.decode(&payloads[&2]).unwrap();
    assert_eq!(
        tokens_hashes(&b),
        want(request_seed(Some("tiny-lora"), Some("tenant-a")), 0..2)
    );
    let b = d.decode(&payloads[&5]).unwrap();
    assert_eq!(tokens_hashes(&b), want(salted, 2..3));
}

#[test]
fn eagle_pairs_flatten_to_firsts_plus_last_second() {
    // Two blocks of 2: pairs (10,11) (11,12) (12,13) (13,14) → tokens 10 11 12 13 (+14 dropped).
    let pairs = V::A(
        [(10, 11), (11, 12), (12, 13), (13, 14)]
            .iter()
            .map(|&(a, b)| ua(&[a, b]))
            .collect(),
    );
    let p = batch(vec![stored_array(
        ua(&[21, 22]),
        V::Nil,
        pairs,
        V::U(2),
        V::Nil,
        V::Nil,
        V::Nil,
        vec![],
    )]);
    let b = decode2(&p);
    let (_, blocks) = stored_blocks(&b.events[0]);
    assert_eq!(blocks[0].tokens_hash, local_hash(&[10, 11], BASE_SEED));
    assert_eq!(blocks[1].tokens_hash, local_hash(&[12, 13], BASE_SEED));
    // A pair list that mixes in plain tokens is malformed.
    let bad = V::A(vec![ua(&[1, 2]), V::U(3)]);
    let p = batch(vec![stored_array(
        ua(&[21]),
        V::Nil,
        bad,
        V::U(2),
        V::Nil,
        V::Nil,
        V::Nil,
        vec![],
    )]);
    assert_eq!(decode2(&p).dropped.get(DropReason::MalformedEvent), 1);
}

#[test]
fn metadata_tail_positions_and_block_mm_infos_shift() {
    // group 0, full attention, window nil: kept.
    let ok = batch(vec![simple_stored(vec![
        V::U(0),
        s("full_attention"),
        V::Nil,
    ])]);
    assert_eq!(decode2(&ok).events.len(), 1);
    // Dynamo's layout: block_mm_infos (an array) at 9, then group/kind.
    let mm = batch(vec![simple_stored(vec![
        V::A(vec![V::Nil]),
        V::U(1),
        s("full_attention"),
    ])]);
    assert_eq!(decode2(&mm).dropped.get(DropReason::NonMainGroup), 1);
    let mm_ok = batch(vec![simple_stored(vec![
        V::A(vec![V::Nil]),
        V::U(0),
        s("mla_attention"),
        V::U(7),
        s("extra"),
    ])]);
    assert_eq!(decode2(&mm_ok).events.len(), 1);
    // Extra trailing elements are ignored.
    let long = batch(vec![simple_stored(vec![
        V::Nil,
        V::Nil,
        V::Nil,
        s("newer"),
        V::U(5),
        m(&[]),
    ])]);
    assert_eq!(decode2(&long).events.len(), 1);
}

// ---- each drop reason --------------------------------------------------------------------------

fn only_drop(p: &[u8], block_size: u32, reason: DropReason) {
    let b = Decoder::new(block_size)
        .decode(p)
        .expect("the batch itself is fine");
    assert!(b.events.is_empty(), "{reason:?}: {:?}", b.events);
    assert_eq!(b.dropped.get(reason), 1, "{reason:?}: {:?}", b.dropped);
    assert_eq!(b.dropped.total(), 1);
}

#[test]
fn drop_non_main_group() {
    only_drop(
        &batch(vec![simple_stored(vec![V::U(1)])]),
        2,
        DropReason::NonMainGroup,
    );
    let rm = V::A(vec![s("BlockRemoved"), ua(&[1]), s("GPU"), V::U(2)]);
    only_drop(&batch(vec![rm]), 2, DropReason::NonMainGroup);
    let map = m(&[
        ("type", s("BlockRemoved")),
        ("block_hashes", ua(&[1])),
        ("group_idx", V::U(3)),
    ]);
    only_drop(&batch(vec![map]), 2, DropReason::NonMainGroup);
}

#[test]
fn drop_non_main_attention() {
    for kind in [
        "sliding_window",
        "mamba",
        "cross_attention",
        "something_new",
    ] {
        only_drop(
            &batch(vec![simple_stored(vec![V::U(0), s(kind)])]),
            2,
            DropReason::NonMainAttention,
        );
    }
    for kind in MAIN_KINDS {
        let b = decode2(&batch(vec![simple_stored(vec![V::U(0), s(kind)])]));
        assert_eq!(b.events.len(), 1, "{kind}");
    }
    let rm = V::A(vec![
        s("BlockRemoved"),
        ua(&[1]),
        s("GPU"),
        V::U(0),
        s("sliding_window"),
    ]);
    only_drop(&batch(vec![rm]), 2, DropReason::NonMainAttention);
}

const MAIN_KINDS: [&str; 3] = super::decode::MAIN_ATTENTION_KINDS;

#[test]
fn drop_unknown_medium() {
    let p = batch(vec![stored_array(
        ua(&[1]),
        V::Nil,
        ua(&[1, 2]),
        V::U(2),
        s("TAPE"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    only_drop(&p, 2, DropReason::UnknownMedium);
    let rm = V::A(vec![s("BlockRemoved"), ua(&[1]), s("FLOPPY")]);
    only_drop(&batch(vec![rm]), 2, DropReason::UnknownMedium);
    // Known media map to tiers.
    for (medium, tier) in [
        ("CPU_PINNED", Tier::Host),
        ("NVME", Tier::Disk),
        ("REMOTE", Tier::External),
        ("DEVICE", Tier::Device),
    ] {
        let p = batch(vec![stored_array(
            ua(&[1]),
            V::Nil,
            ua(&[1, 2]),
            V::U(2),
            s(medium),
            V::Nil,
            V::Nil,
            vec![],
        )]);
        assert_eq!(decode2(&p).events[0].tier, tier, "{medium}");
    }
}

#[test]
fn drop_block_size_mismatch() {
    let p = batch(vec![stored_array(
        ua(&[1]),
        V::Nil,
        ua(&[1, 2, 3, 4]),
        V::U(4),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    only_drop(&p, 2, DropReason::BlockSizeMismatch);
}

#[test]
fn drop_token_count_mismatch() {
    for tokens in [ua(&[1, 2, 3]), ua(&[1]), ua(&[1, 2, 3, 4, 5])] {
        let p = batch(vec![stored_array(
            ua(&[1, 2]),
            V::Nil,
            tokens,
            V::U(2),
            s("GPU"),
            V::Nil,
            V::Nil,
            vec![],
        )]);
        only_drop(&p, 2, DropReason::TokenCountMismatch);
    }
    // Without a block_size field the token count still has to fit.
    let p = batch(vec![stored_array(
        ua(&[1]),
        V::Nil,
        ua(&[1, 2, 3]),
        V::Nil,
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    only_drop(&p, 2, DropReason::TokenCountMismatch);
}

#[test]
fn drop_unknown_event_type() {
    only_drop(
        &batch(vec![V::A(vec![s("BlockMoved"), ua(&[1])])]),
        2,
        DropReason::UnknownEventType,
    );
    only_drop(
        &batch(vec![m(&[("type", s("Future"))])]),
        2,
        DropReason::UnknownEventType,
    );
}

#[test]
fn drop_malformed_event() {
    let cases = vec![
        V::A(vec![]),                                              // no tag
        V::A(vec![V::U(1), ua(&[1])]),                             // tag not a string
        m(&[("block_hashes", ua(&[1]))]),                          // no type
        V::U(7),                                                   // not an event
        V::A(vec![s("BlockStored")]),                              // no block_hashes
        V::A(vec![s("BlockStored"), ua(&[1])]),                    // no token_ids
        V::A(vec![s("BlockStored"), s("x"), V::Nil, ua(&[1, 2])]), // hashes not an array
        V::A(vec![
            s("BlockStored"),
            V::A(vec![V::F(1.0)]),
            V::Nil,
            ua(&[1, 2]),
        ]), // float hash
        V::A(vec![
            s("BlockStored"),
            ua(&[1]),
            V::Nil,
            V::A(vec![V::I(-1), V::U(2)]),
        ]), // negative token
        V::A(vec![s("BlockStored"), ua(&[1]), V::Nil, ua(&[1 << 33, 2])]), // token over u32
        V::A(vec![s("BlockStored"), ua(&[1]), s("p"), ua(&[1, 2])]), // parent a string
        V::A(vec![
            s("BlockStored"),
            ua(&[1]),
            V::Nil,
            ua(&[1, 2]),
            s("two"),
        ]), // block_size a string
        stored_array(
            ua(&[1]),
            V::Nil,
            ua(&[1, 2]),
            V::U(2),
            V::U(5),
            V::Nil,
            V::Nil,
            vec![],
        ), // medium an int
        stored_array(
            ua(&[1]),
            V::Nil,
            ua(&[1, 2]),
            V::U(2),
            V::Nil,
            V::U(5),
            V::Nil,
            vec![],
        ), // lora_name an int
        stored_array(
            ua(&[1]),
            V::Nil,
            ua(&[1, 2]),
            V::U(2),
            V::Nil,
            V::S("\u{0}".into()),
            V::Nil,
            vec![V::I(-1)],
        ), // group negative
        V::A(vec![s("BlockRemoved")]),                             // no hashes
        m(&[("type", V::U(1))]),                                   // type not a string
    ];
    for (i, ev) in cases.into_iter().enumerate() {
        let b = decode2(&batch(vec![ev.clone()]));
        assert_eq!(
            b.dropped.get(DropReason::MalformedEvent),
            1,
            "case {i}: {ev:?} → {:?}",
            b.dropped
        );
        assert!(b.events.is_empty(), "case {i}");
    }
    // Invalid UTF-8 in a name.
    let mut p = batch(vec![stored_array(
        ua(&[1]),
        V::Nil,
        ua(&[1, 2]),
        V::U(2),
        V::Nil,
        s("ab"),
        V::Nil,
        vec![],
    )]);
    let at = p.windows(3).position(|w| w == [0xa2, b'a', b'b']).unwrap();
    p[at + 1] = 0xff;
    assert_eq!(decode2(&p).dropped.get(DropReason::MalformedEvent), 1);
}

#[test]
fn a_bad_event_does_not_drop_its_neighbours() {
    let good = simple_stored(vec![]);
    let p = batch(vec![
        good.clone(),
        V::A(vec![s("Nope")]),
        simple_stored(vec![V::U(9)]),
        good,
    ]);
    let b = decode2(&p);
    assert_eq!(b.events.len(), 2);
    assert_eq!(b.dropped.get(DropReason::UnknownEventType), 1);
    assert_eq!(b.dropped.get(DropReason::NonMainGroup), 1);
}

#[test]
fn drop_malformed_payload() {
    let mut cases: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xc1],                                          // reserved marker
        enc(&V::U(1)),                                       // not a batch
        enc(&V::A(vec![V::F(1.0)])),                         // one element
        enc(&V::A(vec![s("ts"), V::A(vec![])])),             // ts a string
        enc(&V::A(vec![V::F(1.0), V::U(3)])),                // events not an array
        enc(&V::A(vec![V::F(1.0), V::A(vec![]), V::I(-1)])), // negative rank
        enc(&V::A(vec![V::F(1.0), V::A(vec![]), s("0")])),   // rank a string
        enc(&m(&[("ts", V::F(1.0))])),                       // map without events
        hex(&GOLDEN_MAP_ONE[..GOLDEN_MAP_ONE.len() - 10]),   // truncated
    ];
    let mut trailing = hex(GOLDEN_ARRAY_ONE);
    trailing.push(0x00);
    cases.push(trailing);
    // Claims of huge containers fail without allocating.
    cases.push(vec![0xdd, 0xff, 0xff, 0xff, 0xff]);
    cases.push(vec![
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0,
    ]);
    cases.push(vec![0xdf, 0xff, 0xff, 0xff, 0xff]);
    cases.push(vec![0xc6, 0xff, 0xff, 0xff, 0xff]);
    for (i, p) in cases.iter().enumerate() {
        assert_eq!(
            Decoder::new(2).decode(p),
            Err(DropReason::MalformedPayload),
            "case {i}: {p:02x?}"
        );
    }
}

#[test]
fn payload_size_limit_and_rank_alias() {
    let big = vec![0u8; super::decode::MAX_PAYLOAD_BYTES + 1];
    assert_eq!(
        Decoder::new(2).decode(&big),
        Err(DropReason::PayloadTooLarge)
    );
    let p = enc(&m(&[
        ("events", V::A(vec![])),
        ("dp_rank", V::U(3)),
        ("extra", V::Nil),
    ]));
    let b = decode2(&p);
    assert_eq!((b.ts, b.dp_rank), (0.0, Some(3)));
    // A batch whose events are nil is empty, not malformed; extra batch elements are ignored.
    let p = enc(&V::A(vec![V::U(3), V::Nil, V::U(1), s("more")]));
    let b = decode2(&p);
    assert_eq!((b.ts, b.dp_rank, b.events.len()), (3.0, Some(1), 0));
}

#[test]
fn reader_skips_deep_nesting_without_recursion() {
    // 100k nested arrays of one element, then nil: skip is iterative.
    let mut p = vec![0x91u8; 100_000];
    p.push(0xc0);
    let mut r = Reader::new(&p);
    r.skip().unwrap();
    assert!(r.at_end());
    // The same inside an event: malformed, no stack overflow.
    let mut ev = enc(&V::A(vec![V::F(1.0)]));
    ev[0] = 0x92;
    ev.extend(std::iter::repeat_n(0x91u8, 100_000));
    ev.push(0xc0);
    let b = decode2(&ev);
    assert_eq!(b.dropped.get(DropReason::MalformedEvent), 1);
}

/// `depth` arrays of one element around a nil (the test writer recurses: keep it in hundreds).
fn nested(depth: usize) -> V {
    (0..depth).fold(V::Nil, |v, _| V::A(vec![v]))
}

#[test]
fn deep_values_the_decoder_ignores_keep_their_event() {
    // Past rmp-serde's limit (MAX_NESTING), the payload is read again with the depth capped:
    // a deep unknown key, trailing element or block_mm_infos slot still leaves the event whole.
    for depth in [
        super::decode::CAPPED_NESTING,
        super::decode::MAX_NESTING,
        600,
    ] {
        let map = m(&[
            ("type", s("BlockRemoved")),
            ("future", nested(depth)),
            ("block_hashes", ua(&[4])),
        ]);
        let trailing = simple_stored(vec![V::U(0), s("full_attention"), V::Nil, nested(depth)]);
        let mm = simple_stored(vec![V::A(vec![nested(depth)]), V::U(0)]);
        let p = batch(vec![map, trailing, mm]);
        let b = decode2(&p);
        assert_eq!(b.dropped.total(), 0, "depth {depth}: {:?}", b.dropped);
        assert_eq!(b.events.len(), 3, "depth {depth}");
        assert_eq!(b.stored_blocks, 2);
        // The same depth where the decoder reads a field is one malformed event.
        let deep_hashes = V::A(vec![s("BlockRemoved"), V::A(vec![nested(depth)])]);
        let b = decode2(&batch(vec![deep_hashes, simple_stored(vec![])]));
        assert_eq!(
            b.dropped.get(DropReason::MalformedEvent),
            1,
            "depth {depth}"
        );
        assert_eq!(b.events.len(), 1);
        // ... and where the batch is read, a malformed payload.
        let p = enc(&V::A(vec![nested(depth), V::A(vec![])]));
        assert_eq!(
            Decoder::new(2).decode(&p),
            Err(DropReason::MalformedPayload)
        );
    }
    // A deep payload that is also truncated is malformed, whatever the depth.
    let mut p = batch(vec![simple_stored(vec![nested(600)])]);
    p.pop();
    assert_eq!(
        Decoder::new(2).decode(&p),
        Err(DropReason::MalformedPayload)
    );
}

#[test]
fn extensions_and_bools_are_wrong_types_not_bad_payloads() {
    let ext = |len: u8| {
        let mut e = vec![0xd4 + len.trailing_zeros() as u8, 7];
        e.extend(std::iter::repeat_n(0xee, len as usize));
        e
    };
    // An extension (fixext 1..16) as an event, as a hash, and under an unknown key.
    for len in [1u8, 2, 4, 8, 16] {
        let mut p = enc(&V::A(vec![V::F(1.0), V::A(vec![V::Nil, V::Nil])]));
        let at = p.len() - 2;
        p.splice(at..at + 1, ext(len));
        let b = decode2(&p);
        assert_eq!(b.dropped.get(DropReason::MalformedEvent), 2, "fixext {len}");

        let mut p = batch(vec![V::A(vec![s("BlockRemoved"), V::A(vec![V::Nil])])]);
        let at = p.len() - 2;
        p.splice(at..at + 1, ext(len));
        assert_eq!(decode2(&p).dropped.get(DropReason::MalformedEvent), 1);

        let mut p = batch(vec![m(&[
            ("type", s("BlockRemoved")),
            ("block_hashes", ua(&[1])),
            ("x", V::Nil),
        ])]);
        // The batch ends with its nil rank.
        let at = p.len() - 2;
        p.splice(at..at + 1, ext(len));
        assert_eq!(
            decode2(&p).events.len(),
            1,
            "fixext {len} under an unknown key"
        );
    }
    // `true` as the group index.
    let mut p = batch(vec![simple_stored(vec![V::Nil])]);
    let at = p.len() - 2;
    p[at] = 0xc3;
    assert_eq!(decode2(&p).dropped.get(DropReason::MalformedEvent), 1);
}

#[test]
fn a_str_that_is_not_utf8_reads_as_a_byte_string() {
    // rmp-serde hands it over as bytes: a digest where a hash goes...
    let mut p = batch(vec![V::A(vec![s("BlockRemoved"), V::A(vec![s("ab")])])]);
    let at = p.windows(3).position(|w| w == [0xa2, b'a', b'b']).unwrap();
    p[at + 1] = 0xff;
    assert_eq!(
        decode2(&p).events[0].data,
        KvEventData::Removed {
            block_hashes: vec![xxhash_rust::xxh3::xxh3_64(&[0xff, b'b'])]
        }
    );
    // ... and not a string as an event's type.
    let mut p = batch(vec![V::A(vec![s("BlockRemoved"), ua(&[1])])]);
    let at = p.windows(2).position(|w| w == [0xac, b'B']).unwrap();
    p[at + 1] = 0xff;
    assert_eq!(decode2(&p).dropped.get(DropReason::MalformedEvent), 1);
}

// ---- fuzz-style properties ---------------------------------------------------------------------

fn check_no_panic(p: &[u8]) {
    for bs in [1u32, 2, 4, 16] {
        let fresh = Decoder::new(bs).decode(p);
        if let Ok(b) = &fresh {
            // Output is bounded by the input: every event and block needs at least a byte.
            assert!(b.events.len() <= p.len() * 4);
            assert!(b.stored_blocks as usize <= p.len());
            check_batch_contract(b);
        }
        // A decoder and batch that served another payload answer as fresh ones do.
        let mut reused = Decoder::new(bs);
        let mut batch = Batch::default();
        reused
            .decode_into(
                &enc(&V::A(vec![
                    V::U(0),
                    V::A(vec![V::A(vec![s("AllBlocksCleared")])]),
                ])),
                &mut batch,
            )
            .unwrap();
        let again = reused.decode_into(p, &mut batch);
        match (&fresh, again) {
            (Ok(f), Ok(())) => {
                assert_eq!(f.ts.to_bits(), batch.ts.to_bits());
                assert_eq!(
                    (&f.events, f.dp_rank, f.dropped, f.stored_blocks),
                    (
                        &batch.events,
                        batch.dp_rank,
                        batch.dropped,
                        batch.stored_blocks
                    )
                );
            }
            (Err(a), Err(b)) => {
                assert_eq!(*a, b);
                assert!(batch.events.is_empty() && batch.stored_blocks == 0);
            }
            (f, a) => panic!("fresh {f:?} vs reused {a:?}"),
        }
    }
}

/// What every decoded batch promises (the fuzz target `kv_event_msgpack` checks the same): stored
/// events have blocks, removals have hashes, a clear is one event per tier in `Tier::ALL` order,
/// and `stored_blocks` counts the stored blocks.
fn check_batch_contract(b: &Batch) {
    let mut stored = 0u64;
    let mut i = 0;
    while i < b.events.len() {
        match &b.events[i].data {
            KvEventData::Stored { blocks, .. } => {
                assert!(!blocks.is_empty(), "a stored event without blocks");
                stored += blocks.len() as u64;
            }
            KvEventData::Removed { block_hashes } => {
                assert!(!block_hashes.is_empty(), "a removal without hashes");
            }
            KvEventData::Cleared => {
                let tiers: Vec<Tier> = b.events[i..(i + 4).min(b.events.len())]
                    .iter()
                    .filter(|e| e.data == KvEventData::Cleared)
                    .map(|e| e.tier)
                    .collect();
                assert_eq!(tiers, Tier::ALL, "a clear covers every tier once");
                i += 3;
            }
        }
        i += 1;
    }
    assert_eq!(stored, b.stored_blocks);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(p in proptest::collection::vec(any::<u8>(), 0..512)) {
        check_no_panic(&p);
    }

    #[test]
    fn mutated_goldens_never_panic(
        which in 0usize..GOLDENS.len(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..8),
    ) {
        let mut p = hex(GOLDENS[which].1);
        for (at, byte, op) in edits {
            if p.is_empty() { break; }
            let i = at.index(p.len());
            match op {
                0 => p[i] = byte,
                1 => p[i] ^= 1 << (byte % 8),
                2 => p.truncate(i),
                _ => p.insert(i, byte),
            }
        }
        check_no_panic(&p);
    }

    /// Byte-level mutations of the golden payloads that still decode never produce a store whose
    /// blocks disagree with its tokens' local hashes: the index is never poisoned with a hash the
    /// tokens do not give.
    #[test]
    fn decoded_stores_always_hash_their_tokens(
        tokens in proptest::collection::vec(any::<u32>(), 0..64),
        bs in 1u32..8,
        map_form in any::<bool>(),
    ) {
        let n = tokens.len() / bs as usize;
        let toks = &tokens[..n * bs as usize];
        let hashes: Vec<u64> = (0..n as u64).map(|i| i * 31 + 1).collect();
        let ev = if map_form {
            m(&[("type", s("BlockStored")), ("block_hashes", ua(&hashes)), ("token_ids", V::A(toks.iter().map(|&t| V::U(u64::from(t))).collect())), ("block_size", V::U(u64::from(bs)))])
        } else {
            stored_array(ua(&hashes), V::Nil, V::A(toks.iter().map(|&t| V::U(u64::from(t))).collect()), V::U(u64::from(bs)), V::Nil, V::Nil, V::Nil, vec![])
        };
        let b = Decoder::new(bs).decode(&batch(vec![ev])).unwrap();
        if n == 0 {
            prop_assert!(b.events.is_empty());
        } else {
            let (_, blocks) = stored_blocks(&b.events[0]);
            let want = kvroute_core::hashing::local_block_hashes(toks, bs as usize, BASE_SEED);
            prop_assert_eq!(blocks.iter().map(|b| b.tokens_hash).collect::<Vec<_>>(), want);
            prop_assert_eq!(blocks.iter().map(|b| b.block_hash).collect::<Vec<_>>(), hashes);
        }
    }
}

// ---- sequence tracking and replay ----------------------------------------------------------------

fn router_with_worker(block_size: u32, dp_size: u32) -> Arc<Router> {
    let router = Arc::new(
        Router::new(RouterConfig {
            block_size,
            ..RouterConfig::default()
        })
        .unwrap(),
    );
    router
        .upsert_worker(
            1,
            WorkerSpec {
                dp_size,
                ..WorkerSpec::default()
            },
        )
        .unwrap();
    router
}

/// An engine's view for the tests: a chain of one-block stores, block i = tokens [2i+1, 2i+2].
fn store_payload(i: u64) -> Vec<u8> {
    let parent = if i == 0 { V::Nil } else { V::U(100 + i - 1) };
    let t = (2 * i + 1) as u32;
    batch(vec![stored_array(
        ua(&[100 + i]),
        parent,
        ua(&[u64::from(t), u64::from(t) + 1]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )])
}

fn prompt(blocks: u64) -> Vec<u64> {
    let tokens: Vec<u32> = (1..=(2 * blocks) as u32).collect();
    kvroute_core::hashing::local_block_hashes(&tokens, 2, BASE_SEED)
}

fn overlap(router: &Router, blocks: u64) -> u32 {
    router
        .indexer()
        .find_matches(&prompt(blocks))
        .device
        .iter()
        .find(|(k, _)| *k == CandidateKey::new(1, 0))
        .map_or(0, |&(_, d)| d)
}

/// A replay buffer holding some sequence numbers; `fail` makes every replay error out.
#[derive(Default)]
struct Script {
    buffer: BTreeMap<u64, Vec<u8>>,
    fail: bool,
    pending: Vec<(u64, Bytes)>,
    asked: Vec<u64>,
}

impl Replayer for Script {
    async fn start(&mut self, from: u64) -> Result<(), ReplayError> {
        self.asked.push(from);
        if self.fail {
            return Err(ReplayError::Socket("scripted failure".into()));
        }
        self.pending = self
            .buffer
            .range(from..)
            .map(|(&k, v)| (k, Bytes::from(v.clone())))
            .rev()
            .collect();
        Ok(())
    }

    async fn next(&mut self) -> Result<Option<(u64, Bytes)>, ReplayError> {
        Ok(self.pending.pop())
    }
}

fn session(router: &Arc<Router>, script: Option<Script>) -> (Session<Script>, Arc<IngestStats>) {
    let stats = Arc::new(IngestStats::default());
    let applier = PayloadApplier::new(router.clone(), stats.clone(), 1, 0);
    (
        Session::new(applier, script, Arc::new(AtomicBool::new(false))),
        stats,
    )
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn contiguous_messages_apply_in_order() {
    let router = router_with_worker(2, 1);
    let (mut ss, stats) = session(&router, None);
    block_on(async {
        for i in 0..4 {
            ss.on_message(i, &store_payload(i)).await;
        }
    });
    assert_eq!(overlap(&router, 4), 4);
    assert_eq!(stats.gaps.load(Relaxed), 0);
    assert_eq!(stats.blocks_applied.load(Relaxed), 4);
}

#[test]
fn a_gap_is_recovered_by_replay() {
    let router = router_with_worker(2, 1);
    let mut script = Script::default();
    for i in 0..5 {
        script.buffer.insert(i, store_payload(i));
    }
    let (mut ss, stats) = session(&router, Some(script));
    block_on(async {
        ss.on_message(0, &store_payload(0)).await;
        // 1 and 2 are lost on the SUB socket.
        ss.on_message(3, &store_payload(3)).await;
        ss.on_message(4, &store_payload(4)).await;
    });
    assert_eq!(overlap(&router, 5), 5);
    assert_eq!(stats.gaps.load(Relaxed), 1);
    assert_eq!(
        stats.replayed_messages.load(Relaxed),
        2,
        "3 and later arrive live"
    );
    assert_eq!(stats.clears.load(Relaxed), 0);
    assert_eq!(
        stats.events_refused.load(Relaxed),
        0,
        "no parent was missing"
    );
}

#[test]
fn joining_a_running_engine_catches_up_from_its_buffer() {
    let router = router_with_worker(2, 1);
    let mut script = Script::default();
    for i in 0..3 {
        script.buffer.insert(i, store_payload(i));
    }
    let (mut ss, stats) = session(&router, Some(script));
    block_on(ss.on_message(3, &store_payload(3)));
    assert_eq!(overlap(&router, 4), 4);
    assert_eq!(stats.catch_ups.load(Relaxed), 1);
    assert_eq!(s_asked(&ss), vec![0]);
}

#[test]
fn catching_up_from_a_rolled_over_buffer_is_not_counted_as_a_loss() {
    let router = router_with_worker(2, 1);
    let mut script = Script::default();
    // The engine has run for a while: its buffer starts at 5 (a root store), 6 is live.
    let root = batch(vec![stored_array(
        ua(&[800]),
        V::Nil,
        ua(&[1, 2]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    script.buffer.insert(5, root);
    let (mut ss, stats) = session(&router, Some(script));
    let under = batch(vec![stored_array(
        ua(&[801]),
        V::U(800),
        ua(&[3, 4]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    block_on(ss.on_message(6, &under));
    assert_eq!(overlap(&router, 2), 2);
    assert_eq!(stats.catch_ups.load(Relaxed), 1);
    assert_eq!(stats.replay_rolled_over.load(Relaxed), 0);
    assert_eq!(stats.replayed_messages.load(Relaxed), 1);
}

fn s_asked(ss: &Session<Script>) -> Vec<u64> {
    ss.replayer_ref()
        .map(|r| r.asked.clone())
        .unwrap_or_default()
}

#[test]
fn a_rolled_over_buffer_clears_then_applies_what_it_has() {
    let router = router_with_worker(2, 1);
    let mut script = Script::default();
    // The buffer lost 1..=2; a store from the root at 3 still applies.
    let root_store = batch(vec![stored_array(
        ua(&[500]),
        V::Nil,
        ua(&[1, 2]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    script.buffer.insert(3, root_store);
    let (mut ss, stats) = session(&router, Some(script));
    block_on(async {
        ss.on_message(0, &store_payload(0)).await;
        assert_eq!(overlap(&router, 1), 1);
        // Seq 4 stores under the replayed 500.
        let under = batch(vec![stored_array(
            ua(&[501]),
            V::U(500),
            ua(&[3, 4]),
            V::U(2),
            s("GPU"),
            V::Nil,
            V::Nil,
            vec![],
        )]);
        ss.on_message(4, &under).await;
    });
    assert_eq!(stats.replay_rolled_over.load(Relaxed), 1);
    assert_eq!(stats.clears.load(Relaxed), 1);
    assert_eq!(
        overlap(&router, 2),
        2,
        "rebuilt from the replayed root store and the live one"
    );
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 0))[0],
        2,
        "block 100 was cleared"
    );
}

#[test]
fn a_buffer_that_starts_at_the_live_message_clears() {
    let router = router_with_worker(2, 1);
    let mut script = Script::default();
    // 1..=3 are lost: the buffer holds only the live message 4 and a later 5.
    script.buffer.insert(4, store_payload(4));
    script.buffer.insert(5, store_payload(5));
    let (mut ss, stats) = session(&router, Some(script));
    block_on(async {
        ss.on_message(0, &store_payload(0)).await;
        assert_eq!(overlap(&router, 1), 1);
        ss.on_message(4, &store_payload(4)).await;
    });
    assert_eq!(s_asked(&ss), vec![1]);
    assert_eq!(stats.replay_rolled_over.load(Relaxed), 1);
    assert_eq!(stats.clears.load(Relaxed), 1);
    assert_eq!(stats.replayed_messages.load(Relaxed), 0);
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 0))[0],
        0,
        "block 100 was cleared; 104's parent 103 is unknown, so it is dropped"
    );
}

#[test]
fn a_gap_without_replay_endpoint_clears_and_continues() {
    let router = router_with_worker(2, 1);
    let (mut ss, stats) = session(&router, None);
    let root = batch(vec![stored_array(
        ua(&[700]),
        V::Nil,
        ua(&[1, 2]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    block_on(async {
        ss.on_message(0, &store_payload(0)).await;
        ss.on_message(1, &store_payload(1)).await;
        ss.on_message(5, &root).await;
    });
    assert_eq!(stats.gap_unrecoverable.load(Relaxed), 1);
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 0))[0],
        1
    );
    assert_eq!(overlap(&router, 2), 1);
}

#[test]
fn a_failed_or_short_replay_clears() {
    let router = router_with_worker(2, 1);
    let script = Script {
        fail: true,
        ..Script::default()
    };
    let (mut ss, stats) = session(&router, Some(script));
    block_on(async {
        ss.on_message(0, &store_payload(0)).await;
        ss.on_message(2, &store_payload(2)).await;
    });
    assert_eq!(stats.replay_failed.load(Relaxed), 1);
    assert_eq!(
        overlap(&router, 1),
        0,
        "cleared; the live store's parent is unknown"
    );

    // A buffer that ends before the live message.
    let router = router_with_worker(2, 1);
    let mut script = Script::default();
    script.buffer.insert(1, store_payload(1));
    let (mut ss, stats) = session(&router, Some(script));
    block_on(async {
        ss.on_message(0, &store_payload(0)).await;
        ss.on_message(3, &store_payload(3)).await;
    });
    assert_eq!(stats.replay_incomplete.load(Relaxed), 1);
    assert_eq!(overlap(&router, 1), 0);
}

#[test]
fn the_last_sequence_number_again_is_dropped_not_a_restart() {
    let router = router_with_worker(2, 1);
    let (mut ss, stats) = session(&router, Some(Script::default()));
    block_on(async {
        for i in 0..3 {
            ss.on_message(i, &store_payload(i)).await;
        }
        // Seq 2 again, carrying a removal of the first block: not applied.
        let remove = batch(vec![V::A(vec![s("BlockRemoved"), ua(&[100]), s("GPU")])]);
        ss.on_message(2, &remove).await;
        ss.on_message(3, &store_payload(3)).await;
    });
    assert_eq!(stats.duplicates.load(Relaxed), 1);
    assert_eq!(stats.restarts.load(Relaxed), 0);
    assert_eq!(stats.clears.load(Relaxed), 0);
    assert_eq!(
        overlap(&router, 4),
        4,
        "nothing removed, 3 applied in order"
    );
    assert_eq!(ss.tracker.next_expected(), Some(4));
}

fn synced_session(
    router: &Arc<Router>,
    buffer: &[u64],
) -> (
    Session<Script>,
    Arc<IngestStats>,
    Arc<kvroute_core::feeds::FeedCell>,
) {
    use kvroute_core::feeds::{FeedConfig, Feeds};
    let mut script = Script::default();
    for &i in buffer {
        script.buffer.insert(i, store_payload(i));
    }
    let stats = Arc::new(IngestStats::default());
    let cell = Feeds::new(FeedConfig::default()).open(CandidateKey::new(1, 0));
    let applier = PayloadApplier::new(router.clone(), stats.clone(), 1, 0).with_feed(cell.clone());
    (
        Session::new(applier, Some(script), Arc::new(AtomicBool::new(false))),
        stats,
        cell,
    )
}

/// Issue 34: a router started after the engine cached blocks sees them at once (on connect), not
/// at the engine's next event; live copies of what the sync applied are duplicates.
#[test]
fn connecting_syncs_from_the_replay_buffer_at_once() {
    use kvroute_core::feeds::Trust;
    let router = router_with_worker(2, 1);
    let (mut ss, stats, cell) = synced_session(&router, &[0, 1, 2]);
    assert_eq!(cell.trust(), Trust::Recovering, "a new feed");
    block_on(ss.sync());
    assert_eq!(overlap(&router, 3), 3);
    assert_eq!(cell.trust(), Trust::Exact);
    assert_eq!(ss.tracker.next_expected(), Some(3));
    assert_eq!(ss.replayer_ref().unwrap().asked, vec![0]);
    block_on(async {
        // Published while the sync ran: already applied, not a restart.
        ss.on_message(2, &store_payload(2)).await;
        ss.on_message(3, &store_payload(3)).await;
    });
    assert_eq!(stats.restarts.load(Relaxed), 0);
    assert_eq!(overlap(&router, 4), 4);
}

/// Issue 34: on a reconnection the same engine is resumed from its buffer; a restarted one (its
/// buffer no longer holds the last message applied) has its stale blocks dropped at once.
#[test]
fn reconnecting_resumes_the_same_engine_and_clears_a_restarted_one() {
    use kvroute_core::feeds::Trust;
    let router = router_with_worker(2, 1);
    let (mut ss, stats, cell) = synced_session(&router, &[0, 1, 2]);
    block_on(async {
        for i in 0..3 {
            ss.on_message(i, &store_payload(i)).await;
        }
    });
    assert_eq!(cell.trust(), Trust::Exact);
    // The same engine published 3 while we were away.
    ss.replayer_mut()
        .unwrap()
        .buffer
        .insert(3, store_payload(3));
    block_on(ss.sync());
    assert_eq!(ss.replayer_ref().unwrap().asked, vec![2]);
    assert_eq!((overlap(&router, 4), stats.restarts.load(Relaxed)), (4, 0));
    // Now the engine restarts: a fresh process with a fresh buffer, another prompt at seq 0.
    let other = batch(vec![stored_array(
        ua(&[9]),
        V::Nil,
        ua(&[50, 51]),
        V::U(2),
        s("GPU"),
        V::Nil,
        V::Nil,
        vec![],
    )]);
    let buf = &mut ss.replayer_mut().unwrap().buffer;
    buf.clear();
    buf.insert(0, other);
    block_on(ss.sync());
    assert_eq!(stats.restarts.load(Relaxed), 1);
    assert_eq!(
        overlap(&router, 4),
        0,
        "the stale blocks are gone before any new event"
    );
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 0))[0],
        1
    );
    assert_eq!(ss.tracker.next_expected(), Some(1));
    assert_eq!(cell.trust(), Trust::Exact);
    // A restarted engine whose buffer is empty: cleared too.
    ss.replayer_mut().unwrap().buffer.clear();
    block_on(ss.sync());
    assert_eq!(stats.restarts.load(Relaxed), 2);
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 0))[0],
        0
    );
}

#[test]
fn a_join_whose_buffer_rolled_over_is_degraded_and_a_failed_sync_changes_nothing() {
    use kvroute_core::feeds::Trust;
    let router = router_with_worker(2, 1);
    let (mut ss, _stats, cell) = synced_session(&router, &[2, 3]);
    block_on(ss.sync());
    assert_eq!(cell.trust(), Trust::Degraded);
    assert_eq!(ss.tracker.next_expected(), Some(4));
    // An AllBlocksCleared makes the index exact again (the engine holds nothing).
    block_on(ss.on_message(4, &batch(vec![V::A(vec![s("AllBlocksCleared")])])));
    assert_eq!(cell.trust(), Trust::Exact);
    ss.replayer_mut().unwrap().fail = true;
    block_on(ss.sync());
    assert_eq!(cell.trust(), Trust::Exact);
    assert_eq!(ss.tracker.next_expected(), Some(5));
}

#[test]
fn a_sequence_going_back_is_an_engine_restart() {
    let router = router_with_worker(2, 1);
    let (mut ss, stats) = session(&router, Some(Script::default()));
    block_on(async {
        for i in 0..3 {
            ss.on_message(i, &store_payload(i)).await;
        }
        assert_eq!(overlap(&router, 3), 3);
        // The engine restarted and stores a different prompt at seq 0.
        let other = batch(vec![stored_array(
            ua(&[9]),
            V::Nil,
            ua(&[50, 51]),
            V::U(2),
            s("GPU"),
            V::Nil,
            V::Nil,
            vec![],
        )]);
        ss.on_message(0, &other).await;
    });
    assert_eq!(stats.restarts.load(Relaxed), 1);
    assert_eq!(overlap(&router, 3), 0);
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 0))[0],
        1
    );
    assert_eq!(ss.tracker.next_expected(), Some(1));
}

#[test]
fn unregistered_workers_and_ranks_are_refused() {
    let router = router_with_worker(2, 1);
    let stats = Arc::new(IngestStats::default());
    let stop = AtomicBool::new(false);
    let mut a = PayloadApplier::new(router.clone(), stats.clone(), 2, 0);
    assert_eq!(a.apply(0, &store_payload(0), &stop).refused, 1);
    // Rank override to a rank worker 1 does not have.
    let mut a = PayloadApplier::new(router.clone(), stats.clone(), 1, 0);
    let p = enc(&V::A(vec![
        V::F(1.0),
        V::A(vec![simple_stored(vec![])]),
        V::U(5),
    ]));
    assert_eq!(a.apply(0, &p, &stop).refused, 1);
    assert_eq!(router.indexer().stats().held_blocks[0], 0);
    assert!(router.counters.events_unknown_worker.load(Relaxed) >= 2);
}

#[test]
fn a_batch_rank_overrides_the_subscription_rank() {
    let router = router_with_worker(2, 2);
    let stats = Arc::new(IngestStats::default());
    let stop = AtomicBool::new(false);
    let mut a = PayloadApplier::new(router.clone(), stats, 1, 0);
    let p = enc(&V::A(vec![
        V::F(1.0),
        V::A(vec![simple_stored(vec![])]),
        V::U(1),
    ]));
    assert_eq!(a.apply(0, &p, &stop).applied, 1);
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 1))[0],
        1
    );
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 0))[0],
        0
    );
    // Clearing covers the overridden rank too.
    a.clear();
    assert_eq!(
        router.indexer().candidate_blocks(CandidateKey::new(1, 1))[0],
        0
    );
}

#[test]
fn a_stopped_subscription_applies_nothing() {
    let router = router_with_worker(2, 1);
    let stats = Arc::new(IngestStats::default());
    let applier = PayloadApplier::new(router.clone(), stats, 1, 0);
    let stop = Arc::new(AtomicBool::new(true));
    let mut ss: Session<Script> = Session::new(applier, None, stop);
    block_on(ss.on_message(0, &store_payload(0)));
    assert_eq!(overlap(&router, 1), 0);
}

#[test]
fn bad_frames_are_counted() {
    let router = router_with_worker(2, 1);
    let (mut ss, stats) = session(&router, None);
    let b = |x: &[u8]| Bytes::copy_from_slice(x);
    block_on(async {
        ss.on_frames(&[b(b"t"), b(&[0; 8])]).await;
        ss.on_frames(&[b(b"t"), b(&[0; 4]), b(&store_payload(0))])
            .await;
        ss.on_frames(&[b(b"t"), b(&[0; 8]), b(&store_payload(0)), b(b"x")])
            .await;
        ss.on_frames(&[b(b"t"), b(&[0; 8]), b(&store_payload(0))])
            .await;
    });
    assert_eq!(stats.dropped_count(DropReason::BadFrames), 3);
    assert_eq!(overlap(&router, 1), 1);
    let mut text = String::new();
    stats.render(0, &mut text);
    assert!(
        text.contains("kvroute_kv_dropped_total{reason=\"bad_frames\"} 3"),
        "{text}"
    );
}

// ---- endpoints and the manager -------------------------------------------------------------------

#[test]
fn endpoints_offset_by_rank() {
    use kvroute_core::workers::offset_endpoint;
    assert_eq!(
        offset_endpoint("tcp://*:5557", 0).unwrap(),
        "tcp://127.0.0.1:5557"
    );
    assert_eq!(
        offset_endpoint("tcp://10.0.0.1:5557", 3).unwrap(),
        "tcp://10.0.0.1:5560"
    );
    assert_eq!(
        offset_endpoint("tcp://[::1]:5557", 1).unwrap(),
        "tcp://[::1]:5558"
    );
    assert!(offset_endpoint("ipc:///tmp/x", 0).is_err());
    assert!(offset_endpoint("tcp://host", 0).is_err());
    assert!(offset_endpoint("tcp://:5", 0).is_err());
    assert!(offset_endpoint("tcp://h:0", 0).is_err());
    assert!(offset_endpoint("tcp://h:65535", 1).is_err());

    let router = router_with_worker(2, 1);
    let w = router
        .upsert_worker(
            4,
            WorkerSpec {
                dp_start: 2,
                dp_size: 2,
                kv_events: Some(KvEventsSpec {
                    endpoint: "tcp://*:6000".into(),
                    replay_endpoint: Some("tcp://*:7000".into()),
                    topic: "kv".into(),
                }),
                ..WorkerSpec::default()
            },
        )
        .unwrap();
    // SPEC §4: port + dp_rank (the global rank, not the rank within the worker).
    let specs = subscriptions_for(&w).unwrap();
    assert_eq!(specs.len(), 2);
    assert_eq!(
        (specs[0].dp_rank, specs[0].endpoint.as_str()),
        (2, "tcp://127.0.0.1:6002")
    );
    assert_eq!(
        (specs[1].dp_rank, specs[1].endpoint.as_str()),
        (3, "tcp://127.0.0.1:6003")
    );
    assert_eq!(
        specs[1].replay_endpoint.as_deref(),
        Some("tcp://127.0.0.1:7003")
    );
}

#[test]
fn the_manager_follows_the_registry() {
    let router = router_with_worker(2, 1);
    let ing = EventIngestion::start(router.clone(), IngestConfig::default()).unwrap();
    // Every registry write below reaches the manager through the registry itself.
    ing.follow_registry();
    let spec = |ep: &str| WorkerSpec {
        kv_events: Some(KvEventsSpec {
            endpoint: ep.into(),
            replay_endpoint: None,
            topic: String::new(),
        }),
        ..WorkerSpec::default()
    };
    // Nothing listens on these ports: the subscriptions just keep retrying.
    router.upsert_worker(1, spec("tcp://127.0.0.1:9")).unwrap();
    assert_eq!(ing.subscription_count(), 1);
    router.upsert_worker(1, spec("tcp://127.0.0.1:9")).unwrap();
    assert_eq!(
        ing.subscription_count(),
        1,
        "an unchanged registration keeps its subscription"
    );

    // A different endpoint replaces it and clears the worker's index.
    let stop = AtomicBool::new(false);
    PayloadApplier::new(router.clone(), Arc::new(IngestStats::default()), 1, 0).apply(
        0,
        &store_payload(0),
        &stop,
    );
    assert_eq!(overlap(&router, 1), 1);
    router.upsert_worker(1, spec("tcp://127.0.0.1:10")).unwrap();
    assert_eq!(ing.subscriptions()[0].endpoint, "tcp://127.0.0.1:10");
    assert_eq!(overlap(&router, 1), 0);

    // An endpoint that could never be subscribed is refused by the registry, naming the
    // field; the registration and its subscription stay as they were.
    let e = router.upsert_worker(1, spec("udp://x")).unwrap_err();
    assert_eq!(e.field, "kv_events.endpoint", "{e:?}");
    assert_eq!(ing.subscription_count(), 1);
    assert_eq!(ing.subscriptions()[0].endpoint, "tcp://127.0.0.1:10");
    assert_eq!(ing.stats().bad_endpoints.load(Relaxed), 0);

    router.upsert_worker(1, spec("tcp://127.0.0.1:11")).unwrap();
    assert_eq!(ing.subscription_count(), 1);
    router.remove_worker(1);
    assert_eq!(ing.subscription_count(), 0);

    let mut text = String::new();
    ing.render_metrics(&mut text);
    assert!(text.contains("kvroute_kv_subscriptions 0"));
    ing.shutdown();
    ing.shutdown();
    router.upsert_worker(1, spec("tcp://127.0.0.1:12")).unwrap();
    assert_eq!(ing.subscription_count(), 0, "nothing starts after shutdown");
}

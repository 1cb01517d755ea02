//! The publishing side of the wire: KV event batches encoded as vLLM's `ZmqEventPublisher` sends
//! them, for engines we simulate (`kvroute mock-engine`), so the router's ingestion of them is the
//! real one ([`crate::decode`] reads exactly these bytes).
//!
//! vLLM encodes with msgspec, `array_like=True` and a tag: a batch is `[ts, events,
//! data_parallel_rank]` and each event a tagged array with its fields in declaration order:
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name]`,
//! - `["BlockRemoved", block_hashes, medium]`,
//! - `["AllBlocksCleared"]`.
//!
//! The encoding is serde through `rmp-serde` (tuples are MessagePack arrays, integers take their
//! smallest form, `f64` is a float 64, `None` is nil), which gives msgspec's bytes: SPEC §4's
//! golden `array_one` payload comes out byte for byte (tested).
//!
//! A message on the PUB socket is `[topic, seq as 8 big-endian bytes, payload]`
//! ([`frames`]); the replay socket answers `[identity, "", topic, seq, payload]` per buffered
//! message and ends with seq `-1` and an empty payload ([`crate::subscriber::END_SEQ`]).

use bytes::Bytes;
use serde::ser::{Serialize, SerializeTuple, Serializer};

/// One KV event to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PubEvent {
    /// Full blocks newly cached: their engine hashes (a chain, each the next one's parent), the
    /// hash of the block before the first (`None` at the start of a sequence), and their tokens
    /// (`block_hashes.len() * block_size` of them; the router hashes these).
    Stored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u32>,
        /// `"GPU"` for the device tier (vLLM's name), `None` = the device.
        medium: Option<String>,
        lora_name: Option<String>,
    },
    /// Blocks evicted, by engine hash.
    Removed {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    /// The engine dropped its whole cache.
    AllCleared,
}

impl Serialize for PubEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            PubEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
            } => {
                let mut t = s.serialize_tuple(8)?;
                t.serialize_element("BlockStored")?;
                t.serialize_element(block_hashes)?;
                t.serialize_element(parent_block_hash)?;
                t.serialize_element(token_ids)?;
                t.serialize_element(block_size)?;
                t.serialize_element(lora_id)?;
                t.serialize_element(medium)?;
                t.serialize_element(lora_name)?;
                t.end()
            }
            PubEvent::Removed {
                block_hashes,
                medium,
            } => {
                let mut t = s.serialize_tuple(3)?;
                t.serialize_element("BlockRemoved")?;
                t.serialize_element(block_hashes)?;
                t.serialize_element(medium)?;
                t.end()
            }
            PubEvent::AllCleared => {
                let mut t = s.serialize_tuple(1)?;
                t.serialize_element("AllBlocksCleared")?;
                t.end()
            }
        }
    }
}

/// `[ts, events, data_parallel_rank]`.
struct PubBatch<'a> {
    ts: f64,
    events: &'a [PubEvent],
    dp_rank: Option<u32>,
}

impl Serialize for PubBatch<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(3)?;
        t.serialize_element(&self.ts)?;
        t.serialize_element(self.events)?;
        t.serialize_element(&self.dp_rank)?;
        t.end()
    }
}

/// One batch's MessagePack payload: `[ts, events, dp_rank]` (`ts` in seconds since the epoch, as
/// vLLM stamps it).
pub fn encode_batch(ts: f64, events: &[PubEvent], dp_rank: Option<u32>) -> Vec<u8> {
    rmp_serde::to_vec(&PubBatch {
        ts,
        events,
        dp_rank,
    })
    .expect("encoding into a Vec cannot fail")
}

/// The PUB socket's frames of one message: `[topic, seq (8 bytes, big-endian), payload]`.
pub fn frames(topic: &str, seq: u64, payload: Bytes) -> [Bytes; 3] {
    [
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Decoder;
    use kvroute_core::hashing;
    use kvroute_core::indexer::{KvEventData, StoredBlock, Tier};

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn golden_array_one_byte_for_byte() {
        // SPEC §4's `array_one`: [1.0, [["BlockStored", [7], 5, [10, 11], 2, nil, "GPU", nil]], 0].
        let ev = PubEvent::Stored {
            block_hashes: vec![7],
            parent_block_hash: Some(5),
            token_ids: vec![10, 11],
            block_size: 2,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        };
        assert_eq!(
            hex(&encode_batch(1.0, &[ev], Some(0))),
            "93cb3ff00000000000009198ab426c6f636b53746f726564910705920a0b02c0a3475055c000"
        );
    }

    #[test]
    fn round_trip_through_the_decoder() {
        let tokens: Vec<u32> = (100..116).collect();
        let (h1, h2) = (0xF000_0000_0000_0002u64, 3u64);
        let events = [
            PubEvent::Stored {
                block_hashes: vec![h1, h2],
                parent_block_hash: None,
                token_ids: tokens.clone(),
                block_size: 8,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
            },
            PubEvent::Stored {
                block_hashes: vec![9],
                parent_block_hash: Some(h2),
                token_ids: (1..9).collect(),
                block_size: 8,
                lora_id: None,
                medium: None,
                lora_name: None,
            },
            PubEvent::Removed {
                block_hashes: vec![h2, 9],
                medium: Some("GPU".into()),
            },
            PubEvent::AllCleared,
        ];
        let payload = encode_batch(1234.5, &events, Some(3));
        let batch = Decoder::new(8).decode(&payload).expect("decodes");
        assert_eq!(batch.ts, 1234.5);
        assert_eq!(batch.dp_rank, Some(3));
        assert_eq!(batch.dropped, Default::default());
        let device: Vec<&KvEventData> = batch
            .events
            .iter()
            .filter(|e| e.tier == Tier::Device)
            .map(|e| &e.data)
            .collect();
        let seed = hashing::BASE_SEED;
        assert_eq!(
            device,
            vec![
                &KvEventData::Stored {
                    parent_hash: None,
                    blocks: vec![
                        StoredBlock {
                            block_hash: h1,
                            tokens_hash: hashing::local_hash(&tokens[..8], seed),
                        },
                        StoredBlock {
                            block_hash: h2,
                            tokens_hash: hashing::local_hash(&tokens[8..], seed),
                        },
                    ],
                },
                &KvEventData::Stored {
                    parent_hash: Some(h2),
                    blocks: vec![StoredBlock {
                        block_hash: 9,
                        tokens_hash: hashing::local_hash(&(1..9).collect::<Vec<u32>>(), seed),
                    }],
                },
                &KvEventData::Removed {
                    block_hashes: vec![h2, 9],
                },
                &KvEventData::Cleared,
            ]
        );
    }

    #[test]
    fn frames_carry_topic_and_big_endian_seq() {
        let f = frames("kv", 258, Bytes::from_static(b"p"));
        assert_eq!(&f[0][..], b"kv");
        assert_eq!(&f[1][..], &[0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(&f[2][..], b"p");
    }
}

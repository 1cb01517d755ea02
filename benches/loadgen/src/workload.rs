//! The synthetic fleet: prompts sharing a system prefix, each cached in full on a few workers.
//!
//! `groups` distinct prompts of `prompt_tokens` tokens share their first `prefix_blocks` blocks.
//! Every worker caches the prefix; prompt `g` is cached in full on `replicas` workers
//! (`(g + r * workers / replicas) % workers`). With the defaults (64 workers, 512 prompts of 4,096
//! tokens = 256 blocks, a 32-block prefix, 8 replicas) the index holds 919,552 (worker, block)
//! entries, and a query for prompt `g` overlaps 256 blocks on 8 workers and 32 on the other 56:
//! the shape of the core benchmarks in BENCHMARKS.md.
//!
//! Hashes are computed bit for bit as the server does (SPEC §2): local hash = XXH3-64 of the
//! tokens' little-endian bytes seeded with 1337; the stored events' `block_hash` is the chained
//! sequence hash.

use std::fmt::Write as _;

use xxhash_rust::xxh3::xxh3_64_with_seed;

pub const BASE_SEED: u64 = 1337;

#[derive(Clone, Debug)]
pub struct Shape {
    pub workers: u64,
    pub groups: usize,
    pub replicas: u64,
    pub prompt_tokens: usize,
    pub prefix_blocks: usize,
    pub block_size: usize,
}

pub struct Prompt {
    pub tokens: Vec<u32>,
    pub local: Vec<u64>,
    pub seq: Vec<u64>,
    pub workers: Vec<u64>,
}

pub struct Workload {
    pub shape: Shape,
    pub prompts: Vec<Prompt>,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A small, fast PRNG for picking prompts.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (splitmix(&mut self.0) % n as u64) as usize
    }
}

pub fn local_hash(block: &[u32]) -> u64 {
    let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, BASE_SEED)
}

pub fn chain(parent: u64, local: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, BASE_SEED)
}

impl Workload {
    pub fn new(shape: Shape) -> Self {
        let bs = shape.block_size;
        let prefix_tokens = shape.prefix_blocks * bs;
        let mut state = 0xC0FFEE;
        // Token ids below 128,000, like a modern vocabulary.
        let prefix: Vec<u32> = (0..prefix_tokens)
            .map(|_| (splitmix(&mut state) % 128_000) as u32)
            .collect();
        let stride = (shape.workers / shape.replicas).max(1);
        let prompts = (0..shape.groups)
            .map(|g| {
                let mut state = 0x5EED_0000 + g as u64;
                let mut tokens = prefix.clone();
                tokens.extend(
                    (prefix_tokens..shape.prompt_tokens)
                        .map(|_| (splitmix(&mut state) % 128_000) as u32),
                );
                let local: Vec<u64> = tokens.chunks_exact(bs).map(local_hash).collect();
                let mut seq = Vec::with_capacity(local.len());
                for (i, &l) in local.iter().enumerate() {
                    seq.push(if i == 0 { l } else { chain(seq[i - 1], l) });
                }
                let workers = (0..shape.replicas)
                    .map(|r| (g as u64 + r * stride) % shape.workers + 1)
                    .collect();
                Prompt {
                    tokens,
                    local,
                    seq,
                    workers,
                }
            })
            .collect();
        Self { shape, prompts }
    }

    /// Worker ids are 1..=workers.
    pub fn worker_ids(&self) -> impl Iterator<Item = u64> {
        1..=self.shape.workers
    }

    /// The `POST /v1/events` body that populates one worker: the shared prefix, then the rest of
    /// every prompt it holds, chained to the prefix. Returns the body and the number of blocks.
    pub fn events_for(&self, worker: u64) -> (String, usize) {
        let p = self.shape.prefix_blocks;
        let mut out = String::from("[");
        let mut event_id = 0u64;
        let mut blocks = 0;
        let mut push = |out: &mut String, parent: Option<u64>, pairs: &[(u64, u64)]| {
            if event_id > 0 {
                out.push(',');
            }
            let _ = write!(
                out,
                r#"{{"worker_id":{worker},"event":{{"event_id":{event_id},"data":{{"stored":{{"#
            );
            if let Some(ph) = parent {
                let _ = write!(out, r#""parent_hash":{ph},"#);
            }
            out.push_str(r#""blocks":["#);
            for (i, (bh, th)) in pairs.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, r#"{{"block_hash":{bh},"tokens_hash":{th}}}"#);
            }
            out.push_str("]}}}}");
            event_id += 1;
            blocks += pairs.len();
        };
        let first = &self.prompts[0];
        let prefix: Vec<(u64, u64)> = (0..p).map(|i| (first.seq[i], first.local[i])).collect();
        push(&mut out, None, &prefix);
        for prompt in self.prompts.iter().filter(|q| q.workers.contains(&worker)) {
            let rest: Vec<(u64, u64)> = (p..prompt.local.len())
                .map(|i| (prompt.seq[i], prompt.local[i]))
                .collect();
            push(&mut out, Some(prompt.seq[p - 1]), &rest);
        }
        out.push(']');
        (out, blocks)
    }
}

/// How a route query carries its prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptForm {
    Tokens,
    BlockHashes,
}

impl PromptForm {
    pub fn name(self) -> &'static str {
        match self {
            PromptForm::Tokens => "tokens",
            PromptForm::BlockHashes => "block_hashes",
        }
    }
}

/// The JSON members of a route body after the opening brace, without the request id (added per
/// request in booking mode). kvroute: `tokens` or `block_hashes` (local hashes) and `book`.
/// Dynamo's selection service: `token_ids`, or `block_hashes` (local hashes as i64) together with
/// the `sequence_hashes` and `isl_tokens` it requires without tokens.
pub fn route_body_rest(prompt: &Prompt, form: PromptForm, book: bool, dynamo: bool) -> String {
    let mut out = String::with_capacity(prompt.tokens.len() * 8);
    match (form, dynamo) {
        (PromptForm::Tokens, false) => {
            out.push_str(r#""tokens":["#);
            join(&mut out, prompt.tokens.iter());
        }
        (PromptForm::BlockHashes, false) => {
            out.push_str(r#""block_hashes":["#);
            join(&mut out, prompt.local.iter());
        }
        (PromptForm::Tokens, true) => {
            out.push_str(r#""token_ids":["#);
            join(&mut out, prompt.tokens.iter());
        }
        (PromptForm::BlockHashes, true) => {
            out.push_str(r#""block_hashes":["#);
            join(&mut out, prompt.local.iter().map(|&h| h as i64));
            out.push_str(r#"],"sequence_hashes":["#);
            join(&mut out, prompt.seq.iter().map(|&h| h as i64));
            let _ = write!(out, r#"],"isl_tokens":{}"#, prompt.tokens.len());
            out.push('}');
            return out;
        }
    }
    if dynamo {
        out.push_str("]}");
    } else {
        let _ = write!(out, r#"],"book":{book}}}"#);
    }
    out
}

pub fn join<T: std::fmt::Display>(out: &mut String, items: impl Iterator<Item = T>) {
    for (i, t) in items.enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{t}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_counts() {
        let w = Workload::new(Shape {
            workers: 64,
            groups: 512,
            replicas: 8,
            prompt_tokens: 4096,
            prefix_blocks: 32,
            block_size: 16,
        });
        let total: usize = w.worker_ids().map(|id| w.events_for(id).1).sum();
        assert_eq!(total, 919_552);
        let p = &w.prompts[3];
        assert_eq!(p.local.len(), 256);
        assert_eq!(p.local[..32], w.prompts[0].local[..32]);
        assert_ne!(p.local[32], w.prompts[0].local[32]);
        let mut ws = p.workers.clone();
        ws.sort();
        ws.dedup();
        assert_eq!(ws.len(), 8);
    }
}

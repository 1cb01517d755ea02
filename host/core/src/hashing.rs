//! Block hashing, bit for bit as vLLM, SGLang and Dynamo compute it (SPEC §2).
//!
//! A prompt is cut into complete blocks of `block_size` tokens (the tail that does not fill a block is
//! never cached by an engine, so it is dropped). Each block gets a *local* hash — XXH3-64 over the
//! little-endian bytes of its tokens, seeded per request so that LoRA adapters and tenants (cache
//! salts) never share cache entries — and a *sequence* hash that chains the local hashes so a value
//! names a block together with everything before it.
//!
//! The index is keyed by local hashes along parent-linked paths, so routing needs only
//! [`local_block_hashes`]; the chained form is used where a flat key for "this block and its prefix"
//! is wanted (load tracking of shared prompt blocks, approximate-mode handles).

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed every request starts from, and the constant seed of the chaining step.
pub const BASE_SEED: u64 = 1337;

/// The seed of a request: [`BASE_SEED`], plus (wrapping) a hash of the LoRA adapter name, plus a hash
/// of the cache salt. Empty or absent names change nothing.
pub fn request_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = BASE_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Local (content) hash of one block of tokens.
#[inline]
pub fn local_hash(block: &[u32], seed: u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // On little-endian targets the in-memory bytes of the tokens *are* their little-endian
        // serialisation: hash them in place, no copy.
        // SAFETY: a `[u32]` of length n is 4n initialised bytes; u8 has alignment 1.
        let bytes =
            unsafe { std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), block.len() * 4) };
        xxh3_64_with_seed(bytes, seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

/// The local hash of a block whose identity also carries a key that no text prompt has: a
/// multimodal item (an image's hash and its offset in the block), a prompt-embedding digest, or an
/// identity the router could not establish (SPEC §2, "Isolation"). It is
/// `xxh3_64_with_seed(LE(tokens) ‖ LE64(key), seed)`: the input is 8 bytes longer than any
/// block's own, so it never equals a [`local_hash`] of the same size's tokens except by a 2^-64
/// accident, and no prompt without that key can match the block.
pub fn keyed_local_hash(block: &[u32], seed: u64, key: u64) -> u64 {
    let mut bytes = Vec::with_capacity(block.len() * 4 + 8);
    for t in block {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    bytes.extend_from_slice(&key.to_le_bytes());
    xxh3_64_with_seed(&bytes, seed)
}

/// Local hashes of every complete block of `tokens`, appended to `out` (which is cleared first).
///
/// # Panics
/// Never for valid input; `block_size == 0` yields no blocks.
pub fn local_block_hashes_into(tokens: &[u32], block_size: usize, seed: u64, out: &mut Vec<u64>) {
    out.clear();
    if block_size == 0 {
        return;
    }
    out.reserve(tokens.len() / block_size);
    out.extend(
        tokens
            .chunks_exact(block_size)
            .map(|block| local_hash(block, seed)),
    );
}

/// Local hashes of every complete block of `tokens`.
pub fn local_block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    let mut out = Vec::new();
    local_block_hashes_into(tokens, block_size, seed, &mut out);
    out
}

/// One chaining step: the sequence hash of a block from its parent's sequence hash and its own local
/// hash. The seed is always [`BASE_SEED`], whatever the request's LoRA or salt.
#[inline]
pub fn chain(parent_seq: u64, local: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent_seq.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, BASE_SEED)
}

/// Sequence hashes from local hashes: `seq[0] = local[0]`, `seq[i] = chain(seq[i-1], local[i])`.
pub fn sequence_hashes_into(local: &[u64], out: &mut Vec<u64>) {
    out.clear();
    out.reserve(local.len());
    let mut iter = local.iter();
    let Some(&first) = iter.next() else { return };
    out.push(first);
    let mut prev = first;
    for &l in iter {
        prev = chain(prev, l);
        out.push(prev);
    }
}

/// Sequence hashes from local hashes; see [`sequence_hashes_into`].
pub fn sequence_hashes(local: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    sequence_hashes_into(local, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // SPEC §2 test vectors, block size 4, no lora, no salt.
    #[test]
    fn spec_local_vectors() {
        let local = local_block_hashes(&(1..=12).collect::<Vec<u32>>(), 4, BASE_SEED);
        assert_eq!(
            local,
            vec![
                14643705804678351452,
                16777012769546811212,
                483935686894639516
            ]
        );
    }

    #[test]
    fn spec_sequence_vectors() {
        let local = local_block_hashes(&(1..=12).collect::<Vec<u32>>(), 4, BASE_SEED);
        let seq = sequence_hashes(&local);
        assert_eq!(seq[0], 14643705804678351452);
        assert_eq!(seq[1], 4945711292740353085);
        assert_eq!(seq[2], 12583592247330656132);
    }

    #[test]
    fn spec_lora_seed() {
        let seed = request_seed(Some("my-lora"), None);
        assert_eq!(seed, 12827409268353072861);
        assert_eq!(local_hash(&[1, 2, 3, 4], seed), 15671544057904749233);
    }

    #[test]
    fn spec_salt_seed() {
        let seed = request_seed(None, Some("tenant-a"));
        assert_eq!(seed, 1948188790972764086);
        assert_eq!(local_hash(&[1, 2, 3, 4], seed), 5738685477468498325);
    }

    #[test]
    fn empty_names_do_not_change_the_seed() {
        assert_eq!(request_seed(Some(""), Some("")), BASE_SEED);
        assert_eq!(request_seed(None, None), BASE_SEED);
    }

    #[test]
    fn tail_is_dropped_and_zero_block_size_yields_nothing() {
        assert_eq!(
            local_block_hashes(&[1, 2, 3, 4, 5, 6], 4, BASE_SEED).len(),
            1
        );
        assert!(local_block_hashes(&[1, 2, 3], 4, BASE_SEED).is_empty());
        assert!(local_block_hashes(&[1, 2, 3], 0, BASE_SEED).is_empty());
    }

    #[test]
    fn keyed_hashes_differ_from_plain_ones_and_by_key() {
        let block = [1, 2, 3, 4];
        let plain = local_hash(&block, BASE_SEED);
        let a = keyed_local_hash(&block, BASE_SEED, 7);
        let b = keyed_local_hash(&block, BASE_SEED, 8);
        assert_ne!(a, plain);
        assert_ne!(a, b);
        assert_eq!(a, keyed_local_hash(&block, BASE_SEED, 7));
        let mut bytes: Vec<u8> = block.iter().flat_map(|t: &u32| t.to_le_bytes()).collect();
        bytes.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(a, xxh3_64_with_seed(&bytes, BASE_SEED));
    }

    #[test]
    fn large_blocks_hash_like_small_ones() {
        let tokens: Vec<u32> = (0..600).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(local_hash(&tokens, 7), xxh3_64_with_seed(&bytes, 7));
        let small: Vec<u32> = (0..16).collect();
        let bytes: Vec<u8> = small.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(local_hash(&small, 7), xxh3_64_with_seed(&bytes, 7));
    }
}

//! The router's seeded random generator: reproducible draws for tests and the replay simulator,
//! shared lock-free by every thread that routes (and by the policy runtime's `wasi:random` stand-in).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use rand::RngCore;

/// SplitMix64 over one atomic word: a per-router random generator that needs no lock (one
/// `fetch_add` per draw) and, for a single-threaded caller, yields the same sequence for the same
/// seed. Concurrent callers each get distinct draws (the order between threads is whatever the
/// scheduler makes it).
#[derive(Debug)]
pub struct SeededRng {
    state: AtomicU64,
}

impl SeededRng {
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

    pub fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(Self::GAMMA, Relaxed)
            .wrapping_add(Self::GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// [`SeededRng`] as a `rand` generator.
pub(crate) struct SeededRef<'a>(pub(crate) &'a SeededRng);

impl RngCore for SeededRef<'_> {
    #[inline]
    fn next_u32(&mut self) -> u32 {
        (self.0.next_u64() >> 32) as u32
    }
    #[inline]
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        for chunk in dest.chunks_mut(8) {
            let bytes = self.0.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

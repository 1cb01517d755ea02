//! Giving freed index memory back to the operating system within a bounded time.
//!
//! The index frees what removals and clears take out (nodes, edge arrays; its canonical handle
//! map shrinks once it is a quarter full), but allocators keep freed pages until asked or until a
//! decay runs: the process's resident size then stays near its high-water mark. The serve loop's
//! one-second ticker calls [`Trimmer::tick`], which runs [`trim`] (on a blocking thread: it walks
//! the heaps) once the index holds [`TRIM_AFTER_ENTRIES`] fewer (candidate, block) entries than
//! its peak since the last trim: memory comes back at most a tick after the removals, and a
//! steady store/remove churn (which reuses freed memory anyway) never trims.
//!
//! The `kvroute` binary's allocator is jemalloc (host/cli/src/main.rs says why); with this crate's
//! `jemalloc` feature, which that binary sets, a trim purges every jemalloc arena's unused dirty
//! pages at once instead of waiting for their decay (10 s). glibc's `malloc_trim` runs too: C code
//! in the process still allocates there, and without the feature glibc holds everything.

/// Allocations at least this large are served by their own mapping and unmapped when freed.
pub const MMAP_THRESHOLD_BYTES: i32 = 1 << 20;

/// Fixes glibc's mmap threshold at [`MMAP_THRESHOLD_BYTES`]. By default glibc raises the threshold
/// to the size of each mapped block freed (up to 32 MiB), so after the first large request body
/// every later one (a 512-event `POST /v1/events` is ~7 MB) comes from a thread's heap arena, and
/// once freed stays there as resident free space: measured by `tests/index_memory.rs`, the same
/// entries posted 512 events at a time left 55 resident bytes per entry against 11 at 8 events at
/// a time. With the threshold fixed, a body's buffer is unmapped when the request ends. Under
/// jemalloc, the `kvroute` binary's allocator, Rust's allocations do not reach glibc: there the
/// same size is jemalloc's `oversize_threshold` (host/cli/src/main.rs), and this setting covers
/// what C code still allocates from glibc. Call once at start, before serving.
pub fn configure() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt has no preconditions; M_MMAP_THRESHOLD takes a byte count.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
    }
}

/// Entries the index must lose below its peak before a trim runs.
pub const TRIM_AFTER_ENTRIES: u64 = 1 << 16;

/// Tracks the index's peak size between trims.
#[derive(Debug, Default)]
pub struct Trimmer {
    peak: u64,
    trims: u64,
}

impl Trimmer {
    /// Called with the index's current (candidate, block) entries; true when a trim is due (the
    /// caller then runs [`trim`]).
    pub fn tick(&mut self, entries: u64) -> bool {
        self.peak = self.peak.max(entries);
        if self.peak - entries >= TRIM_AFTER_ENTRIES {
            self.peak = entries;
            self.trims += 1;
            return true;
        }
        false
    }

    /// Trims run so far.
    pub fn trims(&self) -> u64 {
        self.trims
    }
}

/// jemalloc's `opt.oversize_threshold`, the block size from which jemalloc gives freed pages
/// back at once (the `kvroute` binary sets it to [`MMAP_THRESHOLD_BYTES`]); `None` if jemalloc
/// does not answer.
#[cfg(feature = "jemalloc")]
pub fn jemalloc_oversize_threshold() -> Option<usize> {
    let (mut value, mut len) = (0usize, std::mem::size_of::<usize>());
    // SAFETY: `opt.oversize_threshold` is a size_t; jemalloc writes at most `len` bytes into
    // `value` and writes nothing back when no new value is given (null, 0).
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            c"opt.oversize_threshold".as_ptr(),
            (&mut value as *mut usize).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (rc == 0).then_some(value)
}

/// Returns free heap memory to the operating system: jemalloc's (with the `jemalloc` feature)
/// and glibc's (on glibc; a no-op elsewhere).
pub fn trim() {
    #[cfg(feature = "jemalloc")]
    {
        // `arena.<MALLCTL_ARENAS_ALL>.purge`: every arena's unused dirty pages, now.
        const PURGE_ALL: &std::ffi::CStr = c"arena.4096.purge";
        // SAFETY: a void mallctl: no old value is read and no new one written (null pointers,
        // length 0), which is how jemalloc documents `arena.<i>.purge`.
        let rc = unsafe {
            tikv_jemalloc_sys::mallctl(
                PURGE_ALL.as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if rc != 0 {
            tracing::warn!(errno = rc, "jemalloc purge failed");
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions and is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_once_the_index_fell_far_enough_below_its_peak() {
        let mut t = Trimmer::default();
        assert!(!t.tick(1_000_000));
        assert!(
            !t.tick(1_000_000 - TRIM_AFTER_ENTRIES + 1),
            "not far enough"
        );
        assert!(t.tick(1_000_000 - TRIM_AFTER_ENTRIES));
        assert!(!t.tick(1_000_000 - TRIM_AFTER_ENTRIES), "the peak restarts");
        // Churn back up and down by less than the threshold: no trim.
        assert!(!t.tick(1_000_000));
        assert!(!t.tick(1_000_000 - 100));
        assert_eq!(t.trims(), 1);
    }
}

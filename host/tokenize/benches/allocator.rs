//! The benches' global allocator: jemalloc, as in the `kvroute` binary (host/cli/src/main.rs), so
//! they time what the product runs; `KVROUTE_BENCH_ALLOCATOR=system` runs the same bench on the
//! system's malloc (glibc's) for the side-by-side figure. The choice is made once, at the first
//! allocation, from the environment read without allocating, and never changes: every block is
//! freed by the allocator that made it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use tikv_jemallocator::Jemalloc;

/// The binary's jemalloc options (host/cli/src/main.rs, `MALLOC_CONF`), so the bench's jemalloc
/// behaves as the product's.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: MallocConf = MallocConf(c"oversize_threshold:1048576".as_ptr());

#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);
// SAFETY: the pointer is to a static, immutable C string.
unsafe impl Sync for MallocConf {}

pub struct BenchAllocator {
    /// 0: not chosen yet, 1: jemalloc, 2: the system's.
    choice: AtomicU8,
}

#[global_allocator]
static ALLOCATOR: BenchAllocator = BenchAllocator {
    choice: AtomicU8::new(0),
};

impl BenchAllocator {
    fn system(&self) -> bool {
        match self.choice.load(Relaxed) {
            1 => false,
            2 => true,
            _ => {
                // SAFETY: a NUL-terminated name; getenv returns a pointer into the environment
                // (or null) and allocates nothing. The bench sets no variables while it runs.
                let v = unsafe { libc::getenv(c"KVROUTE_BENCH_ALLOCATOR".as_ptr()) };
                let system = !v.is_null()
                    // SAFETY: getenv's result is a NUL-terminated string.
                    && unsafe { std::ffi::CStr::from_ptr(v) }.to_bytes() == b"system";
                // Racing first calls read the same environment and agree.
                self.choice.store(if system { 2 } else { 1 }, Relaxed);
                system
            }
        }
    }

    /// The allocator the process runs on, for the bench's report.
    pub fn name() -> &'static str {
        if ALLOCATOR.system() {
            "system"
        } else {
            "jemalloc"
        }
    }
}

// SAFETY: every call goes to one of two sound allocators, always the same one for the process's
// life, so a block is freed or resized by the allocator that made it.
unsafe impl GlobalAlloc for BenchAllocator {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if self.system() {
            unsafe { System.alloc(l) }
        } else {
            unsafe { Jemalloc.alloc(l) }
        }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if self.system() {
            unsafe { System.alloc_zeroed(l) }
        } else {
            unsafe { Jemalloc.alloc_zeroed(l) }
        }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if self.system() {
            unsafe { System.dealloc(p, l) }
        } else {
            unsafe { Jemalloc.dealloc(p, l) }
        }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if self.system() {
            unsafe { System.realloc(p, l, new) }
        } else {
            unsafe { Jemalloc.realloc(p, l, new) }
        }
    }
}

//! A small, fast allocator for policy components.
//!
//! Every `decide` call allocates the same handful of buffers: the host `cabi_realloc`s one per
//! candidate column (14 of them) plus the request's strings and the parameter block, and the
//! answer's cost list; all are freed before the next call. wasi-libc's dlmalloc spends ~1 µs per
//! call on that; power-of-two size classes with LIFO free lists recycle the same blocks in a few
//! nanoseconds each. Single-threaded (Wasm without threads), never returns memory to the host
//! (a component's memory cannot shrink anyway).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::UnsafeCell;

const PAGE: usize = 65536;
/// Smallest class: 16 bytes (class 4).
const MIN_CLASS: u32 = 4;
/// Largest class: 2 GiB (class 31).
const CLASSES: usize = 32;
/// Bump allocations are aligned to their size up to this; larger alignments are refused.
const MAX_ALIGN: usize = PAGE;

struct State {
    free: [usize; CLASSES],
    bump: usize,
    end: usize,
}

/// Size-class allocator; see the module docs.
pub struct SizeClassAlloc(UnsafeCell<State>);

// SAFETY: wasm32-wasip2 components run single-threaded; no two calls run at once.
unsafe impl Sync for SizeClassAlloc {}

impl SizeClassAlloc {
    pub const fn new() -> Self {
        Self(UnsafeCell::new(State {
            free: [0; CLASSES],
            bump: 0,
            end: 0,
        }))
    }
}

#[inline]
fn class_of(layout: Layout) -> Option<(usize, usize)> {
    let size = layout
        .size()
        .max(layout.align())
        .max(1 << MIN_CLASS)
        .checked_next_power_of_two()?;
    let class = size.trailing_zeros() as usize;
    (class < CLASSES && layout.align() <= MAX_ALIGN).then_some((class, size))
}

fn grow(pages: usize) -> Option<usize> {
    let prev = core::arch::wasm32::memory_grow(0, pages);
    (prev != usize::MAX).then_some(prev * PAGE)
}

unsafe impl GlobalAlloc for SizeClassAlloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some((class, size)) = class_of(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: single-threaded (see `Sync` above); no reentrancy (nothing here allocates).
        let s = unsafe { &mut *self.0.get() };
        let head = s.free[class];
        if head != 0 {
            // SAFETY: `head` is a freed block of this class; its first word links the next one.
            s.free[class] = unsafe { *(head as *const usize) };
            return head as *mut u8;
        }
        let align = size.min(MAX_ALIGN);
        let mut start = (s.bump + align - 1) & !(align - 1);
        if start + size > s.end || s.end == 0 {
            let pages = (size + align).div_ceil(PAGE);
            let Some(base) = grow(pages) else {
                return std::ptr::null_mut();
            };
            if base != s.end {
                // Someone else (libc's malloc) grew memory in between: start a new region.
                s.bump = base;
            }
            s.end = base + pages * PAGE;
            start = (s.bump + align - 1) & !(align - 1);
        }
        s.bump = start + size;
        start as *mut u8
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some((class, _)) = class_of(layout) else {
            return;
        };
        // SAFETY: single-threaded; `ptr` came from `alloc` with this layout, so it is at least
        // 16 bytes and aligned for a `usize`.
        unsafe {
            let s = &mut *self.0.get();
            *(ptr as *mut usize) = s.free[class];
            s.free[class] = ptr as usize;
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `layout.align()` is valid and `new_size` fits `isize`.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if class_of(layout).map(|c| c.0) == class_of(new_layout).map(|c| c.0) {
            return ptr;
        }
        // SAFETY: as for `alloc`/`dealloc`; the copy stays within both blocks.
        unsafe {
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

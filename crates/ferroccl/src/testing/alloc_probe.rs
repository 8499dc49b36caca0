//! Test support: the largest single allocation a closure makes on its thread, so fuzz tests
//! can check that a length field from the wire never decides how much is allocated.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Probe;

thread_local! {
    // Const-initialised cells: reading them never allocates, which an allocator requires.
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = WATCHING.try_with(|w| {
        if w.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Probe {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        System.realloc(p, l, new)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
}

#[global_allocator]
static PROBE: Probe = Probe;

/// Runs `f` and returns its result with the largest allocation it made on this thread.
pub(crate) fn largest_allocation_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    WATCHING.with(|w| w.set(true));
    let out = f();
    WATCHING.with(|w| w.set(false));
    (out, LARGEST.with(|l| l.get()))
}

#[test]
fn the_probe_sees_allocations() {
    let (v, largest) = largest_allocation_during(|| vec![0u8; 12345]);
    assert_eq!(v.len(), 12345);
    assert!(largest >= 12345);
    let ((), none) = largest_allocation_during(|| {});
    assert_eq!(none, 0);
}

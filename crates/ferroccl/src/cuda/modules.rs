//! Modules shared by everything in this process that loads the same image on the same GPU.
//!
//! `cuModuleLoadData` and `cuModuleUnload` wait until every kernel of their context has
//! finished, and hold back every other launch into the context while they wait
//! (`bench/probes/driver_waits.cu`, docs/RELIABILITY.md, last section). ferroccl's kernels wait
//! for each other, so a communicator made while another one's kernels wait for their peers (a
//! split, a framework's new process group in the middle of a step) would wait with them and stall
//! every launch of the process on that GPU, or, where those kernels wait for a rank of this
//! process sharing the GPU, wait until their deadline. Shared, a later communicator loads nothing
//! (it also skips the load's time and the module's memory), and a module is unloaded only when
//! the last communicator using it goes.

use std::sync::{Arc, Mutex, Weak};

/// Loaded things (`T`: a module) by context and image. Keeps no module alive: only what its
/// users hold does.
pub(crate) struct Shared<T> {
    entries: Mutex<Vec<Entry<T>>>,
}

struct Entry<T> {
    ctx: usize,
    image: Vec<u8>,
    loaded: Weak<T>,
}

impl<T> Shared<T> {
    pub(crate) const fn new() -> Shared<T> {
        Shared {
            entries: Mutex::new(Vec::new()),
        }
    }

    /// The module of `image` in context `ctx`: one a user still holds, else `load()`'s, kept
    /// for later users. Loads run without the lock (a load may wait for a busy GPU, and other
    /// GPUs' loads must not wait with it); two loads of one image at once both load, and the
    /// second is used without being shared (dropping it would unload, which waits too).
    pub(crate) fn get_or_load<E>(
        &self,
        ctx: usize,
        image: &[u8],
        load: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        if let Some(found) = self.find(ctx, image) {
            return Ok(found);
        }
        let loaded = Arc::new(load()?);
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|e| e.loaded.strong_count() > 0);
        if !entries.iter().any(|e| e.ctx == ctx && e.image == image) {
            entries.push(Entry {
                ctx,
                image: image.to_vec(),
                loaded: Arc::downgrade(&loaded),
            });
        }
        Ok(loaded)
    }

    fn find(&self, ctx: usize, image: &[u8]) -> Option<Arc<T>> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .iter()
            .filter(|e| e.ctx == ctx && e.image == image)
            .find_map(|e| e.loaded.upgrade())
    }

    /// Entries kept (live or not yet pruned), for the tests.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A module that counts its loads and unloads.
    struct Counted<'a>(&'a AtomicUsize);
    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn one_image_on_one_gpu_is_loaded_once_while_anyone_holds_it() {
        let (loads, unloads) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let shared: Shared<Counted<'_>> = Shared::new();
        let load = || {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>(Counted(&unloads))
        };
        let a = shared.get_or_load(1, b"plan", load).unwrap();
        let b = shared.get_or_load(1, b"plan", load).unwrap();
        assert!(
            Arc::ptr_eq(&a, &b),
            "the second user gets the first's module"
        );
        assert_eq!(loads.load(Ordering::SeqCst), 1);
        // Another image, or the same image in another context: loaded apart.
        let c = shared.get_or_load(1, b"peer", load).unwrap();
        let d = shared.get_or_load(2, b"plan", load).unwrap();
        assert!(!Arc::ptr_eq(&a, &c) && !Arc::ptr_eq(&a, &d));
        assert_eq!(loads.load(Ordering::SeqCst), 3);
        // An image that only starts like another is another image.
        let e = shared.get_or_load(1, b"pla", load).unwrap();
        assert!(!Arc::ptr_eq(&a, &e));
        assert_eq!(loads.load(Ordering::SeqCst), 4);
        drop((c, d, e));
        assert_eq!(
            unloads.load(Ordering::SeqCst),
            3,
            "the cache keeps nothing alive"
        );
        drop(a);
        assert_eq!(
            unloads.load(Ordering::SeqCst),
            3,
            "b still holds the module"
        );
        drop(b);
        assert_eq!(unloads.load(Ordering::SeqCst), 4);
        // Gone: the next user loads it again, and the dead entries are pruned.
        let f = shared.get_or_load(1, b"plan", load).unwrap();
        assert_eq!(loads.load(Ordering::SeqCst), 5);
        assert_eq!(shared.len(), 1);
        drop(f);
    }

    #[test]
    fn a_failed_load_is_returned_and_kept_for_no_one() {
        let shared: Shared<u32> = Shared::new();
        assert_eq!(shared.get_or_load(1, b"x", || Err("no")), Err("no"));
        assert_eq!(shared.len(), 0);
        let m = shared.get_or_load(1, b"x", || Ok::<_, ()>(7)).unwrap();
        assert_eq!(*m, 7);
    }
}

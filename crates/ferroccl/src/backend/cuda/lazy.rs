//! Outputs nobody registered, mapped on the fly for the peers whose copy engines write them
//! (NCCL's lazy registration), for the copy engines' rendezvous (`launch/mod.rs`,
//! `launch/posts.rs`): a rank about to post an output that lies in no window lends the allocation
//! holding it to each writer's mapper (`mapper.rs`, as a local registration does) and posts where
//! that writer maps it (`plan::copies::Posted::Mapped`). A cuMem allocation goes as a POSIX file
//! descriptor; `cuMemAlloc` memory (`cudaMalloc`'s, PyTorch's default allocator's segments) by
//! its CUDA IPC handle. Loans are kept by allocation
//! for the next operations on it, so only the first one pays the lend (an export, a message to
//! the mapper, its import and mapping).
//!
//! Kept honest against frees by the allocation's identity (`cuda::mem::Identity`): a cuMem loan
//! holds a reference to its allocation's handle, which the driver keeps the same while the
//! allocation lives and which no other allocation can share while the reference is held; a
//! `cuMemAlloc` loan keeps the driver's buffer id, which it never gives two allocations of a
//! process. A lookup compares the identity the output's address has now with its loan's: a loan
//! whose allocation is gone (freed, or its addresses taken by another) is dropped there, its
//! reference released and its writers' mappings recalled, and the new allocation lent. So an
//! output freed and allocated anew at the same address is never written through a stale mapping.
//! A freed allocation's memory, which the reference and the writers' mappings keep (a peer's IPC
//! mapping keeps `cuMemAlloc` memory until it closes, as the driver does it: measured), is given
//! back by a thread of the communicator ([`Sweeper`]) that checks every loan so every
//! [`SWEEP_EVERY`]: memory a user frees returns within that time even when no operation follows.
//!
//! A loan is never dropped while its allocation lives: a CUDA graph that captured copies into a
//! peer's lent output replays them for as long as the graph lives, which CUDA allows only while
//! the output does. So there is no eviction: beyond [`MAX_LAZY`] live loans, outputs in new
//! allocations are not lent (their operations run on the kernels) until some loan's allocation is
//! freed.
//!
//! A writer in this process needs no mapper: it reaches the allocation at the lender's own
//! address once its GPU may (a cuMem allocation's range granted to it; for `cuMemAlloc` memory,
//! peer access to the lender's context turned on, `Gpu::let_reach`).
//!
//! Memory that neither kind can lend (managed memory, a stream-ordered pool's, a cuMem allocation
//! without POSIX file-descriptor handles) gets no loan: its operations run on the kernels.

use super::mapper::LendFailed;
use ferroccl_core::{Error, Rank};

/// The most allocations lent on the fly at once, per communicator: a sweep costs two driver
/// calls a loan, and each loan is a mapping in every writer's process (whose mapper holds at most
/// `mapper::MAX_LOANS` from all its peers).
pub(crate) const MAX_LAZY: usize = 256;

/// How often the [`Sweeper`] looks for loans whose allocation is gone.
pub(crate) const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// The first number of a loan on the fly at the mappers: apart from local registrations', which
/// count from 1 (`Windows::register_local`), so that one lender's numbers never meet.
const FIRST_ID: u64 = 1 << 63;

/// What lending on the fly needs from the driver and the peers' mappers ([`Live`] on GPUs; the
/// tests fake it).
pub(crate) trait Lender {
    /// A reference to an allocation's handle, released on drop; equal to another exactly when
    /// both name the same allocation.
    type Handle: PartialEq;
    /// What a peer imports the allocation by (a file descriptor, or a CUDA IPC handle).
    type Fd;
    /// The allocation holding `ptr` (base, bytes), where `ptr` is GPU memory of this process.
    fn range(&self, ptr: u64) -> Option<(u64, u64)>;
    /// What names the allocation mapped at `ptr` while it lives, if it can be lent.
    fn retain(&self, ptr: u64) -> Option<Self::Handle>;
    /// What a peer imports the allocation `h` names by.
    fn export(&self, h: &Self::Handle) -> Result<Self::Fd, Error>;
    /// Lends the allocation of `bytes` at `base` (descriptor `fd`) to rank `to` as loan `id`;
    /// where `to` maps `base`.
    fn lend(
        &self,
        to: Rank,
        id: u64,
        base: u64,
        bytes: u64,
        fd: &Self::Fd,
    ) -> Result<u64, LendFailed>;
    /// Asks rank `to` to unmap loan `id` (a failure is logged: the mapping then lasts until
    /// `to`'s communicator ends).
    fn recall(&self, to: Rank, id: u64);
}

/// Where one rank reaches a lent allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// Not lent to it yet.
    Unasked,
    /// Lent: the allocation's base as it maps it.
    At(u64),
    /// It refused, or the allocation cannot be exported: never asked again.
    Refused,
    /// The lend's answer was lost: it may hold a mapping (recalled with the loan), never used.
    Lost,
}

/// One allocation lent on the fly.
struct Loan<H> {
    base: u64,
    bytes: u64,
    handle: H,
    /// Its number at the mappers (one numbering with the rank's local registrations).
    id: u64,
    /// By rank.
    reach: Vec<Reach>,
}

/// A rank's allocations lent on the fly.
pub(crate) struct LazyMaps<H> {
    loans: Vec<Loan<H>>,
    /// The latest loan's number.
    last_id: u64,
}

impl<H> Default for LazyMaps<H> {
    fn default() -> Self {
        LazyMaps {
            loans: Vec::new(),
            last_id: FIRST_ID,
        }
    }
}

impl<H: PartialEq> LazyMaps<H> {
    /// Where each rank of `readers` maps `[ptr, ptr + bytes)` of this rank (None where it
    /// cannot), lending the allocation holding it at its first use. `nranks`: the
    /// communicator's.
    pub fn reach<L: Lender<Handle = H>>(
        &mut self,
        l: &L,
        nranks: usize,
        ptr: u64,
        bytes: u64,
        readers: &[Rank],
    ) -> Vec<Option<u64>> {
        let mut out = vec![None; readers.len()];
        let Some(i) = self.loan_for(l, nranks, ptr, bytes) else {
            return out;
        };
        let loan = &mut self.loans[i];
        let mut fd = None;
        for &r in readers {
            if loan.reach.get(r) != Some(&Reach::Unasked) {
                continue;
            }
            if fd.is_none() {
                match l.export(&loan.handle) {
                    Ok(f) => fd = Some(f),
                    Err(e) => {
                        tracing::debug!("the allocation at {:#x} cannot be lent: {e}", loan.base);
                        loan.reach.iter_mut().for_each(|x| {
                            if *x == Reach::Unasked {
                                *x = Reach::Refused
                            }
                        });
                        break;
                    }
                }
            }
            let f = fd.as_ref().expect("exported above");
            loan.reach[r] = match l.lend(r, loan.id, loan.base, loan.bytes, f) {
                Ok(addr) => Reach::At(addr),
                Err(f) => {
                    tracing::warn!(
                        "rank {r} cannot map the allocation at {:#x} for the copy engines, which leave it to the kernels: {}",
                        loan.base,
                        f.error
                    );
                    if f.maybe_mapped {
                        Reach::Lost
                    } else {
                        Reach::Refused
                    }
                }
            };
        }
        for (o, &r) in out.iter_mut().zip(readers) {
            if let Some(Reach::At(base)) = loan.reach.get(r) {
                *o = Some(base + (ptr - loan.base));
            }
        }
        out
    }

    /// The loan of the allocation holding `[ptr, ptr + bytes)`, made where there is none (a loan
    /// at its address whose allocation is gone dropped first); None where no lendable allocation
    /// holds all of it, or [`MAX_LAZY`] live loans are held.
    fn loan_for<L: Lender<Handle = H>>(
        &mut self,
        l: &L,
        nranks: usize,
        ptr: u64,
        bytes: u64,
    ) -> Option<usize> {
        let (base, size) = l.range(ptr)?;
        if ptr.checked_add(bytes)? > base.checked_add(size)? || ptr < base {
            return None;
        }
        let handle = l.retain(ptr)?;
        if let Some(i) = self.loans.iter().position(|x| x.base == base) {
            if self.loans[i].handle == handle && self.loans[i].bytes == size {
                return Some(i);
            }
            recall(l, self.loans.swap_remove(i));
        }
        if self.loans.len() >= MAX_LAZY {
            // Dropping a live loan could pull a mapping from under a captured graph.
            tracing::debug!("{MAX_LAZY} allocations lent on the fly: the one at {base:#x} is not");
            return None;
        }
        self.last_id += 1;
        self.loans.push(Loan {
            base,
            bytes: size,
            handle,
            id: self.last_id,
            reach: vec![Reach::Unasked; nranks],
        });
        Some(self.loans.len() - 1)
    }

    /// Drops every loan whose address no longer holds its allocation.
    pub fn sweep<L: Lender<Handle = H>>(&mut self, l: &L) {
        let mut i = 0;
        while i < self.loans.len() {
            let loan = &self.loans[i];
            if l.retain(loan.base).is_some_and(|h| h == loan.handle) {
                i += 1;
            } else {
                recall(l, self.loans.swap_remove(i));
            }
        }
    }

    /// Allocations lent now.
    pub fn len(&self) -> usize {
        self.loans.len()
    }
}

/// Recalls `loan` from every rank that may map it; its reference goes with it.
fn recall<L: Lender>(l: &L, loan: Loan<L::Handle>) {
    for (r, x) in loan.reach.iter().enumerate() {
        if matches!(x, Reach::At(_) | Reach::Lost) {
            l.recall(r, loan.id);
        }
    }
}

/// The lender on GPUs: the driver's allocations, and the mappers of communicator `comm_id`.
pub(crate) struct Live<'a> {
    pub gpu: &'a crate::cuda::device::Gpu,
    pub me: Rank,
    pub places: &'a [super::mapper::Place],
    pub comm_id: u64,
    pub abort: &'a std::sync::atomic::AtomicBool,
    pub deadline: std::time::Instant,
}

impl Lender for Live<'_> {
    type Handle = crate::cuda::mem::Identity;
    type Fd = crate::cuda::mem::Shared;

    fn range(&self, ptr: u64) -> Option<(u64, u64)> {
        crate::cuda::mem::allocation_range(self.gpu, ptr).ok()
    }

    fn retain(&self, ptr: u64) -> Option<Self::Handle> {
        crate::cuda::mem::Identity::at(ptr, self.gpu.ordinal())
            .inspect_err(|e| tracing::trace!("the memory at {ptr:#x} cannot be lent: {e}"))
            .ok()
    }

    fn export(&self, h: &Self::Handle) -> Result<Self::Fd, Error> {
        self.gpu.bind()?;
        h.export()
    }

    fn lend(
        &self,
        to: Rank,
        id: u64,
        base: u64,
        bytes: u64,
        fd: &Self::Fd,
    ) -> Result<u64, LendFailed> {
        let unsent = |error| LendFailed {
            error,
            maybe_mapped: false,
        };
        let place = self
            .places
            .get(to)
            .ok_or_else(|| unsent(Error::Internal(format!("no rank {to}"))))?;
        let pid = std::process::id();
        if place.pid == pid {
            // A peer of this process reaches the allocation at its own address once its GPU may.
            crate::cuda::mem::reach_here(self.gpu, fd, base, bytes as usize, place.gpu as usize)
                .map_err(unsent)?;
            return Ok(base);
        }
        let desc = super::window::WindowDesc {
            pid,
            gpu: self.gpu.ordinal() as u32,
            ptr: base,
            len: bytes,
            alloc_base: base,
            alloc_len: bytes,
            symmetric: false,
        };
        let (req, fd) = super::mapper::Request::lend_of(self.me as u32, id, desc, fd);
        super::mapper::lend(
            self.comm_id,
            to,
            place.pid,
            &req,
            fd,
            self.deadline,
            self.abort,
        )
    }

    fn recall(&self, to: Rank, id: u64) {
        let Some(place) = self.places.get(to) else {
            return;
        };
        if place.pid == std::process::id() {
            return;
        }
        let req = super::mapper::Request::Recall {
            from: self.me as u32,
            id,
        };
        if let Err(e) =
            super::mapper::recall(self.comm_id, to, place.pid, &req, self.deadline, self.abort)
        {
            tracing::warn!(
                rank = self.me,
                "rank {to}'s mapper did not unmap an allocation lent on the fly: {e}"
            );
        }
    }
}

/// A communicator's thread that sweeps its loans on the fly ([`LazyMaps::sweep`]) every
/// [`SWEEP_EVERY`] while there are any, so that an allocation a user frees after its last
/// operation is given back (its reference released, its writers' mappings recalled) without
/// waiting for another operation. Stopped and joined on drop, at once.
pub(crate) struct Sweeper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sweeper {
    /// Starts rank `me`'s sweeper of `maps` (communicator `comm_id`, ranks at `places`).
    pub fn of_loans(
        maps: std::sync::Arc<std::sync::Mutex<LazyMaps<crate::cuda::mem::Identity>>>,
        gpu: crate::cuda::device::Gpu,
        me: Rank,
        places: Vec<super::mapper::Place>,
        comm_id: u64,
    ) -> Result<Sweeper, Error> {
        let mut bound = false;
        Sweeper::start(format!("ferroccl-sweeper-{me}"), SWEEP_EVERY, move |halt| {
            bound = bound || gpu.bind().is_ok();
            let Ok(mut m) = maps.lock() else { return };
            if !bound || m.len() == 0 {
                return;
            }
            let l = Live {
                gpu: &gpu,
                me,
                places: &places,
                comm_id,
                abort: halt,
                deadline: std::time::Instant::now() + std::time::Duration::from_secs(2),
            };
            m.sweep(&l);
        })
    }

    /// Runs `sweep` every `every` on a thread named `name` until dropped; `sweep` gets the stop
    /// word, which it may pass on as an abort.
    pub fn start(
        name: String,
        every: std::time::Duration,
        mut sweep: impl FnMut(&std::sync::atomic::AtomicBool) + Send + 'static,
    ) -> Result<Sweeper, Error> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let mut next = std::time::Instant::now() + every;
                while !halt.load(Ordering::Relaxed) {
                    // Parked, not asleep: the drop unparks it, so that a communicator's end does
                    // not wait out the period (and a spurious wake-up parks again).
                    let now = std::time::Instant::now();
                    if now < next {
                        std::thread::park_timeout(next - now);
                        continue;
                    }
                    sweep(&halt);
                    next = std::time::Instant::now() + every;
                }
            })
            .map_err(|e| Error::System(format!("starting the sweeper thread: {e}")))?;
        Ok(Sweeper {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// A fake driver: allocations by base (bytes, allocation number), references counted; and
    /// fake mappers that map each loan at a fresh address and log lends and recalls.
    #[derive(Default)]
    struct Fake {
        mapped: RefCell<Vec<(u64, u64, u64)>>,
        next_alloc: RefCell<u64>,
        refs: Rc<RefCell<std::collections::HashMap<u64, i64>>>,
        refuse: RefCell<Vec<Rank>>,
        lose: RefCell<Vec<Rank>>,
        no_export: RefCell<bool>,
        log: RefCell<Vec<String>>,
    }

    struct H {
        alloc: u64,
        refs: Rc<RefCell<std::collections::HashMap<u64, i64>>>,
    }
    impl PartialEq for H {
        fn eq(&self, o: &H) -> bool {
            self.alloc == o.alloc
        }
    }
    impl Drop for H {
        fn drop(&mut self) {
            *self.refs.borrow_mut().entry(self.alloc).or_default() -= 1;
        }
    }

    impl Fake {
        /// Maps a new allocation of `bytes` at `base`; its number.
        fn alloc(&self, base: u64, bytes: u64) -> u64 {
            *self.next_alloc.borrow_mut() += 1;
            let a = *self.next_alloc.borrow();
            self.mapped.borrow_mut().push((base, bytes, a));
            a
        }
        fn free(&self, base: u64) {
            self.mapped.borrow_mut().retain(|m| m.0 != base);
        }
        /// References held to allocation `a` (by the maps).
        fn held(&self, a: u64) -> i64 {
            self.refs.borrow().get(&a).copied().unwrap_or(0)
        }
        fn log(&self) -> Vec<String> {
            std::mem::take(&mut *self.log.borrow_mut())
        }
    }

    impl Lender for Fake {
        type Handle = H;
        type Fd = u64;
        fn range(&self, ptr: u64) -> Option<(u64, u64)> {
            self.mapped
                .borrow()
                .iter()
                .find(|m| ptr >= m.0 && ptr < m.0 + m.1)
                .map(|m| (m.0, m.1))
        }
        fn retain(&self, ptr: u64) -> Option<H> {
            let (_, _, a) = *self
                .mapped
                .borrow()
                .iter()
                .find(|m| ptr >= m.0 && ptr < m.0 + m.1)?;
            *self.refs.borrow_mut().entry(a).or_default() += 1;
            Some(H {
                alloc: a,
                refs: self.refs.clone(),
            })
        }
        fn export(&self, h: &H) -> Result<u64, Error> {
            if *self.no_export.borrow() {
                return Err(Error::InvalidArgument("not shareable".into()));
            }
            Ok(h.alloc)
        }
        fn lend(
            &self,
            to: Rank,
            id: u64,
            base: u64,
            bytes: u64,
            fd: &u64,
        ) -> Result<u64, LendFailed> {
            let id = id - FIRST_ID;
            self.log.borrow_mut().push(format!(
                "lend {id} of alloc {fd} ({bytes} at {base:#x}) to {to}"
            ));
            let fail = |maybe_mapped| LendFailed {
                error: Error::Remote("no".into()),
                maybe_mapped,
            };
            if self.refuse.borrow().contains(&to) {
                return Err(fail(false));
            }
            if self.lose.borrow().contains(&to) {
                return Err(fail(true));
            }
            Ok(at(to, id))
        }
        fn recall(&self, to: Rank, id: u64) {
            let id = id - FIRST_ID;
            self.log.borrow_mut().push(format!("recall {id} from {to}"));
        }
    }

    /// Where the fake mappers map loan `id` (counted from 1) at rank `to`.
    fn at(to: Rank, id: u64) -> u64 {
        0x7000_0000_0000 * (to as u64 + 1) + (id & !FIRST_ID) * 0x1_0000_0000
    }

    #[test]
    fn a_buffer_is_lent_once_to_each_reader_and_posted_at_its_offset() {
        let f = Fake::default();
        let a = f.alloc(0x10_0000, 1 << 20);
        let mut m = LazyMaps::default();
        // Rank 0 of 3: rank 2 reads first, then ranks 1 and 2.
        assert_eq!(
            m.reach(&f, 3, 0x10_0400, 256, &[2]),
            vec![Some(at(2, 1) + 0x400)]
        );
        assert_eq!(
            f.log(),
            vec![format!("lend 1 of alloc {a} (1048576 at 0x100000) to 2")]
        );
        assert_eq!(
            m.reach(&f, 3, 0x10_0000, 1 << 20, &[1, 2]),
            vec![Some(at(1, 1)), Some(at(2, 1))]
        );
        assert_eq!(
            f.log(),
            vec![format!("lend 1 of alloc {a} (1048576 at 0x100000) to 1")]
        );
        assert_eq!(m.reach(&f, 3, 0x10_0000, 64, &[1, 2]).len(), 2);
        assert!(f.log().is_empty(), "nothing lent twice");
        assert_eq!((m.len(), f.held(a)), (1, 1), "one loan, one reference held");
        assert_eq!(
            m.last_id,
            FIRST_ID + 1,
            "numbered apart from local registrations"
        );
    }

    #[test]
    fn what_no_cuda_allocation_holds_gets_no_loan() {
        let f = Fake::default();
        f.alloc(0x10_0000, 4096);
        let mut m = LazyMaps::default();
        for (ptr, bytes) in [(0x20_0000, 8), (0x10_0f00, 0x101), (0x10_0000, u64::MAX)] {
            assert_eq!(m.reach(&f, 2, ptr, bytes, &[1]), vec![None]);
        }
        assert_eq!((m.len(), m.last_id), (0, FIRST_ID));
        assert!(f.log().is_empty());
    }

    #[test]
    fn a_freed_allocation_is_recalled_and_a_new_one_at_its_address_lent_anew() {
        let f = Fake::default();
        let a = f.alloc(0x10_0000, 4096);
        let mut m = LazyMaps::default();
        assert_eq!(m.reach(&f, 2, 0x10_0000, 8, &[1]), vec![Some(at(1, 1))]);
        f.log();
        // Freed and allocated again at the same address, the same size: another allocation.
        f.free(0x10_0000);
        let b = f.alloc(0x10_0000, 4096);
        assert_eq!(m.reach(&f, 2, 0x10_0000, 8, &[1]), vec![Some(at(1, 2))]);
        assert_eq!(
            f.log(),
            vec![
                "recall 1 from 1".to_string(),
                format!("lend 2 of alloc {b} (4096 at 0x100000) to 1")
            ]
        );
        assert_eq!(
            (f.held(a), f.held(b)),
            (0, 1),
            "the freed one's reference released"
        );
        // Freed for good: a lookup of another allocation leaves it (it looks at its own), the
        // sweep gives it back.
        f.free(0x10_0000);
        f.alloc(0x40_0000, 4096);
        m.reach(&f, 2, 0x40_0000, 8, &[]);
        assert!(f.log().is_empty());
        m.sweep(&f);
        assert_eq!(f.log(), vec!["recall 2 from 1".to_string()]);
        assert_eq!(f.held(b), 0);
    }

    #[test]
    fn a_sweep_alone_gives_back_what_was_freed() {
        let f = Fake::default();
        let a = f.alloc(0x10_0000, 4096);
        let b = f.alloc(0x20_0000, 4096);
        let mut m = LazyMaps::default();
        m.reach(&f, 2, 0x10_0000, 8, &[1]);
        m.reach(&f, 2, 0x20_0000, 8, &[1]);
        f.log();
        m.sweep(&f);
        assert!(f.log().is_empty(), "both live");
        f.free(0x10_0000);
        m.sweep(&f);
        assert_eq!(f.log(), vec!["recall 1 from 1".to_string()]);
        assert_eq!((m.len(), f.held(a), f.held(b)), (1, 0, 1));
    }

    #[test]
    fn refusals_stay_refused_lost_answers_are_recalled_and_unexportable_memory_is_left() {
        let f = Fake::default();
        f.alloc(0x10_0000, 4096);
        f.refuse.borrow_mut().push(1);
        f.lose.borrow_mut().push(2);
        let mut m = LazyMaps::default();
        assert_eq!(
            m.reach(&f, 4, 0x10_0000, 8, &[1, 2, 3]),
            vec![None, None, Some(at(3, 1))]
        );
        assert_eq!(f.log().len(), 3);
        assert_eq!(
            m.reach(&f, 4, 0x10_0000, 8, &[1, 2, 3]),
            vec![None, None, Some(at(3, 1))]
        );
        assert!(f.log().is_empty(), "not asked again");
        // Recalled from the lost one too.
        f.free(0x10_0000);
        assert_eq!(
            m.reach(&f, 4, 0x10_0000, 8, &[1]),
            vec![None],
            "nothing there"
        );
        m.sweep(&f);
        let mut log = f.log();
        log.sort();
        assert_eq!(log, vec!["recall 1 from 2", "recall 1 from 3"]);
        // An allocation that cannot be exported: no lend, and none tried again.
        *f.no_export.borrow_mut() = true;
        f.alloc(0x20_0000, 4096);
        assert_eq!(m.reach(&f, 4, 0x20_0000, 8, &[3]), vec![None]);
        *f.no_export.borrow_mut() = false;
        assert_eq!(m.reach(&f, 4, 0x20_0000, 8, &[3]), vec![None]);
        assert!(f.log().is_empty());
    }

    #[test]
    fn at_most_max_lazy_loans_and_none_dropped_while_its_allocation_lives() {
        let f = Fake::default();
        let mut m = LazyMaps::default();
        let base = |i: u64| 0x100_0000 + i * 0x1_0000;
        let allocs: Vec<u64> = (0..=MAX_LAZY as u64)
            .map(|i| f.alloc(base(i), 4096))
            .collect();
        for i in 0..MAX_LAZY as u64 {
            assert!(m.reach(&f, 2, base(i), 8, &[1])[0].is_some());
        }
        f.log();
        // Full: the next allocation is not lent, and no live loan is recalled (a captured graph
        // may still copy through it).
        let last = base(MAX_LAZY as u64);
        assert_eq!(m.reach(&f, 2, last, 8, &[1]), vec![None]);
        assert!(f.log().is_empty());
        assert_eq!(m.len(), MAX_LAZY);
        assert!(allocs[..MAX_LAZY].iter().all(|&a| f.held(a) == 1));
        assert_eq!(f.held(allocs[MAX_LAZY]), 0, "its reference released");
        // One freed: swept, and the room goes to the next.
        f.free(base(3));
        m.sweep(&f);
        assert_eq!(f.log(), vec!["recall 4 from 1".to_string()]);
        assert!(m.reach(&f, 2, last, 8, &[1])[0].is_some());
        drop(m);
        assert!(
            allocs.iter().all(|&a| f.held(a) == 0),
            "every reference released"
        );
    }

    #[test]
    fn the_sweeper_sweeps_every_period_and_stops_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::time::{Duration, Instant};
        let runs = std::sync::Arc::new(AtomicUsize::new(0));
        let seen = runs.clone();
        let every = Duration::from_millis(10);
        let sw = Sweeper::start("test-sweeper".into(), every, move |_| {
            seen.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        let t0 = Instant::now();
        while runs.load(Ordering::Relaxed) < 3 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no sweeps");
            std::thread::sleep(Duration::from_millis(1));
        }
        // A long period: the drop must not wait it out, and nothing is swept before it.
        let early = std::sync::Arc::new(AtomicUsize::new(0));
        let counted = early.clone();
        let slow = Sweeper::start(
            "test-sweeper-slow".into(),
            Duration::from_secs(60),
            move |_| {
                counted.fetch_add(1, Ordering::Relaxed);
            },
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let t1 = Instant::now();
        drop(slow);
        assert!(t1.elapsed() < Duration::from_secs(5), "{:?}", t1.elapsed());
        assert_eq!(early.load(Ordering::Relaxed), 0, "swept before its period");
        drop(sw);
        let after = runs.load(Ordering::Relaxed);
        std::thread::sleep(every * 5);
        assert_eq!(runs.load(Ordering::Relaxed), after, "swept after its drop");
    }
}

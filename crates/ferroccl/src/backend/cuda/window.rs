//! Registered windows: user buffers that every peer GPU has mapped, so that a kernel can write
//! a message straight into a peer's output (zero-copy, `plan/zcopy.rs` in ferroccl-core).
//!
//! Registration is collective (every rank registers one buffer, in the same order, like
//! `ncclCommWindowRegister`): each rank exports the cuMem allocation holding its buffer as a file
//! descriptor, the peers in other processes import and map it, the peers in this process use it
//! at the same address once access is granted, and then every rank learns where every peer maps
//! *its* buffer: that address is what a receiving kernel posts to the sender (`FcStep` POST).
//! Buffers must be cuMem allocations made with POSIX file-descriptor handles
//! ([`crate::mem::alloc`], or any other such allocation); anything else is refused with a clear
//! error before any peer maps anything.

use super::lazy::{LazyMaps, Live};
use super::mapper::{lend, recall, Place, Request};
use crate::bootstrap::Bootstrap;
use crate::cuda::device::Gpu;
use crate::cuda::fdpass::{FdChannel, FdListener};
use crate::cuda::mem::{export_allocation, export_lendable, DeviceBuffer, Identity, MemStats};
use ferroccl_core::plan::copies::Posted;
use ferroccl_core::{Error, Rank};
use std::os::fd::AsFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

/// What a rank tells the others about the buffer it registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WindowDesc {
    pub pid: u32,
    pub gpu: u32,
    /// The registered range.
    pub ptr: u64,
    pub len: u64,
    /// The cuMem allocation holding it (what a peer imports and maps).
    pub alloc_base: u64,
    pub alloc_len: u64,
    /// Registered as symmetric: every rank's buffers of an operation lie at the same offset of
    /// their windows of this registration, and every rank's window has the same length.
    pub symmetric: bool,
}

impl WindowDesc {
    pub const LEN: usize = 41;
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::LEN);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.gpu.to_le_bytes());
        for x in [self.ptr, self.len, self.alloc_base, self.alloc_len] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.push(self.symmetric as u8);
        v
    }
    pub fn parse(b: &[u8]) -> Result<WindowDesc, Error> {
        if b.len() != Self::LEN {
            return Err(Error::Protocol(format!(
                "window registration: a peer sent {} bytes, expected {}",
                b.len(),
                Self::LEN
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let symmetric = match b[40] {
            0 => false,
            1 => true,
            x => {
                return Err(Error::Protocol(format!(
                    "window registration: a peer sent symmetric flag {x}"
                )))
            }
        };
        let d = WindowDesc {
            pid: u32_at(0),
            gpu: u32_at(4),
            ptr: u64_at(8),
            len: u64_at(16),
            alloc_base: u64_at(24),
            alloc_len: u64_at(32),
            symmetric,
        };
        d.check()?;
        Ok(d)
    }
    /// The range is non-empty and inside its allocation.
    pub fn check(&self) -> Result<(), Error> {
        let end = self.ptr.checked_add(self.len);
        let alloc_end = self.alloc_base.checked_add(self.alloc_len);
        match (end, alloc_end) {
            (Some(e), Some(ae)) if self.len > 0 && self.ptr >= self.alloc_base && e <= ae => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "window of {} bytes at {:#x} is not inside its cuMem allocation ({} bytes at {:#x})",
                self.len, self.ptr, self.alloc_len, self.alloc_base
            ))),
        }
    }
}

/// One registered window of this rank.
struct Window {
    ptr: u64,
    len: u64,
    /// Where each rank maps this rank's window (`views[me] == ptr`).
    views: Vec<u64>,
    /// Symmetric windows: where this process maps each rank's window of this registration
    /// (`far[me] == ptr`), all of them `len` bytes long.
    far: Option<Vec<u64>>,
    /// The collective registration's number (`Windows::registrations` when it was made: the same
    /// on every rank); 0 for a local registration.
    reg: u64,
    /// Peers' windows imported into this process (kept mapped while registered).
    _imported: Vec<DeviceBuffer>,
    /// A local registration (`register_local`): its number, and the ranks whose mappers hold
    /// it. None: a window, registered collectively.
    local: Option<Loan>,
}

/// A local registration's record: what deregistration recalls.
struct Loan {
    id: u64,
    /// The peers that mapped it.
    lent_to: Vec<Rank>,
    /// The peers whose answer was lost (their mapper may hold it): recalled after the others,
    /// so that a peer still silent cannot spend the deadline of recalls that surely matter.
    maybe: Vec<Rank>,
}

/// The windows of one rank, and an epoch that changes with every registration, so that plan
/// tables encoded with an older set are not reused.
#[derive(Default)]
pub(crate) struct Windows {
    list: Vec<Window>,
    epoch: u64,
    /// Registrations so far (collective, so the same on every rank, unlike the epoch, which a
    /// rank's own deregistrations move too): names each registration's descriptor rendezvous.
    registrations: u64,
    /// Local registrations so far: numbers them for the peers' mappers.
    loans: u64,
}

impl Windows {
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// No window is registered (collectively: the same on every rank, so the tuner may plan by
    /// it). Local registrations do not count: each rank makes its own.
    pub fn is_empty(&self) -> bool {
        self.list.iter().all(|w| w.local.is_some())
    }
    /// Nothing at all is registered, windows or local registrations: no output is posted.
    pub fn none_at_all(&self) -> bool {
        self.list.is_empty()
    }
    /// The address at which `peer` reaches `[ptr, ptr + bytes)` of this rank, when a window
    /// holds all of it.
    pub fn view(&self, ptr: u64, bytes: u64, peer: Rank) -> Option<u64> {
        view_in(
            self.list.iter().map(|w| (w.ptr, w.len, w.views.as_slice())),
            ptr,
            bytes,
            peer,
        )
    }

    /// Where this process maps every rank's counterpart of `[ptr, ptr + bytes)` of this rank,
    /// when a symmetric window holds all of it: each rank's window of the same registration at
    /// the same offset (the symmetric contract), inside it since all have one length.
    pub fn symmetric_far(&self, ptr: u64, bytes: u64) -> Option<Vec<u64>> {
        let w = self.symmetric_holding(ptr, bytes)?;
        Some(
            w.far
                .as_ref()?
                .iter()
                .map(|base| base + (ptr - w.ptr))
                .collect(),
        )
    }

    /// The symmetric window that holds all of `[ptr, ptr + bytes)` of this rank.
    fn symmetric_holding(&self, ptr: u64, bytes: u64) -> Option<&Window> {
        let end = ptr.checked_add(bytes)?;
        self.list
            .iter()
            .find(|w| w.far.is_some() && ptr >= w.ptr && end <= w.ptr + w.len)
    }

    /// Where `[ptr, ptr + bytes)` of this rank lies, when a symmetric window holds all of it, as
    /// the rendezvous before a gather or scatter posts it (`plan::copies::Posted`): the window's
    /// registration number and length, the same on every rank, and the offset.
    pub fn posting(&self, ptr: u64, bytes: u64) -> Option<Posted> {
        self.symmetric_holding(ptr, bytes).map(|w| Posted::Window {
            window: w.reg,
            len: w.len,
            offset: ptr - w.ptr,
        })
    }

    /// This rank's posting of its output `[ptr, ptr + bytes)` for each rank as reader (`row[r]`,
    /// `nranks` of them), made for the ranks of `writers` (the others get None): in a symmetric
    /// window, by its registration ([`Windows::posting`]); else, where `lazy` is given
    /// (`FERROCCL_GPU_CE_MAP_UNREGISTERED`), where each writer maps it, lent on the fly
    /// (`lazy.rs`); else nothing.
    pub fn post_output(
        &self,
        lazy: Option<(&mut LazyMaps<Identity>, &Live)>,
        nranks: usize,
        ptr: u64,
        bytes: u64,
        writers: &[Rank],
    ) -> Vec<Option<Posted>> {
        let mut row = vec![None; nranks];
        if writers.is_empty() {
            return row;
        }
        if let Some(p) = self.posting(ptr, bytes) {
            writers.iter().for_each(|&r| row[r] = Some(p));
        } else if let Some((maps, l)) = lazy {
            let at = maps.reach(l, nranks, ptr, bytes, writers);
            for (&r, a) in writers.iter().zip(at) {
                row[r] = a.map(|addr| Posted::Mapped { addr, len: bytes });
            }
        }
        row
    }

    /// Where this process maps rank `q`'s output that `p` (rank q's posting) names: q's window of
    /// that registration, which this process mapped at registration, at the posted offset. None
    /// where this rank holds no such window (deregistered here only) or the posting does not
    /// fit it.
    pub fn far_of(&self, p: Posted, q: Rank) -> Option<u64> {
        let Posted::Window {
            window,
            len,
            offset,
        } = p
        else {
            return None;
        };
        let w = self
            .list
            .iter()
            .find(|w| w.local.is_none() && w.reg == window && w.len == len)?;
        if offset >= w.len {
            return None;
        }
        Some(w.far.as_ref()?.get(q)? + offset)
    }

    /// Registers `[ptr, ptr + len)` with every rank of `boot` (collective), `symmetric` as every
    /// rank must (see [`WindowDesc::symmetric`]; checked, with the lengths). On error nothing is
    /// registered here; peers that got further fail too (the exchange is all-or-nothing per
    /// rank, but a failure on one rank is seen by the others as a failed exchange).
    pub fn register(
        &mut self,
        gpu: &Gpu,
        boot: &Bootstrap,
        ptr: u64,
        len: usize,
        symmetric: bool,
        stats: &Arc<MemStats>,
        abort: &AtomicBool,
        deadline: Instant,
    ) -> Result<(), Error> {
        let (me, n) = (boot.rank(), boot.nranks());
        // Every rank reports success or its error in the first exchange, so a buffer one rank
        // cannot register fails every rank alike before anything is mapped.
        let exported = (|| {
            if len == 0 || ptr == 0 {
                return Err(Error::InvalidArgument(format!(
                    "registering {len} bytes at {ptr:#x}"
                )));
            }
            export_allocation(gpu, ptr, len)
        })();
        self.registrations += 1;
        let job = boot.comm_id()
            ^ 0x5749_4e44_4f57_0000
            ^ self.registrations.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let listener = FdListener::bind(job, me as u32)?;
        let desc = |alloc_base: u64, alloc_len: usize| WindowDesc {
            pid: std::process::id(),
            gpu: gpu.ordinal() as u32,
            ptr,
            len: len as u64,
            alloc_base,
            alloc_len: alloc_len as u64,
            symmetric,
        };
        let exported = exported
            .and_then(|(fd, base, size)| desc(base, size).check().map(|()| (fd, base, size)));
        // A status byte first (0 = a description follows, 0xff = why not), as in the second
        // exchange.
        let mine = match &exported {
            Ok((_, base, size)) => {
                let mut v = vec![0];
                v.extend(desc(*base, *size).encode());
                v
            }
            Err(e) => {
                let mut v = vec![0xff];
                v.extend(e.to_string().bytes().take(200));
                v
            }
        };
        let all = boot.allgather(&mine)?;
        let descs: Vec<WindowDesc> = all
            .iter()
            .enumerate()
            .map(|(q, b)| parse_desc_row(q, b))
            .collect::<Result<_, _>>()?;
        let (fd, _, _) = exported?;
        symmetric_agrees(&descs)?;
        let same_host = |q: Rank| boot.peers()[q].host_id == boot.peers()[me].host_id;
        if let Some(q) = (0..n).find(|&q| !same_host(q)) {
            return Err(Error::InvalidArgument(format!(
                "window registration: rank {q} is on another host; windows are one host's for now"
            )));
        }
        let pid = std::process::id();
        // Peers of this process reach the buffer at its own address once their GPU may.
        let local_gpus: Vec<usize> = (0..n)
            .filter(|&q| q != me && descs[q].pid == pid)
            .map(|q| descs[q].gpu as usize)
            .collect();
        let mine = descs[me];
        if !local_gpus.is_empty() {
            crate::cuda::mem::grant_range(
                gpu,
                mine.alloc_base,
                mine.alloc_len as usize,
                &local_gpus,
            )?;
        }
        let mut here = vec![0u64; n];
        here[me] = ptr;
        for q in (0..n).filter(|&q| q != me && descs[q].pid == pid) {
            here[q] = descs[q].ptr;
        }
        let remote: Vec<Rank> = (0..n).filter(|&q| q != me && descs[q].pid != pid).collect();
        let mut imported = Vec::new();
        let exchanged = (|| -> Result<(), Error> {
            for &q in &remote {
                let ch = FdChannel::connect(job, q as u32, deadline, abort)?;
                ch.send_fds(&[fd.as_fd()], &(me as u32).to_le_bytes(), deadline, abort)?;
            }
            let mut seen = Vec::new();
            for _ in &remote {
                let ch = listener.accept(deadline, abort)?;
                let (fds, payload) = ch.recv_fds(deadline, abort)?;
                let q = check_window_message(fds.len(), &payload, &remote, &seen)?;
                seen.push(q);
                let d = descs[q];
                let buf =
                    DeviceBuffer::import(fds[0].as_fd(), d.alloc_len as usize, gpu, &[], stats)?;
                here[q] = buf.device_ptr() + (d.ptr - d.alloc_base);
                imported.push(buf);
            }
            Ok(())
        })();
        // Where everyone maps everyone; row q is rank q's view of each window, or why it could
        // not map them, so that all ranks fail alike. This exchange is also the barrier: no
        // rank posts its window before every peer has mapped it.
        let rows = boot.allgather(&view_row(&here, exchanged.as_ref().err()))?;
        exchanged?;
        let views = views_of(&rows, me, n)?;
        let far = symmetric.then_some(here);
        self.list.push(Window {
            ptr,
            len: len as u64,
            views,
            far,
            reg: self.registrations,
            _imported: imported,
            local: None,
        });
        self.epoch += 1;
        Ok(())
    }

    /// Registers `[ptr, ptr + len)` of this rank alone (`ncclCommRegister`): peers of this
    /// process reach it at its own address once their GPUs may (granted here), peers of other
    /// processes where their mappers map it (`mapper.rs`; a peer that cannot map it gets no
    /// address and stages). `places`: where every rank runs; `comm_id` names the mappers.
    /// `cuMemAlloc` memory goes to other processes by its CUDA IPC handle; peers of this process
    /// reach it at its own address once their GPUs have peer access to this one's context
    /// (`mem::reach_here`; a peer whose GPU cannot stages). Other memory than that or a cuMem
    /// allocation with POSIX fd handles is refused, and nothing changes.
    #[allow(clippy::too_many_arguments)]
    pub fn register_local(
        &mut self,
        gpu: &Gpu,
        me: Rank,
        places: &[Place],
        comm_id: u64,
        ptr: u64,
        len: usize,
        abort: &AtomicBool,
        deadline: Instant,
    ) -> Result<(), Error> {
        if len == 0 || ptr == 0 {
            return Err(Error::InvalidArgument(format!(
                "registering {len} bytes at {ptr:#x}"
            )));
        }
        let (shared, base, size) = export_lendable(gpu, ptr, len)?;
        let pid = std::process::id();
        let desc = WindowDesc {
            pid,
            gpu: gpu.ordinal() as u32,
            ptr,
            len: len as u64,
            alloc_base: base,
            alloc_len: size as u64,
            symmetric: false,
        };
        desc.check()?;
        let n = places.len();
        let mut views = vec![0u64; n];
        views[me] = ptr;
        let here: Vec<Rank> = (0..n)
            .filter(|&q| q != me && places[q].pid == pid)
            .collect();
        // As a window: peers of this process reach it at its own address once their GPU may
        // (`mem::reach_here`); a peer whose GPU cannot stages, as a peer whose mapper cannot.
        for &q in &here {
            match crate::cuda::mem::reach_here(gpu, &shared, base, size, places[q].gpu as usize) {
                Ok(()) => views[q] = ptr,
                Err(e) => tracing::warn!(rank = me, "registering {len} bytes at {ptr:#x}: rank {q} cannot reach them, and gets them staged: {e}"),
            }
        }
        self.loans += 1;
        let id = self.loans;
        let (req, fd) = Request::lend_of(me as u32, id, desc, &shared);
        let (mut lent_to, mut maybe) = (Vec::new(), Vec::new());
        for q in (0..n).filter(|&q| q != me && places[q].pid != pid) {
            match lend(comm_id, q, places[q].pid, &req, fd, deadline, abort) {
                Ok(addr) => {
                    views[q] = addr;
                    lent_to.push(q);
                }
                Err(f) => {
                    // Staged for q either way; recalled at deregistration where q may hold it.
                    if f.maybe_mapped {
                        maybe.push(q);
                    }
                    tracing::warn!(rank = me, "registering {len} bytes at {ptr:#x}: rank {q} cannot map them, and gets them staged: {}", f.error)
                }
            }
        }
        self.list.push(Window {
            ptr,
            len: len as u64,
            views,
            far: None,
            reg: 0,
            _imported: Vec::new(),
            local: Some(Loan { id, lent_to, maybe }),
        });
        self.epoch += 1;
        Ok(())
    }

    /// Forgets the latest local registration at `ptr` and has the peers' mappers unmap it (a
    /// peer that does not answer keeps its mapping until its communicator ends). The caller has
    /// drained the stream: no launch of this rank posts the buffer any more.
    pub fn deregister_local(
        &mut self,
        me: Rank,
        places: &[Place],
        comm_id: u64,
        ptr: u64,
        abort: &AtomicBool,
        deadline: Instant,
    ) -> Result<(), Error> {
        let i = self
            .list
            .iter()
            .rposition(|w| w.ptr == ptr && w.local.is_some())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "deregistering {ptr:#x}: no local registration of this rank is there"
                ))
            })?;
        let w = self.list.remove(i);
        self.epoch += 1;
        let loan = w.local.expect("a local registration");
        for q in loan.lent_to.into_iter().chain(loan.maybe) {
            if let Err(e) = recall(
                comm_id,
                q,
                places[q].pid,
                &Request::Recall {
                    from: me as u32,
                    id: loan.id,
                },
                deadline,
                abort,
            ) {
                tracing::warn!(
                    rank = me,
                    "deregistering {ptr:#x}: rank {q}'s mapper did not unmap it: {e}"
                );
            }
        }
        Ok(())
    }

    /// Forgets the window registered at `ptr`, on this rank only (as NCCL's deregistration,
    /// which nccl-tests calls for every rank in turn from one thread: a collective one would
    /// wait there for ranks the same thread has yet to reach). Its views of the peers' windows
    /// of that registration are unmapped; the peers keep theirs until they deregister too, and
    /// every rank must have done so before the buffers take part in an operation again (the
    /// symmetric contract would otherwise disagree between ranks). The caller has drained the
    /// stream.
    pub fn deregister(&mut self, ptr: u64) -> Result<(), Error> {
        let i = self
            .list
            .iter()
            .position(|w| w.ptr == ptr && w.local.is_none())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "deregistering {ptr:#x}: no window of this rank is registered there"
                ))
            })?;
        self.list.remove(i);
        self.epoch += 1;
        Ok(())
    }
}

/// Every rank registered the window alike: symmetric on all or on none, and symmetric ones of
/// one length (every rank sees every description, so all fail alike, before mapping anything).
fn symmetric_agrees(descs: &[WindowDesc]) -> Result<(), Error> {
    let Some(first) = descs.first() else {
        return Ok(());
    };
    if let Some(q) = descs.iter().position(|d| d.symmetric != first.symmetric) {
        return Err(Error::InvalidArgument(format!(
            "window registration: rank 0 registers a {} window, rank {q} a {} one; every rank must register alike",
            if first.symmetric { "symmetric" } else { "local" },
            if descs[q].symmetric { "symmetric" } else { "local" }
        )));
    }
    if let Some(q) = descs
        .iter()
        .position(|d| first.symmetric && d.len != first.len)
    {
        return Err(Error::InvalidArgument(format!(
            "window registration: symmetric windows must have one length on every rank: rank 0 registers {} bytes, rank {q} {}",
            first.len, descs[q].len
        )));
    }
    Ok(())
}

/// The view of `[ptr, ptr + bytes)` for `peer` among windows (ptr, len, views).
fn view_in<'a>(
    windows: impl Iterator<Item = (u64, u64, &'a [u64])>,
    ptr: u64,
    bytes: u64,
    peer: Rank,
) -> Option<u64> {
    let end = ptr.checked_add(bytes)?;
    for (base, len, views) in windows {
        // A view of 0: that peer could not map it (local registrations).
        if ptr >= base && end <= base + len {
            return views
                .get(peer)
                .filter(|&&v| v != 0)
                .map(|v| v + (ptr - base));
        }
    }
    None
}

/// One rank's row of the first exchange: its window's description, or why it has none.
fn parse_desc_row(q: Rank, b: &[u8]) -> Result<WindowDesc, Error> {
    match b.split_first() {
        Some((0, d)) => WindowDesc::parse(d).map_err(|e| e.context(format!("rank {q}'s window"))),
        Some((0xff, why)) => Err(Error::InvalidArgument(format!(
            "rank {q} could not register its buffer: {}",
            String::from_utf8_lossy(why)
        ))),
        _ => Err(Error::Protocol(format!(
            "window registration: rank {q} sent a description without a status"
        ))),
    }
}

/// One rank's row of the second exchange: a status byte (0 = mapped), then where it maps each
/// rank's window, or the reason it could not.
fn view_row(here: &[u64], failed: Option<&Error>) -> Vec<u8> {
    if let Some(e) = failed {
        let mut v = vec![0xff];
        v.extend(e.to_string().bytes().take(200));
        return v;
    }
    let mut row = Vec::with_capacity(1 + 8 * here.len());
    row.push(0);
    for v in here {
        row.extend_from_slice(&v.to_le_bytes());
    }
    row
}

/// From every rank's row of where it maps each window: where each rank maps ours.
fn views_of(rows: &[Vec<u8>], me: Rank, n: usize) -> Result<Vec<u64>, Error> {
    if rows.len() != n {
        return Err(Error::Protocol(format!(
            "window registration: {} rows of views for {n} ranks",
            rows.len()
        )));
    }
    rows.iter()
        .enumerate()
        .map(|(q, r)| {
            match r.split_first() {
                Some((0, _)) => {}
                Some((0xff, why)) => {
                    return Err(Error::InvalidArgument(format!(
                        "window registration: rank {q} could not map the windows: {}",
                        String::from_utf8_lossy(why)
                    )))
                }
                _ => {
                    return Err(Error::Protocol(format!(
                        "window registration: rank {q} sent a row without a status"
                    )))
                }
            }
            let r = &r[1..];
            if r.len() != 8 * n {
                return Err(Error::Protocol(format!(
                    "window registration: rank {q} sent {} bytes of views, expected {}",
                    r.len(),
                    8 * n
                )));
            }
            let v = u64::from_le_bytes(r[8 * me..8 * me + 8].try_into().expect("8 bytes"));
            if v == 0 {
                return Err(Error::Protocol(format!(
                    "window registration: rank {q} did not map our window"
                )));
            }
            Ok(v)
        })
        .collect()
}

/// Checks one message of a window's descriptor: one fd, from a rank expected to send one and
/// that has not yet.
fn check_window_message(
    nfds: usize,
    payload: &[u8],
    expected: &[Rank],
    seen: &[Rank],
) -> Result<Rank, Error> {
    if nfds != 1 || payload.len() != 4 {
        return Err(Error::Protocol(format!(
            "window registration: a malformed message ({nfds} descriptors, {} payload bytes; expected 1 and 4)",
            payload.len()
        )));
    }
    let q = u32::from_le_bytes(payload.try_into().expect("4 bytes")) as usize;
    if !expected.contains(&q) || seen.contains(&q) {
        return Err(Error::Protocol(format!("window registration: a descriptor from unexpected rank {q} (expected one each from {expected:?})")));
    }
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_descriptions_round_trip_and_are_checked() {
        let d = WindowDesc {
            pid: 9,
            gpu: 1,
            ptr: 0x7f00_0020_0000,
            len: 4096,
            alloc_base: 0x7f00_0000_0000,
            alloc_len: 4 << 20,
            symmetric: false,
        };
        assert_eq!(WindowDesc::parse(&d.encode()).unwrap(), d);
        let s = WindowDesc {
            symmetric: true,
            ..d
        };
        assert_eq!(WindowDesc::parse(&s.encode()).unwrap(), s);
        assert!(matches!(
            WindowDesc::parse(&d.encode()[..40]),
            Err(Error::Protocol(_))
        ));
        let mut bad_flag = d.encode();
        bad_flag[40] = 2;
        assert!(matches!(
            WindowDesc::parse(&bad_flag),
            Err(Error::Protocol(_))
        ));
        // Empty, before the allocation, past its end, wrapping.
        for bad in [
            WindowDesc { len: 0, ..d },
            WindowDesc {
                ptr: d.alloc_base - 1,
                ..d
            },
            WindowDesc { len: 4 << 20, ..d },
            WindowDesc {
                ptr: u64::MAX - 10,
                alloc_base: u64::MAX - 20,
                alloc_len: 20,
                len: 100,
                ..d
            },
        ] {
            assert!(
                matches!(
                    WindowDesc::parse(&bad.encode()),
                    Err(Error::InvalidArgument(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn first_exchange_rows_carry_a_status() {
        // A pid whose low byte is 0xff must not read as a failure.
        let d = WindowDesc {
            pid: 0x1ff,
            gpu: 0,
            ptr: 0x20_0000,
            len: 64,
            alloc_base: 0x20_0000,
            alloc_len: 2 << 20,
            symmetric: false,
        };
        let mut ok = vec![0u8];
        ok.extend(d.encode());
        assert_eq!(parse_desc_row(0, &ok).unwrap(), d);
        let mut bad = vec![0xffu8];
        bad.extend(b"0x1000 is not GPU memory");
        let e = parse_desc_row(3, &bad).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_))
                && e.to_string().contains("rank 3 could not register"),
            "{e}"
        );
        assert!(matches!(parse_desc_row(0, &[]), Err(Error::Protocol(_))));
        let d7 = WindowDesc { pid: 7, ..d };
        assert!(
            matches!(parse_desc_row(0, &d7.encode()), Err(Error::Protocol(_))),
            "a row without its status byte"
        );
    }

    #[test]
    fn views_cover_only_ranges_inside_a_window() {
        let v0 = [0x1000u64, 0x9000, 0x5000];
        let v1 = [0x20000u64, 0x30000, 0x40000];
        let ws = || [(0x1000u64, 0x100u64, &v0[..]), (0x20000, 0x1000, &v1[..])].into_iter();
        assert_eq!(view_in(ws(), 0x1000, 0x100, 1), Some(0x9000));
        assert_eq!(view_in(ws(), 0x1010, 0x10, 2), Some(0x5010));
        assert_eq!(view_in(ws(), 0x20800, 0x800, 1), Some(0x30800));
        // Running past the end, before the start, in no window, wrapping, unknown peer.
        assert_eq!(view_in(ws(), 0x1010, 0x100, 1), None);
        assert_eq!(view_in(ws(), 0xfff, 0x10, 1), None);
        assert_eq!(view_in(ws(), 0x5000, 1, 0), None);
        assert_eq!(view_in(ws(), u64::MAX - 1, 4, 0), None);
        assert_eq!(view_in(ws(), 0x1000, 1, 3), None);
        // A peer that could not map a local registration has no view of it.
        let v2 = [0x7000u64, 0, 0x8000];
        let local = || [(0x7000u64, 0x100u64, &v2[..])].into_iter();
        assert_eq!(view_in(local(), 0x7010, 0x10, 1), None);
        assert_eq!(view_in(local(), 0x7010, 0x10, 2), Some(0x8010));
    }

    #[test]
    fn symmetric_windows_are_registered_alike_and_name_every_ranks_counterpart() {
        let d = WindowDesc {
            pid: 1,
            gpu: 0,
            ptr: 0x20_0000,
            len: 4096,
            alloc_base: 0x20_0000,
            alloc_len: 2 << 20,
            symmetric: true,
        };
        assert!(symmetric_agrees(&[
            d,
            WindowDesc {
                ptr: 0x40_0000,
                alloc_base: 0x40_0000,
                ..d
            }
        ])
        .is_ok());
        let local = WindowDesc {
            symmetric: false,
            ..d
        };
        assert!(
            symmetric_agrees(&[local, WindowDesc { len: 64, ..local }]).is_ok(),
            "local windows may differ in length"
        );
        let e = symmetric_agrees(&[d, local]).unwrap_err();
        assert!(e.to_string().contains("rank 1 a local one"), "{e}");
        let e = symmetric_agrees(&[d, d, WindowDesc { len: 8192, ..d }]).unwrap_err();
        assert!(e.to_string().contains("rank 2 8192"), "{e}");
        // Rank 1 of 3: its symmetric window at 0x1000 (512 bytes), mapped for the others at
        // 0xa000 and 0xc000 here; a local window beside it offers no counterpart.
        let ws = Windows {
            list: vec![
                Window {
                    ptr: 0x1000,
                    len: 512,
                    views: vec![0xa1, 0x1000, 0xc1],
                    far: Some(vec![0xa000, 0x1000, 0xc000]),
                    reg: 1,
                    _imported: Vec::new(),
                    local: None,
                },
                Window {
                    ptr: 0x8000,
                    len: 512,
                    views: vec![0xa2, 0x8000, 0xc2],
                    far: None,
                    reg: 2,
                    _imported: Vec::new(),
                    local: None,
                },
            ],
            epoch: 2,
            registrations: 2,
            loans: 0,
        };
        assert_eq!(
            ws.symmetric_far(0x1000, 512),
            Some(vec![0xa000, 0x1000, 0xc000])
        );
        assert_eq!(
            ws.symmetric_far(0x1100, 16),
            Some(vec![0xa100, 0x1100, 0xc100])
        );
        assert_eq!(ws.symmetric_far(0x1100, 512), None, "past the end");
        assert_eq!(ws.symmetric_far(0x8000, 16), None, "a local window");
        assert_eq!(ws.symmetric_far(u64::MAX - 1, 4), None);
        assert_eq!(ws.view(0x8000, 16, 2), Some(0xc2));
        // A gather's or scatter's posting: the symmetric window's number, length and offset;
        // another rank's posting of it resolves to where this process maps that rank's window.
        let p = ws.posting(0x1100, 16).expect("inside the symmetric window");
        let w = |window, len, offset| Posted::Window {
            window,
            len,
            offset,
        };
        assert_eq!(p, w(1, 512, 0x100));
        assert_eq!(ws.posting(0x1100, 512), None, "past the end");
        assert_eq!(ws.posting(0x8000, 16), None, "not a symmetric window");
        assert_eq!(ws.far_of(p, 0), Some(0xa100));
        assert_eq!(ws.far_of(p, 2), Some(0xc100));
        assert_eq!(ws.far_of(p, 3), None, "no such rank");
        assert_eq!(
            ws.far_of(w(2, 512, 0x100), 0),
            None,
            "no symmetric window 2"
        );
        assert_eq!(ws.far_of(w(7, 512, 0x100), 0), None, "not registered here");
        assert_eq!(ws.far_of(w(1, 256, 0x100), 0), None, "another length");
        assert_eq!(ws.far_of(w(1, 512, 512), 0), None, "past the end");
        assert_eq!(
            ws.far_of(
                Posted::Mapped {
                    addr: 0xa100,
                    len: 16
                },
                0
            ),
            None,
            "not a window's posting"
        );
        // Posted for its writers: by the window where one holds it, to the writers only; an
        // output in no window, with no lender, for nobody.
        assert_eq!(
            ws.post_output(None, 3, 0x1100, 16, &[0, 2]),
            vec![Some(p), None, Some(p)]
        );
        assert_eq!(ws.post_output(None, 3, 0x1100, 16, &[]), vec![None; 3]);
        assert_eq!(ws.post_output(None, 3, 0x8000, 16, &[0]), vec![None; 3]);
    }

    /// Local registrations post outputs like windows but leave the tuner's collective view
    /// alone, and each kind of deregistration finds only its own kind.
    #[test]
    fn local_registrations_are_apart_from_windows() {
        let at = |ptr: u64, local: Option<u64>| Window {
            ptr,
            len: 256,
            views: vec![ptr, 0xb000 + ptr],
            far: None,
            reg: 0,
            _imported: Vec::new(),
            local: local.map(|id| Loan {
                id,
                lent_to: Vec::new(),
                maybe: Vec::new(),
            }),
        };
        let mut ws = Windows {
            list: vec![at(0x1000, Some(1))],
            epoch: 1,
            registrations: 0,
            loans: 1,
        };
        assert!(ws.is_empty(), "a local registration is not a window");
        assert!(!ws.none_at_all());
        assert_eq!(ws.view(0x1000, 16, 1), Some(0xc000));
        let never = AtomicBool::new(false);
        let soon = Instant::now();
        // The window deregistration does not take a local registration, nor the other way.
        assert!(ws
            .deregister(0x1000)
            .unwrap_err()
            .to_string()
            .contains("no window"));
        ws.list.push(at(0x2000, None));
        assert!(!ws.is_empty());
        assert!(ws
            .deregister_local(0, &[], 7, 0x2000, &never, soon)
            .unwrap_err()
            .to_string()
            .contains("no local registration"));
        // The same buffer registered twice locally: one deregistration each, latest first.
        ws.list.push(at(0x1000, Some(2)));
        ws.deregister_local(0, &[], 7, 0x1000, &never, soon)
            .unwrap();
        assert_eq!(
            ws.list
                .iter()
                .filter_map(|w| w.local.as_ref().map(|l| l.id))
                .collect::<Vec<_>>(),
            vec![1]
        );
        ws.deregister_local(0, &[], 7, 0x1000, &never, soon)
            .unwrap();
        assert!(ws
            .deregister_local(0, &[], 7, 0x1000, &never, soon)
            .is_err());
        ws.deregister(0x2000).unwrap();
        assert!(ws.none_at_all());
        assert_eq!(ws.epoch(), 4, "every change moves the epoch");
    }

    #[test]
    fn views_are_read_from_every_ranks_row() {
        let row = |vals: &[u64]| view_row(vals, None);
        // Rank q's row says where q maps each rank's window; we are rank 1.
        let rows = vec![
            row(&[0xa0, 0xa1, 0xa2]),
            row(&[0xb0, 0xb1, 0xb2]),
            row(&[0xc0, 0xc1, 0xc2]),
        ];
        assert_eq!(views_of(&rows, 1, 3).unwrap(), vec![0xa1, 0xb1, 0xc1]);
        assert!(views_of(&rows[..2], 1, 3).is_err());
        let mut short = rows.clone();
        short[2].pop();
        assert!(matches!(views_of(&short, 1, 3), Err(Error::Protocol(_))));
        // A rank that could not map a window says why, and every rank fails with it.
        let mut failed = rows.clone();
        failed[2] = view_row(
            &[],
            Some(&Error::System(
                "cuMemImportFromShareableHandle failed: CUDA_ERROR_INVALID_VALUE".into(),
            )),
        );
        let e = views_of(&failed, 1, 3).unwrap_err();
        assert!(
            e.to_string().contains("rank 2 could not map")
                && e.to_string().contains("CUDA_ERROR_INVALID_VALUE"),
            "{e}"
        );
        assert!(matches!(
            views_of(&[vec![], rows[1].clone(), rows[2].clone()], 1, 3),
            Err(Error::Protocol(_))
        ));
        let mut unmapped = rows.clone();
        unmapped[0] = row(&[0xa0, 0, 0xa2]);
        assert!(views_of(&unmapped, 1, 3)
            .unwrap_err()
            .to_string()
            .contains("rank 0 did not map"));
    }

    #[test]
    fn window_messages_are_checked() {
        let from = |q: u32| q.to_le_bytes();
        assert_eq!(check_window_message(1, &from(2), &[1, 2], &[]).unwrap(), 2);
        assert!(check_window_message(2, &from(2), &[1, 2], &[]).is_err());
        assert!(check_window_message(1, &[2, 0], &[1, 2], &[]).is_err());
        assert!(check_window_message(1, &from(3), &[1, 2], &[]).is_err());
        assert!(check_window_message(1, &from(1), &[1, 2], &[1]).is_err());
    }
}

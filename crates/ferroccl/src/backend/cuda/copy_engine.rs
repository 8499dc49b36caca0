//! The copy engine: data-movement collectives (`plan::copies`) moved by the GPUs' copy engines,
//! with no thread block of ours. What each lane's stream runs is data, built and proved in
//! `ferroccl_core::plan::lanes` (the pieces, slots and handshakes); this module issues those
//! commands on the rank's streams (copies, and the flag words' waits and stores as batches of
//! stream memory operations) and orders the streams around the caller's.
//!
//! The words live in host memory (`cuda::hostpage`): a stream stalled on a word whose peer died
//! is freed by CPU stores (`release`), which no full GPU queue can hold up. Copy-engine waits
//! have no deadline of their own: a peer that hangs without dying holds them until the
//! communicator is aborted.

use super::fabric::CeFabric;
use crate::cuda::cu_ok;
use crate::cuda::device::Gpu;
use crate::cuda::hostpage::HostPage;
use cudarc::driver::sys;
use ferroccl_core::plan::copies::{Taper, CE_LANES, CE_SLOTS};
use ferroccl_core::plan::lanes::{
    lane_index, lone_lane_on_caller, schedule, zcopy_schedule, Addr, CeFlags, CeOp, Cmd, Lane,
    Schedule,
};
use ferroccl_core::{Error, Rank};
use std::time::{Duration, Instant};

/// A fold kernel's launch, as `CopyEngine::enqueue` hands it to the launch path: device
/// addresses as this GPU maps them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FoldLaunch {
    /// The piece word of each lane in this rank's page.
    pub words: [u64; CE_LANES],
    /// This rank's own operand.
    pub mine: u64,
    /// The output, where the peer's copy lands.
    pub out: u64,
    pub bytes: usize,
    pub taper: Taper,
    pub blocks: usize,
}

/// A lane's run of consecutive stream memory operations, issued as one
/// `cuStreamBatchMemOp` (the driver runs a batch's operations in order, as it would the single
/// calls). A wait holds until its word is 1; a write's default flags put a system-wide fence
/// before its store, so the copy before it has landed when the peer sees the word. Held inline,
/// so that an enqueue allocates nothing: a run longer than [`MemOps::MAX`] (a receive lane's
/// handshakes for many receives from one peer in a launch) goes out as several batches, in
/// order.
struct MemOps {
    ops: [sys::CUstreamBatchMemOpParams; MemOps::MAX],
    len: usize,
}

// Within the driver's limit of a batch, checked when built.
const _: () = assert!(MemOps::MAX <= 255);

impl MemOps {
    /// The most operations one batch holds here (the driver takes up to 255): a collective's
    /// runs are one to three long.
    const MAX: usize = 16;

    fn new() -> MemOps {
        MemOps {
            // SAFETY: an all-zero parameter block is a valid value of the union.
            ops: unsafe { std::mem::zeroed() },
            len: 0,
        }
    }

    /// Whether the next operation must wait for an `issue`.
    fn full(&self) -> bool {
        self.len == Self::MAX
    }

    fn push(&mut self, p: sys::CUstreamBatchMemOpParams) {
        debug_assert!(!self.full());
        self.ops[self.len] = p;
        self.len += 1;
    }

    fn wait(&mut self, addr: u64) {
        // SAFETY: an all-zero parameter block is a valid start for any of the union's members.
        let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
        p.waitValue.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32;
        p.waitValue.address = addr;
        p.waitValue.__bindgen_anon_1.value = 1;
        p.waitValue.flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32;
        self.push(p);
    }

    fn write(&mut self, addr: u64, value: u32) {
        // SAFETY: as in `wait`.
        let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
        p.writeValue.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32;
        p.writeValue.address = addr;
        p.writeValue.__bindgen_anon_1.value = value;
        p.writeValue.flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        self.push(p);
    }

    /// What is pending, in order: the next batch.
    fn pending(&mut self) -> &mut [sys::CUstreamBatchMemOpParams] {
        &mut self.ops[..self.len]
    }

    /// Enqueues what is pending on `st` as one batch, if anything is, and empties it.
    ///
    /// # Safety
    /// `st` is a live stream of the bound context; every address is a word mapped for it.
    unsafe fn issue(&mut self, st: sys::CUstream) -> Result<(), Error> {
        if self.len > 0 {
            let batch = self.pending();
            cu_ok(
                "cuStreamBatchMemOp",
                sys::cuStreamBatchMemOp_v2(st, batch.len() as u32, batch.as_mut_ptr(), 0),
            )?;
            self.len = 0;
        }
        Ok(())
    }
}

/// A rank's streams for the copy engine and the events that order them after the caller's
/// stream (fork) and it after them (joins).
struct Streams {
    /// A stream per peer and lane, at `peer * CE_LANES + lane` (null for this rank itself).
    streams: Vec<sys::CUstream>,
    fork: sys::CUevent,
    joins: Vec<sys::CUevent>,
    /// Per lane, recorded just before its first copy (its opening handshake done): this rank's
    /// own copy on the caller's stream waits for it (see `enqueue_with`).
    opened: Vec<sys::CUevent>,
}

/// One rank's copy engine.
pub(crate) struct CopyEngine {
    gpu: Gpu,
    rank: Rank,
    nranks: usize,
    slot_bytes: usize,
    streams: Streams,
    fabric: CeFabric,
    /// Whether a launch's lone lane may run on the caller's stream (`lone_lane_on_caller`): only
    /// where no two ranks of one process share a GPU (`Fabric::ranks_post`). Ranks sharing a GPU in one process
    /// may find their callers' streams in one hardware queue, where one rank's wait for the other
    /// would stand in front of the other's commands for good (the staged copies' GPU test of
    /// ranks on one GPU hung so); the lanes' own streams, made early, get queues of their own.
    lone_on_caller: bool,
}

// SAFETY: stream and event handles are used through the thread-safe driver with the context
// bound; nothing changes after creation, and the communicator enqueues one launch at a time.
unsafe impl Send for CopyEngine {}
unsafe impl Sync for CopyEngine {}

impl CopyEngine {
    /// The streams are made here, at the communicator's creation, not at the first operation:
    /// the driver deals streams out to the GPU's hardware queues in turn
    /// (`CUDA_DEVICE_MAX_CONNECTIONS` of them), and a stream stalled in a wait holds up every
    /// other stream of its queue. Made together, early, this rank's lanes get queues of their
    /// own as far as there are queues (see docs/ENV.md on `CUDA_DEVICE_MAX_CONNECTIONS`).
    /// `slot_bytes` 0: no staged copies (`FERROCCL_GPU_COPY_ENGINE_BYTES=0`), only the copies
    /// between symmetric windows. `lone_on_caller`: no two ranks share a GPU in one process
    /// (`Fabric::ranks_post`; see the field).
    pub fn new(
        gpu: &Gpu,
        rank: Rank,
        nranks: usize,
        slot_bytes: usize,
        fabric: CeFabric,
        lone_on_caller: bool,
    ) -> Result<CopyEngine, Error> {
        if slot_bytes * CE_SLOTS > fabric.region_bytes {
            return Err(Error::Internal(format!(
                "copy-engine slots of {slot_bytes} bytes do not fit a region of {}",
                fabric.region_bytes
            )));
        }
        gpu.bind()?;
        let streams = Streams::new(rank, nranks)?;
        Ok(CopyEngine {
            gpu: gpu.clone(),
            rank,
            nranks,
            slot_bytes,
            streams,
            fabric,
            lone_on_caller,
        })
    }

    /// This rank's commands for `op` (every call of its shape enqueues the same: the launch
    /// path keeps them with the shape).
    pub fn schedule(&self, op: &CeOp) -> Result<Schedule, Error> {
        if self.slot_bytes == 0 {
            return Err(Error::Internal(
                "the copy engine's staging is off (FERROCCL_GPU_COPY_ENGINE_BYTES=0)".into(),
            ));
        }
        schedule(op, self.rank, self.nranks, self.slot_bytes)
    }

    /// This rank's commands for `op` between symmetric windows (`zcopy_schedule`; the launch
    /// path keeps them with the buffers' addresses).
    /// `fold`: the fold kernel's blocks and the pieces' taper, for the reductions (the tuner's
    /// channels and `tune::fold_taper`).
    pub fn zcopy_schedule(
        &self,
        op: &CeOp,
        far: &[u64],
        fold: (usize, Taper),
    ) -> Result<Schedule, Error> {
        zcopy_schedule(op, self.rank, self.nranks, far, fold)
    }

    fn addr(&self, a: Addr, op: &CeOp) -> u64 {
        match a {
            Addr::Send(o) => op.send + o as u64,
            Addr::Recv(o) => op.recv + o as u64,
            Addr::Stage { owner, from, slot } => {
                let region = if from < owner { from } else { from - 1 };
                self.fabric.stage[owner]
                    + (region * self.fabric.region_bytes + slot * self.slot_bytes) as u64
            }
            Addr::Abs(a) => a,
        }
    }

    fn word(&self, page: Rank, word: usize) -> u64 {
        match CeFlags::piece_at(self.nranks, word) {
            Some(at) => self.fabric.fold[page] + at as u64,
            None => self.fabric.pages[page] + 4 * word as u64,
        }
    }

    /// Enqueues `lanes` (`schedule` of `op`) on `op`'s buffers after everything on `user`, and
    /// makes `user` wait for it. `fold` launches the fold kernel a `Cmd::Fold` asks for on the
    /// stream given (the launch path owns the kernels).
    pub fn enqueue(
        &self,
        lanes: &Schedule,
        op: &CeOp,
        user: sys::CUstream,
        fold: &dyn Fn(FoldLaunch, sys::CUstream) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.enqueue_with(lanes, op, user, fold, None)
    }

    /// `enqueue`, with `beside` run after the lanes' commands and before `user` waits for them:
    /// what it enqueues on `user` runs alongside the lanes (the kernels' part of a launch whose
    /// sends and receives the copy engines share, which must not wait for the copies nor the
    /// copies for it: the peer may have put the matching halves in two launches either way).
    /// Its error is returned once `user` waits for the lanes all the same.
    pub fn enqueue_beside(
        &self,
        lanes: &Schedule,
        op: &CeOp,
        user: sys::CUstream,
        fold: &dyn Fn(FoldLaunch, sys::CUstream) -> Result<(), Error>,
        beside: &mut dyn FnMut() -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.enqueue_with(lanes, op, user, fold, Some(beside))
    }

    fn enqueue_with(
        &self,
        lanes: &Schedule,
        op: &CeOp,
        user: sys::CUstream,
        fold: &dyn Fn(FoldLaunch, sys::CUstream) -> Result<(), Error>,
        beside: Option<&mut dyn FnMut() -> Result<(), Error>>,
    ) -> Result<(), Error> {
        if lanes.is_empty() {
            return beside.map_or(Ok(()), |b| b());
        }
        self.gpu.bind()?;
        let s = &self.streams;
        // This rank's own copy (an out-of-place all-gather's or all-to-all's own block, a
        // root's) waits until every lane that copies has passed its opening handshake: on 2 x
        // H200 a local copy running through the handshakes' memory operations added about 13 us
        // to them whatever its size (docs/PERFORMANCE.md section 37), where beside the peer copy
        // alone it added nothing. So the peers' lanes go first, then the caller's stream's.
        let local_copies = lanes.iter().any(|(l, cmds)| {
            *l == Lane::Local
                && cmds.iter().any(|c| {
                    matches!(*c, Cmd::Copy { dst, src, .. } if self.addr(dst, op) != self.addr(src, op))
                })
        });
        let copies = |k: usize| lanes[k].1.iter().any(|c| matches!(c, Cmd::Copy { .. }));
        let kept = beside.is_some() || !self.lone_on_caller;
        let alone = lone_lane_on_caller(lanes, kept, local_copies);
        // Per lane, its own stream's index, or None where it runs on the caller's stream.
        let forked = |k: usize| lane_index(lanes[k].0).filter(|_| !alone);
        let stream_of = |k: usize| forked(k).map_or(user, |i| s.streams[i]);
        let order = (0..lanes.len())
            .filter(|&k| forked(k).is_some())
            .chain((0..lanes.len()).filter(|&k| forked(k).is_none()));
        // SAFETY: our streams and events, the caller's live stream; every address is the
        // caller's buffer (its contract), a staging slot or a flag word mapped for this GPU.
        unsafe {
            if (0..lanes.len()).any(|k| forked(k).is_some()) {
                cu_ok("cuEventRecord", sys::cuEventRecord(s.fork, user))?;
            }
            for i in (0..lanes.len()).filter_map(forked) {
                cu_ok(
                    "cuStreamWaitEvent",
                    sys::cuStreamWaitEvent(s.streams[i], s.fork, 0),
                )?;
            }
            for k in order {
                let cmds = &lanes[k].1;
                let st = stream_of(k);
                let mut copied = false;
                // A lane's consecutive waits and writes go to the stream as one batch: one
                // command for the GPU's front end to fetch and run instead of one per word.
                let mut memops = MemOps::new();
                for c in cmds {
                    if memops.full() {
                        memops.issue(st)?;
                    }
                    match *c {
                        Cmd::Wait { page, word } => memops.wait(self.word(page, word)),
                        Cmd::Write { page, word, value } => {
                            memops.write(self.word(page, word), value)
                        }
                        Cmd::Copy { dst, src, bytes } => {
                            memops.issue(st)?;
                            let (d, sr) = (self.addr(dst, op), self.addr(src, op));
                            if !copied && local_copies {
                                copied = true;
                                match forked(k) {
                                    Some(i) => {
                                        cu_ok("cuEventRecord", sys::cuEventRecord(s.opened[i], st))?
                                    }
                                    // Every forked lane that copies was enqueued above and has
                                    // recorded its event.
                                    None if d != sr => {
                                        for i in (0..lanes.len())
                                            .filter(|&j| copies(j))
                                            .filter_map(forked)
                                        {
                                            cu_ok(
                                                "cuStreamWaitEvent",
                                                sys::cuStreamWaitEvent(st, s.opened[i], 0),
                                            )?;
                                        }
                                    }
                                    None => {}
                                }
                            }
                            if d != sr {
                                cu_ok(
                                    "cuMemcpyDtoDAsync",
                                    sys::cuMemcpyDtoDAsync_v2(d, sr, bytes, st),
                                )?;
                            }
                        }
                        Cmd::Fold {
                            from,
                            src,
                            bytes,
                            taper,
                            blocks,
                        } => {
                            memops.issue(st)?;
                            fold(
                                FoldLaunch {
                                    words: std::array::from_fn(|lane| {
                                        self.word(
                                            self.rank,
                                            CeFlags::piece(self.nranks, from, lane),
                                        )
                                    }),
                                    mine: op.send + src as u64,
                                    out: op.recv,
                                    bytes,
                                    taper,
                                    blocks,
                                },
                                st,
                            )?
                        }
                    }
                }
                memops.issue(st)?;
            }
            let besides = beside.map_or(Ok(()), |b| b());
            for i in (0..lanes.len()).filter_map(forked) {
                cu_ok(
                    "cuEventRecord",
                    sys::cuEventRecord(s.joins[i], s.streams[i]),
                )?;
                cu_ok(
                    "cuStreamWaitEvent",
                    sys::cuStreamWaitEvent(user, s.joins[i], 0),
                )?;
            }
            besides
        }
    }

    /// Whether every stream of the engine has nothing left to run.
    fn idle(&self) -> bool {
        if self.gpu.bind().is_err() {
            return false;
        }
        // SAFETY: our live streams.
        self.streams
            .streams
            .iter()
            .filter(|st| !st.is_null())
            .all(|&st| unsafe { sys::cuStreamQuery(st) } == sys::CUresult::CUDA_SUCCESS)
    }

    /// Frees streams stalled on this rank's words (abort, a dead peer): stores 1 into every
    /// word of this rank's page, again and again, until the streams have drained or `limit`
    /// has passed (a lane lowers a word right after its wait, so one store may free one wait
    /// only). What the freed copies move is garbage: the communicator is failed by then.
    /// Returns whether the streams drained.
    pub fn release(&self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            for i in 0..CeFlags::words(self.nranks) {
                self.fabric.mine.set(i, 1);
            }
            if self.idle() {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Streams {
    /// A stream and a join event per peer and lane (none for this rank itself: its local copy
    /// runs on the caller's stream), and the fork event, for rank `me` of `n`. The context must
    /// be bound.
    fn new(me: Rank, n: usize) -> Result<Streams, Error> {
        let count = n * CE_LANES;
        let mut s = Streams {
            streams: vec![std::ptr::null_mut(); count],
            fork: std::ptr::null_mut(),
            joins: vec![std::ptr::null_mut(); count],
            opened: vec![std::ptr::null_mut(); count],
        };
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: out pointers for new objects of the bound context; on error the ones made so
        // far are released when `s` drops.
        cu_ok("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut s.fork, flags)
        })?;
        for q in (0..n).filter(|&q| q != me) {
            for lane in 0..CE_LANES {
                let i = q * CE_LANES + lane;
                cu_ok("cuStreamCreate", unsafe {
                    sys::cuStreamCreate(
                        &mut s.streams[i],
                        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    )
                })?;
                cu_ok("cuEventCreate", unsafe {
                    sys::cuEventCreate(&mut s.joins[i], flags)
                })?;
                cu_ok("cuEventCreate", unsafe {
                    sys::cuEventCreate(&mut s.opened[i], flags)
                })?;
            }
        }
        Ok(s)
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        // SAFETY: our objects; destroying a stream with work left lets that work finish first.
        unsafe {
            for &st in self.streams.iter().filter(|st| !st.is_null()) {
                sys::cuStreamDestroy_v2(st);
            }
            for &ev in self
                .joins
                .iter()
                .chain(&self.opened)
                .chain(std::iter::once(&self.fork))
            {
                if !ev.is_null() {
                    sys::cuEventDestroy_v2(ev);
                }
            }
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Streams still waiting on our words would read them after the page is gone: free them
        // first; if they will not drain, keep the pages mapped (leaked) rather than fault.
        let drained = self.idle() || self.release(Duration::from_secs(2));
        // The streams are destroyed as the fields drop, with this context bound.
        let _ = self.gpu.bind();
        if !drained {
            tracing::warn!("copy-engine streams did not drain: leaving its flag pages mapped");
            self.fabric.mine.keep_mapped();
            self.fabric.imported.iter().for_each(HostPage::keep_mapped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane's memory operations reach the driver as it would take the single calls: in order,
    /// a wait for 1 with the equality test, every write behind the default (system-wide) fence
    /// that puts a copy before the word announcing it (the driver refuses writes without it in
    /// a batch on 2 x H200), and a batch full at `MemOps::MAX`, within the driver's 255.
    #[test]
    fn memops_keep_order_fences_and_the_batch_limit() {
        let mut m = MemOps::new();
        assert!(m.pending().is_empty() && !m.full());
        m.wait(0x1000);
        m.write(0x2000, 7);
        for i in 0..(MemOps::MAX - 2) as u32 {
            assert!(!m.full());
            m.write(0x3000 + 4 * u64::from(i), i);
        }
        assert!(m.full());
        let batch = m.pending();
        assert_eq!(batch.len(), MemOps::MAX);
        // SAFETY: each operation is read through the member it was built as.
        unsafe {
            let w = batch[0].waitValue;
            assert_eq!(
                w.operation,
                sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32
            );
            assert_eq!((w.address, w.__bindgen_anon_1.value), (0x1000, 1));
            assert_eq!(
                w.flags,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32
            );
            for (k, p) in batch[1..].iter().enumerate() {
                let x = p.writeValue;
                assert_eq!(
                    x.operation,
                    sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32
                );
                assert_eq!(
                    x.flags,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32
                );
                let want = if k == 0 {
                    (0x2000, 7)
                } else {
                    (0x3000 + 4 * (k as u64 - 1), k as u32 - 1)
                };
                assert_eq!((x.address, x.__bindgen_anon_1.value), want);
            }
        }
    }

    /// The flag words of 16 ranks fit the host page that holds them (`CeFlags::words`).
    #[test]
    fn flag_words_fit_a_host_page() {
        assert!(CeFlags::words(16) * 4 <= crate::cuda::hostpage::PAGE_BYTES);
    }
}

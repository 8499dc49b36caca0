//! The CUDA launch path: one call is one launch of the plan kernel on the current stream (or of
//! its point-to-point form, of a one-kernel engine, or the copy engine's copies).
//!
//! A launch's step tables depend only on the operations' shapes (kinds, counts, types,
//! reductions, roots, in-place-ness) and the registered windows, never on the buffers, which
//! ride in the kernel's parameter (`FcLaunch::inline_ops`). So the tables are built and uploaded
//! the first time a shape is seen, and every later call of that shape, on any buffers, is one
//! kernel launch with nothing allocated or copied: legal inside CUDA-graph capture, and cheap for
//! frameworks whose caching allocators hand out new pointers all the time. Two exceptions key
//! by address too: with registered windows (a receiver's post names its output as each sender
//! maps it) and for groups of more than `INLINE_OPS` operations (their op table is uploaded).
//!
//! Tables live in a pool of a few cuMem slabs, filled from the start; when the pool is full,
//! everything not used by a captured graph is evicted at once, once this communicator's
//! queued kernels are done (`StreamOrder`).
//! Tables a graph captured stay for the communicator's life, as the graph may replay them.

use super::comm::{CudaComm, BLOCK_THREADS};
use super::copy_engine::FoldLaunch;
use super::p2p::{p2p_form, P2pForm};
use super::tables::{
    encode, fc_op, kind_code, DeviceTables, Encoded, FcDirect, FcFold, FcLaunch, FcOp, FcPeer,
    OpDesc, ZeroCopy, DIRECT_THREADS, INLINE_OPS, P2P_MAX_STEPS, P2P_SMALL_STEPS, PEER_MAX_RANKS,
    PEER_THREADS,
};
use super::window::Windows;
use crate::cuda::cu_ok;
use crate::cuda::device::{Kernel, LaunchDims};
use crate::cuda::mem::DeviceBuffer;
use crate::info::{CommInfo, CommState};
use crate::ops::{plan_launch, OpArgs, Planned};
use cudarc::driver::sys;
use ferroccl_core::algo::{build, CollDesc};
use ferroccl_core::plan::lanes::{fold_ends, p2p_schedule, CeOp, P2pCopy, Schedule};
use ferroccl_core::plan::zcopy::{peer_desc, remote_dsts};
use ferroccl_core::tune::{Algo, Choice, Engine, Protocol};
use ferroccl_core::CollKind;
use ferroccl_core::Error;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Bytes of one slab (the cuMem granularity on the GPUs we know); a larger table set gets a
/// slab of its own size.
const SLAB_BYTES: usize = 2 << 20;
/// Slabs beyond this many bytes are made only when nothing can be evicted.
const POOL_BYTES: usize = 8 << 20;
/// Table sets start at this alignment (what the kernel's vector loads like).
const TABLE_ALIGN: usize = 256;
/// Words of an operation in a shape key.
const OP_WORDS: usize = 10;

/// The words that identify a launch's tables. `by_address`: the tables also hold the buffers'
/// addresses (windows registered, or an op table).
fn op_words(a: &OpArgs, rank: usize, by_address: bool) -> [u64; OP_WORDS] {
    let addr = |x: u64| if by_address { x } else { 0 };
    let scalar = match a.op {
        // The scalar apart from the op id: PreMulSum(0.0) must not look like Sum.
        ferroccl_core::ReduceOp::PreMulSum(s) if by_address => s.to_bits(),
        _ => 0,
    };
    [
        a.kind as u64,
        a.count as u64,
        a.dtype.nccl_id() as u64,
        a.redop().nccl_id() as u64,
        a.root as u64,
        a.is_in_place(rank) as u64,
        addr(a.send as u64),
        addr(a.recv as u64),
        scalar,
        addr(a.device_scalar.unwrap_or(0)),
    ]
}

/// A launch's key: every op's words, then the windows' epoch. Hashed and compared without
/// building it, so a repeated call allocates nothing.
struct Key<'a> {
    args: &'a [OpArgs],
    rank: usize,
    by_address: bool,
    epoch: u64,
}

impl Key<'_> {
    fn words(&self) -> impl Iterator<Item = u64> + '_ {
        self.args
            .iter()
            .flat_map(|a| op_words(a, self.rank, self.by_address))
            .chain([self.epoch, self.args.len() as u64])
    }
    fn hash(&self) -> u64 {
        // Multiply-xorshift over the words: quality enough for a table of a few hundred shapes.
        self.words().fold(0x9e37_79b9_7f4a_7c15u64, |h, w| {
            let h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd);
            h ^ (h >> 32)
        })
    }
    fn matches(&self, words: &[u64]) -> bool {
        self.words().eq(words.iter().copied())
    }
}

/// Slabs of device memory filled from their start; a slab whose table sets were all evicted is
/// filled from its start again. `B` is the memory (a `DeviceBuffer`; `()` in tests).
struct SlabPool<B> {
    slabs: Vec<Slab<B>>,
}

struct Slab<B> {
    mem: B,
    cap: usize,
    used: usize,
    /// Table sets living here.
    live: usize,
}

impl<B> Default for SlabPool<B> {
    fn default() -> Self {
        SlabPool { slabs: Vec::new() }
    }
}

impl<B> SlabPool<B> {
    /// (slab, offset) of `bytes` in a slab with room, if any.
    fn place(&mut self, bytes: usize) -> Option<(usize, usize)> {
        let (i, s) = self
            .slabs
            .iter_mut()
            .enumerate()
            .find(|(_, s)| s.cap - s.used >= bytes)?;
        let at = s.used;
        s.used = (s.used + bytes).div_ceil(TABLE_ALIGN) * TABLE_ALIGN;
        s.used = s.used.min(s.cap);
        s.live += 1;
        Some((i, at))
    }
    /// Whether a new slab for `bytes` stays within the pool's budget.
    fn may_grow(&self, bytes: usize) -> bool {
        self.slabs.iter().map(|s| s.cap).sum::<usize>() + slab_size(bytes) <= POOL_BYTES
    }
    /// A new slab for `bytes`, holding them at its start.
    fn grow(&mut self, bytes: usize, mem: B) -> (usize, usize) {
        self.slabs.push(Slab {
            mem,
            cap: slab_size(bytes),
            used: 0,
            live: 0,
        });
        self.place(bytes)
            .expect("a fresh slab holds what it was made for")
    }
    fn release(&mut self, slab: usize) {
        let s = &mut self.slabs[slab];
        s.live -= 1;
        if s.live == 0 {
            s.used = 0;
        }
    }
}

fn slab_size(bytes: usize) -> usize {
    bytes.div_ceil(SLAB_BYTES).max(1) * SLAB_BYTES
}

/// What runs a launch shape.
#[derive(Clone, Debug)]
enum Run {
    /// The plan kernel over these tables (steps, lanes, and the op table of a big group).
    Plan(DeviceTables),
    /// The direct kernel, on this many blocks.
    Direct { blocks: u32 },
    /// The peer kernel, on this many blocks, in rounds of this many elements per block;
    /// `oneshot`: an all-reduce in one crossing (2 ranks); `read`: receivers read each round out
    /// of their senders' staging (`tune::peer_read_pays`); `direct`: senders store straight into
    /// outputs their receivers post (the tuner's zero-copy), `post`: this rank posts its output
    /// where a window holds it; `pull`: an all-reduce, or a reduce's root, that reads its peer's
    /// input from the peer's symmetric window (the reductions' zero-copy, `tune::peer_pulls`;
    /// a reduce's non-root only flags and waits); `lines`: an
    /// all-reduce in line rounds (`Protocol::LL128`, `tune::peer_lines`).
    Peer {
        blocks: u32,
        chunk: u64,
        oneshot: bool,
        split: bool,
        read: bool,
        direct: bool,
        /// Direct rounds whose senders wait for the posts at the start (`Choice::wait_posts`).
        wait_posts: bool,
        post: bool,
        pull: bool,
        lines: bool,
    },
    /// The copy engines: no kernel; this rank's commands for the shape.
    Copy(Arc<Schedule>),
    /// The plan kernel's point-to-point form: the plan's sends and receives, each with its
    /// connection, in the parameter (no tables).
    P2p(Arc<P2pForm>),
}

/// One launch shape's tables on the GPU, or the direct engine's choice.
struct Entry {
    words: Vec<u64>,
    /// The slab holding the tables (None for the direct engine, which has none).
    slab: Option<usize>,
    run: Run,
    /// Used inside a graph capture: the graph may replay it at any time, so it is never
    /// evicted.
    pinned: bool,
    /// Made inside a capture: the host copy the graph's upload node reads at every replay.
    _host: Vec<u8>,
}

/// A communicator's plan tables on the GPU, by launch shape.
#[derive(Default)]
pub(crate) struct PlanCache {
    map: HashMap<u64, Vec<Entry>>,
    pool: SlabPool<DeviceBuffer>,
    /// Entries without tables in `map`, and the count at which the unpinned ones are dropped.
    tableless: usize,
    trim_at: usize,
}

/// Entries without tables (the one-kernel engines, the copy engine, the point-to-point form)
/// kept before the unpinned ones are dropped. They hold no device memory, so the pool never
/// fills to evict them, and where launches are keyed by address (registered windows, groups of
/// more than `INLINE_OPS`) a framework's ever-new buffers would grow the map without end.
/// Dropping one costs the next call of its shape a re-plan, never a queued launch (which
/// carries its own copy of the run).
const TABLELESS_MAX: usize = 1024;

/// Where this communicator's latest launch outside a capture went, and an event recorded
/// after it. Two uses, one event:
/// - a launch on another stream first waits for it, so that a communicator's launches run one
///   after the other whichever streams the caller names (they share its FIFOs, slots and
///   staging; NCCL orders a communicator's work alike);
/// - since every launch is so ordered after the one before, the latest one done means all are:
///   evicting tables waits for this event alone. A `cuCtxSynchronize` there would also wait for
///   every other kernel of the context: another communicator's, or another rank's on the same
///   GPU, that may be waiting for this very launch (a deadlock until the deadline), or a
///   framework's compute on its own streams (a stall).
///
/// The event is recorded at every launch, while its stream is surely alive: the caller may
/// destroy a stream after its call, and a destroyed stream must not be named again.
pub(crate) struct StreamOrder {
    last: sys::CUstream,
    event: sys::CUevent,
}

impl Default for StreamOrder {
    fn default() -> Self {
        StreamOrder {
            last: std::ptr::null_mut(),
            event: std::ptr::null_mut(),
        }
    }
}

impl StreamOrder {
    /// Before a launch on `stream`: waits for the latest launch when that went elsewhere.
    fn before(&self, stream: sys::CUstream) -> Result<(), Error> {
        if !self.last.is_null() && self.last != stream {
            // SAFETY: the caller's live stream; our event, recorded after the previous launch.
            cu_ok("cuStreamWaitEvent", unsafe {
                sys::cuStreamWaitEvent(stream, self.event, 0)
            })?;
        }
        Ok(())
    }

    /// After a launch on `stream` (not inside a capture). The context must be bound.
    fn after(&mut self, stream: sys::CUstream) -> Result<(), Error> {
        if self.event.is_null() {
            // SAFETY: an out pointer for a new event of the bound context.
            cu_ok("cuEventCreate", unsafe {
                sys::cuEventCreate(
                    &mut self.event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            })?;
        }
        // SAFETY: our event; the stream just launched on.
        cu_ok("cuEventRecord", unsafe {
            sys::cuEventRecord(self.event, stream)
        })?;
        self.last = stream;
        Ok(())
    }

    /// Waits until every launch of this communicator outside a capture has finished (an event
    /// stays valid when its stream is destroyed).
    fn wait_all(&self) -> Result<(), Error> {
        if self.event.is_null() {
            return Ok(());
        }
        // SAFETY: our recorded event.
        cu_ok("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.event)
        })
    }
}

impl Drop for StreamOrder {
    fn drop(&mut self) {
        if !self.event.is_null() {
            // SAFETY: our event; destroying a recorded one is allowed.
            unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

impl PlanCache {
    fn get(&mut self, key: &Key) -> Option<&mut Entry> {
        self.map
            .get_mut(&key.hash())?
            .iter_mut()
            .find(|e| key.matches(&e.words))
    }

    /// Adds an entry without tables, first dropping the unpinned ones beyond [`TABLELESS_MAX`].
    fn insert_tableless(&mut self, hash: u64, entry: Entry) {
        debug_assert!(entry.slab.is_none());
        if self.tableless >= self.trim_at.max(TABLELESS_MAX) {
            for v in self.map.values_mut() {
                v.retain(|e| e.slab.is_some() || e.pinned);
            }
            self.map.retain(|_, v| !v.is_empty());
            self.tableless = self
                .map
                .values()
                .flatten()
                .filter(|e| e.slab.is_none())
                .count();
            // Captured entries stay for good: trim again only once as many new ones came.
            self.trim_at = 2 * self.tableless;
        }
        self.tableless += 1;
        self.map.entry(hash).or_default().push(entry);
    }

    /// Drops every entry no graph captured (the caller made sure no kernel still reads them).
    fn evict(&mut self) {
        let pool = &mut self.pool;
        for v in self.map.values_mut() {
            v.retain(|e| {
                if let (false, Some(slab)) = (e.pinned, e.slab) {
                    pool.release(slab);
                }
                e.pinned
            });
        }
        self.map.retain(|_, v| !v.is_empty());
        self.tableless = self
            .map
            .values()
            .flatten()
            .filter(|e| e.slab.is_none())
            .count();
    }
}

/// Whether `stream` is being captured into a CUDA graph.
fn capturing(stream: sys::CUstream) -> Result<bool, Error> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    cu_ok("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(stream, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Every lane of a launch may wait on a peer that waits on another lane of ours, so all of them
/// must run at once: a launch the GPU cannot hold whole would hang, and is refused instead.
fn check_residency(lanes: u32, resident: u32) -> Result<(), Error> {
    if lanes > resident {
        return Err(Error::InvalidArgument(format!(
            "this launch needs {lanes} thread blocks at once but the GPU holds {resident}: \
             lower FERROCCL_GPU_CHANNELS, or split the group"
        )));
    }
    Ok(())
}

/// One operation's buffers and arithmetic as the tables see them; the flags come from the
/// tuner's choice (None: only the buffers are wanted, for the op entry).
fn op_desc(a: &OpArgs, info: &CommInfo, choice: Option<&Choice>) -> OpDesc {
    let (sc, rc) = a
        .kind
        .buffer_counts(a.count, info.nranks, a.root == info.rank)
        .expect("validated");
    OpDesc {
        send: a.send as u64,
        recv: a.recv as u64,
        send_count: sc,
        recv_count: rc,
        dtype: a.dtype,
        op: a.redop(),
        scalar_dev: if a.kind.reduces() {
            a.device_scalar.unwrap_or(0)
        } else {
            0
        },
        ll: choice.is_some_and(|c| c.protocol == Protocol::LL),
        zero_copy: choice.is_some_and(|c| c.zero_copy),
        post_output: choice.is_some_and(|c| c.post_output),
    }
}

/// Where each peer maps this rank's output of `o` (the whole receive buffer), when a window
/// holds it (None: no peer may store into it).
fn peer_views(windows: &Windows, o: &OpDesc, nranks: usize) -> Option<[u64; PEER_MAX_RANKS]> {
    let bytes = (o.recv_count * o.dtype.size()) as u64;
    let mut views = [0u64; PEER_MAX_RANKS];
    for (q, v) in views
        .iter_mut()
        .enumerate()
        .take(nranks.min(PEER_MAX_RANKS))
    {
        *v = windows.view(o.recv, bytes, q).unwrap_or(0);
    }
    views.iter().any(|&v| v != 0).then_some(views)
}

/// The copy engine's view of one operation.
fn ce_op(a: &OpArgs) -> CeOp {
    CeOp {
        kind: a.kind,
        count: a.count,
        elem: a.dtype.size(),
        root: a.root,
        send: a.send as u64,
        recv: a.recv as u64,
    }
}

/// The `FC_KIND_*` code of the one operation a one-kernel engine runs (collectives only).
fn engine_kind(a: &OpArgs) -> Result<u32, Error> {
    kind_code(a.kind).ok_or_else(|| Error::Internal(format!("a one-kernel engine got {}", a.kind)))
}

/// What the ranks exchanged before a launch (`launch/mod.rs`), for one communicator's share.
pub(crate) enum Exchanged {
    /// Nothing: the common launch.
    Nothing,
    /// A gather's or scatter's rendezvous: where this rank's copy engines write each peer's
    /// output (`CudaComm::rendezvous_far`).
    Far(Vec<u64>),
    /// The posted-receive rendezvous (`launch/posts.rs`): per operation, its part by the copy
    /// engines, or None for the kernels.
    Posted(Vec<Option<P2pCopy>>),
    /// The reduce's pull after its rendezvous (`CudaComm::rendezvous_far`): on the root, where
    /// this process maps the non-root's input; on the non-root, its own input's address (never
    /// read: a pull's non-root only flags and waits).
    Pull(u64),
}

/// The peer engine's run for the tuner's choice `c` of a launch whose one operation is of `kind`.
fn peer_run(c: &Choice, kind: CollKind) -> Run {
    // The peer engine's zero-copy for the reductions is the pull (the all-reduce's, the reduce's
    // root's); for the rest, direct rounds.
    let pull = c.zero_copy && matches!(kind, CollKind::AllReduce | CollKind::Reduce);
    Run::Peer {
        blocks: c.channels as u32,
        chunk: c.chunk_elems as u64,
        oneshot: c.algo == Algo::OneShot && kind == CollKind::AllReduce,
        split: c.split,
        read: c.read,
        direct: c.zero_copy && !pull,
        wait_posts: c.wait_posts,
        post: c.post_output,
        pull,
        lines: c.protocol == Protocol::LL128,
    }
}

impl CudaComm {
    /// Enqueues the operations `args` (one call, or a group's share on this communicator) on
    /// the current stream as one kernel launch, and returns.
    /// `exchanged`: what the ranks exchanged before the launch, if anything.
    pub(crate) fn launch(
        &self,
        info: &CommInfo,
        state: &mut CommState,
        args: &[OpArgs],
        exchanged: Exchanged,
    ) -> Result<(), Error> {
        let exchanged = match exchanged {
            Exchanged::Posted(ways) => {
                // The copy engines' part, and the rest on the kernels as a launch of its own
                // beside it: both start after what the caller's stream holds, neither waits for
                // the other (a peer may make the matching sends and receives in two launches, in
                // either order), and the caller's stream waits for both.
                let copies: Vec<P2pCopy> = ways.iter().flatten().copied().collect();
                let rest: Vec<OpArgs> = args
                    .iter()
                    .zip(&ways)
                    .filter(|(_, w)| w.is_none())
                    .map(|(a, _)| *a)
                    .collect();
                if rest.is_empty() {
                    self.enqueue_posted(info, &args[0], &copies, None)?;
                    state.seq += 1;
                    return Ok(());
                }
                return self.enqueue_posted(
                    info,
                    &args[0],
                    &copies,
                    Some(&mut || self.launch(info, state, &rest, Exchanged::Nothing)),
                );
            }
            other => other,
        };
        state.seq += 1;
        let nranks = u32::try_from(info.nranks)
            .map_err(|_| Error::InvalidArgument("too many ranks".into()))?;
        let mut inline = [FcOp::default(); INLINE_OPS];
        let many: Vec<FcOp>;
        let ops: &[FcOp] = if args.len() <= INLINE_OPS {
            for (i, a) in args.iter().enumerate() {
                inline[i] = fc_op(i, &op_desc(a, info, None), nranks)?;
            }
            &inline[..args.len()]
        } else {
            many = args
                .iter()
                .enumerate()
                .map(|(i, a)| fc_op(i, &op_desc(a, info, None), nranks))
                .collect::<Result<_, _>>()?;
            &many
        };

        let stream = self.current_stream();
        let windows = self.windows()?;
        let key = Key {
            args,
            rank: info.rank,
            by_address: !windows.is_empty() || args.len() > INLINE_OPS,
            epoch: windows.epoch(),
        };
        let mut cache = self
            .plans
            .lock()
            .map_err(|_| Error::Internal("GPU tables lock poisoned".into()))?;
        self.gpu.bind()?;
        let captured = capturing(stream)?;
        // A captured launch runs when its graph does: its order is the graph's.
        if !captured {
            self.order()?.before(stream)?;
        }
        if !matches!(exchanged, Exchanged::Nothing) {
            // After a rendezvous the launch names buffers its peers posted, which may move while
            // this rank's stay: planned and run now, never kept.
            drop(cache);
            let (run, pull) =
                self.exchanged_run(info, state, args, exchanged, !windows.is_empty())?;
            drop(windows);
            self.run_entry(run, args, ops, stream, None, pull)?;
            if !captured {
                self.order()?.after(stream)?;
            }
            return Ok(());
        }
        if cache.get(&key).is_none() {
            // A new shape: the tuner's choices, then a run without tables (a one-kernel engine,
            // the copy engine, the point-to-point form), or the plan's tables encoded and put on
            // the GPU.
            // Where the copy engine's zero-copy would copy to or from (an operation alone in
            // its launch, its far buffer in a symmetric window).
            let far = match args {
                [a] => self.far_in(&windows, a, info),
                _ => None,
            };
            let planned = plan_launch(info, args, !windows.is_empty(), &|a| {
                (far.is_some(), self.inputs_in(&windows, a, info))
            })?;
            state.log_choices(info, &planned.shapes, &planned.choices);
            let tableless = match planned.choices[..] {
                // The one-kernel engines: no tables, only the choice.
                [c] if matches!(
                    c.engine,
                    Engine::DirectKernel | Engine::PeerKernel | Engine::CopyEngine
                ) =>
                {
                    let blocks = c.channels as u32;
                    Some(match c.engine {
                        Engine::DirectKernel if self.direct.is_some() => Run::Direct { blocks },
                        Engine::PeerKernel if self.peer.is_some() => peer_run(&c, args[0].kind),
                        Engine::CopyEngine if self.ce.is_some() => {
                            let ce = self.ce.as_ref().expect("checked");
                            // Between symmetric windows (kept by address: `key.by_address`).
                            let lanes = match (&far, c.zero_copy) {
                                (Some(far), true) => ce.zcopy_schedule(
                                    &ce_op(&args[0]),
                                    far,
                                    (
                                        c.channels,
                                        ferroccl_core::tune::fold_taper(&info.config, args[0].kind),
                                    ),
                                )?,
                                _ => ce.schedule(&ce_op(&args[0]))?,
                            };
                            Run::Copy(Arc::new(lanes))
                        }
                        e => {
                            return Err(Error::Internal(format!(
                                "{e:?} was chosen for {} ranks, which it does not serve",
                                info.nranks
                            )))
                        }
                    })
                }
                _ => {
                    let enc = self.encode(info, args, &planned, &windows)?;
                    // Only sends and receives: the point-to-point form runs the same steps (each
                    // rank decides for itself; the peers see the same messages).
                    match self
                        .p2p
                        .as_ref()
                        .and_then(|_| p2p_form(&enc, &self.fabric.conns))
                    {
                        Some(form) => {
                            tracing::debug!(
                                rank = info.rank,
                                "a launch of {} operations on the point-to-point form ({}): {} blocks",
                                args.len(),
                                if form.small() { "ferroccl_p2p" } else { "ferroccl_p2p_wide" },
                                form.blocks
                            );
                            Some(Run::P2p(Arc::new(form)))
                        }
                        None => {
                            self.store(
                                &mut cache,
                                &key,
                                &enc,
                                ops.len() > INLINE_OPS,
                                stream,
                                captured,
                            )?;
                            None
                        }
                    }
                }
            };
            if let Some(run) = tableless {
                let entry = Entry {
                    words: key.words().collect(),
                    slab: None,
                    run,
                    pinned: false,
                    _host: Vec::new(),
                };
                cache.insert_tableless(key.hash(), entry);
            }
        }
        let entry = cache.get(&key).expect("stored above");
        entry.pinned |= captured;
        let run = entry.run.clone();
        drop(cache);
        // Where each peer may store straight into this rank's output (the peer engine's direct
        // rounds): looked up at every launch, as the buffers are.
        let views = match run {
            Run::Peer { post: true, .. } if !windows.none_at_all() => {
                peer_views(&windows, &op_desc(&args[0], info, None), info.nranks)
            }
            _ => None,
        };
        // Where a pull (2 ranks: the peer is `rank ^ 1`) reads its peer's input: the peer's
        // window at this rank's offset (the symmetric contract), as this process maps it. A
        // reduce's non-root reads nothing but takes it alike: the kernel knows a pull by it.
        let pull = match run {
            Run::Peer { pull: true, .. } => {
                let a = &args[0];
                windows
                    .symmetric_far(a.send as u64, (a.count * a.dtype.size()) as u64)
                    .and_then(|f| f.get(info.rank ^ 1).copied())
                    .ok_or_else(|| {
                        Error::Internal("a pull whose input left its symmetric window".into())
                    })?
            }
            _ => 0,
        };
        drop(windows);

        self.run_entry(run, args, ops, stream, views, pull)?;
        if !captured {
            self.order()?.after(stream)?;
        }
        Ok(())
    }

    /// Enqueues the sends and receives the copy engines take after the posted-receive rendezvous
    /// (`plan::lanes::p2p_schedule`) on the current stream, in the launch path's stream order,
    /// with `kernels` (the launch's other operations, if any) enqueued beside them.
    fn enqueue_posted(
        &self,
        info: &CommInfo,
        any: &OpArgs,
        copies: &[P2pCopy],
        kernels: Option<&mut dyn FnMut() -> Result<(), Error>>,
    ) -> Result<(), Error> {
        let ce = self.ce.as_ref().ok_or_else(|| {
            Error::Internal("the posted-receive rendezvous without the copy engine".into())
        })?;
        let lanes = p2p_schedule(info.rank, info.nranks, copies);
        let stream = self.current_stream();
        self.gpu.bind()?;
        let captured = capturing(stream)?;
        if !captured {
            self.order()?.before(stream)?;
        }
        self.last_blocks.store(0, Ordering::Relaxed);
        let no_fold = |_, _| Err(Error::Internal("a fold among sends and receives".into()));
        match kernels {
            Some(k) => ce.enqueue_beside(&lanes, &ce_op(any), stream, &no_fold, k)?,
            None => ce.enqueue(&lanes, &ce_op(any), stream, &no_fold)?,
        }
        if !captured {
            self.order()?.after(stream)?;
        }
        Ok(())
    }

    /// The run of a launch of one operation after its rendezvous, and the address a pull reads
    /// (0 for the copies): the copy engines straight into the outputs the peers posted
    /// (`Exchanged::Far`, planned as every rank naming the outputs it writes), or the reduce's
    /// pull from the input its non-root posted (`Exchanged::Pull`, planned as the root naming
    /// the input it reads). The tuner must give it the path the exchange was for: every rank
    /// decided alike from the same postings.
    fn exchanged_run(
        &self,
        info: &CommInfo,
        state: &mut CommState,
        args: &[OpArgs],
        exchanged: Exchanged,
        windows: bool,
    ) -> Result<(Run, u64), Error> {
        let pulled = matches!(exchanged, Exchanged::Pull(_));
        let planned = plan_launch(info, args, windows, &|_| (!pulled, pulled))?;
        state.log_choices(info, &planned.shapes, &planned.choices);
        let kind = args[0].kind;
        match (exchanged, &planned.choices[..]) {
            (Exchanged::Far(far), [c]) if c.engine == Engine::CopyEngine && c.zero_copy => {
                let ce = self.ce.as_ref().ok_or_else(|| {
                    Error::Internal("the copies' rendezvous without the copy engine".into())
                })?;
                let taper = ferroccl_core::tune::fold_taper(&info.config, kind);
                let lanes = ce.zcopy_schedule(&ce_op(&args[0]), &far, (c.channels, taper))?;
                Ok((Run::Copy(Arc::new(lanes)), 0))
            }
            (Exchanged::Pull(at), [c])
                if c.engine == Engine::PeerKernel && c.zero_copy && self.peer.is_some() =>
            {
                Ok((peer_run(c, kind), at))
            }
            (_, choices) => Err(Error::Internal(format!(
                "the ranks exchanged {} for {kind}, and the tuner chose {choices:?}",
                if pulled {
                    "an input for its pull"
                } else {
                    "their outputs' places"
                }
            ))),
        }
    }

    fn order(&self) -> Result<std::sync::MutexGuard<'_, StreamOrder>, Error> {
        self.order
            .lock()
            .map_err(|_| Error::Internal("stream order lock poisoned".into()))
    }

    /// Enqueues what `run` says for `args` on `stream`.
    fn run_entry(
        &self,
        run: Run,
        args: &[OpArgs],
        ops: &[FcOp],
        stream: sys::CUstream,
        views: Option<[u64; PEER_MAX_RANKS]>,
        pull: u64,
    ) -> Result<(), Error> {
        match run {
            Run::Plan(at) => {
                self.last_blocks.store(at.nlanes, Ordering::Relaxed);
                if at.nlanes == 0 {
                    return Ok(());
                }
                let mut param = FcLaunch::new(&at, ops);
                let kernel = self.module.kernel_at(self.plan_fn);
                let dims = LaunchDims {
                    grid: (at.nlanes, 1, 1),
                    block: (BLOCK_THREADS, 1, 1),
                    shared_bytes: 0,
                    overlap_prior: self.overlap_prior,
                };
                let mut params = [&mut param as *mut _ as *mut std::ffi::c_void];
                // SAFETY: the kernel takes one FcLaunch by value; every address in it is device
                // memory of this GPU or mapped for it, valid while the cache entry (tables), the
                // caller's buffers (its contract) and the communicator (connections, status) live.
                unsafe { kernel.launch(dims, stream, &mut params) }
            }
            Run::Direct { blocks } => {
                let (module, kernels, template) = self
                    .direct
                    .as_ref()
                    .expect("checked when the entry was made");
                let a = &args[0];
                let param = FcDirect {
                    count: a.count as u64,
                    kind: engine_kind(a)?,
                    root: a.root as u32,
                    nblocks: blocks,
                    op: ops[0],
                    ..*template
                };
                // SAFETY: the direct kernel takes one FcDirect; its slots, acks and epochs are
                // this communicator's fabric (mapped for this GPU).
                unsafe {
                    self.launch_engine(
                        kernels.kernel(std::slice::from_ref(module), a)?,
                        blocks,
                        DIRECT_THREADS,
                        param,
                        stream,
                    )
                }
            }
            Run::P2p(form) => {
                let (small, wide, head) =
                    self.p2p.as_ref().expect("checked when the entry was made");
                // SAFETY: each point-to-point kernel takes one parameter of its size; its
                // connections' words are this communicator's fabric (mapped for this GPU), its
                // buffers the caller's.
                unsafe {
                    if form.small() {
                        let param = form.param::<P2P_SMALL_STEPS>(ops, head);
                        self.launch_engine(
                            self.module.kernel_at(*small),
                            form.blocks,
                            form.threads(),
                            param,
                            stream,
                        )
                    } else {
                        let param = form.param::<P2P_MAX_STEPS>(ops, head);
                        self.launch_engine(
                            self.module.kernel_at(*wide),
                            form.blocks,
                            form.threads(),
                            param,
                            stream,
                        )
                    }
                }
            }
            Run::Copy(lanes) => {
                self.last_blocks.store(0, Ordering::Relaxed);
                let a = &args[0];
                // The fold kernel of a copy-and-fold reduction, on the stream the schedule says.
                let fold = |f: FoldLaunch, st: sys::CUstream| -> Result<(), Error> {
                    let (Some((module, _, template)), Some(kernels)) = (&self.peer, &self.fold)
                    else {
                        return Err(Error::Internal(
                            "a copy-and-fold without the peer engine's module".into(),
                        ));
                    };
                    let es = a.dtype.size();
                    let mut param = FcFold {
                        words: f.words,
                        mine: f.mine,
                        out: f.out,
                        count: (f.bytes / es) as u64,
                        abort: self.status.abort_ptr(),
                        error: self.status.error_ptr(),
                        timeout_ns: self.timeout_ns,
                        rank: template.rank,
                        nblocks: f.blocks as u32,
                        op: ops[0],
                        ..FcFold::default()
                    };
                    (param.ends, param.pieces) = fold_ends(f.bytes, f.taper, es)?;
                    // SAFETY: the fold kernel takes one FcFold; its words are this rank's flag
                    // page (mapped for this GPU), its buffers the caller's (its contract).
                    unsafe {
                        self.launch_engine(
                            kernels.kernel(module, a)?,
                            f.blocks as u32,
                            PEER_THREADS,
                            param,
                            st,
                        )
                    }
                };
                self.ce
                    .as_ref()
                    .expect("checked when the entry was made")
                    .enqueue(&lanes, &ce_op(a), stream, &fold)
            }
            Run::Peer {
                blocks,
                chunk,
                oneshot,
                split,
                read,
                direct,
                wait_posts,
                post: _,
                pull: _,
                lines,
            } => {
                let (module, kernels, template) =
                    self.peer.as_ref().expect("checked when the entry was made");
                let a = &args[0];
                let param = FcPeer {
                    count: a.count as u64,
                    chunk,
                    kind: engine_kind(a)?,
                    nblocks: blocks,
                    root: a.root as u32,
                    oneshot: oneshot as u32,
                    split: split as u32,
                    read: read as u32,
                    op: ops[0],
                    views: views.unwrap_or_default(),
                    // 2: the senders wait for the posts at the start (peer.cu).
                    direct: if direct && wait_posts {
                        2
                    } else {
                        direct as u32
                    },
                    post: views.is_some() as u32,
                    pull,
                    // The template holds the communicator's salt for the lines' flags.
                    lines: if lines { template.lines } else { 0 },
                    ..*template
                };
                // SAFETY: the peer kernel takes one FcPeer; its staging, flags and counters are
                // this communicator's fabric (mapped for this GPU).
                unsafe {
                    self.launch_engine(
                        kernels.kernel(module, a)?,
                        blocks,
                        PEER_THREADS,
                        param,
                        stream,
                    )
                }
            }
        }
    }

    /// One launch of a one-kernel engine (direct, peer) on `blocks` blocks with `param` by value.
    ///
    /// # Safety
    /// `kernel` takes exactly one parameter of type `P`, every address in which is valid for
    /// the operation: the communicator's fabric, and the caller's buffers (its contract).
    unsafe fn launch_engine<P>(
        &self,
        kernel: Kernel<'_>,
        blocks: u32,
        threads: u32,
        mut param: P,
        stream: sys::CUstream,
    ) -> Result<(), Error> {
        self.last_blocks.store(blocks, Ordering::Relaxed);
        let dims = LaunchDims {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
            overlap_prior: self.overlap_prior,
        };
        let mut params = [&mut param as *mut P as *mut std::ffi::c_void];
        // SAFETY: the caller's contract.
        unsafe { kernel.launch(dims, stream, &mut params) }
    }

    /// The plan kernel's tables of a planned launch, with the zero-copy marks where windows are
    /// registered.
    fn encode(
        &self,
        info: &CommInfo,
        args: &[OpArgs],
        planned: &Planned,
        windows: &Windows,
    ) -> Result<Encoded, Error> {
        check_residency(planned.plan.lanes.len() as u32, self.resident)?;
        let descs: Vec<OpDesc> = args
            .iter()
            .zip(&planned.choices)
            .map(|(a, c)| op_desc(a, info, Some(c)))
            .collect();
        // The peers' plans of the same operations say where each message lands.
        let remote = planned.choices.iter().any(|c| c.zero_copy).then(|| {
            remote_dsts(&planned.plan, |op, peer| {
                let a = &args[op as usize];
                let desc = peer_desc(
                    &CollDesc {
                        kind: a.kind,
                        count: a.count,
                        root: a.root,
                    },
                    info.rank,
                )?;
                Some(build(
                    &desc,
                    op,
                    peer,
                    info.nranks,
                    &planned.choices[op as usize].tuning(),
                ))
            })
        });
        let post = |op: usize, peer: usize| -> (u64, u64) {
            let o = &descs[op];
            let bytes = (o.recv_count * o.dtype.size()) as u64;
            (
                if o.post_output {
                    windows.view(o.recv, bytes, peer).unwrap_or(0)
                } else {
                    0
                },
                bytes,
            )
        };
        let zc = remote.as_ref().map(|remote| ZeroCopy {
            remote,
            post: &post,
        });
        let geo = self.fabric.geo;
        encode(&planned.plan, &descs, |k| geo.conn_index(k), zc.as_ref())
    }

    /// Puts a launch's tables (steps, lanes, and the op table when `with_ops`) into the pool and
    /// the cache. The upload is enqueued on `stream`, so inside a capture it becomes part of the
    /// graph (reading the entry's host copy, which a captured entry keeps).
    fn store(
        &self,
        cache: &mut PlanCache,
        key: &Key,
        enc: &Encoded,
        with_ops: bool,
        stream: sys::CUstream,
        captured: bool,
    ) -> Result<(), Error> {
        let as_bytes = |p: *const u8, n: usize| unsafe { std::slice::from_raw_parts(p, n) };
        let parts = [
            as_bytes(
                enc.steps.as_ptr() as *const u8,
                std::mem::size_of_val(&enc.steps[..]),
            ),
            as_bytes(
                enc.lanes.as_ptr() as *const u8,
                std::mem::size_of_val(&enc.lanes[..]),
            ),
            if with_ops {
                as_bytes(
                    enc.ops.as_ptr() as *const u8,
                    std::mem::size_of_val(&enc.ops[..]),
                )
            } else {
                &[]
            },
        ];
        let mut offs = [0usize; 3];
        let mut total = 0;
        for (i, p) in parts.iter().enumerate() {
            offs[i] = total;
            total = (total + p.len()).div_ceil(64) * 64;
        }
        let total = total.max(64);
        let mut host = vec![0u8; total];
        for (i, p) in parts.iter().enumerate() {
            host[offs[i]..offs[i] + p.len()].copy_from_slice(p);
        }

        let (slab, at) = match cache.pool.place(total) {
            Some(p) => p,
            None if captured || cache.pool.may_grow(total) => cache.pool.grow(
                total,
                DeviceBuffer::alloc(&self.gpu, slab_size(total), &[], &self.stats)?,
            ),
            None => {
                // Tables in use by this communicator's queued kernels, on any stream, must
                // outlive them; other kernels of the context are none of our business.
                self.order()?.wait_all()?;
                cache.evict();
                match cache.pool.place(total) {
                    Some(p) => p,
                    None => cache.pool.grow(
                        total,
                        DeviceBuffer::alloc(&self.gpu, slab_size(total), &[], &self.stats)?,
                    ),
                }
            }
        };
        let base = cache.pool.slabs[slab].mem.device_ptr() + at as u64;
        cu_ok("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(base, host.as_ptr().cast(), total, stream)
        })?;
        let at = DeviceTables {
            steps: base + offs[0] as u64,
            lanes: base + offs[1] as u64,
            nsteps: enc.steps.len() as u32,
            nlanes: enc.lanes.len() as u32,
            ops: if with_ops { base + offs[2] as u64 } else { 0 },
            conns: self.fabric.table,
            nconns: self.fabric.nconns,
            abort: self.status.abort_ptr(),
            error: self.status.error_ptr(),
            timeout_ns: self.timeout_ns,
            rank: enc.rank,
        };
        let entry = Entry {
            words: key.words().collect(),
            slab: Some(slab),
            run: Run::Plan(at),
            pinned: captured,
            _host: if captured { host } else { Vec::new() },
        };
        cache.map.entry(key.hash()).or_default().push(entry);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroccl_core::{CollKind, DataType, ReduceOp};

    fn args(kind: CollKind, send: usize, recv: usize, count: usize) -> OpArgs {
        OpArgs {
            kind,
            send: send as *const u8,
            recv: recv as *mut u8,
            count,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            root: 0,
            device_scalar: None,
        }
    }

    fn key(a: &[OpArgs], by_address: bool, epoch: u64) -> (u64, Vec<u64>) {
        let k = Key {
            args: a,
            rank: 0,
            by_address,
            epoch,
        };
        (k.hash(), k.words().collect())
    }

    #[test]
    fn shapes_key_the_tables_and_buffers_only_where_the_tables_hold_them() {
        let base = args(CollKind::AllReduce, 0x1000, 0x2000, 64);
        // New buffers of a known shape: the same tables.
        let moved = OpArgs {
            send: 0x5000 as *const u8,
            recv: 0x6000 as *mut u8,
            ..base
        };
        assert_eq!(key(&[base], false, 0), key(&[moved], false, 0));
        // Not with windows (a post names the output), nor in a big group's op table.
        assert_ne!(key(&[base], true, 1), key(&[moved], true, 1));
        assert_ne!(
            key(&[base], false, 0),
            key(&[base], false, 1),
            "another set of windows"
        );
        // Everything the steps depend on changes the key.
        let variants = [
            base,
            OpArgs {
                op: ReduceOp::Prod,
                ..base
            },
            OpArgs {
                kind: CollKind::Reduce,
                ..base
            },
            OpArgs {
                kind: CollKind::Reduce,
                root: 1,
                ..base
            },
            OpArgs { count: 65, ..base },
            OpArgs {
                dtype: DataType::Int32,
                ..base
            },
            OpArgs {
                recv: 0x1000 as *mut u8,
                ..base
            },
        ];
        let keys: Vec<_> = variants
            .iter()
            .map(|a| key(std::slice::from_ref(a), false, 0).1)
            .collect();
        for i in 0..keys.len() {
            for j in 0..i {
                assert_ne!(
                    keys[i], keys[j],
                    "{:?} and {:?} share tables",
                    variants[i], variants[j]
                );
            }
        }
        // The pre-mul-sum scalar rides in the op entry; PreMulSum(0.0) is not Sum.
        let pms = |s, dev| OpArgs {
            op: ReduceOp::PreMulSum(s),
            device_scalar: dev,
            ..base
        };
        assert_eq!(
            key(&[pms(0.0, None)], false, 0),
            key(&[pms(3.0, Some(0x3000))], false, 0)
        );
        assert_ne!(key(&[pms(0.0, None)], false, 0), key(&[base], false, 0));
        assert_ne!(
            key(&[pms(0.0, None)], true, 0),
            key(&[pms(1.0, None)], true, 0)
        );
        assert_ne!(
            key(&[pms(1.0, Some(0x3000))], true, 0),
            key(&[pms(1.0, Some(0x3004))], true, 0)
        );
        // A group is keyed by all its operations, in order.
        assert_ne!(
            key(&[variants[0], variants[1]], false, 0),
            key(&[variants[1], variants[0]], false, 0)
        );
        assert_ne!(key(&[base], false, 0), key(&[base, base], false, 0));
    }

    #[test]
    fn the_pool_reuses_slabs_once_their_tables_are_gone() {
        let mut p: SlabPool<()> = SlabPool::default();
        assert_eq!(p.place(100), None, "no slab yet");
        assert!(p.may_grow(100));
        assert_eq!(p.grow(100, ()), (0, 0));
        // Aligned and packed.
        assert_eq!(p.place(1000), Some((0, 256)));
        assert_eq!(p.place(SLAB_BYTES), None);
        // A table set larger than a slab gets a slab of its own size.
        assert_eq!(p.grow(SLAB_BYTES + 1, ()), (1, 0));
        assert_eq!(p.slabs[1].cap, 2 * SLAB_BYTES);
        assert!(p.may_grow(1) && !p.may_grow(POOL_BYTES));
        // A slab is filled from its start again only when all its tables are gone.
        p.release(0);
        assert_eq!(p.slabs[0].used, 1280, "one table set still lives in slab 0");
        p.release(0);
        assert_eq!(p.place(SLAB_BYTES - 1024), Some((0, 0)));
        p.release(1);
        assert_eq!(p.slabs[1].used, 0);
    }

    #[test]
    fn entries_without_tables_stay_bounded_and_captured_ones_stay() {
        let entry = |i: u64, pinned: bool| Entry {
            words: vec![i],
            slab: None,
            run: Run::Direct { blocks: 1 },
            pinned,
            _host: Vec::new(),
        };
        let mut c = PlanCache::default();
        let count = |c: &PlanCache| c.map.values().flatten().count();
        // Ever-new shapes (new buffers, keyed by address): never more than the bound.
        for i in 0..10 * TABLELESS_MAX as u64 {
            c.insert_tableless(i, entry(i, i % 1000 == 0));
            assert!(
                count(&c) <= TABLELESS_MAX + 1 + (i as usize / 1000),
                "{} entries after {i}",
                count(&c)
            );
        }
        // Every captured entry is still there (a graph may replay it), and the latest shape.
        for i in (0..10 * TABLELESS_MAX as u64).step_by(1000) {
            assert!(
                c.map
                    .get(&i)
                    .is_some_and(|v| v.iter().any(|e| e.pinned && e.words == [i])),
                "captured {i} dropped"
            );
        }
        let last = 10 * TABLELESS_MAX as u64 - 1;
        assert!(c.map.contains_key(&last));
        // A lookup of a dropped shape misses (it is planned again), of a kept one hits.
        let a = args(CollKind::AllReduce, 0x1000, 0x2000, 64);
        let k = Key {
            args: std::slice::from_ref(&a),
            rank: 0,
            by_address: false,
            epoch: 0,
        };
        assert!(c.get(&k).is_none());
        c.insert_tableless(
            k.hash(),
            Entry {
                words: k.words().collect(),
                ..entry(0, false)
            },
        );
        assert!(c.get(&k).is_some());
        // Eviction keeps the captured ones and recounts.
        c.evict();
        assert_eq!(c.tableless, count(&c));
        assert!(c.map.values().flatten().all(|e| e.pinned));
    }

    #[test]
    fn a_launch_larger_than_the_gpu_holds_is_refused_with_the_knob() {
        assert!(check_residency(132, 132).is_ok());
        let e = check_residency(133, 132).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(
            e.to_string().contains("133 thread blocks")
                && e.to_string().contains("FERROCCL_GPU_CHANNELS"),
            "{e}"
        );
    }
}

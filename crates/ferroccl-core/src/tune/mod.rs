//! The tuner: the one place that decides how an operation runs.
//!
//! [`choose`] takes an operation's shape, where the communicator runs and its [`Config`], and
//! returns a [`Choice`]: the algorithm and its cut (channels, chunk), the protocol, the engine
//! and whether messages may go straight into the receiver's output. Nothing else in ferroccl
//! decides any of these; backends execute what the choice says, and the algorithms build the
//! plan it names.
//!
//! Every rank must build the same plan for an operation (messages are matched by their order on
//! each connection, and zero-copy senders build their peers' plans), so everything but
//! `zero_copy` is computed from values all ranks share: the operation's kind, count, type and
//! rank count, the backend and the config (whose wire-relevant knobs every rank must set
//! alike; windows are registered collectively, so every rank has as many). Only `post_output`
//! depends on this rank's own buffers: whether it offers its output to its senders, which each
//! receiver decides for itself (a sender that finds no offer uses the FIFO).

use crate::algo::Tuning;
use crate::plan::copies::{self, CE_SLOTS};
use crate::plan::zcopy::may_post;
use crate::types::{CollKind, DataType, ReduceOp};
use crate::Config;

#[cfg(test)]
mod tests;

/// Data bytes one LL message carries at most: a message occupies twice that in the LL slots
/// (a flag beside every 8 data bytes). The GPU kernel's `FC_LL_DATA` has the same value.
pub const LL_DATA_BYTES: usize = 8192;

/// The GPU's direct engine: the most ranks it serves, thread blocks it runs, and data bytes one
/// block sends one peer in one operation (each rank's receive slots hold that much per block,
/// sender and parity). Its one-shot operations thus carry at most 256 KiB per peer: LL lines
/// cost twice the data over NVLink, and the plan kernel overtakes beyond that (measured).
pub const DIRECT_MAX_RANKS: usize = 16;
/// Thread blocks of the direct engine at most.
pub const DIRECT_MAX_BLOCKS: usize = 16;
/// Data bytes one direct-engine block sends one peer in one operation at most.
pub const DIRECT_SLOT_BYTES: usize = 16 << 10;

/// The GPU's peer engine: the most ranks it serves and thread blocks it runs (each rank's
/// staging holds slots for that many blocks), the smallest slot worth a round's handshake, and
/// the bytes of an operation's largest buffer one block takes at least.
pub const PEER_MAX_RANKS: usize = 16;
/// Thread blocks of the peer engine at most (the kernel's flag lines and round counters are laid
/// out for this many; the staging for [`peer_blocks`]).
pub const PEER_MAX_BLOCKS: usize = 128;
/// Slot bytes below which the peer engine is not offered (its handshake per round would cost
/// more than the round moves).
pub const PEER_MIN_SLOT_BYTES: usize = 16 << 10;
/// Bytes of an operation's largest buffer per peer-engine block, at least: the default of
/// `FERROCCL_GPU_PEER_BLOCK_BYTES`.
/// 8 KiB: on 2 x H200 in CUDA graphs 256 KiB - 1 MiB operations took up to 0.7 us less than with
/// 32 KiB (all-reduce 256 KiB 6.6 -> 5.9 us, reduce-scatter 512 KiB 7.3 -> 6.7), gather and
/// scatter of 256 KiB 0.25 us more (docs/PERFORMANCE.md, section 20).
pub const PEER_BLOCK_BYTES: usize = 8 << 10;

/// Thread blocks the peer engine's staging is cut for on a communicator of `nranks` under `cfg`
/// (`FERROCCL_GPU_PEER_BLOCKS`, else by rank count), and so the most one of its operations runs.
/// On 2 ranks 64: over NVLink (2 x H200) a kernel of 512-thread blocks storing into the peer's
/// memory moved 355 GB/s one way with 32 blocks and 367 with 64, and 309 against 345 when each
/// block also copied every round out of its own staging, as the symmetric kinds do
/// (`bench/probes/peer_store.cu`, docs/PERFORMANCE.md section 17). Beyond 2 ranks 32, so that
/// the slots stay at 16 KiB or more up to 16 ranks with the default staging (up to 9 with 16
/// MiB; not yet measured beyond 2 GPUs). A value set by the
/// knob is the most: fewer where the staging would otherwise cut slots under 16 KiB (so that
/// asking for many blocks on many ranks does not turn the engine off).
pub fn peer_blocks(cfg: &Config, nranks: usize) -> usize {
    if cfg.gpu_peer_blocks == 0 {
        return if nranks == 2 { 64 } else { 32 };
    }
    let fit = cfg.gpu_peer_bytes / (nranks.saturating_sub(1).max(1) * 4 * PEER_MIN_SLOT_BYTES);
    cfg.gpu_peer_blocks.min(PEER_MAX_BLOCKS).min(fit).max(1)
}

/// Bytes of one peer-engine slot on a communicator of `nranks` under `cfg`, or 0 where the
/// engine is off (a rank count it does not serve, or staging too small for 16 KiB slots). Each
/// rank's staging (`FERROCCL_GPU_PEER_BYTES` in all, whatever the rank count, so that memory
/// does not grow with it) holds, for every block and every other rank, an input and an output
/// slot per parity: `peer_blocks x (n-1) x 4` slots, in multiples of 4 KiB so that a slot
/// holds a multiple of 64 elements of every type. With the default 32 MiB
/// (`config::GPU_PEER_BYTES`): 128 KiB slots on 2 ranks (64 blocks), 128 KiB on 3, 36 KiB on 8
/// and 16 KiB on 16 (32 blocks). The GPU
/// backend sizes its staging from this and the tuner its rounds: one place for both.
pub fn peer_slot_bytes(cfg: &Config, nranks: usize) -> usize {
    if !(2..=PEER_MAX_RANKS).contains(&nranks) {
        return 0;
    }
    let slot = cfg.gpu_peer_bytes / (peer_blocks(cfg, nranks) * (nranks - 1) * 4) / 4096 * 4096;
    if slot < PEER_MIN_SLOT_BYTES {
        0
    } else {
        slot
    }
}

/// Bytes of one sender's region in a rank's peer-engine staging on a communicator of `nranks`
/// under `cfg`: that sender's slots for every block (input and result, two parities). The copy
/// engine borrows it whole.
pub fn peer_region_bytes(cfg: &Config, nranks: usize) -> usize {
    peer_blocks(cfg, nranks) * 4 * peer_slot_bytes(cfg, nranks)
}

/// Thread blocks of the fold kernel of a copy-and-fold reduction (`copies::fold_list`): it reads
/// two pieces and writes one in HBM for every piece the link brings, and must keep ahead of the
/// link (the pieces taper by what it keeps up with, `copies::FOLD_RAMP`). On 2 x H200 with 8 pairs
/// of loads in flight a thread (`FC_FOLD_UNROLL`) 16 blocks folded as fast as 32 with 4 and with 8
/// (all-reduce 2 GiB 373 / 363-370 / 354-362 GB/s); only the reduce, whose one-way link is the
/// fastest, gained from 32 (383 against 387; docs/PERFORMANCE.md section 36). 16: the bandwidth
/// issue's goal for reductions. `FERROCCL_GPU_FOLD_BLOCKS` sets it, within
/// `FERROCCL_GPU_CHANNELS` (the block budget of a collective, which `ferroccl bench --max-ctas`
/// sets).
pub const FOLD_BLOCKS: usize = 16;

/// [`FOLD_BLOCKS`] for the reduce of 2 ranks (`FERROCCL_GPU_FOLD_REDUCE_BLOCKS`): only its root
/// folds, while the other rank's SMs idle, and its one-way link is the engines' fastest, so the
/// fold must run faster to stay ahead (with `copies::FOLD_REDUCE_RAMP`). Still fewer than the
/// 64 blocks of the peer engine's rounds it replaces.
pub const FOLD_REDUCE_BLOCKS: usize = 32;

/// [`FOLD_MIN_BYTES`] for the reduce of 2 ranks (`FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES`): on 2 x
/// H200 (32 fold blocks at 140 %, the peer engine's stored rounds in the same call, a process per
/// GPU, plain buffers, graphs, float32; docs/PERFORMANCE.md section 39) 128 MiB 336-337 against
/// 346-348 GB/s, 256 MiB 361 against 352, 512 MiB 376 against 361. Below it the reduce pulls
/// ([`PEER_PULL_REDUCE_MIN_BYTES`]; on plain buffers after a rendezvous,
/// [`pull_rendezvous_wanted`]), which at 256 MiB beat the fold: 731.1-731.7 us against 742.6-743.0
/// (float32), 733.4 against 748.2 (bfloat16; docs/PERFORMANCE.md section 43).
pub const FOLD_REDUCE_MIN_BYTES: usize = 512 << 20;

/// The copy-and-fold knobs of `kind`: (blocks, ramp, smallest largest-buffer). The one place
/// that gives the reduce of 2 ranks its own (`FERROCCL_GPU_FOLD_REDUCE_*`) and every other kind
/// the shared ones.
fn fold_knobs(cfg: &Config, kind: CollKind) -> (usize, usize, usize) {
    if kind == CollKind::Reduce {
        (
            cfg.gpu_fold_reduce_blocks,
            cfg.gpu_fold_reduce_ramp,
            cfg.gpu_fold_reduce_min_bytes,
        )
    } else {
        (
            cfg.gpu_fold_blocks,
            cfg.gpu_fold_ramp,
            cfg.gpu_fold_min_bytes,
        )
    }
}

/// The fold kernel's blocks for a copy-and-fold `kind` (`fold_knobs`), within
/// `FERROCCL_GPU_CHANNELS` (a collective's block budget).
pub fn fold_blocks(cfg: &Config, kind: CollKind) -> usize {
    fold_knobs(cfg, kind).0.min(cfg.gpu_channels.max(1)).max(1)
}

/// The smallest largest-buffer of a copy-and-fold `kind` (`fold_knobs`; 0: never).
pub fn fold_min_bytes(cfg: &Config, kind: CollKind) -> usize {
    fold_knobs(cfg, kind).2
}

/// Whether the copy-and-fold takes a reduction of `redop` (`OpShape::redop`) over `dtype`: Sum,
/// Prod, Max and Min of 2-, 4- and 8-byte elements, Avg of 4- and 8-byte ones. A PreMulSum's
/// landed operand would need its sender's scalar, which may differ by rank (nccl-tests' does:
/// every element wrong when the receiver scaled it with its own); on 2 x H200 at 1 GiB
/// (nccl-tests `-R 2`, the copy-and-fold against the peer engine in the same runs) 16 blocks
/// folded fp8 at 130-167 GB/s against 192-271 and bytes' Max and Min at 233-276 against 283-303,
/// where Sum, Prod, Max and Min of the wider types ran 338-351 against 315-341
/// (docs/PERFORMANCE.md section 21). Avg, since its division became a shift or a multiplication
/// (section 25): float32 1-2 GiB all-reduce 344-356 against the kernels' 315-318, reduce-scatter
/// 323-344 against 317-331; bfloat16 slower on 16 blocks (all-reduce 260-269 against 284-287,
/// reduce-scatter 240-261 against 296-300), as the general loop converts every element.
/// `FERROCCL_GPU_FOLD_EVERY_TYPE` (`cfg.gpu_fold_every_type`) gives it every type and reduction
/// but PreMulSum, to measure the 1- and 2-byte folds that go a word at a time since session 37
/// (docs/PERFORMANCE.md section 49) against the kernels.
pub fn fold_pays(dtype: DataType, redop: i32, cfg: &Config) -> bool {
    match redop {
        r if (ReduceOp::Sum.nccl_id()..=ReduceOp::Min.nccl_id()).contains(&r) => {
            dtype.size() >= 2 || cfg.gpu_fold_every_type
        }
        r if r == ReduceOp::Avg.nccl_id() => dtype.size() >= 4 || cfg.gpu_fold_every_type,
        _ => false,
    }
}

/// How a copy-and-fold of `kind` cuts its copy into pieces (`copies::fold_cuts`):
/// `FERROCCL_GPU_FOLD_PIECE_BYTES` at most, tapering by `FERROCCL_GPU_FOLD_RAMP` per cent a piece
/// (a reduce's by `FERROCCL_GPU_FOLD_REDUCE_RAMP`) down to `FERROCCL_GPU_FOLD_TAIL_BYTES` at the
/// end (every rank's alike: shared settings).
pub fn fold_taper(cfg: &Config, kind: CollKind) -> copies::Taper {
    copies::Taper {
        max: cfg.gpu_fold_piece_bytes,
        tail: cfg.gpu_fold_tail_bytes,
        ramp: fold_knobs(cfg, kind).1,
    }
}

/// The smallest largest-buffer of a copy-and-fold reduction (`FERROCCL_GPU_FOLD_MIN_BYTES`):
/// on 2 x H200 (tapering pieces, 16 fold blocks, a process per GPU, plain buffers mapped on the
/// fly, graphs, float32, the kernels in the same call; docs/PERFORMANCE.md section 36) all-reduce
/// 256 MiB 322 against 327 GB/s, 512 MiB 350 against 332, 2 GiB 373 against 336; reduce 333
/// against 345, 360 against 347, 383 against 350; reduce-scatter 299 against 317, 321 against
/// 321, 365 against 322.
pub const FOLD_MIN_BYTES: usize = 512 << 20;

/// The smallest largest-buffer for which [`peer_split_pays`] splits.
pub const PEER_SPLIT_MIN_BYTES: usize = 32 << 20;

/// The smallest largest-buffer for which [`peer_split_pays`] splits an all-to-all. Its split
/// rounds run in place too (a rank's in-place-ness is its own), where each receive block waits
/// for its send block's round and half the blocks store: on 2 x H200 (a thread per GPU, graphs,
/// float32, `s30a`) split against whole in place 32 MiB 245-249 against 272-276 GB/s, 64 MiB
/// 289-295 against 300-301, 128 MiB 319-323 against 317-320; out of place 32 MiB 255-259 against
/// 235-241, 64 MiB 282-285 against 266-271, 128 MiB 303-304 against 294-296. Below 128 MiB the
/// whole in-place rounds are the faster of the four.
pub const PEER_SPLIT_A2A_MIN_BYTES: usize = 128 << 20;

/// The largest-buffer sizes for which [`peer_split_pays`] splits the rooted kinds.
pub const PEER_SPLIT_ROOTED_BYTES: std::ops::RangeInclusive<usize> = (256 << 10)..=(2 << 20);

/// Whether the peer engine's split rounds (half the blocks sending, half receiving) are the
/// default for `kind` with a largest buffer of `bytes` (`FERROCCL_GPU_PEER_SPLIT=auto`).
/// Measured on 2 x H200 with 64 blocks, graphs, float32 (docs/PERFORMANCE.md section 18): split
/// rounds moved all-gather 321 -> 340 GB/s at 2 GiB (out of place), all-to-all 314 -> 348,
/// scatter 344 -> 353, reduce-scatter 320 -> 325, where the symmetric kinds' blocks no longer
/// copy out between their stores; and cost gather 359 -> 350, broadcast 348 -> 343, reduce
/// 362 -> 349, all-reduce 340 -> 332, whose receiving side had every block before. From 32 MiB
/// (128 MiB and up measured alike; below, not measured). And the rooted kinds from 256 KiB to 2
/// MiB (section 21, a thread per GPU, graphs): a root folds or copies out one block's round while
/// the peer's send blocks store the next, 0.7-1.2 us off broadcast, gather, reduce and scatter of
/// 512 KiB - 2 MiB (reduce 512 KiB 7.15 -> 6.14 us); at 8 MiB a reduce lost 1 us, at 128 KiB
/// broadcast 0.16, and all-gather and reduce-scatter lost 2-2.5 us from 512 KiB.
pub fn peer_split_pays(kind: CollKind, bytes: Option<usize>, nranks: usize) -> bool {
    let Some(b) = bytes else { return false };
    match kind {
        CollKind::AllToAll => b >= PEER_SPLIT_A2A_MIN_BYTES,
        CollKind::AllGather | CollKind::ReduceScatter | CollKind::Scatter
            if b >= PEER_SPLIT_MIN_BYTES =>
        {
            true
        }
        // Measured on 2 ranks only.
        CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter => {
            nranks == 2 && PEER_SPLIT_ROOTED_BYTES.contains(&b)
        }
        _ => false,
    }
}

/// Where read rounds are the default (`FERROCCL_GPU_PEER_READ=auto`, 2 ranks, unsplit rounds),
/// by kind: the largest buffers from and to (both included). See [`peer_read_pays`]. Not the
/// gather: it gained in place (32 MiB 306-312 against 286-295 GB/s) and lost out of place (its
/// root copies its own block in each round before its reads, and the link idles meanwhile: 64
/// MiB 282-285 against 318-319), and a rank's in-place-ness is its own (a gather's non-root has
/// no output), where every rank must choose alike.
pub const PEER_READ_BYTES: [(CollKind, usize, usize); 3] = [
    (CollKind::Broadcast, 8 << 20, 32 << 20),
    // Up to the reduce's fold (FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES), in slots of 128 KiB.
    (CollKind::Reduce, 8 << 20, 128 << 20),
    (CollKind::Scatter, 4 << 20, 16 << 20),
];

/// Whether the peer engine's one-phase rounds read (`Choice::read`) for `op` with a largest
/// buffer of `bytes` (`FERROCCL_GPU_PEER_READ=auto`): each sender copies its round into its own
/// staging (local memory) and flags it, and the receiver reads it over the link, as NCCL's P2P
/// read mode does, where a stored round's flag waits until the link has acknowledged every
/// store before it. Measured on 2 x H200 against the stored rounds in the same call (a process
/// per GPU, plain buffers, graphs, float32, two alternations, GB/s out of place / in place;
/// docs/PERFORMANCE.md section 39): the receivers that only read gained, broadcast 16 MiB
/// 302-312 / 304-312 against 288 / 295-296, 32 MiB 318-322 / 323-324 against 305 / 318-319,
/// scatter 8 MiB 224-244 / 238-240 against 209-219 / 215-225, reduce 16 MiB 304-310 / 303-306
/// against 292 / 287-293; in 64 KiB slots the
/// reduce lost from 64 MiB (128 MiB 338-340 against 346-348), in the 128 KiB slots of 32 MiB
/// of staging it gained to 128 MiB (32 MiB 333-336 / 333-336 against 325-329 / 326-329, 64 MiB
/// 341-343 / 342-344 against 336-338, 128 MiB 347 / 347-348 against 344-345 / 345-346);
/// every kind that exchanges both ways lost (all-gather, all-to-all 8 MiB 179-180 against
/// 188-211, the all-reduce 1-5 %, the split reduce-scatter 32 MiB 214-218 against 248-251), as
/// did the split scatter from 32 MiB. Only from what every rank knows alike (kind, rank count,
/// the largest buffer, which follows from the count), as sender and receiver must agree on
/// where each round lies.
pub fn peer_read_pays(op: &OpShape, bytes: Option<usize>) -> bool {
    let Some(b) = bytes else { return false };
    op.nranks == 2
        && PEER_READ_BYTES
            .iter()
            .any(|&(kind, from, to)| kind == op.kind && (from..=to).contains(&b))
}

/// Whether the peer engine runs `kind` on `nranks` ranks (given room in its staging): 2 to
/// [`PEER_MAX_RANKS`] ranks, every collective, no sends or receives. Broadcast and reduce go
/// one-shot there, the root's link carrying n-1 copies where the chain carries one: beyond 2
/// ranks the tuner gives them to it only while those copies are few bytes
/// ([`peer_rooted_fits`]).
pub fn peer_engine_serves(kind: CollKind, nranks: usize) -> bool {
    (2..=PEER_MAX_RANKS).contains(&nranks) && kind.is_collective()
}

/// Whether a broadcast or reduce of `bytes` per rank (its largest buffer: both of its buffers
/// are that size) on `nranks` ranks is small enough for the peer engine's one-shot: the root's link carries `(n-1) x bytes`, at most
/// `FERROCCL_GPU_PEER_ROOTED_MAX_BYTES` (on 2 ranks always: one copy, as the chain). Other kinds
/// always fit.
pub fn peer_rooted_fits(kind: CollKind, nranks: usize, bytes: Option<usize>, cfg: &Config) -> bool {
    match kind {
        CollKind::Broadcast | CollKind::Reduce if nranks > 2 => bytes
            .and_then(|b| b.checked_mul(nranks - 1))
            .is_some_and(|b| b <= cfg.gpu_peer_rooted_max_bytes),
        _ => true,
    }
}

/// Bytes of one copy-engine staging slot on a communicator of `nranks` under `cfg`, or 0 where
/// the copy engine is off (`FERROCCL_GPU_COPY_ENGINE_BYTES=0`, no peer-engine staging, or a
/// slot under [`CE_MIN_SLOT_BYTES`]). The copy engine borrows the peer engine's staging: each
/// rank's staging holds one region per sender (the peer engine's slots of that sender, for
/// every block), cut into [`CE_SLOTS`] slots. With the default 32 MiB: 8 MiB slots on 2 ranks,
/// 1.1 MiB on 8.
pub fn ce_slot_bytes(cfg: &Config, nranks: usize) -> usize {
    let peer = peer_slot_bytes(cfg, nranks);
    if cfg.gpu_copy_engine_bytes == 0 || peer == 0 {
        return 0;
    }
    let slot = peer_region_bytes(cfg, nranks) / CE_SLOTS / 4096 * 4096;
    if slot < CE_MIN_SLOT_BYTES {
        0
    } else {
        slot
    }
}

/// Copy-engine slots below this size are not worth their handshake (several stream memory
/// operations per piece, a few microseconds, against a piece's transfer).
pub const CE_MIN_SLOT_BYTES: usize = 256 << 10;

/// What the communicator runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory: plans run on the calling thread over shared memory or sockets.
    Host,
    /// GPUs of one host, linked by NVLink or PCIe peer access.
    Gpu,
}

/// One operation as the tuner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpShape {
    /// The operation.
    pub kind: CollKind,
    /// NCCL's count (see [`CollKind::buffer_counts`]).
    pub count: usize,
    /// Its element type.
    pub dtype: DataType,
    /// Ranks of the communicator.
    pub nranks: usize,
    /// This rank's buffers follow NCCL's in-place convention. Local: may differ between ranks.
    pub in_place: bool,
    /// The communicator has registered windows (collective: the same on every rank), so
    /// outputs that lie in one can be written by the senders directly.
    pub windows: bool,
    /// The operation's buffers (those NCCL defines on every rank) lie in symmetric windows:
    /// registered as such on every rank, each rank's buffer at the same offset of the same
    /// window as every other rank's (the contract of NCCL's symmetric windows, which makes this
    /// the same on every rank, as it makes `in_place`), so a sender can name a receiver's
    /// output itself. The launch after a rendezvous in which every receiver posted its output
    /// for its senders (`rendezvous_wanted`) is planned with it too: every rank then names every
    /// output it writes, alike.
    pub symmetric: bool,
    /// Every rank's input lies in a symmetric window, at one offset of one window (the same on
    /// every rank by that contract), so that a rank may read its peers' inputs in place: what a
    /// reduce's pull needs ([`peer_pulls`]). Said apart from `symmetric` because a reduce's
    /// `symmetric` speaks of its root's posted output.
    pub inputs_symmetric: bool,
    /// The reduction, as NCCL numbers it (`ReduceOp::nccl_id`: 0 Sum, 1 Prod, 2 Max, 3 Min, 4
    /// Avg, 5 any PreMulSum; 0 for the kinds that do not reduce). NCCL makes it the same on
    /// every rank (a PreMulSum's scalar may differ).
    pub redop: i32,
}

impl OpShape {
    /// Bytes of the operation's largest buffer (the root's, for rooted operations), the same on
    /// every rank; None when the size overflows.
    pub fn largest_bytes(&self) -> Option<usize> {
        let (s, r) = self.kind.buffer_counts(self.count, self.nranks, true)?;
        s.max(r).checked_mul(self.dtype.size())
    }
}

/// The algorithm: which plan builder makes the operation's steps (`algo::build`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// All-reduce, reduce-scatter, all-gather: a ring per channel over slices of the buffer.
    Ring,
    /// All-reduce: every rank sends each owner its share, owners reduce and send the result to
    /// all, in rounds of a chunk: two dependent messages instead of the ring's 2(n-1). On the
    /// plan kernel and the host on 3+ ranks within one chunk; on the GPU peer engine on any
    /// rank count and size.
    TwoShot,
    /// Broadcast, reduce: a chain from (or to) the root.
    Chain,
    /// All-to-all, gather, scatter, send and receive: each block straight to its peer.
    Direct,
    /// Every collective in one round: each rank sends every peer what it needs, then combines
    /// what it received (n-1 times the data per rank, one message of latency).
    OneShot,
}

impl Algo {
    /// Whether this algorithm has a plan builder for `kind`.
    pub fn supports(self, kind: CollKind) -> bool {
        use CollKind::*;
        match self {
            Algo::Ring => matches!(kind, AllReduce | ReduceScatter | AllGather),
            Algo::TwoShot => kind == AllReduce,
            Algo::Chain => matches!(kind, Broadcast | Reduce),
            Algo::Direct => matches!(kind, AllToAll | Gather | Scatter | Send | Recv),
            Algo::OneShot => kind.is_collective(),
        }
    }

    /// The algorithm an operation takes when nothing better applies.
    pub fn default_for(kind: CollKind) -> Algo {
        use CollKind::*;
        match kind {
            AllReduce | ReduceScatter | AllGather => Algo::Ring,
            Broadcast | Reduce => Algo::Chain,
            AllToAll | Gather | Scatter | Send | Recv => Algo::Direct,
        }
    }

    /// Its name in logs ("ring", "one-shot", ...).
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::TwoShot => "two-shot",
            Algo::Chain => "chain",
            Algo::Direct => "direct",
            Algo::OneShot => "one-shot",
        }
    }
}

/// How a message travels over a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Data slots, then a length and a head counter (one fence per slot).
    Simple,
    /// Every 8 data bytes stored with a flag beside them: no fence and no separate flag store
    /// between a send and its receipt (GPUs only).
    LL,
    /// 128-byte lines of 120 data bytes and an 8-byte flag, a warp storing four at once (the
    /// peer engine's one-shot all-reduce on 2 ranks joined by NVLink, [`peer_lines`]): a line
    /// whose flag is the round's holds the round's data, so the receiver folds each as it
    /// lands, with no fence, flag word or wait between the stores and the fold.
    LL128,
}

/// What executes the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// The host executor, on the calling thread.
    HostExecutor,
    /// The GPU plan kernel: one thread block per lane. (A launch of sends and receives alone
    /// runs the same plan on the plan kernel's point-to-point form, a leaner kernel speaking the
    /// same protocols on the same connections: not a choice made here, since it changes no
    /// message and each rank may take it or not; the CUDA backend's `p2p.rs` decides it from
    /// the encoded plan.)
    PlanKernel,
    /// The GPU direct kernel: one-shot operations of one operation per launch, each block
    /// storing its messages straight into the peers' receive slots with a flag in every 8 data
    /// bytes, and folding what it received in rank order (the same bits on every rank).
    DirectKernel,
    /// The GPU peer kernel: all-reduce (two-shot, or one-shot on 2 ranks) and the other
    /// collectives (one-shot; broadcast and reduce beyond 2 ranks while the root's n-1 copies fit
    /// `FERROCCL_GPU_PEER_ROOTED_MAX_BYTES`) of one operation per launch, in rounds per block and
    /// peer (two-shot: a slot per phase; one-shot: both phases' slots of a parity): each block
    /// stores its messages straight into the receivers' staging and raises one flag per receiver
    /// and round; no FIFO, no per-slot head or length.
    PeerKernel,
    /// The GPUs' copy engines: data-movement operations alone in their launch, each message cut
    /// into pieces that the sender's copy engine puts into the receiver's staging and the
    /// receiver's copies out, handshakes by stream memory operations; no thread block.
    CopyEngine,
}

impl Engine {
    /// Whether it executes a [`Plan`](crate::plan::Plan) (the others are specialised for the
    /// operations they take and need none built).
    pub fn runs_plans(self) -> bool {
        matches!(self, Engine::HostExecutor | Engine::PlanKernel)
    }
}

/// Why each part of a [`Choice`] is what it is, for the debug log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Why {
    /// Why this algorithm.
    pub algo: &'static str,
    /// Why this protocol.
    pub protocol: &'static str,
    /// Why this many channels.
    pub channels: &'static str,
}

/// How one operation runs. Everything but `post_output` and `wait_posts` (which follow this
/// rank's own in-place-ness; the wait is bounded, so ranks may differ) is the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Choice {
    /// The plan builder.
    pub algo: Algo,
    /// How messages travel.
    pub protocol: Protocol,
    /// What executes the plan.
    pub engine: Engine,
    /// Channels (lanes; on GPUs, thread blocks) the operation is spread over.
    pub channels: usize,
    /// Elements one message carries at most (the pipeline unit).
    pub chunk_elems: usize,
    /// Zero-copy: receivers post their output (or that they offer none) where a run of the
    /// operation's steps starts, and senders write straight into posted outputs. On the peer
    /// engine (its direct rounds) senders look for posts without waiting for them, so a rank
    /// that posts nothing only costs its senders a look per round.
    pub zero_copy: bool,
    /// This rank may offer its output (when it lies in a window): not where a peer's write
    /// could land before this rank has read the input it overwrites.
    pub post_output: bool,
    /// The peer engine only: each slice of the operation on two thread blocks, one sending and
    /// one receiving at its own pace (`channels` is then even: half send, half receive).
    pub split: bool,
    /// The peer engine only: read rounds (`peer_read_pays`): each message lies in its sender's own
    /// staging and its receiver reads it over the link, where stored rounds write it into the
    /// receiver's staging.
    pub read: bool,
    /// The peer engine's direct rounds only: the senders wait (a few microseconds at most) for
    /// their receivers' posts at the launch's start, so that they store straight into the
    /// outputs from the first round, where every receiver posts (symmetric windows; not an
    /// in-place all-to-all, judged by this rank's own buffers, which the symmetric contract
    /// makes every rank's).
    pub wait_posts: bool,
    /// Why each part is what it is.
    pub why: Why,
}

impl Choice {
    /// What the plan builder needs.
    pub fn tuning(&self) -> Tuning {
        Tuning {
            algo: self.algo,
            channels: self.channels,
            chunk_elems: self.chunk_elems,
        }
    }
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}), {:?} ({}), {} channels ({}), chunk {} elements, {:?}{}",
            self.algo.name(),
            self.why.algo,
            self.protocol,
            self.why.protocol,
            self.channels,
            self.why.channels,
            self.chunk_elems,
            self.engine,
            match (self.zero_copy, self.post_output) {
                (false, _) => "",
                (true, true) => ", zero-copy",
                (true, false) => ", zero-copy (not into this rank's output)",
            }
        )
    }
}

/// Thread blocks the sends to every peer may take on GPUs (one per peer and channel; as many
/// again for the receives of a full exchange), above the floor of [`GPU_P2P_CHANNELS_MIN`]
/// per peer.
pub const GPU_P2P_LANES: usize = 32;
/// Point-to-point channels per peer on GPUs at least (unless `FERROCCL_GPU_P2P_CHANNELS` is
/// lower), however many peers there are.
pub const GPU_P2P_CHANNELS_MIN: usize = 8;

/// The most channels any choice may use on `device` in a communicator of `nranks`: what a GPU
/// communicator allocates FIFOs for at creation (collective channels, point-to-point channels
/// per peer and direction).
///
/// One block moves about 21 GB/s of a send (measured: 8 blocks per direction gave 171-174
/// GB/s over NVLink on 2 x H200 and between two ranks on one H100 alike), so one peer needs
/// many; but a group may send to and receive from every peer at once, and every lane of a
/// launch must be resident (the plan kernel holds one block per SM: 132 on an H100 or H200).
/// So a peer gets `FERROCCL_GPU_P2P_CHANNELS` (32) with 2 ranks, fewer with more (the sends to
/// every peer within [`GPU_P2P_LANES`] blocks, the receives as many, so that a full exchange
/// leaves room for a collective's 32 in the same group), never below 8, the old budget, which a
/// full exchange among 9 ranks or more already exceeds.
/// Every rank computes the same from the same `nranks` and config, so both ends of every
/// connection agree.
pub fn channel_budget(device: Device, cfg: &Config, nranks: usize) -> (usize, usize) {
    match device {
        Device::Host => (cfg.channels.max(1), 1),
        Device::Gpu => {
            let coll = cfg.gpu_channels.max(1);
            let peers = nranks.saturating_sub(1).max(1);
            let p2p = (GPU_P2P_LANES / peers)
                .max(GPU_P2P_CHANNELS_MIN)
                .min(cfg.gpu_p2p_channels.max(1));
            (coll, p2p)
        }
    }
}

/// The largest operation LL may carry: what the knob allows, and never more than one
/// connection's LL slots hold, so that every message fits its FIFO whole. Algorithms that send
/// to every peer before receiving from any (all-to-all, two-shot all-reduce) need that room;
/// piece-by-piece pipelining cannot help when every rank is sending.
pub fn ll_limit(cfg: &Config) -> usize {
    cfg.ll_max_bytes.min(ll_connection_bytes(cfg))
}

/// Data bytes one connection's LL slots hold.
fn ll_connection_bytes(cfg: &Config) -> usize {
    cfg.slots
        .saturating_mul(cfg.slot_bytes.min(LL_DATA_BYTES) & !7)
}

/// Elements of the largest of `channels` slices of `count` (`algo::channel_slice`, which aligns
/// the cuts, so a slice may exceed `count / channels`).
fn largest_slice(count: usize, channels: usize) -> usize {
    let ch = channels.max(1);
    (0..ch)
        .map(|c| {
            let (a, b) = crate::algo::channel_slice(count, ch, c);
            b - a
        })
        .max()
        .unwrap_or(0)
}

/// Whether a send or receive of `bytes` whose largest channel share is `share` bytes takes LL:
/// within `FERROCCL_LL_MAX_BYTES`, and each share within one connection's LL slots. A channel's
/// share of a send/recv runs on its own send and receive blocks, so unlike a collective's
/// messages (which [`ll_limit`] bounds whole) only the share must fit.
fn p2p_ll_fits(bytes: usize, share: usize, cfg: &Config) -> bool {
    bytes <= cfg.ll_max_bytes && share <= ll_connection_bytes(cfg)
}

/// Decides how each operation of a launch runs. The direct engine runs one operation per
/// launch: a group whose operations would take it runs them all on the plan kernel instead.
pub fn choose_launch(ops: &[OpShape], device: Device, cfg: &Config) -> Vec<Choice> {
    let single = ops.len() == 1;
    ops.iter()
        .map(|op| choose_with(op, device, cfg, single))
        .collect()
}

/// Decides how `op` runs on `device` under `cfg`, alone in its launch.
pub fn choose(op: &OpShape, device: Device, cfg: &Config) -> Choice {
    choose_with(op, device, cfg, true)
}

/// Channels for the direct engine: one per `gpu_channel_bytes` of the per-peer message, more
/// where a slice would not fit a slot; None when even the most blocks (16, or
/// `gpu_channels` if fewer) cannot carry it.
fn direct_blocks(count: usize, es: usize, cfg: &Config) -> Option<usize> {
    let max = DIRECT_MAX_BLOCKS.min(cfg.gpu_channels.max(1));
    let want = (count * es)
        .div_ceil(cfg.gpu_channel_bytes.max(1))
        .clamp(1, max);
    (want..=max).find(|&ch| {
        (0..ch).all(|c| {
            let (a, b) = crate::algo::channel_slice(count, ch, c);
            (b - a) * es <= DIRECT_SLOT_BYTES
        })
    })
}

/// The smallest and largest all-reduce the peer engine pulls (`FERROCCL_GPU_PEER_PULL_MIN_BYTES`,
/// `FERROCCL_GPU_PEER_PULL_MAX_BYTES`; see [`peer_pulls`]). On 2 x H200 (a process per GPU,
/// registered, float32, pull / the staged rounds in the same runs, GB/s): 16 MiB 291-293 /
/// 282-283 in graphs, 32 MiB 312 / 298-301, 128 MiB 330 / 320-322, 512 MiB 334-335 / 328-331;
/// but 8 MiB 32.1-32.7 / 32.0 us, 1 MiB 10.3-10.7 / 8.9-9.1 us (its second crossing and the
/// reads' round trip cost more than the overlap gives there), and 1-2 GiB 335-336 against the
/// copy-and-fold's 340-356 (docs/PERFORMANCE.md section 22); the copy-and-fold takes over from
/// `FERROCCL_GPU_FOLD_MIN_BYTES` (512 MiB since its pieces taper: 350 GB/s there, section 36).
pub const PEER_PULL_MIN_BYTES: usize = 16 << 20;
/// See [`PEER_PULL_MIN_BYTES`].
pub const PEER_PULL_MAX_BYTES: usize = 512 << 20;

/// The smallest reduce the peer engine pulls (`FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES`; see
/// [`peer_pulls`]). On 2 x H200 (registered, a process per GPU, graphs, float32 and bfloat16,
/// two alternated runs, us, pull / the staged read rounds): 64 MiB 191.5-193.3 / 194.2-196.4,
/// 128 MiB 369.8-376.0 / 383.7-386.2, 256 MiB in place 731-737 / 762-768 (out of place the
/// copy-and-fold takes it either way); but 32 MiB level (98.6-101.5 / 98.7-100.7), and 2-16 MiB
/// 5-25 % slower (16 MiB 53.6-54.9 / 51.1-51.9). Not for want of blocks (64 were no faster
/// there, and slower from 32 MiB); more likely its end, where the non-root waits for the root's
/// "read" flag (docs/PERFORMANCE.md section 42).
pub const PEER_PULL_REDUCE_MIN_BYTES: usize = 64 << 20;

/// The most thread blocks a pulling all-reduce runs on (it fills no slots, so the staging's cut
/// does not bind it). On 2 x H200 (registered, a process per GPU, graphs, out of place, float32
/// and bfloat16 together, GB/s, two alternated runs, 64 / 32 / 16 / 128 blocks): 32 MiB 311-312 /
/// 310-311 / 301-306 / 311-313, 128 MiB 330-331 / 328-329 / 321-325 / 330-331, 512 MiB 334-335 /
/// 334-335 / 326-331 / 334-335 (docs/PERFORMANCE.md section 26; `bench/probes/peer_pull.cu` had
/// 16 blocks' loads both ways level with 64's, the fold's HBM traffic is what 16 lose on); this
/// cap against 64 blocks in one call: 0.6-1.3 % slower at 32 MiB (float32 309-310 against 313-314),
/// 0.1-0.7 % from 128 MiB. 32: half the SMs for about 1 %. The default of
/// `FERROCCL_GPU_PEER_PULL_BLOCKS`.
pub const PEER_PULL_BLOCKS: usize = 32;

/// Whether the peer engine's all-reduce of `op` (on 2 ranks, `bytes` its largest buffer) pulls:
/// each rank reads its peer's input straight out of the peer's symmetric window and folds it
/// with its own into its output, in one round per block; a flag says the input is there, a
/// second that the peer has read it. No staging, no store phase: the link's reads and the
/// fold's HBM traffic overlap, where the staged one-shot stores, then folds. Out of place only
/// (in place, a rank's output is the input its peer still reads), and not a PreMulSum (the
/// peer's input would need the peer's scalar, which may differ by rank).
///
/// The reduce of 2 ranks pulls too, where every rank's input lies in a symmetric window
/// (`inputs_symmetric`): its root reads the peer's input and folds it with its own into its
/// output; the non-root reads nothing and only says its input is there, then waits until the
/// root has read it. In place or not (the root reads and writes each element by the same
/// thread, and nobody reads the root's buffers), so each rank's own in-place-ness, which its
/// peer cannot see, does not enter. From `FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES` up with no
/// upper bound (`FERROCCL_GPU_PEER_PULL_MAX_BYTES` is the all-reduce's): the copy-and-fold,
/// which the tuner asks first, takes the reduces it can from `FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES`
/// (out of place, a reduction the fold pays for), and the pull the rest, an in-place root's
/// above all, which the rounds ran at 0.97 x NCCL at 1-2 GiB (docs/PERFORMANCE.md section 43).
pub fn peer_pulls(op: &OpShape, bytes: Option<usize>, cfg: &Config) -> bool {
    let redop = (ReduceOp::Sum.nccl_id()..=ReduceOp::Avg.nccl_id()).contains(&op.redop);
    let shape = match op.kind {
        // The all-reduce's floor of 0 pulls from the first byte (its setting's older convention).
        CollKind::AllReduce => {
            op.symmetric
                && !op.in_place
                && bytes.is_some_and(|b| {
                    b >= cfg.gpu_peer_pull_min_bytes && b <= cfg.gpu_peer_pull_max_bytes
                })
        }
        CollKind::Reduce => {
            op.inputs_symmetric && reaches(bytes, cfg.gpu_peer_pull_reduce_min_bytes)
        }
        _ => false,
    };
    op.nranks == 2 && redop && shape
}

/// Whether a largest buffer of `bytes` reaches a size knob's `min`, by the knobs' convention that
/// 0 means never.
fn reaches(bytes: Option<usize>, min: usize) -> bool {
    bytes.is_some_and(|b| min > 0 && b >= min)
}

/// Whether the ranks should tell each other where their outputs lie before a launch of `op`
/// alone (`plan::copies::rendezvous_far`), so that the copy engines can copy straight into them:
/// a data-movement collective on GPUs (`copies::rendezvous_serves`) whose outputs the ranks can
/// post: in symmetric windows (`op.windows`), or anywhere with
/// `FERROCCL_GPU_CE_MAP_UNREGISTERED` (outputs mapped for their writers on the fly); without
/// either, nothing is posted and no exchange is paid. Its largest buffer from
/// `FERROCCL_GPU_CE_RENDEZVOUS_BYTES` and from `FERROCCL_GPU_CE_WINDOW_BYTES` up (a gather's or
/// scatter's from `FERROCCL_GPU_CE_GATHER_BYTES` too, a broadcast's from
/// `FERROCCL_GPU_CE_BROADCAST_BYTES`: [`ce_kind_floor_met`]). An all-gather,
/// all-to-all or broadcast whose buffers lie in symmetric windows (`op.symmetric`) needs no
/// exchange: each rank names its peers' outputs by its own. The copy-and-fold reductions (an
/// all-reduce or reduce-scatter of 2 ranks) exchange where the tuner would give them the fold
/// between symmetric windows (`FERROCCL_GPU_FOLD_MIN_BYTES`, a reduction the fold pays for) and
/// their buffers lie in none; the reduce of 2 ranks there whatever its buffers (only its root's
/// posting tells its peer that the root is out of place); and a reduce of 2 ranks whose root
/// would pull its peer's input, where the inputs lie in no symmetric window, from the pull's
/// floor (below the fold alone, from it beside the fold's outputs: [`pull_rendezvous_wanted`]).
/// The exchange is a bootstrap
/// all-gather (tens of microseconds on one host) and blocks the call until every rank has made
/// it: on 2 x H200 a gather of 128 MiB by the copy engines took 346-350 GB/s against the
/// kernels' 331, host launches included (docs/PERFORMANCE.md section 33). Everything it reads is
/// the same on every rank (the symmetric contract makes `symmetric` so), so all ranks exchange,
/// or none. The backend adds what only it knows, alike on every rank too: a process per rank,
/// the copy engine and the peer engine's fabric present.
pub fn rendezvous_wanted(op: &OpShape, device: Device, cfg: &Config) -> bool {
    outputs_rendezvous_wanted(op, device, cfg) || pull_rendezvous_wanted(op, device, cfg)
}

/// Whether a rank of `op` can post its buffers to its peers at all: on GPUs, where it has
/// windows or lends what lies in none on the fly (`FERROCCL_GPU_CE_MAP_UNREGISTERED`).
fn postable(op: &OpShape, device: Device, cfg: &Config) -> bool {
    device == Device::Gpu && (op.windows || cfg.gpu_ce_map_unregistered)
}

/// [`rendezvous_wanted`] for the outputs alone: where the ranks post their outputs to their
/// writers (the copy engines' zero-copy and the copy-and-fold), leaving out the reduce's input
/// posted for its root's pull ([`pull_rendezvous_wanted`]).
pub fn outputs_rendezvous_wanted(op: &OpShape, device: Device, cfg: &Config) -> bool {
    if copies::fold_kind(op.kind, op.nranks) {
        return fold_rendezvous_wanted(op, device, cfg);
    }
    let at_least = |min: usize| reaches(op.largest_bytes(), min);
    postable(op, device, cfg)
        && copies::rendezvous_serves(op.kind, op.nranks)
        && !(op.symmetric && copies::zcopy_serves(op.kind, op.nranks))
        && at_least(cfg.gpu_ce_rendezvous_bytes)
        && at_least(cfg.gpu_ce_window_bytes)
        && ce_kind_floor_met(op, cfg)
}

/// [`rendezvous_wanted`] for the copy-and-fold reductions (`copies::fold_kind`): where the tuner
/// gives `op` the fold once every rank can name its peer's output.
fn fold_rendezvous_wanted(op: &OpShape, device: Device, cfg: &Config) -> bool {
    // Where the tuner gives these buffers the fold once every rank can name its peer's output
    // (which `symmetric` says; out of place, which a rank in place refuses by its posting, so
    // that in-place-ness need not be alike here). The fold's size first: the tuner is not asked
    // for the many small reductions. The reduce exchanges between symmetric windows too
    // (`copies::posted_fold_serves`: only its root's posting tells whether it is in place).
    let named_anyway = op.symmetric && !copies::posted_fold_serves(op.kind, op.nranks);
    if !postable(op, device, cfg)
        || named_anyway
        || !reaches(op.largest_bytes(), fold_min_bytes(cfg, op.kind))
    {
        return false;
    }
    let named = OpShape {
        symmetric: true,
        in_place: false,
        ..*op
    };
    let c = choose(&named, device, cfg);
    c.engine == Engine::CopyEngine && c.zero_copy
}

/// Whether the rendezvous before the reduce `op` carries its non-root's input for its root's
/// pull (`copies::rendezvous_pull`): a reduce of 2 ranks whose inputs lie in no symmetric window
/// (in them the root names its peer's input itself, [`peer_pulls`]), where the tuner would give
/// it the pull once its root can name that input. Its non-root then posts its input for its
/// root: in a window, or lent on the fly (`FERROCCL_GPU_CE_MAP_UNREGISTERED`). Below the
/// copy-and-fold's floor this is the rendezvous's only purpose, and the launch after it is
/// planned with `inputs_symmetric` and pulls; from the floor the same exchange carries the root's
/// output for the fold too ([`outputs_rendezvous_wanted`]), and the launch folds where the root posted
/// it (out of place) and pulls where only the input was posted (a root in place refuses the
/// fold). Nothing it reads is one rank's own (in-place-ness is not asked: the reduce's pull
/// takes either), so every rank decides alike. On 2 x H200 the pull between registered windows
/// ran the reduce of 128 MiB in 370-373 us against the read rounds' 385-386 (docs/PERFORMANCE.md
/// section 42), which buffers nobody registered ran until session 33.
pub fn pull_rendezvous_wanted(op: &OpShape, device: Device, cfg: &Config) -> bool {
    if !postable(op, device, cfg) || op.kind != CollKind::Reduce || op.inputs_symmetric {
        return false;
    }
    let named = OpShape {
        symmetric: false,
        inputs_symmetric: true,
        in_place: false,
        ..*op
    };
    // The pull's own bounds first: the tuner is not asked for the many small reduces.
    if !peer_pulls(&named, op.largest_bytes(), cfg) {
        return false;
    }
    let c = choose(&named, device, cfg);
    c.engine == Engine::PeerKernel && c.zero_copy
}

/// Whether `op` is past its kind's own floor for the copies, on top of the shared ones
/// (`FERROCCL_GPU_CE_WINDOW_BYTES`, `_RENDEZVOUS_BYTES`): gather and scatter wait for
/// `FERROCCL_GPU_CE_GATHER_BYTES`, broadcast for `FERROCCL_GPU_CE_BROADCAST_BYTES` (0: never).
/// Their kernels carry one direction, and hold out longer against the copies' fixed cost (the
/// handshakes, about 16 us a launch) than the two-way kinds' do: on 2 x H200 the copies took an
/// out-of-place all-gather and all-to-all of 32 MiB 7-9 % past the kernels, a broadcast of 32
/// MiB in place 2 % under them, gather and scatter of 64 MiB 2-4 % under (docs/PERFORMANCE.md
/// sections 37 and 38).
pub fn ce_kind_floor_met(op: &OpShape, cfg: &Config) -> bool {
    let floor = match op.kind {
        CollKind::Gather | CollKind::Scatter => cfg.gpu_ce_gather_bytes,
        CollKind::Broadcast => cfg.gpu_ce_broadcast_bytes,
        _ => return true,
    };
    reaches(op.largest_bytes(), floor)
}

/// Whether a send or receive of `op` goes through the posted-receive rendezvous
/// (`plan::copies::RecvPost`): the receiver posts where its output lies to its sender before
/// the launch, and where it lies in a symmetric window, or is mapped for the sender on the fly
/// (`FERROCCL_GPU_CE_MAP_UNREGISTERED`), the sender's copy engines copy straight into it. On
/// GPUs, the communicator with symmetric windows or that setting, the message from
/// `FERROCCL_GPU_CE_P2P_BYTES` up (16 MiB: on 2 x H200 sendrecv by the copies 335-344 GB/s at 64
/// MiB against the kernels' 309-318; with the handshakes in batches 306-308 at 32 MiB against
/// 291-305, 259 at 16 MiB against 271; with both directions on one lane on the caller's stream
/// 284 at 16 MiB against 270; docs/PERFORMANCE.md sections 34, 37 and 38); a matched
/// send and receive have one length, so both ends decide alike. The receiver never waits for it;
/// the sender waits for its receiver's call.
pub fn p2p_rendezvous_wanted(op: &OpShape, device: Device, cfg: &Config) -> bool {
    postable(op, device, cfg)
        && op.nranks >= 2
        && matches!(op.kind, CollKind::Send | CollKind::Recv)
        && reaches(op.largest_bytes(), cfg.gpu_ce_p2p_bytes)
}

/// `FERROCCL_GPU_PEER_LINES_MAX_BYTES` by default: 1 MiB, where line rounds ([`peer_lines`])
/// measured faster than the staged rounds. On 2 x H200 (registered, a process per GPU, CUDA
/// graphs, rows 128 KiB - 1 MiB 4 KiB apart, medians of a band, lines / staged in the same call):
/// 128-192 KiB 4.96 / 6.18 us, 320-512 KiB 6.16 / 6.80, 768 KiB - 1 MiB 7.49 / 8.36; level at 2-4
/// MiB, slower from 8 MiB (the lines' stores carry about 290 GB/s of data, the staged rounds'
/// 320). Their polls pause between stale reads (`FC_LINE_POLL_NS`): without the pause about 0.2 %
/// of such rows ran every operation at under 1 GB/s (47 of 22,500), with it 1 of 12,600, the rate
/// seen in NCCL's own rows (docs/PERFORMANCE.md, section 24; `bench/stalls.py`). 0 turns them off.
pub const PEER_LINES_MAX_BYTES: usize = 1 << 20;

/// A warp's store in the peer engine's line rounds: four 128-byte lines, of which 480 bytes are
/// data and 32 the four lines' flags (`kernels/peer.cu`, `line_round`).
pub const LINE_GROUP_BYTES: usize = 512;
/// The data bytes of one [`LINE_GROUP_BYTES`] store.
pub const LINE_GROUP_DATA: usize = 480;

/// Elements of `es` bytes one line round of a block carries: its parity's two slots of `slot`
/// bytes (a one-shot round's room) filled with lines, 15/16 of it data. A multiple of 16 bytes,
/// so every round of a block starts as aligned as its first.
pub fn peer_line_round_elems(slot: usize, es: usize) -> usize {
    2 * slot / LINE_GROUP_BYTES * LINE_GROUP_DATA / es.max(1)
}

/// Whether the peer engine's rounds of `op` (2 ranks, `bytes` its largest buffer) travel in lines
/// (`Protocol::LL128`): the one-shot all-reduce, the reduce-scatter and the reduce (the kinds
/// that fold what they receive, where the fold can follow the lines as they land; the reduce from
/// [`PEER_LINES_REDUCE_MIN_BYTES`]), every reduction, in place or not, windows or not, up to
/// `FERROCCL_GPU_PEER_LINES_MAX_BYTES`. The staged one-shot's round stores, drains its stores
/// over the link (a release per block), raises a flag and waits for the peer's before it folds,
/// so the link idles through the fold and the crossing costs a fixed 5-6 us (all-reduce 256 KiB
/// 5.8 us, 4 MiB 18.0 us on 2 x H200: docs/PERFORMANCE.md, "What limits us now"); in lines each
/// warp folds the peer's lines as they land while it stores its next ones, for 1/16 more bytes
/// on the link. NVLink only: the line's flag says its other 120 bytes are there because a
/// warp's 128-byte store crosses NVLink whole (as NCCL's LL128 protocol also takes it), which
/// PCIe does not promise; the communicator turns the knob off where a link is not NVLink.
pub fn peer_lines(op: &OpShape, bytes: Option<usize>, cfg: &Config) -> bool {
    let from = match op.kind {
        CollKind::AllReduce | CollKind::ReduceScatter => 0,
        CollKind::Reduce => PEER_LINES_REDUCE_MIN_BYTES,
        _ => return false,
    };
    op.nranks == 2 && bytes.is_some_and(|b| b >= from && b <= cfg.gpu_peer_lines_max_bytes)
}

/// The smallest reduce (its buffer) that travels in lines ([`peer_lines`]). Below it the split
/// rounds ([`peer_split_pays`]), whose root folds one block's round while the peer's send blocks
/// store the next, measured faster: at 256 KiB 5.67-5.92 us against the lines' 5.94-6.15 (2 x
/// H200, float32, a process per GPU, CUDA graphs; docs/PERFORMANCE.md section 30); the lines
/// gained 0.3-0.9 us at 512 KiB and 1 MiB.
pub const PEER_LINES_REDUCE_MIN_BYTES: usize = 512 << 10;

/// The smallest largest-buffer from which senders wait for their receivers' posts at a launch's
/// start (`FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES`, `Choice::wait_posts`). On 2 x H200 (a
/// process per GPU, registered symmetric windows, graphs, float32, two alternations, `s30b`,
/// GB/s out of place / in place) the all-gather of 16 MiB 241-249 / 253-262 against 231-232 /
/// 246-250, level at 8 MiB, and below it the wait lost up to a quarter (1 MiB 50-53 against
/// 63-67, 4 MiB 128-134 against 152-165; broadcast 1-4 MiB alike): the early rank's stores no
/// longer overlap its peer's late start. From 32 MiB these kinds take the copies.
pub const PEER_WAIT_POSTS_MIN_BYTES: usize = 16 << 20;

/// The smallest largest-buffer from which the peer engine runs direct rounds: below it a launch
/// has too few rounds a block for them (they start on the third), and the look after every
/// round cost all-gather 512 KiB - 8 MiB 5-15 % on 2 x H200 (docs/PERFORMANCE.md, section 19).
pub const PEER_DIRECT_MIN_BYTES: usize = 32 << 20;

/// The kinds that only move data: a peer-engine sender may store their messages straight into
/// the receiver's output (the kernel's `movement_kind`).
pub fn moves_only(kind: CollKind) -> bool {
    matches!(
        kind,
        CollKind::AllGather
            | CollKind::AllToAll
            | CollKind::Broadcast
            | CollKind::Gather
            | CollKind::Scatter
    )
}

/// Whether the peer engine takes `op` when it is alone in its launch beyond the direct engine:
/// it serves the kind on this many ranks, the staging gives it slots, and a rooted operation's
/// copies fit (`bytes`: the operation's largest buffer, as `choose_with` has it).
fn peer_takes(op: &OpShape, bytes: Option<usize>, cfg: &Config) -> bool {
    peer_engine_serves(op.kind, op.nranks)
        && peer_slot_bytes(cfg, op.nranks) > 0
        && peer_rooted_fits(op.kind, op.nranks, bytes, cfg)
}

fn choose_with(op: &OpShape, device: Device, cfg: &Config, may_direct: bool) -> Choice {
    let es = op.dtype.size();
    let bytes = op.largest_bytes();
    let p2p = !op.kind.is_collective();
    // The GPU's FIFOs have slots of their own (FERROCCL_GPU_SLOTS), and so its chunk.
    let chunk_bytes = match device {
        Device::Gpu => cfg.gpu_chunk_bytes(),
        Device::Host => cfg.chunk_bytes,
    };
    let chunk_elems = (chunk_bytes / es).max(1);
    // What each rank sends each peer in one round: the per-rank block, for every collective.
    let message = op.count.checked_mul(es);
    let one_shot_here = message.is_some_and(|m| m <= cfg.direct_max_bytes) && !p2p;

    // The GPU's direct engine: one message of latency, at most 256 KiB per peer.
    if device == Device::Gpu && may_direct && !p2p && op.nranks <= DIRECT_MAX_RANKS {
        // Each rank sends (n-1) messages in its one round: bounded, so that more ranks take
        // the one-shot for smaller operations only.
        let sent = message.and_then(|m| m.checked_mul(op.nranks.saturating_sub(1).max(1)));
        // Where the peer engine would take over, it does so sooner: it beats the direct engine
        // once each rank sends more than FERROCCL_GPU_PEER_FROM_BYTES (docs/PERFORMANCE.md,
        // section 12), where the plan kernel, the next engine otherwise, does not.
        let limit = if peer_takes(op, bytes, cfg) {
            cfg.gpu_oneshot_max_bytes.min(cfg.gpu_peer_from_bytes)
        } else {
            cfg.gpu_oneshot_max_bytes
        };
        let fits = sent.is_some_and(|b| b <= limit);
        if let Some(channels) = fits.then(|| direct_blocks(op.count, es, cfg)).flatten() {
            return Choice {
                algo: Algo::OneShot,
                protocol: Protocol::LL,
                engine: Engine::DirectKernel,
                channels,
                // A slice is one message.
                chunk_elems: op.count.max(1),
                zero_copy: false,
                post_output: false,
                split: false,
                read: false,
                wait_posts: false,
                why: Why {
                    algo: "what each rank sends is within FERROCCL_GPU_ONESHOT_MAX_BYTES (FERROCCL_GPU_PEER_FROM_BYTES where the peer engine serves it)",
                    protocol: "the direct engine's flags in the data",
                    channels: "one per FERROCCL_GPU_CHANNEL_BYTES of the message",
                },
            };
        }
    }

    // Large pure data movement between symmetric windows: the copy engines copy each message
    // once, straight from input to output over the link (0 SMs; the link's full rate, 391-395
    // GB/s per direction on 2 x H200 against 367 for SM stores). The kinds whose outputs every
    // rank passes alike (`copies::zcopy_serves`), not an all-to-all in place:
    // each rank's output would take a peer's block before its own left for that peer, and with
    // no staging nothing can break that cycle (the symmetric contract makes in-place-ness the
    // same on every rank, so all ranks decide alike).
    let ce_window = reaches(bytes, cfg.gpu_ce_window_bytes) && ce_kind_floor_met(op, cfg);
    // Gather and scatter join them once the ranks have posted their outputs to each other
    // (`rendezvous_wanted`), and so do the others whose outputs lie in no symmetric window
    // (posted as mapped for their writers): `symmetric` then says that every sender can name
    // its receivers' outputs.
    if device == Device::Gpu
        && may_direct
        && op.symmetric
        && ce_window
        && copies::serves(op.kind, op.nranks)
        && (copies::zcopy_serves(op.kind, op.nranks) || rendezvous_wanted(op, device, cfg))
        && !(op.kind == CollKind::AllToAll && op.in_place)
    {
        return Choice {
            algo: Algo::OneShot,
            protocol: Protocol::Simple,
            engine: Engine::CopyEngine,
            channels: 0,
            chunk_elems: op.count.max(1),
            zero_copy: true,
            post_output: true,
            split: false,
            read: false,
            wait_posts: false,
            why: Why {
                algo: "data movement between symmetric windows from FERROCCL_GPU_CE_WINDOW_BYTES up: one copy per pair, input to output",
                protocol: "one handshake before and after, by stream memory operations",
                channels: "no thread block: copy engines",
            },
        };
    }

    // Large all-reduces and reduce-scatters between symmetric windows on 2 ranks: each rank's
    // copy engines copy the share its peer reduces straight into the peer's output, piece by
    // piece, and a fold kernel of FOLD_BLOCKS blocks reduces each piece there as it lands
    // (`copies::fold_list`): the link carries each byte once at the engines' rate, and the SMs only
    // make a local pass over HBM. Out of place only (in place the landing area is the operand).
    // The reduce of 2 ranks likewise after a rendezvous (`symmetric` then says its root posted
    // its output, out of place; a non-root's own in-place-ness means nothing, it has no output),
    // its non-root copying and its root folding.
    let fold_min = fold_min_bytes(cfg, op.kind);
    let fold_size = reaches(bytes, fold_min);
    if device == Device::Gpu
        && may_direct
        && op.symmetric
        && fold_size
        && (copies::fold_serves(op.kind, op.nranks, op.in_place)
            || copies::posted_fold_serves(op.kind, op.nranks))
        && fold_pays(op.dtype, op.redop, cfg)
    {
        return Choice {
            algo: Algo::OneShot,
            protocol: Protocol::Simple,
            engine: Engine::CopyEngine,
            channels: fold_blocks(cfg, op.kind),
            chunk_elems: (cfg.gpu_fold_piece_bytes / es).max(1),
            zero_copy: true,
            post_output: true,
            split: false,
            read: false,
            wait_posts: false,
            why: Why {
                algo: "a reduction of 2 ranks into posted outputs from FERROCCL_GPU_FOLD_MIN_BYTES (a reduce: FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES) up: the peer's share copied into the output, folded there",
                protocol: "a word per piece (pieces tapering to the end) raised by stream memory operations, polled by the fold kernel",
                channels: "the fold kernel's blocks (FERROCCL_GPU_FOLD_BLOCKS; a reduce: FERROCCL_GPU_FOLD_REDUCE_BLOCKS); copy engines move the data",
            },
        };
    }

    // Large pure data movement goes to the copy engines, leaving every SM to the user.
    let ce_slot = ce_slot_bytes(cfg, op.nranks);
    let ce_size = bytes.is_some_and(|b| b >= cfg.gpu_copy_engine_bytes);
    if device == Device::Gpu
        && may_direct
        && ce_slot > 0
        && ce_size
        && copies::serves(op.kind, op.nranks)
    {
        return Choice {
            algo: Algo::OneShot,
            protocol: Protocol::Simple,
            engine: Engine::CopyEngine,
            channels: 0,
            chunk_elems: (ce_slot / es).max(1),
            zero_copy: false,
            post_output: false,
            split: false,
            read: false,
            wait_posts: false,
            why: Why {
                algo: "data movement from FERROCCL_GPU_COPY_ENGINE_BYTES up: one message per pair by copy engines",
                protocol: "staging slots handed over by stream memory operations",
                channels: "no thread block: copy engines",
            },
        };
    }

    // Beyond it, collectives take the peer engine: rounds of one slot per block and peer,
    // two-shot for all-reduce (each element reduced once, by its owner, so every rank gets the
    // same bits), one-shot for the others.
    if device == Device::Gpu && may_direct && peer_takes(op, bytes, cfg) {
        let slot = peer_slot_bytes(cfg, op.nranks);
        let slot_elems = slot / es;
        let per = bytes
            .unwrap_or(usize::MAX)
            .div_ceil(cfg.gpu_peer_block_bytes.max(1))
            .max(1);
        let pull = peer_pulls(op, bytes, cfg);
        let channels = per.min(peer_blocks(cfg, op.nranks));
        let channels = if pull {
            channels.min(cfg.gpu_peer_pull_blocks.max(1))
        } else {
            channels
        };
        // A two-shot all-reduce round fills a slot per peer and phase (its shares, then the
        // results). Every one-shot round (every other kind, and the all-reduce on 2 ranks within
        // FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES) has one phase and fills both phases' slots of its
        // parity, which lie side by side: twice the bytes per flag, wait and acknowledgement.
        let one_crossing =
            op.nranks == 2 && bytes.is_some_and(|b| b <= cfg.gpu_peer_oneshot_max_bytes);
        let lines = !pull && one_crossing && peer_lines(op, bytes, cfg);
        let (algo, chunk_elems) = match op.kind {
            // A pull has no slots to fill: one round takes a block's whole slice.
            _ if pull => (Algo::OneShot, op.count.max(1)),
            // Lines fill the parity's two slots, a sixteenth of them flags.
            _ if lines => (Algo::OneShot, peer_line_round_elems(slot, es).max(1)),
            CollKind::AllReduce if !one_crossing => {
                (Algo::TwoShot, slot_elems.saturating_mul(op.nranks))
            }
            // FERROCCL_GPU_PEER_ROUND_BYTES: smaller rounds, at least 64 elements (a cut).
            _ if cfg.gpu_peer_round_bytes > 0 => (
                Algo::OneShot,
                (cfg.gpu_peer_round_bytes / es).clamp(64, slot_elems.saturating_mul(2).max(64)),
            ),
            _ => (Algo::OneShot, slot_elems.saturating_mul(2)),
        };
        // FERROCCL_GPU_PEER_SPLIT: one-phase rounds on a send block and a receive block a
        // slice; needs two blocks. In and out of place alike: every rank must split as its
        // peers do, and a rank's in-place-ness is its own. Where a receive block's writes land
        // on input its send block has yet to send (an all-to-all or one-shot all-reduce in
        // place), the kernel has the receive block wait for that round's send (`peer.cu`,
        // `split_in_place`).
        let wanted = cfg
            .gpu_peer_split
            .unwrap_or_else(|| peer_split_pays(op.kind, bytes, op.nranks));
        let split = wanted && !pull && !lines && algo == Algo::OneShot && channels >= 2;
        let channels = if split { channels / 2 * 2 } else { channels };
        // FERROCCL_GPU_PEER_READ: one-phase rounds (not the pull, which reads the peer's input
        // itself, nor lines) left in their senders' staging for the receivers to read.
        let read = !pull
            && !lines
            && algo == Algo::OneShot
            && cfg
                .gpu_peer_read
                .unwrap_or_else(|| !split && peer_read_pays(op, bytes));
        // Direct rounds: a sender stores straight into an output its receiver posts (a window's,
        // found at run time: nobody waits for a post), so only what moves data unreduced, and
        // only from PEER_DIRECT_MIN_BYTES: the looks cost medium sizes more than they gave.
        // A pull is the all-reduce's zero-copy: every rank reads its peer's input.
        // Between symmetric windows every receiver posts, so the senders may wait for the posts
        // at the start (FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES, a bounded wait) and go direct from
        // the first round: no copy out of the staging even in a launch of one round a block.
        let wait_posts = cfg.gpu_peer_direct
            && !pull
            && !read
            && moves_only(op.kind)
            && op.symmetric
            && may_post(op.kind, op.in_place)
            && reaches(bytes, cfg.gpu_peer_wait_posts_min_bytes);
        let zero_copy = pull
            || wait_posts
            || (cfg.gpu_peer_direct
                && !read
                && moves_only(op.kind)
                && reaches(bytes, PEER_DIRECT_MIN_BYTES));
        return Choice {
            algo,
            protocol: if lines {
                Protocol::LL128
            } else {
                Protocol::Simple
            },
            engine: Engine::PeerKernel,
            channels,
            chunk_elems,
            zero_copy,
            // Nobody stores into a puller's output: it has nothing to post.
            post_output: zero_copy && !pull && may_post(op.kind, op.in_place),
            split,
            read,
            wait_posts,
            why: Why {
                algo: if pull && op.kind == CollKind::Reduce {
                    "reduce of 2 ranks whose inputs lie in symmetric windows within FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES - FERROCCL_GPU_PEER_PULL_MAX_BYTES: the root pulls its peer's input on the peer engine"
                } else if pull {
                    "all-reduce of 2 ranks between symmetric windows within FERROCCL_GPU_PEER_PULL_MIN_BYTES - FERROCCL_GPU_PEER_PULL_MAX_BYTES: each rank pulls its peer's input on the peer engine"
                } else if algo == Algo::TwoShot {
                    "all-reduce beyond the direct engine: two-shot on the peer engine"
                } else if op.kind == CollKind::AllReduce {
                    "all-reduce on 2 ranks within FERROCCL_GPU_PEER_ONESHOT_MAX_BYTES: one-shot on the peer engine"
                } else {
                    "beyond the direct engine: one round per slot on the peer engine"
                },
                protocol: if lines {
                    "all-reduce, reduce-scatter or reduce of 2 ranks over NVLink within FERROCCL_GPU_PEER_LINES_MAX_BYTES: 128-byte lines with the round's flag in each"
                } else if read {
                    "the peer engine's flag per block and round, each round read out of its sender's staging (FERROCCL_GPU_PEER_READ)"
                } else {
                    "the peer engine's flag per block and round"
                },
                channels: if pull {
                    "one per FERROCCL_GPU_PEER_BLOCK_BYTES (8 KiB) of the largest buffer, up to FERROCCL_GPU_PEER_PULL_BLOCKS (32) and the blocks the staging is cut for: a pull fills no slots"
                } else if split {
                    "one per FERROCCL_GPU_PEER_BLOCK_BYTES (8 KiB) of the largest buffer, up to the blocks its staging is cut for (FERROCCL_GPU_PEER_BLOCKS), half sending and half receiving (FERROCCL_GPU_PEER_SPLIT)"
                } else {
                    "one per FERROCCL_GPU_PEER_BLOCK_BYTES (8 KiB) of the largest buffer, up to the blocks its staging is cut for (FERROCCL_GPU_PEER_BLOCKS: 64 on 2 ranks, 32 beyond)"
                },
            },
        };
    }

    // Two shots beat the ring's 2(n-1) hops when latency is all there is; a share must be one
    // message, so that every rank can send all of them before receiving any.
    let two_shot_fits = op.kind == CollKind::AllReduce && op.nranks >= 3 && op.count <= chunk_elems;
    let (algo, why_algo) = match device {
        // Proven by the simulator and checked on the host backend, and on a GPU with 3 ranks
        // sharing it, but not yet on 3 or more GPUs (no such machine was lent since it landed):
        // GPUs keep the ring unless FERROCCL_GPU_TWO_SHOT asks for it, as the check there will.
        Device::Gpu if two_shot_fits && cfg.gpu_two_shot => (
            Algo::TwoShot,
            "all-reduce on 3+ ranks within a chunk (FERROCCL_GPU_TWO_SHOT)",
        ),
        Device::Gpu if two_shot_fits => (
            Algo::Ring,
            "two-shot not yet checked on 3+ GPUs (FERROCCL_GPU_TWO_SHOT=1 takes it)",
        ),
        // On the host a rank reduces what it receives in arrival order, own data first, so
        // reductions go one-shot only where that order cannot differ between ranks (2 ranks).
        Device::Host if one_shot_here && (op.nranks == 2 || !op.kind.reduces()) => (
            Algo::OneShot,
            "one round of messages within FERROCCL_DIRECT_MAX_BYTES",
        ),
        Device::Host if two_shot_fits && op.count <= cfg.direct_max_bytes / es => (
            Algo::TwoShot,
            "all-reduce within FERROCCL_DIRECT_MAX_BYTES on 3+ ranks",
        ),
        _ => (Algo::default_for(op.kind), "the default for the operation"),
    };
    let (coll_max, p2p_max) = channel_budget(device, cfg, op.nranks);
    let max = if p2p { p2p_max } else { coll_max };
    let (channels, why_channels) = match device {
        // The host executor polls every lane from one thread: channels only add lanes.
        Device::Host => (
            max,
            if p2p {
                "one lane per peer direction on the host"
            } else {
                "FERROCCL_CHANNELS"
            },
        ),
        // A block per channel: as many as the bytes can keep busy (FERROCCL_GPU_CHANNEL_BYTES
        // each), up to the budget. Launching idle blocks costs launch and exit time.
        Device::Gpu => {
            let per = cfg.gpu_channel_bytes.max(1);
            let want = bytes.map_or(max, |b| b.div_ceil(per).max(1));
            if want >= max {
                (max, "the budget: FERROCCL_GPU_CHANNELS (send/recv: FERROCCL_GPU_P2P_CHANNELS, fewer with many ranks)")
            } else {
                (
                    want,
                    "one per FERROCCL_GPU_CHANNEL_BYTES of the largest buffer",
                )
            }
        }
    };

    let (protocol, why_protocol) = match (device, bytes) {
        // Sends and receives: each channel's share is its own message, which runs on its own
        // send and receive blocks, so only the share must fit a connection whole.
        (Device::Gpu, Some(b)) if p2p && p2p_ll_fits(b, largest_slice(op.count, channels) * es, cfg) => {
            (Protocol::LL, "within FERROCCL_LL_MAX_BYTES, each channel's share within its connection's LL slots")
        }
        (Device::Gpu, Some(b)) if !p2p && b <= ll_limit(cfg) => (Protocol::LL, "within the LL limit"),
        (Device::Gpu, _) => (Protocol::Simple, "beyond the LL limit"),
        (Device::Host, _) => (Protocol::Simple, "the host moves slots"),
    };

    let engine = match device {
        Device::Host => Engine::HostExecutor,
        Device::Gpu => Engine::PlanKernel,
    };
    // LL messages carry flags in the data, so they cannot land in a plain output buffer. Sends
    // and receives stay staged: zero-copy made them slower at every size on 2 x H200 (the
    // receiver's post and the sender's wait for it on top of the stores, and the plan kernel in
    // place of the point-to-point form: sendrecv 128 KiB 13.1 against 7.6 us in CUDA graphs,
    // 2 GiB 325 against 341 GB/s; docs/PERFORMANCE.md, section 20).
    let zero_copy = device == Device::Gpu && op.windows && protocol == Protocol::Simple && !p2p;
    Choice {
        algo,
        protocol,
        engine,
        channels,
        chunk_elems,
        zero_copy,
        post_output: zero_copy && may_post(op.kind, op.in_place),
        split: false,
        read: false,
        wait_posts: false,
        why: Why {
            algo: why_algo,
            protocol: why_protocol,
            channels: why_channels,
        },
    }
}

/// What one engine costs, for [`estimate_us`]: a fixed time per launch, a time per dependent
/// hop (a message that must arrive before the next is sent), and the bus bandwidth it reaches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// Microseconds per launch.
    pub launch_us: f64,
    /// Microseconds per dependent hop.
    pub hop_us: f64,
    /// Bytes per microsecond (= MB/s; 1 GB/s is 1,000).
    pub bytes_per_us: f64,
}

/// The engines' costs. GPU figures: 2 x H200 (NV18) at f601ac8
/// (`bench/results/h200x2-2026-11-23-s4-f601ac8-final`): the direct engine's 8 B all-reduce
/// takes 4.2 us and 128 KiB 7.8 us; the plan kernel's hop is about a microsecond, its LL
/// carries about 40 GB/s and Simple reaches 260-330 GB/s bus bandwidth at 2 GiB. Host
/// figures: shared memory between 2 threads on the 2-core CI machine (`ferroccl bench
/// all-reduce --ranks 2 -b 8 -e 64M -f 8`): 1-2 us at 8 B, 5-20 GB/s from 256 KiB up.
pub fn cost(engine: Engine, protocol: Protocol) -> Cost {
    match (engine, protocol) {
        // The link's copy-engine rate on 2 x H200 (../shared/ANCHORS.md); a few memory
        // operations per piece. Not yet measured as an engine there.
        (Engine::CopyEngine, _) => Cost {
            launch_us: 8.0,
            hop_us: 0.0,
            bytes_per_us: 380_000.0,
        },
        (Engine::DirectKernel, _) => Cost {
            launch_us: 4.0,
            hop_us: 0.0,
            bytes_per_us: 40_000.0,
        },
        // Not yet measured over NVLink: the plan kernel's figures until it is.
        (Engine::PeerKernel, _) => Cost {
            launch_us: 5.0,
            hop_us: 1.5,
            bytes_per_us: 260_000.0,
        },
        (Engine::PlanKernel, Protocol::LL | Protocol::LL128) => Cost {
            launch_us: 5.0,
            hop_us: 1.0,
            bytes_per_us: 40_000.0,
        },
        (Engine::PlanKernel, Protocol::Simple) => Cost {
            launch_us: 6.0,
            hop_us: 1.5,
            bytes_per_us: 260_000.0,
        },
        (Engine::HostExecutor, _) => Cost {
            launch_us: 1.0,
            hop_us: 0.5,
            bytes_per_us: 8_000.0,
        },
    }
}

/// Dependent hops and bytes each rank sends, for `op` run by `algo`: what the alpha-beta
/// estimate charges. None when the sizes overflow.
pub fn traffic(op: &OpShape, algo: Algo) -> Option<(usize, usize)> {
    use CollKind::*;
    let n = op.nranks.max(1);
    let block = op.count.checked_mul(op.dtype.size())?;
    if n == 1 {
        return Some((0, 0));
    }
    let peers = n - 1;
    // NCCL's bus-bandwidth conventions: what crosses a rank's link for the operation.
    Some(match (algo, op.kind) {
        (Algo::OneShot, _) => (1, block.checked_mul(peers)?),
        (Algo::TwoShot, _) => (2, (block / n).checked_mul(2 * peers)?),
        (_, AllReduce) => (2 * peers, (block / n).checked_mul(2 * peers)?),
        (_, AllGather | ReduceScatter | AllToAll) => (peers, block.checked_mul(peers)?),
        // Pipelined down the chain: every rank but the last forwards the whole buffer.
        (_, Broadcast | Reduce) => (peers, block),
        (_, Gather | Scatter) => (1, block.checked_mul(peers)?),
        (_, Send | Recv) => (1, block),
    })
}

/// A rough time for `op` run as `choice` says, in microseconds: the engine's launch cost, its
/// hop latency times the dependent hops, and the bytes each rank sends at the engine's bus
/// bandwidth over the channels' share of it. For `ncclGroupSimulateEnd` and the debug log:
/// no decision is taken from it.
pub fn estimate_us(op: &OpShape, choice: &Choice) -> f64 {
    let c = cost(choice.engine, choice.protocol);
    let Some((hops, bytes)) = traffic(op, choice.algo) else {
        return f64::INFINITY;
    };
    c.launch_us + hops as f64 * c.hop_us + bytes as f64 / c.bytes_per_us
}

/// The time of a launch of `ops`, which run one after the other within it.
pub fn estimate_launch_us(ops: &[OpShape], device: Device, cfg: &Config) -> f64 {
    let choices = choose_launch(ops, device, cfg);
    ops.iter()
        .zip(&choices)
        .map(|(op, c)| estimate_us(op, c))
        .sum()
}

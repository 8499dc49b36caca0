//! A [`Plan`] as the tables the plan-execution kernel reads (`kernels/types.cuh`).
//!
//! The kernel trusts these tables for addresses, so [`encode`] is where a plan is checked
//! against its buffers and connections: it is pure (no CUDA), and everything it accepts is safe
//! to launch. The kernel re-checks indices and roles cheaply and reports an `FC_ERR_PLAN` record
//! instead of touching memory when they are off, in case tables and conns come from different
//! launches.
//!
//! The step table depends only on the plan and the connection numbering; buffer addresses live
//! in the op table, which a launch carries inline in its parameter (up to [`INLINE_OPS`]
//! operations). So uploaded steps and lanes serve every call of the same operation shape, and a
//! call on new buffers costs no upload at all.

use ferroccl_core::numeric::{Element, F8E4M3, F8E5M2};
use ferroccl_core::plan::zcopy::{posts_of_run, run_starts, step_ops, waits_of_run, RemoteDsts};
use ferroccl_core::plan::{BufKind, ConnKey, Dir, Plan, Region, Step};
use ferroccl_core::{DataType, Error, Rank, ReduceOp};
use half::{bf16, f16};

pub(crate) use ferroccl_core::tune::LL_DATA_BYTES;

pub(crate) const STEP_SEND: u32 = 0;
pub(crate) const STEP_RECV: u32 = 1;
pub(crate) const STEP_RECV_REDUCE: u32 = 2;
pub(crate) const STEP_RECV_COPY: u32 = 3;
pub(crate) const STEP_COPY: u32 = 4;
/// Zero-copy: the receiving lane tells the sender (recv_conn's peer) where its output is, as
/// that peer maps it (`src_off`, 0 = not this time: use the FIFO) and how long (`count` bytes).
pub(crate) const STEP_POST: u32 = 5;

pub(crate) const FLAG_PRE: u32 = 1;
pub(crate) const FLAG_POST: u32 = 2;
pub(crate) const FLAG_PRE_LOCAL: u32 = 4;
pub(crate) const FLAG_HAS_DST: u32 = 8;
pub(crate) const FLAG_HAS_TO: u32 = 16;
/// The step's messages travel in the LL format (see `fifo.cuh`); set on every step of an op.
pub(crate) const FLAG_LL: u32 = 32;
/// Zero-copy: the step's message may be written at element `rdst_off` of the receiver's output,
/// when the receiver posted one.
pub(crate) const FLAG_RDST: u32 = 64;
/// Zero-copy: the first send of the lane's run of this op on send_conn: wait for the peer's
/// post of that run before the first message.
pub(crate) const FLAG_WAIT_POST: u32 = 128;
/// In `lens`: the message went straight into the receiver's output (zero-copy).
#[cfg_attr(not(test), allow(dead_code))] // the kernel writes and reads it
pub(crate) const LEN_DIRECT: u32 = 1 << 31;

pub(crate) const BUF_INPUT: u32 = 0;
pub(crate) const BUF_OUTPUT: u32 = 1;

pub(crate) const CONN_SEND: u32 = 0;
pub(crate) const CONN_RECV: u32 = 1;

/// `FcError::code` values.
pub(crate) const ERR_ABORTED: u32 = 1;
pub(crate) const ERR_TIMEOUT: u32 = 2;
pub(crate) const ERR_LENGTH: u32 = 3;
#[allow(dead_code)] // named for readers of error records; the kernel writes it
pub(crate) const ERR_PLAN: u32 = 4;

/// `FcError::what` values.
pub(crate) const WHAT_DATA: u32 = 1;
pub(crate) const WHAT_ROOM: u32 = 2;
pub(crate) const WHAT_LENGTH: u32 = 3;
#[allow(dead_code)] // as ERR_PLAN
pub(crate) const WHAT_PLAN: u32 = 4;
pub(crate) const WHAT_POST: u32 = 5;
/// A split launch in place: the receive block waits for its own send block (`peer.cu`).
pub(crate) const WHAT_SENT: u32 = 6;

/// Operations a launch carries in its parameter (`FC_INLINE_OPS`); larger groups put their op
/// table on the device.
pub(crate) const INLINE_OPS: usize = 8;

/// The kernel's only parameter, passed by value. Addresses are device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FcLaunch {
    pub steps: u64,
    pub lanes: u64,
    /// The op table when `nops > INLINE_OPS`, else 0 (`inline_ops` holds them).
    pub ops: u64,
    pub conns: u64,
    /// An `int`, non-zero = abort; may be host-mapped memory. 0 = no abort word.
    pub abort: u64,
    /// An [`FcError`] in device memory (the kernel uses atomicCAS on it). Required.
    pub error: u64,
    /// Longest time one wait may go without progress; 0 = forever.
    pub timeout_ns: u64,
    pub nlanes: u32,
    pub rank: u32,
    pub nsteps: u32,
    pub nops: u32,
    pub nconns: u32,
    pub reserved: u32,
    pub inline_ops: [FcOp; INLINE_OPS],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FcLane {
    pub first_step: u32,
    pub nsteps: u32,
}

/// One [`Step`]. Regions are (buffer, element offset) of `op`, all `count` elements long.
/// Send: src. Recv: dst. RecvReduce: src = local, dst when HAS_DST. RecvCopy: dst when HAS_DST.
/// Copy: src and dst. Unused fields are zero, unused connections -1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FcStep {
    pub kind: u32,
    pub flags: u32,
    pub recv_conn: i32,
    pub send_conn: i32,
    pub op: u32,
    pub src_buf: u32,
    pub src_off: u64,
    pub dst_buf: u32,
    /// The operation whose buffer `dst` is: `op` but for a copy from a send to oneself into
    /// the matching receive (two operations of one group).
    pub dst_op: u32,
    pub dst_off: u64,
    pub count: u64,
    /// FLAG_RDST: where the message lands in the receiver's output (elements).
    pub rdst_off: u64,
}

/// One operation: buffers and arithmetic. The PreMulSum scalar is stored already converted to
/// the element type, exactly as the host `Reducer` converts it, so both backends multiply by the
/// same number: `scalar_f64` for float types (exact in the type), `scalar_i64` for integers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FcOp {
    pub send: u64,
    pub recv: u64,
    pub dtype: u32,
    pub redop: u32,
    pub scalar_f64: f64,
    pub scalar_i64: i64,
    pub nranks: u32,
    pub elem_size: u32,
    /// Device address of a PreMulSum scalar of the op's type, read when the op runs (NCCL's
    /// `ncclScalarDevice`), else 0 and the scalar fields hold it.
    pub scalar_dev: u64,
}

/// One end of a slot FIFO as this GPU addresses it (see `types.cuh` for the protocol).
/// `dir == CONN_RECV`: data, lens, head are local, tail is the sender's (peer-mapped), counter =
/// slots consumed. `dir == CONN_SEND`: data, lens, head are the receiver's (peer-mapped), tail is
/// local, counter = slots produced. The counter words persist between launches; all words
/// start at zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FcConn {
    pub data: u64,
    pub lens: u64,
    pub head: u64,
    pub tail: u64,
    pub counter: u64,
    pub slots: u32,
    pub slot_bytes: u32,
    pub peer: u32,
    pub dir: u32,
    /// The LL slots (`slots` of `2 * LL_DATA_BYTES`), apart from the data slots: a stale
    /// simple-protocol payload must never pass for an LL flag.
    pub ll: u64,
    /// Zero-copy post words {run's first message + 1, output address, bytes}: in the sender's
    /// memory, written by the receiver (STEP_POST), read by the sender (FLAG_WAIT_POST/RDST).
    pub post: u64,
}

/// The direct kernel's only parameter (`direct.cu`): the communicator's slots, acks and epochs
/// (filled once), and one operation. Addresses are device addresses as this GPU maps them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FcDirect {
    /// Rank q's receive slots.
    pub slots: [u64; DIRECT_MAX_RANKS],
    /// Rank q's ack words.
    pub acks: [u64; DIRECT_MAX_RANKS],
    /// This rank's epoch word per block.
    pub epochs: u64,
    pub abort: u64,
    pub error: u64,
    pub timeout_ns: u64,
    /// Elements of the per-rank block (the operation's NCCL count).
    pub count: u64,
    /// `kind_code` of the operation.
    pub kind: u32,
    pub rank: u32,
    pub nranks: u32,
    pub root: u32,
    pub nblocks: u32,
    pub reserved: u32,
    pub op: FcOp,
}

pub(crate) use ferroccl_core::tune::{
    DIRECT_MAX_BLOCKS, DIRECT_MAX_RANKS, DIRECT_SLOT_BYTES, PEER_MAX_BLOCKS, PEER_MAX_RANKS,
};

/// The peer kernel's only parameter (`kernels/peer.cu`): the communicator's staging, flag lines and
/// round counters (filled once), and one operation with its cut. Addresses are device
/// addresses as this GPU maps them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FcPeer {
    /// Rank q's staging slots.
    pub stage: [u64; PEER_MAX_RANKS],
    /// Rank q's flag lines.
    pub flags: [u64; PEER_MAX_RANKS],
    /// This rank's round counter per block.
    pub seqs: u64,
    pub abort: u64,
    pub error: u64,
    pub timeout_ns: u64,
    /// Elements of the per-rank block (the operation's NCCL count).
    pub count: u64,
    /// Elements of one round of a block (the tuner's chunk).
    pub chunk: u64,
    /// Bytes of one staging slot.
    pub slot_bytes: u64,
    /// `kind_code` of the operation.
    pub kind: u32,
    pub rank: u32,
    pub nranks: u32,
    pub nblocks: u32,
    /// Rooted operations' root.
    pub root: u32,
    /// 1: an all-reduce on 2 ranks in one crossing (the tuner's `Algo::OneShot`); 0: two-shot.
    pub oneshot: u32,
    /// Blocks the staging is cut for (`tune::peer_blocks`): the stride of the slots' block index,
    /// and the most blocks a launch may run.
    pub blocks: u32,
    /// 1: the grid's first half sends and its second half receives, a slice on two blocks
    /// (the tuner's `Choice::split`).
    pub split: u32,
    pub op: FcOp,
    /// Where rank q may store straight into this rank's output (q's mapping of the output's
    /// base; 0: it may not): posted to q at the launch's start when `post` is 1.
    pub views: [u64; PEER_MAX_RANKS],
    /// 1: senders look for their receivers' posts and store straight into the outputs posted
    /// (the tuner's `Choice::zero_copy`; movement kinds only).
    pub direct: u32,
    /// 1: this rank posts `views` (the tuner's `Choice::post_output`, and a view to post).
    pub post: u32,
    /// Where the receiving kernels count the direct rounds they got (a diagnostic).
    pub stats: u64,
    /// A pull (2 ranks; an all-reduce, or a reduce, whose root alone reads): the peer's input as
    /// this GPU maps it (its symmetric window); 0: the staged rounds.
    pub pull: u64,
    /// An all-reduce on 2 ranks in line rounds (`Protocol::LL128`): the salt its flags are mixed
    /// with (from the communicator's id, never 0), so that no earlier data in the slots passes
    /// for a flag; 0: the staged rounds.
    pub lines: u64,
    /// 1: read rounds (the tuner's `Choice::read`): each message lies in its sender's own
    /// staging and its receiver reads it over the link; 0: the sender stores it into the
    /// receiver's.
    pub read: u32,
    pub reserved: u32,
}

/// The fold kernel's only parameter (`kernels/peer.cu`, `ferroccl_fold_*`): a copy-and-fold
/// reduction's local half (`plan::lanes::fold_schedule`). Addresses are device addresses as this
/// GPU maps them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FcFold {
    /// The piece word of each copy lane in this rank's GPU memory (`CeFabric::fold`).
    pub words: [u64; CE_LANES],
    /// This rank's own operand.
    pub mine: u64,
    /// The output, where the peer's copy lands and the result goes.
    pub out: u64,
    /// Elements to fold.
    pub count: u64,
    /// Pieces (`plan::lanes::fold_pieces`), at most `FOLD_MAX_PIECES`: the first `pieces` of
    /// `ends`.
    pub pieces: u64,
    pub abort: u64,
    pub error: u64,
    pub timeout_ns: u64,
    pub rank: u32,
    pub nblocks: u32,
    /// The operation's type and reduction (its buffers are `mine` and `out`).
    pub op: FcOp,
    /// Where each piece ends, in elements from the start (the last: `count`).
    pub ends: [u64; FOLD_MAX_PIECES],
}

pub(crate) use ferroccl_core::plan::copies::{CE_LANES, FOLD_MAX_PIECES};

/// Steps the point-to-point kernel's parameter holds (`FC_P2P_MAX_STEPS`): launches with more
/// stay on the plan kernel.
pub(crate) const P2P_MAX_STEPS: usize = 64;

/// Threads per block of the point-to-point kernel (`FC_P2P_THREADS`): the plan kernel's, whose
/// copy loop its simple-protocol steps use.
pub(crate) const P2P_THREADS: u32 = 512;

/// A point-to-point kernel step that copies locally (`FC_P2P_COPY`): a send to oneself.
pub(crate) const P2P_COPY: u8 = 2;

/// One message of the point-to-point kernel (`p2p.cuh`): a plan step (or a lane's run of them)
/// with its connection's addresses and this call's buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FcP2pStep {
    /// The connection's slots (LL or data, as `ll` says), the receiver's memory as this GPU
    /// maps it; a copy: its destination.
    pub base: u64,
    /// Send: this rank's tail word; receive: the sender's.
    pub tail: u64,
    /// This rank's counter word of the connection.
    pub counter: u64,
    /// Send, copy: the message's first byte; receive: where it goes.
    pub buf: u64,
    pub bytes: u32,
    /// Bytes per slot: the plan kernel's piece.
    pub piece: u32,
    pub slots: u32,
    pub conn: i32,
    pub peer: u32,
    /// The block that runs it.
    pub block: u16,
    /// `CONN_SEND`, `CONN_RECV` or [`P2P_COPY`].
    pub dir: u8,
    /// 1: the LL protocol; 0: the simple one.
    pub ll: u8,
}

/// Steps of the point-to-point kernel's small parameter (`FC_P2P_SMALL_STEPS`): a launch of
/// this many LL steps or fewer takes `ferroccl_p2p` (0.7 KB of parameter, no simple
/// protocol), any other `ferroccl_p2p_wide` (3.6 KB).
pub(crate) const P2P_SMALL_STEPS: usize = 12;

/// The point-to-point kernel's only parameter, with room for `N` steps.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FcP2pN<const N: usize> {
    pub conns: u64,
    pub abort: u64,
    pub error: u64,
    pub timeout_ns: u64,
    pub rank: u32,
    pub nsteps: u32,
    pub steps: [FcP2pStep; N],
}

impl<const N: usize> Default for FcP2pN<N> {
    fn default() -> Self {
        FcP2pN {
            conns: 0,
            abort: 0,
            error: 0,
            timeout_ns: 0,
            rank: 0,
            nsteps: 0,
            steps: [FcP2pStep::default(); N],
        }
    }
}

/// `ferroccl_p2p_wide`'s parameter.
pub(crate) type FcP2p = FcP2pN<P2P_MAX_STEPS>;
/// The parameter's part a communicator fills once (its table and status words), no steps.
pub(crate) type FcP2pHead = FcP2pN<0>;
/// `ferroccl_p2p`'s parameter.
pub(crate) type FcP2pSmall = FcP2pN<P2P_SMALL_STEPS>;

/// Flag lines per block and sender in the peer engine (`FC_PEER_PHASES`): inputs, results,
/// acknowledgements.
pub(crate) const PEER_PHASES: usize = 3;

/// Threads per block of the peer kernel (`FC_PEER_THREADS`): the plan kernel's, whose module
/// and copy and reduce loops it shares.
pub(crate) const PEER_THREADS: u32 = 512;

/// Threads per block of the direct kernel (`FC_DIRECT_THREADS`).
pub(crate) const DIRECT_THREADS: u32 = 256;

/// `FC_KIND_*`: a collective in declaration order (the direct kernel serves collectives only).
pub(crate) fn kind_code(kind: ferroccl_core::CollKind) -> Option<u32> {
    ferroccl_core::CollKind::COLLECTIVES
        .iter()
        .position(|&k| k == kind)
        .map(|i| i as u32)
}

/// What the kernel reports when a lane fails; `code != 0` means the record is complete.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FcError {
    pub claimed: u32,
    pub code: u32,
    pub lane: u32,
    /// Index of the step within its lane.
    pub step: u32,
    /// Peer of `conn`, u32::MAX when none.
    pub peer: u32,
    pub what: u32,
    pub conn: i32,
    pub rank: u32,
    /// Length check: the bytes expected; timeout: the timeout.
    pub expected: u64,
    /// Length check: the bytes received; timeout: how long the wait lasted.
    pub got: u64,
    /// One-kernel engines: the flag value (round, epoch) the wait was for.
    pub wanted: u64,
    /// One-kernel engines: the value last read there.
    pub seen: u64,
}

macro_rules! layout {
    ($($t:ident: $size:literal { $($f:ident @ $off:literal),* $(,)? })*) => {
        $(
            const _: () = assert!(std::mem::size_of::<$t>() == $size);
            $( const _: () = assert!(std::mem::offset_of!($t, $f) == $off); )*
        )*
        /// (struct, field or "" for the size, bytes) for every pinned number, so a test can
        /// compare them with the FC_CHECK_* lines of types.cuh.
        #[cfg(test)]
        pub(crate) const LAYOUT: &[(&str, &str, usize)] = &[
            $( (stringify!($t), "", $size), $( (stringify!($t), stringify!($f), $off), )* )*
        ];
    };
}

layout! {
    FcLaunch: 528 { steps @ 0, lanes @ 8, ops @ 16, conns @ 24, abort @ 32, error @ 40, timeout_ns @ 48,
                   nlanes @ 56, rank @ 60, nsteps @ 64, nops @ 68, nconns @ 72, reserved @ 76, inline_ops @ 80 }
    FcLane: 8 { first_step @ 0, nsteps @ 4 }
    FcStep: 64 { kind @ 0, flags @ 4, recv_conn @ 8, send_conn @ 12, op @ 16, src_buf @ 20, src_off @ 24,
                 dst_buf @ 32, dst_op @ 36, dst_off @ 40, count @ 48, rdst_off @ 56 }
    FcOp: 56 { send @ 0, recv @ 8, dtype @ 16, redop @ 20, scalar_f64 @ 24, scalar_i64 @ 32, nranks @ 40,
               elem_size @ 44, scalar_dev @ 48 }
    FcConn: 72 { data @ 0, lens @ 8, head @ 16, tail @ 24, counter @ 32, slots @ 40, slot_bytes @ 44, peer @ 48,
                 dir @ 52, ll @ 56, post @ 64 }
    FcError: 64 { claimed @ 0, code @ 4, lane @ 8, step @ 12, peer @ 16, what @ 20, conn @ 24, rank @ 28,
                  expected @ 32, got @ 40, wanted @ 48, seen @ 56 }
    FcDirect: 376 { slots @ 0, acks @ 128, epochs @ 256, abort @ 264, error @ 272, timeout_ns @ 280, count @ 288,
                    kind @ 296, rank @ 300, nranks @ 304, root @ 308, nblocks @ 312, reserved @ 316, op @ 320 }
    FcPeer: 568 { stage @ 0, flags @ 128, seqs @ 256, abort @ 264, error @ 272, timeout_ns @ 280, count @ 288,
                  chunk @ 296, slot_bytes @ 304, kind @ 312, rank @ 316, nranks @ 320, nblocks @ 324, root @ 328,
                  oneshot @ 332, blocks @ 336, split @ 340, op @ 344, views @ 400, direct @ 528, post @ 532, stats @ 536,
                  pull @ 544, lines @ 552, read @ 560 }
    FcFold: 392 { words @ 0, mine @ 16, out @ 24, count @ 32, pieces @ 40, abort @ 48, error @ 56, timeout_ns @ 64,
                  rank @ 72, nblocks @ 76, op @ 80, ends @ 136 }
    FcP2pStep: 56 { base @ 0, tail @ 8, counter @ 16, buf @ 24, bytes @ 32, piece @ 36, slots @ 40, conn @ 44,
                    peer @ 48, block @ 52, dir @ 54, ll @ 55 }
    FcP2p: 3624 { conns @ 0, abort @ 8, error @ 16, timeout_ns @ 24, rank @ 32, nsteps @ 36, steps @ 40 }
    FcP2pSmall: 712 { steps @ 40 }
}

/// One operation of a launch as the device sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OpDesc {
    /// Device address of the input buffer (0 only when it has no elements).
    pub send: u64,
    /// Device address of the output buffer (0 only when it has no elements).
    pub recv: u64,
    /// Elements of the input and output buffers, to check every region against.
    pub send_count: usize,
    pub recv_count: usize,
    pub dtype: DataType,
    pub op: ReduceOp,
    /// Device address of the PreMulSum scalar when it lives on the GPU (0: `op` carries it).
    pub scalar_dev: u64,
    /// The tuner's choice: messages of this op use the LL protocol (every rank decides alike).
    pub ll: bool,
    /// The tuner's choice: the op takes part in the zero-copy handshake (posts and waits).
    pub zero_copy: bool,
    /// The tuner's choice: this rank may post its output to its senders.
    pub post_output: bool,
}

/// The tables of one launch, ready to upload.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Encoded {
    pub lanes: Vec<FcLane>,
    pub steps: Vec<FcStep>,
    pub ops: Vec<FcOp>,
    pub rank: u32,
}

/// Where a launch's tables were put on the device, and the communicator's words.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DeviceTables {
    pub steps: u64,
    pub lanes: u64,
    pub nsteps: u32,
    pub nlanes: u32,
    /// The op table, for launches of more than [`INLINE_OPS`] operations (else 0).
    pub ops: u64,
    pub conns: u64,
    pub nconns: u32,
    pub abort: u64,
    pub error: u64,
    pub timeout_ns: u64,
    pub rank: u32,
}

impl FcLaunch {
    /// The kernel parameter for the tables at `at` and this call's `ops`, carried inline when
    /// they fit (else `at.ops` must hold them); the grid is `at.nlanes` blocks.
    pub fn new(at: &DeviceTables, ops: &[FcOp]) -> FcLaunch {
        let mut inline_ops = [FcOp::default(); INLINE_OPS];
        if ops.len() <= INLINE_OPS {
            inline_ops[..ops.len()].copy_from_slice(ops);
        }
        FcLaunch {
            steps: at.steps,
            lanes: at.lanes,
            ops: if ops.len() <= INLINE_OPS { 0 } else { at.ops },
            conns: at.conns,
            abort: at.abort,
            error: at.error,
            timeout_ns: at.timeout_ns,
            nlanes: at.nlanes,
            rank: at.rank,
            nsteps: at.nsteps,
            nops: ops.len() as u32,
            nconns: at.nconns,
            reserved: 0,
            inline_ops,
        }
    }
}

fn redop_code(op: ReduceOp) -> u32 {
    op.nccl_id() as u32
}

fn rounded<T: Element>(s: f64) -> f64 {
    T::from_f64(s).to_f64()
}

/// The PreMulSum scalar in the element type, as (float value, integer value).
fn scalar_of(dtype: DataType, op: ReduceOp) -> (f64, i64) {
    let ReduceOp::PreMulSum(s) = op else {
        return (0.0, 0);
    };
    match dtype {
        DataType::Int8 => (0.0, i8::from_f64(s) as i64),
        DataType::Uint8 => (0.0, u8::from_f64(s) as i64),
        DataType::Int32 => (0.0, i32::from_f64(s) as i64),
        DataType::Uint32 => (0.0, u32::from_f64(s) as i64),
        DataType::Int64 => (0.0, i64::from_f64(s)),
        DataType::Uint64 => (0.0, u64::from_f64(s) as i64),
        DataType::Float16 => (rounded::<f16>(s), 0),
        DataType::Float32 => (rounded::<f32>(s), 0),
        DataType::Float64 => (s, 0),
        DataType::Bfloat16 => (rounded::<bf16>(s), 0),
        DataType::Float8E4M3 => (rounded::<F8E4M3>(s), 0),
        DataType::Float8E5M2 => (rounded::<F8E5M2>(s), 0),
    }
}

fn to_u32(v: usize, what: &str) -> Result<u32, Error> {
    u32::try_from(v).map_err(|_| {
        Error::InvalidArgument(format!(
            "{what} {v} does not fit the kernel's 32-bit tables"
        ))
    })
}

/// The optional store and forward of a receive step.
fn set_dst_to(s: &mut FcStep, dst: Option<Region>, forwards: bool) {
    if let Some(d) = dst {
        s.flags |= FLAG_HAS_DST;
        s.dst_buf = buf_code(d.buf);
        s.dst_off = d.offset as u64;
    }
    if forwards {
        s.flags |= FLAG_HAS_TO;
    }
}

fn buf_code(b: BufKind) -> u32 {
    match b {
        BufKind::Input => BUF_INPUT,
        BufKind::Output => BUF_OUTPUT,
    }
}

/// Operation `i` of a launch as the kernel reads it, after checking what the kernel would trust:
/// the reduction for the type, no null buffer with elements, nothing wrapping the address space,
/// a device scalar aligned and only for a pre-mul-sum.
pub(crate) fn fc_op(i: usize, o: &OpDesc, nranks: u32) -> Result<FcOp, Error> {
    o.op.validate(o.dtype)
        .map_err(|e| e.context(format!("operation {i}")))?;
    let es = o.dtype.size();
    for (what, addr, count) in [
        ("input", o.send, o.send_count),
        ("output", o.recv, o.recv_count),
    ] {
        let bytes = count
            .checked_mul(es)
            .and_then(|b| u64::try_from(b).ok())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "operation {i}: {what} of {count} elements overflows"
                ))
            })?;
        if count > 0 && addr == 0 {
            return Err(Error::InvalidArgument(format!(
                "operation {i}: null {what} buffer of {count} elements"
            )));
        }
        if addr.checked_add(bytes).is_none() {
            return Err(Error::InvalidArgument(format!(
                "operation {i}: {what} buffer wraps the address space"
            )));
        }
    }
    if o.scalar_dev != 0
        && (!matches!(o.op, ReduceOp::PreMulSum(_)) || !o.scalar_dev.is_multiple_of(es as u64))
    {
        return Err(Error::InvalidArgument(format!(
            "operation {i}: a device scalar ({:#x}) needs a pre-mul-sum and {es}-byte alignment for {}",
            o.scalar_dev, o.dtype
        )));
    }
    let (scalar_f64, scalar_i64) = scalar_of(o.dtype, o.op);
    Ok(FcOp {
        send: o.send,
        recv: o.recv,
        dtype: o.dtype.nccl_id() as u32,
        redop: redop_code(o.op),
        scalar_f64,
        scalar_i64,
        nranks,
        elem_size: es as u32,
        scalar_dev: o.scalar_dev,
    })
}

/// What zero-copy needs from the runtime for one launch (`plan/zcopy.rs`).
pub(crate) struct ZeroCopy<'a> {
    /// Per lane, per step of the plan: where the message lands in the receiver's output.
    pub remote: &'a RemoteDsts,
    /// (address, bytes) of operation `op`'s output as `peer` maps it; address 0 when this rank
    /// does not post it (not in a registered window, or not `post_output`).
    pub post: &'a dyn Fn(usize, Rank) -> (u64, u64),
}

/// Encodes `plan` for the kernel. `ops[i]` is operation `i` of the plan's regions;
/// `conn_index` numbers the connections (the index into the launch's `FcConn` table) and returns
/// None for one that was never set up, which is an error here rather than a hang on the device.
pub(crate) fn encode(
    plan: &Plan,
    ops: &[OpDesc],
    conn_index: impl Fn(ConnKey) -> Option<u32>,
    zc: Option<&ZeroCopy<'_>>,
) -> Result<Encoded, Error> {
    if let Some(z) = zc {
        let shape_ok = z.remote.len() == plan.lanes.len()
            && z.remote
                .iter()
                .zip(&plan.lanes)
                .all(|(m, l)| m.len() == l.steps.len());
        if !shape_ok {
            return Err(Error::Internal(
                "zero-copy marks do not have the plan's shape".into(),
            ));
        }
    }
    let nranks = to_u32(plan.nranks, "rank count")?;
    if nranks == 0 {
        return Err(Error::InvalidArgument(
            "a plan for a communicator of 0 ranks".into(),
        ));
    }
    let sizes: Vec<(usize, usize)> = ops.iter().map(|o| (o.send_count, o.recv_count)).collect();
    plan.validate(&sizes).map_err(Error::Internal)?;

    let fc_ops = ops
        .iter()
        .enumerate()
        .map(|(i, o)| fc_op(i, o, nranks))
        .collect::<Result<Vec<_>, _>>()?;
    to_u32(fc_ops.len(), "operation count")?;

    let mut lanes = Vec::with_capacity(plan.lanes.len());
    let mut steps = Vec::with_capacity(plan.step_count());
    for (li, lane) in plan.lanes.iter().enumerate() {
        let first_step = to_u32(steps.len(), "step count")?;
        let lane_ops = step_ops(&lane.steps);
        let runs = run_starts(&lane_ops);
        // Peers this run's sends wait for, and those already waited for.
        let (mut waits, mut waited): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        for (si, step) in lane.steps.iter().enumerate() {
            let run_op = lane_ops[si] as usize;
            let zc_here = zc.filter(|_| ops.get(run_op).is_some_and(|o| o.zero_copy));
            if runs[si] == si {
                waits.clear();
                waited.clear();
                if let Some(z) = zc_here {
                    waits = waits_of_run(&lane.steps, &lane_ops, &z.remote[li], si);
                    for peer in posts_of_run(&lane.steps, &lane_ops, si) {
                        let key = ConnKey {
                            peer,
                            channel: lane.channel,
                            dir: Dir::Recv,
                        };
                        let c = conn_index(key).ok_or_else(|| {
                            Error::Internal(format!("no connection {key:?} to post on"))
                        })?;
                        let (addr, bytes) = (z.post)(run_op, peer);
                        steps.push(FcStep {
                            kind: STEP_POST,
                            recv_conn: c as i32,
                            send_conn: -1,
                            op: run_op as u32,
                            src_off: addr,
                            count: bytes,
                            ..Default::default()
                        });
                    }
                }
            }
            let at =
                |e: Error| e.context(format!("rank {} lane {li} step {si} ({step:?})", plan.rank));
            let conn = |peer: Option<usize>, dir: Dir| -> Result<i32, Error> {
                let Some(peer) = peer else { return Ok(-1) };
                let key = ConnKey {
                    peer,
                    channel: lane.channel,
                    dir,
                };
                let i = conn_index(key)
                    .ok_or_else(|| at(Error::Internal(format!("no connection {key:?}"))))?;
                i32::try_from(i).map_err(|_| {
                    at(Error::Internal(format!(
                        "connection index {i} out of range"
                    )))
                })
            };
            let op = step.op();
            if op as usize >= ops.len() {
                return Err(at(Error::Internal(format!(
                    "operation {op} of {}",
                    ops.len()
                ))));
            }
            let mut s = FcStep {
                kind: 0,
                flags: 0,
                recv_conn: conn(step.recv_from(), Dir::Recv)?,
                send_conn: conn(step.send_to(), Dir::Send)?,
                op: op as u32,
                dst_op: op as u32,
                count: step.count() as u64,
                ..Default::default()
            };
            let mut src = |r: Region| {
                s.src_buf = buf_code(r.buf);
                s.src_off = r.offset as u64;
            };
            match *step {
                Step::Send { src: r, pre, .. } => {
                    src(r);
                    s.kind = STEP_SEND;
                    s.flags = if pre { FLAG_PRE } else { 0 };
                }
                Step::Recv { dst, .. } => {
                    s.kind = STEP_RECV;
                    s.dst_buf = buf_code(dst.buf);
                    s.dst_off = dst.offset as u64;
                }
                Step::RecvReduce {
                    local,
                    pre_local,
                    post,
                    dst,
                    to,
                    ..
                } => {
                    src(local);
                    s.kind = STEP_RECV_REDUCE;
                    s.flags = if pre_local { FLAG_PRE_LOCAL } else { 0 }
                        | if post { FLAG_POST } else { 0 };
                    set_dst_to(&mut s, dst, to.is_some());
                }
                Step::RecvCopy { dst, to, .. } => {
                    s.kind = STEP_RECV_COPY;
                    set_dst_to(&mut s, dst, to.is_some());
                }
                Step::Copy {
                    src: r,
                    dst,
                    pre,
                    post,
                } => {
                    src(r);
                    s.kind = STEP_COPY;
                    s.flags = if pre { FLAG_PRE } else { 0 } | if post { FLAG_POST } else { 0 };
                    s.dst_buf = buf_code(dst.buf);
                    s.dst_off = dst.offset as u64;
                    if dst.op as usize >= ops.len() {
                        return Err(at(Error::Internal(format!(
                            "operation {} of {}",
                            dst.op,
                            ops.len()
                        ))));
                    }
                    s.dst_op = dst.op as u32;
                }
            }
            if ops[op as usize].ll {
                s.flags |= FLAG_LL;
            }
            if let Some(z) = zc_here {
                if let Some(off) = z.remote[li][si] {
                    s.flags |= FLAG_RDST;
                    s.rdst_off = off as u64;
                }
                if let Some(to) = step
                    .send_to()
                    .filter(|t| waits.contains(t) && !waited.contains(t))
                {
                    s.flags |= FLAG_WAIT_POST;
                    waited.push(to);
                }
            }
            steps.push(s);
        }
        let nsteps = to_u32(steps.len() - first_step as usize, "steps in a lane")?;
        lanes.push(FcLane { first_step, nsteps });
    }
    to_u32(steps.len(), "step count")?;
    to_u32(lanes.len(), "lane count")?;
    Ok(Encoded {
        lanes,
        steps,
        ops: fc_ops,
        rank: to_u32(plan.rank, "rank")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroccl_core::algo::{build, Algo, CollDesc, Tuning};
    use ferroccl_core::CollKind;

    fn ring(channels: usize, chunk_elems: usize) -> Tuning {
        Tuning {
            algo: Algo::Ring,
            channels,
            chunk_elems,
        }
    }

    const TYPES_CUH: &str = include_str!("kernels/types.cuh");

    /// Every FC_CHECK_SIZE / FC_CHECK_OFFSET line of types.cuh, as (struct, field, bytes).
    fn cuda_layout() -> Vec<(String, String, usize)> {
        let mut v = Vec::new();
        for line in TYPES_CUH.lines() {
            let line = line.trim();
            let (field, args) = if let Some(a) = line.strip_prefix("FC_CHECK_SIZE(") {
                (false, a)
            } else if let Some(a) = line.strip_prefix("FC_CHECK_OFFSET(") {
                (true, a)
            } else {
                continue;
            };
            let args: Vec<&str> = args
                .trim_end_matches(");")
                .split(',')
                .map(str::trim)
                .collect();
            let (t, f, n) = if field {
                (args[0], args[1], args[2])
            } else {
                (args[0], "", args[1])
            };
            v.push((t.to_string(), f.to_string(), n.parse().unwrap()));
        }
        v
    }

    #[test]
    fn cuda_header_pins_the_same_layout() {
        let mut cuda = cuda_layout();
        let mut rust: Vec<(String, String, usize)> = LAYOUT
            .iter()
            .map(|&(t, f, n)| (t.to_string(), f.to_string(), n))
            .collect();
        cuda.sort();
        rust.sort();
        assert_eq!(cuda, rust);
        // Every field of every struct is pinned: the offsets plus the last field's size fill it.
        assert_eq!(LAYOUT.iter().filter(|e| e.1.is_empty()).count(), 12);
    }

    #[test]
    fn constants_match_the_header() {
        let defs: Vec<(&str, u32)> = TYPES_CUH
            .lines()
            .filter_map(|l| {
                let mut w = l.strip_prefix("#define ")?.split_whitespace();
                let (name, val) = (w.next()?, w.next()?);
                Some((name, val.strip_suffix('u')?.parse().ok()?))
            })
            .collect();
        let get = |n: &str| {
            defs.iter()
                .find(|d| d.0 == n)
                .unwrap_or_else(|| panic!("{n} not in types.cuh"))
                .1
        };
        for (n, v) in [
            ("FC_STEP_SEND", STEP_SEND),
            ("FC_STEP_RECV", STEP_RECV),
            ("FC_STEP_RECV_REDUCE", STEP_RECV_REDUCE),
            ("FC_STEP_RECV_COPY", STEP_RECV_COPY),
            ("FC_STEP_COPY", STEP_COPY),
            ("FC_FLAG_PRE", FLAG_PRE),
            ("FC_FLAG_POST", FLAG_POST),
            ("FC_FLAG_PRE_LOCAL", FLAG_PRE_LOCAL),
            ("FC_FLAG_HAS_DST", FLAG_HAS_DST),
            ("FC_FLAG_HAS_TO", FLAG_HAS_TO),
            ("FC_FLAG_LL", FLAG_LL),
            ("FC_STEP_POST", STEP_POST),
            ("FC_FLAG_RDST", FLAG_RDST),
            ("FC_FLAG_WAIT_POST", FLAG_WAIT_POST),
            ("FC_LEN_DIRECT", LEN_DIRECT),
            ("FC_WHAT_POST", WHAT_POST),
            ("FC_WHAT_SENT", WHAT_SENT),
            ("FC_LL_DATA", LL_DATA_BYTES as u32),
            ("FC_BUF_INPUT", BUF_INPUT),
            ("FC_BUF_OUTPUT", BUF_OUTPUT),
            ("FC_CONN_SEND", CONN_SEND),
            ("FC_CONN_RECV", CONN_RECV),
            ("FC_ERR_ABORTED", ERR_ABORTED),
            ("FC_ERR_TIMEOUT", ERR_TIMEOUT),
            ("FC_ERR_LENGTH", ERR_LENGTH),
            ("FC_ERR_PLAN", ERR_PLAN),
            ("FC_WHAT_DATA", WHAT_DATA),
            ("FC_WHAT_ROOM", WHAT_ROOM),
            ("FC_WHAT_LENGTH", WHAT_LENGTH),
            ("FC_WHAT_PLAN", WHAT_PLAN),
            ("FC_DIRECT_MAX_RANKS", DIRECT_MAX_RANKS as u32),
            ("FC_DIRECT_MAX_BLOCKS", DIRECT_MAX_BLOCKS as u32),
            ("FC_DIRECT_SLOT_DATA", DIRECT_SLOT_BYTES as u32),
            ("FC_DIRECT_THREADS", DIRECT_THREADS),
            ("FC_PEER_MAX_RANKS", PEER_MAX_RANKS as u32),
            ("FC_PEER_MAX_BLOCKS", PEER_MAX_BLOCKS as u32),
            ("FC_PEER_THREADS", PEER_THREADS),
            ("FC_PEER_PHASES", PEER_PHASES as u32),
            (
                "FC_LINE_GROUP",
                ferroccl_core::tune::LINE_GROUP_BYTES as u32,
            ),
            (
                "FC_LINE_GROUP_DATA",
                ferroccl_core::tune::LINE_GROUP_DATA as u32,
            ),
            ("FC_CE_LANES", CE_LANES as u32),
            ("FC_FOLD_MAX_PIECES", FOLD_MAX_PIECES as u32),
            ("FC_P2P_MAX_STEPS", P2P_MAX_STEPS as u32),
            ("FC_P2P_THREADS", P2P_THREADS),
            ("FC_P2P_COPY", P2P_COPY as u32),
            ("FC_P2P_SMALL_STEPS", P2P_SMALL_STEPS as u32),
            ("FC_INLINE_OPS", INLINE_OPS as u32),
        ] {
            assert_eq!(get(n), v, "{n}");
        }
        for (i, n) in [
            "ALL_REDUCE",
            "ALL_GATHER",
            "REDUCE_SCATTER",
            "BROADCAST",
            "REDUCE",
            "ALL_TO_ALL",
            "GATHER",
            "SCATTER",
        ]
        .iter()
        .enumerate()
        {
            assert_eq!(
                Some(get(&format!("FC_KIND_{n}"))),
                kind_code(ferroccl_core::CollKind::COLLECTIVES[i]),
                "{n}"
            );
        }
        assert_eq!(kind_code(ferroccl_core::CollKind::Send), None);
        let dtypes = [
            "INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FLOAT16", "FLOAT32", "FLOAT64",
            "BFLOAT16",
        ];
        for (i, n) in dtypes.iter().enumerate() {
            assert_eq!(get(&format!("FC_{n}")) as i32, DataType::ALL[i].nccl_id());
        }
        assert_eq!(get("FC_FP8E4M3") as i32, DataType::Float8E4M3.nccl_id());
        assert_eq!(get("FC_FP8E5M2") as i32, DataType::Float8E5M2.nccl_id());
        for (n, op) in [
            ("FC_OP_SUM", ReduceOp::Sum),
            ("FC_OP_PROD", ReduceOp::Prod),
            ("FC_OP_MAX", ReduceOp::Max),
            ("FC_OP_MIN", ReduceOp::Min),
            ("FC_OP_AVG", ReduceOp::Avg),
            ("FC_OP_PREMULSUM", ReduceOp::PreMulSum(1.0)),
        ] {
            assert_eq!(get(n), redop_code(op), "{n}");
        }
    }

    fn op_desc(dtype: DataType, op: ReduceOp, send_count: usize, recv_count: usize) -> OpDesc {
        OpDesc {
            send: 0x7000_0000_0000,
            recv: 0x7100_0000_0000,
            send_count,
            recv_count,
            dtype,
            op,
            scalar_dev: 0,
            ll: false,
            zero_copy: true,
            post_output: true,
        }
    }

    fn numbering(plan: &Plan) -> impl Fn(ConnKey) -> Option<u32> {
        let conns = plan.connections();
        move |k| conns.iter().position(|c| *c == k).map(|i| i as u32)
    }

    /// The encoded steps say exactly what the plan's steps say.
    fn assert_one_to_one(plan: &Plan, e: &Encoded) {
        let conns = plan.connections();
        let idx = |k: ConnKey| conns.iter().position(|c| *c == k).unwrap() as i32;
        assert_eq!(e.lanes.len(), plan.lanes.len());
        assert_eq!(e.rank as usize, plan.rank);
        let mut next = 0u32;
        for (lane, fl) in plan.lanes.iter().zip(&e.lanes) {
            assert_eq!(fl.first_step, next);
            assert_eq!(fl.nsteps as usize, lane.steps.len());
            next += fl.nsteps;
            for (i, step) in lane.steps.iter().enumerate() {
                let s = e.steps[(fl.first_step as usize) + i];
                let rc = step.recv_from().map_or(-1, |p| {
                    idx(ConnKey {
                        peer: p,
                        channel: lane.channel,
                        dir: Dir::Recv,
                    })
                });
                let sc = step.send_to().map_or(-1, |p| {
                    idx(ConnKey {
                        peer: p,
                        channel: lane.channel,
                        dir: Dir::Send,
                    })
                });
                assert_eq!((s.recv_conn, s.send_conn), (rc, sc), "{step:?}");
                assert_eq!(s.count, step.count() as u64);
                assert_eq!(s.op, step.op() as u32);
                if !matches!(step, Step::Copy { .. }) {
                    assert_eq!(s.dst_op, s.op, "{step:?}");
                }
                let reg = |b: u32, o: u64| (b, o);
                let r = |r: Region| (buf_code(r.buf), r.offset as u64);
                match *step {
                    Step::Send { src, pre, .. } => {
                        assert_eq!(s.kind, STEP_SEND);
                        assert_eq!(s.flags, if pre { FLAG_PRE } else { 0 });
                        assert_eq!(reg(s.src_buf, s.src_off), r(src));
                    }
                    Step::Recv { dst, .. } => {
                        assert_eq!(s.kind, STEP_RECV);
                        assert_eq!(s.flags, 0);
                        assert_eq!(reg(s.dst_buf, s.dst_off), r(dst));
                    }
                    Step::RecvReduce {
                        local,
                        pre_local,
                        post,
                        dst,
                        to,
                        ..
                    } => {
                        assert_eq!(s.kind, STEP_RECV_REDUCE);
                        assert_eq!(s.flags & FLAG_PRE_LOCAL != 0, pre_local);
                        assert_eq!(s.flags & FLAG_POST != 0, post);
                        assert_eq!(s.flags & FLAG_HAS_DST != 0, dst.is_some());
                        assert_eq!(s.flags & FLAG_HAS_TO != 0, to.is_some());
                        assert_eq!(s.flags & FLAG_PRE, 0);
                        assert_eq!(reg(s.src_buf, s.src_off), r(local));
                        if let Some(d) = dst {
                            assert_eq!(reg(s.dst_buf, s.dst_off), r(d));
                        }
                    }
                    Step::RecvCopy { dst, to, .. } => {
                        assert_eq!(s.kind, STEP_RECV_COPY);
                        assert_eq!(s.flags & FLAG_HAS_DST != 0, dst.is_some());
                        assert_eq!(s.flags & FLAG_HAS_TO != 0, to.is_some());
                        assert_eq!(s.flags & !(FLAG_HAS_DST | FLAG_HAS_TO), 0);
                        if let Some(d) = dst {
                            assert_eq!(reg(s.dst_buf, s.dst_off), r(d));
                        }
                    }
                    Step::Copy {
                        src,
                        dst,
                        pre,
                        post,
                    } => {
                        assert_eq!(s.kind, STEP_COPY);
                        assert_eq!(
                            s.flags,
                            if pre { FLAG_PRE } else { 0 } | if post { FLAG_POST } else { 0 }
                        );
                        assert_eq!(reg(s.src_buf, s.src_off), r(src));
                        assert_eq!(reg(s.dst_buf, s.dst_off), r(dst));
                        assert_eq!((s.op, s.dst_op), (src.op as u32, dst.op as u32), "{step:?}");
                    }
                }
            }
        }
        assert_eq!(next as usize, e.steps.len());
    }

    #[test]
    fn ring_all_reduce_encodes_one_to_one() {
        for (nranks, channels, count, chunk) in [
            (4, 2, 10_000, 512),
            (3, 1, 7, 2),
            (8, 4, 1 << 16, 4096),
            (1, 2, 100, 16),
        ] {
            for rank in 0..nranks {
                let desc = CollDesc {
                    kind: CollKind::AllReduce,
                    count,
                    root: 0,
                };
                let plan = build(&desc, 0, rank, nranks, &ring(channels, chunk));
                let ops = [op_desc(DataType::Float32, ReduceOp::Avg, count, count)];
                let e = encode(&plan, &ops, numbering(&plan), None).unwrap();
                assert_one_to_one(&plan, &e);
                assert!(plan.step_count() > 0);
                assert_eq!(e.ops[0].nranks as usize, nranks);
                assert_eq!(e.ops[0].redop, 4);
                assert_eq!(e.ops[0].dtype, 7);
                assert_eq!(e.ops[0].elem_size, 4);
                if nranks > 1 {
                    // The ring's shape: a first send with pre, reductions forwarding, the last
                    // reduction posting into the output, then copies.
                    let lane0 = &e.steps[..e.lanes[0].nsteps as usize];
                    assert_eq!(lane0[0].kind, STEP_SEND);
                    assert_eq!(lane0[0].flags, FLAG_PRE);
                    let last_red = lane0
                        .iter()
                        .position(|s| s.kind == STEP_RECV_REDUCE && s.flags & FLAG_POST != 0)
                        .unwrap();
                    assert_eq!(
                        lane0[last_red].flags & (FLAG_HAS_DST | FLAG_HAS_TO),
                        FLAG_HAS_DST | FLAG_HAS_TO
                    );
                    assert_eq!(lane0[last_red].dst_buf, BUF_OUTPUT);
                    assert_eq!(lane0[last_red + 1].kind, STEP_RECV_COPY);
                }
            }
        }
    }

    #[test]
    fn every_collective_encodes() {
        let kinds = CollKind::ALL.iter();
        for &kind in kinds {
            for nranks in [1, 2, 5] {
                for rank in 0..nranks {
                    let count = 1000;
                    let root = if matches!(kind, CollKind::Send | CollKind::Recv) {
                        (rank + 1) % nranks
                    } else {
                        nranks - 1
                    };
                    if matches!(kind, CollKind::Send | CollKind::Recv) && root == rank {
                        continue;
                    }
                    let desc = CollDesc { kind, count, root };
                    let plan = build(&desc, 0, rank, nranks, &Tuning::default_for(kind, 2, 64));
                    let (i, o) = kind.buffer_counts(count, nranks, rank == root).unwrap();
                    let ops = [op_desc(DataType::Bfloat16, ReduceOp::Sum, i, o)];
                    let e = encode(&plan, &ops, numbering(&plan), None)
                        .unwrap_or_else(|err| panic!("{kind} {rank}/{nranks}: {err}"));
                    assert_one_to_one(&plan, &e);
                }
            }
        }
    }

    #[test]
    fn group_of_two_ops_keeps_op_indices() {
        let t = ring(2, 64);
        let mut plan = build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count: 300,
                root: 0,
            },
            0,
            1,
            3,
            &t,
        );
        plan.append(build(
            &CollDesc {
                kind: CollKind::AllGather,
                count: 100,
                root: 0,
            },
            1,
            1,
            3,
            &t,
        ));
        let ops = [
            op_desc(DataType::Int32, ReduceOp::Max, 300, 300),
            OpDesc {
                send: 0x10_0000,
                recv: 0x20_0000,
                ..op_desc(DataType::Uint8, ReduceOp::Sum, 100, 300)
            },
        ];
        let e = encode(&plan, &ops, numbering(&plan), None).unwrap();
        assert_one_to_one(&plan, &e);
        assert!(e.steps.iter().any(|s| s.op == 1));
        assert_eq!(e.ops[1].send, 0x10_0000);
        assert_eq!(e.ops[1].elem_size, 1);
    }

    /// A send to oneself in a group is a copy from the send's input into the matching receive's
    /// output: two operations, so the step names both (the kernel resolved the destination
    /// against the send's buffers, whose output is null: an illegal address on the GPU).
    #[test]
    fn a_send_to_oneself_copies_into_the_receive_of_another_op() {
        use ferroccl_core::algo::{build_launch, LaunchOp, SELF_LANE};
        let t = Tuning {
            algo: Algo::Direct,
            channels: 2,
            chunk_elems: 64,
        };
        let p2p = |kind, root| LaunchOp {
            desc: CollDesc {
                kind,
                count: 100,
                root,
            },
            dtype: DataType::Float32,
            tuning: t,
        };
        // Rank 1 of 3: receive from itself (op 0), send to 2 (op 1), send to itself (op 2).
        let ops = [
            p2p(CollKind::Recv, 1),
            p2p(CollKind::Send, 2),
            p2p(CollKind::Send, 1),
        ];
        let plan = build_launch(1, 3, &ops).unwrap();
        let descs: Vec<OpDesc> = ops
            .iter()
            .map(|_| op_desc(DataType::Float32, ReduceOp::Sum, 100, 100))
            .collect();
        let e = encode(&plan, &descs, numbering(&plan), None).unwrap();
        assert_one_to_one(&plan, &e);
        let li = plan
            .lanes
            .iter()
            .position(|l| l.id == SELF_LANE)
            .expect("a lane for the copy");
        let s = e.steps[e.lanes[li].first_step as usize];
        assert_eq!(
            (s.kind, s.op, s.dst_op, s.src_buf, s.dst_buf, s.count),
            (
                STEP_COPY,
                2,
                0,
                buf_code(BufKind::Input),
                buf_code(BufKind::Output),
                100
            )
        );
    }

    #[test]
    fn premulsum_scalar_is_converted_like_the_host() {
        let f = |d, s| scalar_of(d, ReduceOp::PreMulSum(s));
        assert_eq!(f(DataType::Float32, 0.1), ((0.1f32) as f64, 0));
        assert_eq!(f(DataType::Float64, 0.1), (0.1, 0));
        // 1 + 2^-11 ties to even in f16 (1.0); in bf16, 1/3 rounds to 0x3eab.
        assert_eq!(f(DataType::Float16, 1.0 + 2f64.powi(-11)).0, 1.0);
        assert_eq!(
            f(DataType::Bfloat16, 1.0 / 3.0).0,
            bf16::from_bits(0x3eab).to_f64()
        );
        assert_eq!(f(DataType::Float8E4M3, 1000.0).0, 448.0);
        assert_eq!(f(DataType::Float8E5M2, -1e9).0, -57344.0);
        assert_eq!(f(DataType::Int8, -3.0), (0.0, -3));
        assert_eq!(f(DataType::Int8, 300.0), (0.0, 127));
        assert_eq!(f(DataType::Uint64, 3.0), (0.0, 3));
        assert_eq!(
            f(DataType::Uint64, 1.8e19).1 as u64,
            18_000_000_000_000_000_000
        );
        assert_eq!(scalar_of(DataType::Float32, ReduceOp::Sum), (0.0, 0));
    }

    #[test]
    fn ll_marks_every_step_and_nothing_else() {
        let f = DataType::Float32;
        let plan = build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count: 300,
                root: 0,
            },
            0,
            1,
            3,
            &ring(2, 64),
        );
        let n = numbering(&plan);
        let on = encode(
            &plan,
            &[OpDesc {
                ll: true,
                ..op_desc(f, ReduceOp::Sum, 300, 300)
            }],
            &n,
            None,
        )
        .unwrap();
        let off = encode(&plan, &[op_desc(f, ReduceOp::Sum, 300, 300)], &n, None).unwrap();
        assert!(on.steps.iter().all(|s| s.flags & FLAG_LL != 0));
        assert!(off.steps.iter().all(|s| s.flags & FLAG_LL == 0));
        // Nothing else differs.
        let strip = |e: &Encoded| {
            e.steps
                .iter()
                .map(|s| FcStep {
                    flags: s.flags & !FLAG_LL,
                    ..*s
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(&on), strip(&off));
    }

    #[test]
    fn a_device_scalar_reaches_the_op_table() {
        let plan = build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count: 64,
                root: 0,
            },
            0,
            0,
            2,
            &ring(1, 8),
        );
        let n = numbering(&plan);
        let dev = |op, at| OpDesc {
            scalar_dev: at,
            ..op_desc(DataType::Float16, op, 64, 64)
        };
        let e = encode(&plan, &[dev(ReduceOp::PreMulSum(0.0), 0x5000)], &n, None).unwrap();
        assert_eq!(e.ops[0].scalar_dev, 0x5000);
        assert_eq!(e.ops[0].redop, 5);
        assert_eq!(
            encode(&plan, &[dev(ReduceOp::PreMulSum(3.0), 0)], &n, None)
                .unwrap()
                .ops[0]
                .scalar_dev,
            0
        );
        // Not a pre-mul-sum, or an address the kernel cannot load an f16 from.
        assert!(matches!(
            encode(&plan, &[dev(ReduceOp::Sum, 0x5000)], &n, None),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            encode(&plan, &[dev(ReduceOp::PreMulSum(1.0), 0x5001)], &n, None),
            Err(Error::InvalidArgument(_))
        ));
    }

    /// Zero-copy tables: a POST per receiving peer where a lane starts an op's run (before its
    /// steps, carrying what the runtime says), RDST with the receiver's offset on every message
    /// the peer only stores, WAIT_POST on the first send of the run to each such peer; nothing
    /// for LL ops; the plan's own steps otherwise unchanged.
    #[test]
    fn zero_copy_adds_posts_waits_and_remote_offsets() {
        use ferroccl_core::plan::zcopy::{peer_desc, remote_dsts};
        let t = ring(2, 64);
        let (n, me, count) = (3, 1, 1000);
        let ag = CollDesc {
            kind: CollKind::AllGather,
            count,
            root: 0,
        };
        let ar = CollDesc {
            kind: CollKind::AllReduce,
            count,
            root: 0,
        };
        let mut plan = build(&ag, 0, me, n, &t);
        plan.append(build(&ar, 1, me, n, &t));
        let descs = [ag, ar];
        let remote = remote_dsts(&plan, |op, p| {
            Some(build(
                &peer_desc(&descs[op as usize], me).unwrap(),
                op,
                p,
                n,
                &t,
            ))
        });
        let post = |op: usize, peer: usize| {
            (
                0xa000_0000 + (op as u64) * 0x1000 + peer as u64,
                4000 * (op as u64 + 1),
            )
        };
        let z = ZeroCopy {
            remote: &remote,
            post: &post,
        };
        let ops = [
            op_desc(DataType::Float32, ReduceOp::Sum, count, n * count),
            op_desc(DataType::Float32, ReduceOp::Sum, count, count),
        ];
        let nb = numbering(&plan);
        let with = encode(&plan, &ops, &nb, Some(&z)).unwrap();
        let without = encode(&plan, &ops, &nb, None).unwrap();
        let prev = (me + n - 1) % n;
        for (li, lane) in plan.lanes.iter().enumerate() {
            let w =
                &with.steps[with.lanes[li].first_step as usize..][..with.lanes[li].nsteps as usize];
            let plain = &without.steps[without.lanes[li].first_step as usize..]
                [..without.lanes[li].nsteps as usize];
            // Two runs (one per op), each opened by one POST to the ring's previous rank (even
            // channels; odd channels run the other way).
            let from = if lane.channel % 2 == 0 {
                prev
            } else {
                (me + 1) % n
            };
            let posts: Vec<&FcStep> = w.iter().filter(|s| s.kind == STEP_POST).collect();
            assert_eq!(posts.len(), 2, "lane {li}");
            for (k, p) in posts.iter().enumerate() {
                assert_eq!(
                    (p.op, p.src_off, p.count),
                    (k as u32, post(k, from).0, post(k, from).1)
                );
                assert_eq!(
                    p.recv_conn,
                    nb(ConnKey {
                        peer: from,
                        channel: lane.channel,
                        dir: Dir::Recv
                    })
                    .unwrap() as i32
                );
            }
            assert_eq!(w[0].kind, STEP_POST, "a lane posts before its first step");
            let body: Vec<FcStep> = w.iter().filter(|s| s.kind != STEP_POST).copied().collect();
            assert_eq!(body.len(), lane.steps.len());
            let mut waits = [0; 2];
            for ((s, p), (step, m)) in body
                .iter()
                .zip(plain)
                .zip(lane.steps.iter().zip(&remote[li]))
            {
                assert_eq!(
                    FcStep {
                        flags: s.flags & !(FLAG_RDST | FLAG_WAIT_POST),
                        rdst_off: 0,
                        ..*s
                    },
                    *p
                );
                assert_eq!(s.flags & FLAG_RDST != 0, m.is_some(), "{step:?}");
                assert_eq!(s.rdst_off, m.unwrap_or(0) as u64);
                if s.flags & FLAG_WAIT_POST != 0 {
                    assert!(step.send_to().is_some());
                    waits[s.op as usize] += 1;
                }
            }
            // All-gather: every send is direct, the first waits. All-reduce: the first send
            // feeds a reduction, yet it waits (the run has direct messages to that peer).
            assert_eq!(waits, [1, 1], "lane {li}");
            let first_ar_send = body
                .iter()
                .position(|s| s.op == 1 && s.send_conn >= 0)
                .unwrap();
            assert_eq!(
                body[first_ar_send].flags & (FLAG_WAIT_POST | FLAG_RDST),
                FLAG_WAIT_POST
            );
            assert!(body
                .iter()
                .filter(|s| s.op == 0 && s.send_conn >= 0)
                .all(|s| s.flags & FLAG_RDST != 0));
        }
        // Ops outside the handshake take none of it (LL ops: the tuner never puts them in it).
        let ll_ops = ops.map(|o| OpDesc {
            ll: true,
            zero_copy: false,
            ..o
        });
        let ll = encode(&plan, &ll_ops, &nb, Some(&z)).unwrap();
        assert!(ll
            .steps
            .iter()
            .all(|s| s.kind != STEP_POST && s.flags & (FLAG_RDST | FLAG_WAIT_POST) == 0));
        // Marks of another plan's shape are an internal error, not a wrong table.
        let short: RemoteDsts = remote[..1].to_vec();
        assert!(encode(
            &plan,
            &ops,
            &nb,
            Some(&ZeroCopy {
                remote: &short,
                post: &post
            })
        )
        .is_err());
    }

    #[test]
    fn missing_connection_is_an_error() {
        let plan = build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count: 64,
                root: 0,
            },
            0,
            0,
            2,
            &ring(1, 8),
        );
        let ops = [op_desc(DataType::Float32, ReduceOp::Sum, 64, 64)];
        let only_recv = |k: ConnKey| (k.dir == Dir::Recv).then_some(0);
        let err = encode(&plan, &ops, only_recv, None).unwrap_err();
        assert!(
            matches!(err, Error::Internal(ref m) if m.contains("no connection")),
            "{err}"
        );
    }

    #[test]
    fn bad_tables_are_rejected() {
        let plan = build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count: 64,
                root: 0,
            },
            0,
            0,
            2,
            &ring(1, 8),
        );
        let n = numbering(&plan);
        // Regions beyond the buffers the caller gave.
        assert!(encode(
            &plan,
            &[op_desc(DataType::Float32, ReduceOp::Sum, 63, 64)],
            &n,
            None
        )
        .is_err());
        // No op for the plan's op 0.
        assert!(encode(&plan, &[], &n, None).is_err());
        // A null buffer with elements.
        let null = OpDesc {
            send: 0,
            ..op_desc(DataType::Float32, ReduceOp::Sum, 64, 64)
        };
        assert!(matches!(
            encode(&plan, &[null], &n, None),
            Err(Error::InvalidArgument(_))
        ));
        // An op the dtype cannot do.
        assert!(matches!(
            encode(
                &plan,
                &[op_desc(DataType::Int32, ReduceOp::PreMulSum(0.5), 64, 64)],
                &n,
                None
            ),
            Err(Error::InvalidArgument(_))
        ));
        // A buffer running off the end of the address space.
        let wrap = OpDesc {
            recv: u64::MAX - 16,
            ..op_desc(DataType::Float32, ReduceOp::Sum, 64, 64)
        };
        assert!(encode(&plan, &[wrap], &n, None).is_err());
    }

    #[test]
    fn launch_carries_tables_and_inline_ops() {
        let plan = build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count: 1000,
                root: 0,
            },
            0,
            2,
            4,
            &ring(3, 50),
        );
        let e = encode(
            &plan,
            &[op_desc(DataType::Float32, ReduceOp::Sum, 1000, 1000)],
            numbering(&plan),
            None,
        )
        .unwrap();
        let at = DeviceTables {
            steps: 1,
            lanes: 2,
            nsteps: e.steps.len() as u32,
            nlanes: e.lanes.len() as u32,
            ops: 3,
            conns: 4,
            nconns: 6,
            abort: 5,
            error: 6,
            timeout_ns: 7,
            rank: 2,
        };
        let l = FcLaunch::new(&at, &e.ops);
        assert_eq!(
            (l.nlanes, l.nsteps, l.nops, l.nconns, l.rank),
            (3, e.steps.len() as u32, 1, 6, 2)
        );
        assert_eq!(
            (l.steps, l.lanes, l.conns, l.abort, l.error, l.timeout_ns),
            (1, 2, 4, 5, 6, 7)
        );
        // One op rides in the parameter; the op table is not read.
        assert_eq!((l.ops, l.inline_ops[0]), (0, e.ops[0]));
        assert_eq!(l.inline_ops[1], FcOp::default());
        // More than fit: the table at `at.ops`.
        let many = vec![e.ops[0]; INLINE_OPS + 1];
        let l = FcLaunch::new(&at, &many);
        assert_eq!((l.ops, l.nops), (3, INLINE_OPS as u32 + 1));
        assert_eq!(l.inline_ops, [FcOp::default(); INLINE_OPS]);
    }
}

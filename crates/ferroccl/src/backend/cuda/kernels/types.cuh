// Structures shared between the host (crates/ferroccl/src/backend/cuda/tables.rs) and the
// plan-execution kernel. Every layout is pinned twice: static_asserts here, const asserts and a
// test that re-reads the FC_CHECK_* lines of this file on the Rust side. Change both together.
#pragma once

#include "ints.cuh"

#define FC_CHECK_SIZE(T, n) static_assert(sizeof(T) == (n), "layout of " #T " differs from tables.rs")
// NVRTC's front end has no __builtin_offsetof (nor <cstddef>); __INTADDR__ is its constant
// folding of an address, which gives the same number.
#if defined(__CUDACC_RTC__)
#define FC_OFFSETOF(T, f) __INTADDR__(&((T*)0)->f)
#else
#define FC_OFFSETOF(T, f) __builtin_offsetof(T, f)
#endif
#define FC_CHECK_OFFSET(T, f, n) static_assert(FC_OFFSETOF(T, f) == (n), "offset of " #T "." #f " differs from tables.rs")

// Step kinds: the variants of ferroccl_core::plan::Step, in declaration order.
#define FC_STEP_SEND 0u
#define FC_STEP_RECV 1u
#define FC_STEP_RECV_REDUCE 2u
#define FC_STEP_RECV_COPY 3u
#define FC_STEP_COPY 4u
// Zero-copy (not a plan step; encode adds it where a lane starts an op's run): tell the sender
// of recv_conn where this op's output is as that sender maps it (src_off; 0 = use the FIFO)
// and how many bytes it has (count).
#define FC_STEP_POST 5u

// Step flags.
#define FC_FLAG_PRE 1u        // Send, Copy: pre-multiply the source (PreMulSum only)
#define FC_FLAG_POST 2u       // RecvReduce, Copy: divide by nranks (Avg only)
#define FC_FLAG_PRE_LOCAL 4u  // RecvReduce: pre-multiply the local operand (PreMulSum only)
#define FC_FLAG_HAS_DST 8u    // RecvReduce, RecvCopy: dst is meaningful
#define FC_FLAG_HAS_TO 16u    // RecvReduce, RecvCopy: send_conn is meaningful
#define FC_FLAG_LL 32u        // the step's messages use the LL protocol (fifo.cuh)
#define FC_FLAG_RDST 64u      // zero-copy: the message may land at rdst_off of the receiver's output
#define FC_FLAG_WAIT_POST 128u  // zero-copy: first send of the run on send_conn: wait for the post

// In lens[]: the message went straight into the receiver's output; the slot's first 8 bytes
// hold the element offset it was written at, for the receiver to check.
#define FC_LEN_DIRECT 2147483648u

// Data bytes of one LL message at most; an LL slot is twice that (a flag per 4 data bytes).
#define FC_LL_DATA 8192u

#define FC_BUF_INPUT 0u
#define FC_BUF_OUTPUT 1u

// Reduction ops, NCCL numbering (PreMulSum is dynamic in NCCL; 5 here).
#define FC_OP_SUM 0u
#define FC_OP_PROD 1u
#define FC_OP_MAX 2u
#define FC_OP_MIN 3u
#define FC_OP_AVG 4u
#define FC_OP_PREMULSUM 5u

// Data types, NCCL numbering.
#define FC_INT8 0u
#define FC_UINT8 1u
#define FC_INT32 2u
#define FC_UINT32 3u
#define FC_INT64 4u
#define FC_UINT64 5u
#define FC_FLOAT16 6u
#define FC_FLOAT32 7u
#define FC_FLOAT64 8u
#define FC_BFLOAT16 9u
#define FC_FP8E4M3 10u
#define FC_FP8E5M2 11u

#define FC_CONN_SEND 0u
#define FC_CONN_RECV 1u

// Error codes (FcError::code).
#define FC_ERR_ABORTED 1u  // the abort word became non-zero
#define FC_ERR_TIMEOUT 2u  // one wait saw no progress for timeout_ns
#define FC_ERR_LENGTH 3u   // a received slot's length differs from what this rank expects
#define FC_ERR_PLAN 4u     // the tables are inconsistent (index out of range, wrong role, ...)

// What the failing lane was doing (FcError::what).
#define FC_WHAT_DATA 1u   // waiting for data from the peer
#define FC_WHAT_ROOM 2u   // waiting for a free slot towards the peer
#define FC_WHAT_POST 5u   // waiting for the peer's output address (zero-copy post)
#define FC_WHAT_SENT 6u   // an in-place split receive block waiting for its own send block (peer.cu)
#define FC_WHAT_LENGTH 3u // checking a received length
#define FC_WHAT_PLAN 4u   // checking the tables

struct FcLane {
    fc_u32 first_step;
    fc_u32 nsteps;
};
FC_CHECK_SIZE(FcLane, 8);
FC_CHECK_OFFSET(FcLane, first_step, 0);
FC_CHECK_OFFSET(FcLane, nsteps, 4);

// Regions are (buffer, element offset) of op `op`, but a Copy's dst, which is of op `dst_op` (a
// send to oneself is copied into the matching receive, another op of the group); the element
// count is `count` for every region of a step (the plan guarantees it). Send: src. Recv: dst.
// RecvReduce: src = local, dst if HAS_DST. RecvCopy: dst if HAS_DST. Copy: src and dst.
struct FcStep {
    fc_u32 kind;
    fc_u32 flags;
    fc_i32 recv_conn;  // index into FcConn[], -1 = none
    fc_i32 send_conn;  // index into FcConn[], -1 = none
    fc_u32 op;
    fc_u32 src_buf;
    fc_u64 src_off;
    fc_u32 dst_buf;
    fc_u32 dst_op;
    fc_u64 dst_off;
    fc_u64 count;
    fc_u64 rdst_off;  // FC_FLAG_RDST: element offset in the receiver's output
};
FC_CHECK_SIZE(FcStep, 64);
FC_CHECK_OFFSET(FcStep, kind, 0);
FC_CHECK_OFFSET(FcStep, flags, 4);
FC_CHECK_OFFSET(FcStep, recv_conn, 8);
FC_CHECK_OFFSET(FcStep, send_conn, 12);
FC_CHECK_OFFSET(FcStep, op, 16);
FC_CHECK_OFFSET(FcStep, src_buf, 20);
FC_CHECK_OFFSET(FcStep, src_off, 24);
FC_CHECK_OFFSET(FcStep, dst_buf, 32);
FC_CHECK_OFFSET(FcStep, dst_op, 36);
FC_CHECK_OFFSET(FcStep, dst_off, 40);
FC_CHECK_OFFSET(FcStep, count, 48);
FC_CHECK_OFFSET(FcStep, rdst_off, 56);

// The scalar of PreMulSum is stored already converted to the element type (as the host
// Reducer converts it), so the kernel only widens it: scalar_f64 for float types, scalar_i64
// (two's complement bits) for integer types.
struct FcOp {
    fc_u64 send;  // input buffer (device address)
    fc_u64 recv;  // output buffer
    fc_u32 dtype;
    fc_u32 redop;
    double scalar_f64;
    fc_i64 scalar_i64;
    fc_u32 nranks;
    fc_u32 elem_size;
    fc_u64 scalar_dev;  // non-zero: the PreMulSum scalar, of the op's type, at this device address
};
FC_CHECK_SIZE(FcOp, 56);
FC_CHECK_OFFSET(FcOp, send, 0);
FC_CHECK_OFFSET(FcOp, recv, 8);
FC_CHECK_OFFSET(FcOp, dtype, 16);
FC_CHECK_OFFSET(FcOp, redop, 20);
FC_CHECK_OFFSET(FcOp, scalar_f64, 24);
FC_CHECK_OFFSET(FcOp, scalar_i64, 32);
FC_CHECK_OFFSET(FcOp, nranks, 40);
FC_CHECK_OFFSET(FcOp, elem_size, 44);
FC_CHECK_OFFSET(FcOp, scalar_dev, 48);

// Operations a launch carries in its parameter: a repeated operation on new buffers (a caching
// allocator hands out new pointers all the time) then needs no table upload at all.
#define FC_INLINE_OPS 8u

// Passed by value (__grid_constant__), so a launch needs no upload of its own and the kernel
// reaches its tables one dependent load sooner.
struct FcLaunch {
    fc_u64 steps;       // FcStep[nsteps]
    fc_u64 lanes;       // FcLane[nlanes]
    fc_u64 ops;         // FcOp[nops] when nops > FC_INLINE_OPS, else unused (inline_ops)
    fc_u64 conns;       // FcConn[nconns]
    fc_u64 abort;       // int, non-zero = abort; may be host-mapped; 0 = none
    fc_u64 error;       // FcError, device memory (atomicCAS on it); must not be 0
    fc_u64 timeout_ns;  // longest wait without progress; 0 = wait forever
    fc_u32 nlanes;
    fc_u32 rank;
    fc_u32 nsteps;
    fc_u32 nops;
    fc_u32 nconns;
    fc_u32 reserved;
    FcOp inline_ops[FC_INLINE_OPS];  // the ops when nops <= FC_INLINE_OPS
};
FC_CHECK_SIZE(FcLaunch, 528);
FC_CHECK_OFFSET(FcLaunch, steps, 0);
FC_CHECK_OFFSET(FcLaunch, lanes, 8);
FC_CHECK_OFFSET(FcLaunch, ops, 16);
FC_CHECK_OFFSET(FcLaunch, conns, 24);
FC_CHECK_OFFSET(FcLaunch, abort, 32);
FC_CHECK_OFFSET(FcLaunch, error, 40);
FC_CHECK_OFFSET(FcLaunch, timeout_ns, 48);
FC_CHECK_OFFSET(FcLaunch, nlanes, 56);
FC_CHECK_OFFSET(FcLaunch, rank, 60);
FC_CHECK_OFFSET(FcLaunch, nsteps, 64);
FC_CHECK_OFFSET(FcLaunch, nops, 68);
FC_CHECK_OFFSET(FcLaunch, nconns, 72);
FC_CHECK_OFFSET(FcLaunch, reserved, 76);
FC_CHECK_OFFSET(FcLaunch, inline_ops, 80);

// ---- the direct engine (direct.cu) -------------------------------------------------------------
// One-shot collectives: block b of rank p stores its message for rank q, as LL lines, into q's
// receive slots [b][p][epoch parity]; q folds or copies what arrived, then acknowledges the
// epoch to every peer ([b][q] in their ack words) so that they may reuse the parity's slots.
#define FC_DIRECT_MAX_RANKS 16u
#define FC_DIRECT_MAX_BLOCKS 16u
#define FC_DIRECT_SLOT_DATA 16384u
#define FC_DIRECT_THREADS 256u

// Passed by value, like FcLaunch; the communicator's part is filled once, the op per call.
struct FcDirect {
    fc_u64 slots[FC_DIRECT_MAX_RANKS];  // rank q's receive slots, as this GPU maps them
    fc_u64 acks[FC_DIRECT_MAX_RANKS];   // rank q's ack words, as this GPU maps them
    fc_u64 epochs;                      // this rank's epoch word per block
    fc_u64 abort;                       // as FcLaunch
    fc_u64 error;
    fc_u64 timeout_ns;
    fc_u64 count;                       // elements of the per-rank block
    fc_u32 kind;                        // CollKind in declaration order (FC_KIND_*)
    fc_u32 rank;
    fc_u32 nranks;
    fc_u32 root;
    fc_u32 nblocks;
    fc_u32 reserved;
    FcOp op;
};
FC_CHECK_SIZE(FcDirect, 376);
FC_CHECK_OFFSET(FcDirect, slots, 0);
FC_CHECK_OFFSET(FcDirect, acks, 128);
FC_CHECK_OFFSET(FcDirect, epochs, 256);
FC_CHECK_OFFSET(FcDirect, abort, 264);
FC_CHECK_OFFSET(FcDirect, error, 272);
FC_CHECK_OFFSET(FcDirect, timeout_ns, 280);
FC_CHECK_OFFSET(FcDirect, count, 288);
FC_CHECK_OFFSET(FcDirect, kind, 296);
FC_CHECK_OFFSET(FcDirect, rank, 300);
FC_CHECK_OFFSET(FcDirect, nranks, 304);
FC_CHECK_OFFSET(FcDirect, root, 308);
FC_CHECK_OFFSET(FcDirect, nblocks, 312);
FC_CHECK_OFFSET(FcDirect, reserved, 316);
FC_CHECK_OFFSET(FcDirect, op, 320);

// ---- the peer engine (peer.cu) ----------------------------------------------------------------
// Collectives in rounds: block b of rank p stores round s's message for rank q into q's
// staging slot [p][b][s parity][phase] and raises q's flag line [b][p][phase] to s; q waits for
// its senders' flags, then reads its slots. Phase 0 carries inputs (all-reduce: the owner's
// share), phase 1 an all-reduce owner's result (a one-shot all-reduce's round fills both);
// flag phase 2 is q's acknowledgement of round s in p's memory. Direct rounds (peer.cu) use the
// lines' second halves: q posts its output there in phase 2's line (FC_PEER_POST_*), and p marks
// its first direct round in phase 0's (FC_PEER_DIRECT_FROM).
#define FC_PEER_MAX_RANKS 16u
#define FC_PEER_MAX_BLOCKS 128u
#define FC_PEER_THREADS 512u
#define FC_PEER_PHASES 3u
// The peer engine's line rounds (peer.cu): a warp stores four 128-byte lines at once, 480 of
// their 512 bytes data (tune::LINE_GROUP_BYTES, tune::LINE_GROUP_DATA).
#define FC_LINE_GROUP 512u
#define FC_LINE_GROUP_DATA 480u
// Byte offsets in a 128-byte flag line (the flag or acknowledgement is at 0).
#define FC_PEER_POST_SEQ 64u
#define FC_PEER_POST_ADDR 72u
#define FC_PEER_DIRECT_FROM 64u

// Passed by value; the communicator's part is filled once, the op per call.
struct FcPeer {
    fc_u64 stage[FC_PEER_MAX_RANKS];  // rank q's staging slots, as this GPU maps them
    fc_u64 flags[FC_PEER_MAX_RANKS];  // rank q's flag lines, as this GPU maps them
    fc_u64 seqs;                      // this rank's round counter per block
    fc_u64 abort;                     // as FcLaunch
    fc_u64 error;
    fc_u64 timeout_ns;
    fc_u64 count;                     // elements of the per-rank block (NCCL's count)
    fc_u64 chunk;                     // elements of one round of a block
    fc_u64 slot_bytes;                // bytes of one slot
    fc_u32 kind;                      // FC_KIND_*
    fc_u32 rank;
    fc_u32 nranks;
    fc_u32 nblocks;
    fc_u32 root;                      // rooted operations' root
    fc_u32 oneshot;                   // 1: an all-reduce on 2 ranks in one crossing (peer.cu)
    fc_u32 blocks;                    // blocks the staging is cut for (the slots' block stride)
    fc_u32 split;                     // 1: each slice on a send block and a receive block (peer.cu)
    FcOp op;
    fc_u64 views[FC_PEER_MAX_RANKS];  // where rank q may store into this rank's output (0: it may not)
    fc_u32 direct;                    // 1: senders store straight into outputs their receivers post; 2: and wait for the posts at the start
    fc_u32 post;                      // 1: this rank posts `views` to its senders
    fc_u64 stats;                     // where receivers count the direct rounds they got
    fc_u64 pull;                      // a pull (an all-reduce, a reduce): the peer's input as this GPU maps it
    fc_u64 lines;                     // line rounds (peer.cu): the flags' salt, never 0; 0: staged
    fc_u32 read;                      // 1: messages lie in their senders' staging, read over the link
    fc_u32 reserved;
};
FC_CHECK_SIZE(FcPeer, 568);
FC_CHECK_OFFSET(FcPeer, stage, 0);
FC_CHECK_OFFSET(FcPeer, flags, 128);
FC_CHECK_OFFSET(FcPeer, seqs, 256);
FC_CHECK_OFFSET(FcPeer, abort, 264);
FC_CHECK_OFFSET(FcPeer, error, 272);
FC_CHECK_OFFSET(FcPeer, timeout_ns, 280);
FC_CHECK_OFFSET(FcPeer, count, 288);
FC_CHECK_OFFSET(FcPeer, chunk, 296);
FC_CHECK_OFFSET(FcPeer, slot_bytes, 304);
FC_CHECK_OFFSET(FcPeer, kind, 312);
FC_CHECK_OFFSET(FcPeer, rank, 316);
FC_CHECK_OFFSET(FcPeer, nranks, 320);
FC_CHECK_OFFSET(FcPeer, nblocks, 324);
FC_CHECK_OFFSET(FcPeer, root, 328);
FC_CHECK_OFFSET(FcPeer, oneshot, 332);
FC_CHECK_OFFSET(FcPeer, blocks, 336);
FC_CHECK_OFFSET(FcPeer, split, 340);
FC_CHECK_OFFSET(FcPeer, op, 344);
FC_CHECK_OFFSET(FcPeer, views, 400);
FC_CHECK_OFFSET(FcPeer, direct, 528);
FC_CHECK_OFFSET(FcPeer, post, 532);
FC_CHECK_OFFSET(FcPeer, stats, 536);
FC_CHECK_OFFSET(FcPeer, pull, 544);
FC_CHECK_OFFSET(FcPeer, lines, 552);
FC_CHECK_OFFSET(FcPeer, read, 560);

// ---- the fold kernel (peer.cu, in the peer engine's module) ---------------------------------------
// The local half of a copy-and-fold reduction on 2 ranks (copy_engine.rs `fold_schedule`): the
// peer's copy engines land its share in this rank's output piece by piece, raising a word per
// copy lane in this rank's GPU memory (after the peer engine's flag lines); the kernel folds this
// rank's own operand into each piece once its word says it is there.
#define FC_CE_LANES 2u
// Pieces a copy-and-fold has at most (plan::copies::FOLD_MAX_PIECES).
#define FC_FOLD_MAX_PIECES 32u

struct FcFold {
    fc_u64 words[FC_CE_LANES];  // piece word of each copy lane (this GPU's memory)
    fc_u64 mine;                // this rank's own operand
    fc_u64 out;                 // the output: the peer's copy lands here, the result goes here
    fc_u64 count;               // elements to fold
    fc_u64 pieces;              // pieces, at most FC_FOLD_MAX_PIECES: the first `pieces` of ends
    fc_u64 abort;               // as FcLaunch
    fc_u64 error;
    fc_u64 timeout_ns;
    fc_u32 rank;
    fc_u32 nblocks;
    FcOp op;                    // type and reduction (send and recv unused)
    fc_u64 ends[FC_FOLD_MAX_PIECES];  // where each piece ends, in elements (the last: count)
};
FC_CHECK_SIZE(FcFold, 392);
FC_CHECK_OFFSET(FcFold, words, 0);
FC_CHECK_OFFSET(FcFold, mine, 16);
FC_CHECK_OFFSET(FcFold, out, 24);
FC_CHECK_OFFSET(FcFold, count, 32);
FC_CHECK_OFFSET(FcFold, pieces, 40);
FC_CHECK_OFFSET(FcFold, abort, 48);
FC_CHECK_OFFSET(FcFold, error, 56);
FC_CHECK_OFFSET(FcFold, timeout_ns, 64);
FC_CHECK_OFFSET(FcFold, rank, 72);
FC_CHECK_OFFSET(FcFold, nblocks, 76);
FC_CHECK_OFFSET(FcFold, op, 80);
FC_CHECK_OFFSET(FcFold, ends, 136);

// ---- the point-to-point kernel (p2p.cuh, in the plan kernel's module) ---------------------------
// A launch whose plan is only sends and receives (and copies for sends to oneself), run over the
// plan kernel's own connections with its protocols, so that either kernel may sit at either end
// of a connection: each step is one message (or a run of a lane's messages that cut into the
// same pieces) on one connection, cut into the plan kernel's pieces.
#define FC_P2P_MAX_STEPS 64u
#define FC_P2P_THREADS 512u
// A step's direction: FC_CONN_SEND, FC_CONN_RECV, or a local copy (a send to oneself into the
// matching receive), which has no connection.
#define FC_P2P_COPY 2u

struct FcP2pStep {
    fc_u64 base;     // the connection's slots (LL or data, as `ll` says; the receiver's memory, as
                     // this GPU maps it); a copy: its destination
    fc_u64 tail;     // send: this rank's tail word, polled; receive: the sender's, stored
    fc_u64 counter;  // this rank's counter word of the connection (messages so far)
    fc_u64 buf;      // send, copy: the message's first byte; receive: where its first byte goes
    fc_u32 bytes;    // bytes of the message
    fc_u32 piece;    // bytes per slot: the plan kernel's piece (whole elements)
    fc_u32 slots;    // slots of the connection
    fc_i32 conn;     // its index in the connection table (simple: lens and head; error records)
    fc_u32 peer;
    fc_u16 block;    // the block that runs it; a block runs its steps in table order
    fc_u8 dir;       // FC_CONN_SEND, FC_CONN_RECV or FC_P2P_COPY
    fc_u8 ll;        // 1: the LL protocol; 0: the simple one
};
FC_CHECK_SIZE(FcP2pStep, 56);
FC_CHECK_OFFSET(FcP2pStep, base, 0);
FC_CHECK_OFFSET(FcP2pStep, tail, 8);
FC_CHECK_OFFSET(FcP2pStep, counter, 16);
FC_CHECK_OFFSET(FcP2pStep, buf, 24);
FC_CHECK_OFFSET(FcP2pStep, bytes, 32);
FC_CHECK_OFFSET(FcP2pStep, piece, 36);
FC_CHECK_OFFSET(FcP2pStep, slots, 40);
FC_CHECK_OFFSET(FcP2pStep, conn, 44);
FC_CHECK_OFFSET(FcP2pStep, peer, 48);
FC_CHECK_OFFSET(FcP2pStep, block, 52);
FC_CHECK_OFFSET(FcP2pStep, dir, 54);
FC_CHECK_OFFSET(FcP2pStep, ll, 55);

// Passed by value: the connection table and status words, then the launch's steps with this
// call's buffers. Two sizes, two entry points (p2p.cuh): a small launch of LL steps carries
// 0.7 KB; 64 steps take 3.6 KB, within the classic 4 KB of kernel parameters.
#define FC_P2P_SMALL_STEPS 12u
template <fc_u32 N>
struct FcP2pN {
    fc_u64 conns;  // the FcConn table
    fc_u64 abort;  // as FcLaunch
    fc_u64 error;
    fc_u64 timeout_ns;
    fc_u32 rank;
    fc_u32 nsteps;
    FcP2pStep steps[N];
};
typedef FcP2pN<FC_P2P_MAX_STEPS> FcP2p;
typedef FcP2pN<FC_P2P_SMALL_STEPS> FcP2pSmall;
FC_CHECK_SIZE(FcP2p, 3624);
FC_CHECK_OFFSET(FcP2p, conns, 0);
FC_CHECK_OFFSET(FcP2p, abort, 8);
FC_CHECK_OFFSET(FcP2p, error, 16);
FC_CHECK_OFFSET(FcP2p, timeout_ns, 24);
FC_CHECK_OFFSET(FcP2p, rank, 32);
FC_CHECK_OFFSET(FcP2p, nsteps, 36);
FC_CHECK_OFFSET(FcP2p, steps, 40);
FC_CHECK_SIZE(FcP2pSmall, 712);
FC_CHECK_OFFSET(FcP2pSmall, steps, 40);

#define FC_KIND_ALL_REDUCE 0u
#define FC_KIND_ALL_GATHER 1u
#define FC_KIND_REDUCE_SCATTER 2u
#define FC_KIND_BROADCAST 3u
#define FC_KIND_REDUCE 4u
#define FC_KIND_ALL_TO_ALL 5u
#define FC_KIND_GATHER 6u
#define FC_KIND_SCATTER 7u

// One end of a single-producer single-consumer FIFO, as this GPU addresses it. The FIFO's
// data, lens and head live in the receiver's memory, tail in the sender's; each side also has a
// private counter word in its own memory that carries its position from launch to launch.
//
//   dir = FC_CONN_RECV: data, lens, head local; tail = the sender's tail (peer mapping);
//                       counter = slots consumed so far.
//   dir = FC_CONN_SEND: data, lens, head = the receiver's (peer mapping); tail local;
//                       counter = slots produced so far.
//
// head counts slots published, tail slots freed; both only grow (64 bits never wrap). Slot k
// of the stream lives at data + (k % slots) * slot_bytes with its byte length at lens[k % slots].
// All words start at zero when the connection is made.
struct FcConn {
    fc_u64 data;
    fc_u64 lens;
    fc_u64 head;
    fc_u64 tail;
    fc_u64 counter;
    fc_u32 slots;
    fc_u32 slot_bytes;
    fc_u32 peer;  // for error records only
    fc_u32 dir;
    fc_u64 ll;  // the LL slots: `slots` of 2 * FC_LL_DATA bytes, where data would be
    // Zero-copy: {first message of the posted run + 1, output address, output bytes}, in the
    // sender's memory: the receiver writes it (FC_STEP_POST), the sender polls it.
    fc_u64 post;
};
FC_CHECK_SIZE(FcConn, 72);
FC_CHECK_OFFSET(FcConn, data, 0);
FC_CHECK_OFFSET(FcConn, lens, 8);
FC_CHECK_OFFSET(FcConn, head, 16);
FC_CHECK_OFFSET(FcConn, tail, 24);
FC_CHECK_OFFSET(FcConn, counter, 32);
FC_CHECK_OFFSET(FcConn, slots, 40);
FC_CHECK_OFFSET(FcConn, slot_bytes, 44);
FC_CHECK_OFFSET(FcConn, peer, 48);
FC_CHECK_OFFSET(FcConn, dir, 52);
FC_CHECK_OFFSET(FcConn, ll, 56);
FC_CHECK_OFFSET(FcConn, post, 64);

// Written once per failure: the first block to win `claimed` fills the record and then sets
// `code` (after a system fence), so a reader that sees code != 0 sees the whole record. Other
// blocks leave at their next wait when `claimed` is set. The host zeroes it to reuse the
// communicator (it normally does not: a failed launch leaves the FIFOs in an unknown state).
struct FcError {
    fc_u32 claimed;
    fc_u32 code;
    fc_u32 lane;
    fc_u32 step;  // index within the lane
    fc_u32 peer;
    fc_u32 what;
    fc_i32 conn;
    fc_u32 rank;
    fc_u64 expected;  // length check: expected bytes; timeout: timeout_ns
    fc_u64 got;       // length check: received bytes; timeout: ns waited
    fc_u64 wanted;    // one-kernel engines: the flag value (round, epoch) the wait was for
    fc_u64 seen;      // one-kernel engines: the value last read there
};
FC_CHECK_SIZE(FcError, 64);
FC_CHECK_OFFSET(FcError, claimed, 0);
FC_CHECK_OFFSET(FcError, code, 4);
FC_CHECK_OFFSET(FcError, lane, 8);
FC_CHECK_OFFSET(FcError, step, 12);
FC_CHECK_OFFSET(FcError, peer, 16);
FC_CHECK_OFFSET(FcError, what, 20);
FC_CHECK_OFFSET(FcError, conn, 24);
FC_CHECK_OFFSET(FcError, rank, 28);
FC_CHECK_OFFSET(FcError, expected, 32);
FC_CHECK_OFFSET(FcError, got, 40);
FC_CHECK_OFFSET(FcError, wanted, 48);
FC_CHECK_OFFSET(FcError, seen, 56);

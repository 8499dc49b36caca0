// ferroccl_peer: the peer engine. All-reduce (two-shot), reduce-scatter, all-gather,
// all-to-all, gather and scatter, and on 2 ranks broadcast and reduce (one-shot), of one
// operation, in rounds (algo/direct.rs `all_reduce_two_shot` and algo/oneshot.rs, with the
// tuner's chunk as the round): block b of every rank takes the same slice of the operation
// (cut as algo::channel_slice) and walks it round by round. In a round a block stores each
// receiver's message straight into that receiver's staging slot, with 16-byte vector stores
// over NVLink, then raises one flag line per receiver; a receiver waits for the flags of its
// senders and reads its own slots, which are local memory. No FIFO, no head or length words,
// no per-slot handshake: one flag per block, peer, phase and round.
//
// Phases of a round s (slots alternate by s's parity):
//  0: every sender stores what each receiver needs of its input (all-reduce: the receiver's
//     share of the round; reductions pre-multiplied, as the plan's Send says) into the
//     receiver's input slot, and flags it;
//  (an all-reduce on 2 ranks may go one-shot, FcPeer::oneshot: each rank stores its whole
//  round, into both phases' slots, and each folds the two; nothing more crosses;
//  the other kinds' rounds, one phase each, likewise fill both slots of their parity: the
//  tuner's chunk is two slots, so a flag, a wait and an acknowledgement carry twice the bytes);
//  then all-reduce: each rank reduces its share (own input first, then the peers' in the
//     plan's order: each element reduced once, by its owner, so every rank gets the same
//     bits), stores the result into its output and every peer's result slot (phase 1), flags
//     it, waits for the peers' results and copies them into its output; the others: each
//     receiver reduces or copies what it received.
//  Every rank acknowledges round s to every peer (phase 2, in the peer's memory), whether it
//  received from it or not, at the first barrier of round s+1 of a rooted operation, and the
//  last round of a launch at the start of the block's next launch (a relaxed store: that launch
//  begins only once the previous one is complete and its memory operations performed, so the
//  kernel boundary orders the reads before it, where a release at the launch's end cost a
//  system-scope fence, 0.8 us a launch on an H100: bench/probes/graph_launch.cu);
//  a sender writes a slot parity again (round s+2) once the receiver acknowledged round s,
//  each warp checking for itself before its first store. Rooted operations send one way
//  only, so nothing else tells a sender that its slot was read; where every rank sends to
//  every rank, the phase-0 flags of round s+1 that a sender waited for already say so, and
//  only a launch's first round looks, and only when the block's round before was a rooted
//  operation's (the counter's top bit says whether it was symmetric).
// Round counters live per block on each rank (seqs[b]) and advance by the same number of
// rounds on every rank, whatever mix of operations runs, because every rank cuts every
// operation alike (a rank with nothing to send or receive in a round still counts it). A split
// launch's receive blocks keep their own (seqs[FC_PEER_MAX_BLOCKS + b]): a send block with
// nothing to wait for (a reduce's root, a launch of one or two rounds) can finish and advance
// its counter before its slice's receive block has even started, which would then begin at the
// new value, acknowledge rounds it never read and wait for the next launch's flags (found by
// the GPU test with two ranks sharing one GPU, where not every block starts at once). Blocks
// that do both write both.
//
// Direct rounds (FcPeer::direct, the movement kinds): a receiver whose output lies in memory its
// senders have mapped (a registered buffer or window) posts that output at its launch's start,
// once every earlier operation of its stream is complete: the address each sender maps it at and
// the launch's first round, in the second half of the acknowledgement line it owns in the
// sender's memory. A sender looks for the post at the end of every round but its last, and
// from two rounds after it finds one it stores that receiver's messages straight into the
// output (no room check: no slot is involved) until the launch ends; it marks that first direct
// round in the second half of the receiver's flag line before the flag that covers it, so a
// receiver that waited for round s knows whether s came straight (the mark is of this launch and
// not after s) and skips its copy out of the staging. Nobody waits for a post: a receiver that
// posts late, or not at all, gets staged rounds. A post is read only between the launch's start
// and the sender's last store to that receiver, before which the receiver cannot finish the
// launch and post the next one, so a post's address and round are always one launch's.
//
// Its own module (kernels.rs): NVRTC compiles it beside the plan kernel's and the direct
// engine's, each on its own thread, so a first start waits for the longest of the three.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "types.cuh"
#include "fifo.cuh"
#include "reduce.cuh"

namespace fc {

// Slot [from][b][parity][phase] in `owner`'s staging (no slots for the owner itself), for the
// P.blocks blocks the staging is cut for. Sender first: each sender's slots are one region,
// which the copy engine borrows whole. A parity's two phases are adjacent: every one-shot round
// (all but the two-shot all-reduce) stores up to twice a slot from phase 0's on, into both.
__device__ __forceinline__ fc_u8* peer_slot(const FcPeer& P, fc_u32 owner, fc_u32 b, fc_u32 from, fc_u32 phase, fc_u64 s) {
    const fc_u32 f = from < owner ? from : from - 1u;
    const fc_u64 i = (((fc_u64)f * P.blocks + b) * 2u + (s & 1u)) * 2u + phase;
    return (fc_u8*)P.stage[owner] + i * P.slot_bytes;
}

// Where round s's message from rank `from` to rank `to` lies. Stored rounds: in the receiver's
// staging (slot [from] of `to`), written over the link, read locally. Read rounds (FcPeer::read,
// one-phase rounds): in the sender's own staging (slot [to] of `from`), written locally, read by
// the receiver over the link. NCCL's P2P read mode (as the all-reduce's pull, but out of a
// staging slot): the flag's release then waits for local stores only, where a round of stores
// over NVLink held the block's flag back until the link acknowledged them. The slot the
// protocol hands over is the pair's either way (one region per ordered pair of ranks, the same
// parity rule, acknowledgements and room checks), so rounds of either kind may follow each
// other: region [q] of rank r carries q's stored rounds to r and r's read rounds to q, and both
// are written only after the rank that reads them acknowledged the same parity, and read only
// by that one rank.
__device__ __forceinline__ fc_u8* peer_msg(const FcPeer& P, fc_u32 from, fc_u32 to, fc_u32 b, fc_u32 phase, fc_u64 s) {
    return P.read != 0u ? peer_slot(P, from, b, to, phase, s) : peer_slot(P, to, b, from, phase, s);
}

// Flag line [b][from][phase] in `owner`'s flag area, 128 bytes each (phase 2: acknowledgements).
__device__ __forceinline__ fc_u64* peer_flag(const FcPeer& P, fc_u32 owner, fc_u32 b, fc_u32 from, fc_u32 phase) {
    return (fc_u64*)(P.flags[owner] + (((fc_u64)b * P.nranks + from) * FC_PEER_PHASES + phase) * 128u);
}

// Every peer when `only` is FC_PEER_ALL, else that one rank (never this rank).
#define FC_PEER_ALL 0xffffffffu
__device__ __forceinline__ bool peer_in(const FcPeer& P, fc_u32 q, fc_u32 only) {
    return q < P.nranks && q != P.rank && (only == FC_PEER_ALL || q == only);
}

// A block's direct-round state (see the top), in shared memory.
struct PeerDirect {
    bool on;         // the launch may run direct rounds (FcPeer::direct, a movement kind)
    fc_u64 s0;       // the launch's first round
    fc_u64* to;      // [2][FC_PEER_MAX_RANKS]: where the round of parity p stores q's messages
                     // (q's posted output; 0: q's staging slot), set by thread q two rounds ahead
    fc_u32* from;    // [FC_PEER_MAX_RANKS]: 1 when the round waited for came straight from q
    fc_u32* marked;  // [FC_PEER_MAX_RANKS]: thread q marked its first direct round for q
};

// Thread q, a sender: the output receiver q posted to this block for the launch starting at
// round s0, or 0.
__device__ __forceinline__ fc_u64 peer_posted(const FcPeer& P, fc_u32 slice, fc_u32 q, fc_u64 s0) {
    const fc_u8* line = (const fc_u8*)peer_flag(P, P.rank, slice, q, 2);
    if (ld_acquire_sys((const fc_u64*)(line + FC_PEER_POST_SEQ)) != s0) return 0;
    return *(const volatile fc_u64*)(line + FC_PEER_POST_ADDR);
}

// Thread q, a sender to q, before round s's barrier: when round s is its first direct round to
// q, the mark in q's flag line (the flag released after the barrier covers it).
__device__ __forceinline__ void peer_direct_mark(const FcPeer& P, const PeerDirect& D, fc_u32 slice, fc_u64 s, fc_u32 to) {
    const fc_u32 q = threadIdx.x;
    if (!D.on || !peer_in(P, q, to) || D.marked[q] != 0u || D.to[(s & 1u) * FC_PEER_MAX_RANKS + q] == 0) return;
    st_relaxed_sys((fc_u64*)((fc_u8*)peer_flag(P, q, slice, P.rank, 0) + FC_PEER_DIRECT_FROM), s);
    D.marked[q] = 1u;
}

// FcPeer::direct 2 (tune::Choice::wait_posts: every receiver posts, as symmetric windows do):
// before its first round, thread q, a sender to q, waits up to FC_PEER_POST_WAIT_NS for q's post
// of this launch, and with it stores straight into q's output from the first round on (where a
// look finds it two rounds on at the earliest): a launch of one or two rounds a block then makes
// no copy out of the staging. A post that comes later gets staged rounds and the looks, as ever.
#ifndef FC_PEER_POST_WAIT_NS
#define FC_PEER_POST_WAIT_NS 5000
#endif
__device__ __forceinline__ void peer_direct_wait(const FcPeer& P, const PeerDirect& D, fc_u32 slice, fc_u32 to) {
    const fc_u32 q = threadIdx.x;
    if (!D.on || P.direct != 2u || !peer_in(P, q, to)) return;
    const fc_u64 t0 = globaltimer();
    fc_u64 a;
    while ((a = peer_posted(P, slice, q, D.s0)) == 0 && globaltimer() - t0 < FC_PEER_POST_WAIT_NS) {
    }
    D.to[q] = a;
    D.to[FC_PEER_MAX_RANKS + q] = a;
}

// Thread q, a sender to q, after round s's barrier (every thread's use of round s's choice is
// over, and round s + 2's comes after round s + 1's barrier): where round s + 2 stores q's
// messages, direct once round s + 1 is, else as the post now says. Off the rounds' critical
// path: only thread q's warp waits for the load.
__device__ __forceinline__ void peer_direct_look(const FcPeer& P, const PeerDirect& D, fc_u32 slice, fc_u64 s, fc_u32 to) {
    const fc_u32 q = threadIdx.x;
    if (!D.on || !peer_in(P, q, to)) return;
    const fc_u64 next = D.to[((s + 1u) & 1u) * FC_PEER_MAX_RANKS + q];
    D.to[(s & 1u) * FC_PEER_MAX_RANKS + q] = next != 0 ? next : peer_posted(P, slice, q, D.s0);
}

// Every warp for itself, before its first store of round s: the peers this round sends to
// (`to`) have read their slots of round s - 2, the same parity. Lane 0 polls this rank's own
// acknowledgement lines (acquire; usually long since there, so no block barrier stands on the
// way to the first store), and the warp barrier orders the other lanes' stores after it. False
// on failure, decided for the block at the next barrier.
__device__ __forceinline__ bool peer_room(const FcPeer& P, fc_u32 slice, fc_u64 s, fc_u32 to, const fc_u64* direct_to = nullptr) {
    if (s <= 2) return true;
    int ok = 1;
    if ((threadIdx.x & 31u) == 0) {
        for (fc_u32 q = 0; q < P.nranks && ok; ++q) {
            if (!peer_in(P, q, to) || (direct_to != nullptr && direct_to[q] != 0)) continue;
            const fc_u64* f = peer_flag(P, P.rank, slice, q, 2);
            fc_u32 polls = 0;
            fc_u64 since = 0;
            fc_u64 v;
            while ((v = ld_acquire_sys(f)) + 2u < s) {
                if (!engine_keep_waiting(P, polls, since, FC_WHAT_ROOM, q, s - 2u, v)) {
                    ok = 0;
                    break;
                }
            }
        }
    }
    __syncwarp();
    return __shfl_sync(0xffffffffu, ok, 0) != 0;
}

// Block-wide, at the first barrier of round s: false on every thread when one failed (`bad`);
// else thread q acknowledges round `ack` (s - 1: every thread's reads of it came before this
// barrier) to peer q, and when `to` names q and `phase` is a phase (not FC_PEER_PHASES), tells
// q this block's stores of the phase are done. The ordering of fifo.cuh: the barrier puts
// every thread's stores before thread q's release, which is cumulative and orders the flag
// after them.
__device__ __forceinline__ bool peer_signal(const FcPeer& P, fc_u32 slice, fc_u32 phase, fc_u64 s, fc_u32 to, int bad, fc_u64 ack) {
    if (__syncthreads_or(bad)) return false;
    const fc_u32 q = threadIdx.x;
    if (ack > 0 && peer_in(P, q, FC_PEER_ALL)) st_release_sys(peer_flag(P, q, slice, P.rank, 2), ack);
    if (phase < FC_PEER_PHASES && peer_in(P, q, to)) {
        st_release_sys(peer_flag(P, q, slice, P.rank, phase), s);
    }
    return true;
}

// Block-wide: thread q polls line [b][q][phase] of this rank's flags until it reaches s, for
// the peers `from` names; false, on every thread, when a wait failed (abort, deadline,
// another block's failure). The barrier also orders every thread's later loads after the
// acquiring poll.
// With `D` (phase 0 of a launch that may run direct rounds), thread q also records whether
// round s came straight into the output (q's mark of this launch, not after s).
__device__ __forceinline__ bool peer_wait(const FcPeer& P, fc_u32 slice, fc_u32 phase, fc_u64 s, fc_u32 from, const PeerDirect* D = nullptr) {
    int bad = 0;
    const fc_u32 q = threadIdx.x;
    if (peer_in(P, q, from)) {
        const fc_u64* f = peer_flag(P, P.rank, slice, q, phase);
        fc_u32 polls = 0;
        fc_u64 since = 0;
        fc_u64 v;
        while ((v = ld_acquire_sys(f)) < s) {
            if (!engine_keep_waiting(P, polls, since, FC_WHAT_DATA, q, s, v)) {
                bad = 1;
                break;
            }
        }
        if (D != nullptr && D->on) {
            const fc_u64 d = *(const volatile fc_u64*)((const fc_u8*)f + FC_PEER_DIRECT_FROM);
            D->from[q] = (d >= D->s0 && d <= s) ? 1u : 0u;
        }
    }
    return __syncthreads_or(bad) == 0;
}

// A split launch (FcPeer::split, FERROCCL_GPU_PEER_SPLIT, one-phase rounds only) runs each slice
// on two blocks: the first half of the grid sends (room, stores, flags, the own block's copy),
// the second half receives (waits, reads, and acknowledges every round to every peer), each at
// its own pace, so that the link stays busy while the receiver copies out. The flow model's
// `Engine::PeerSplit` proves the protocol. Otherwise one block does both, as described above.
#define FC_ROLE_BOTH 0u
#define FC_ROLE_SEND 1u
#define FC_ROLE_RECV 2u

// A split launch in place, where a rank's output is its input (an all-to-all, the one-shot
// all-reduce): the receive block writes round s over the input its send block reads in round s.
// Each rank decides it by its own pointers alone (in-place-ness is a rank's own, so the tuner
// splits in and out of place alike): its send block says when it has stored a round, in a word
// per slice of this GPU's memory after the two counter arrays (`Geometry::peer_sent_off`), and
// its receive block waits for that round before it writes. The words only grow, as rounds do.
// Whether a launch's rounds flag every peer every round (its last round's flags then stand for the
// acknowledgements): the symmetric kinds', and a pull's, a reduce's included (its flow is the
// all-reduce's pull).
__device__ __forceinline__ bool flows_symmetric(const FcPeer& P) {
    return symmetric_kind(P.kind) || P.pull != 0;
}

__device__ __forceinline__ bool split_in_place(const FcPeer& P, fc_u32 kind, fc_u32 role) {
    return role != FC_ROLE_BOTH && P.op.send == P.op.recv && (kind == FC_KIND_ALL_TO_ALL || kind == FC_KIND_ALL_REDUCE);
}

__device__ __forceinline__ fc_u64* peer_sent_word(const FcPeer& P, fc_u32 slice) {
    return (fc_u64*)P.seqs + 2u * FC_PEER_MAX_BLOCKS + slice;
}

// The send block, after the barrier in its round's signal ended every thread's reads of round s.
__device__ __forceinline__ void peer_say_sent(const FcPeer& P, fc_u32 slice, fc_u64 s) {
    if (threadIdx.x == 0) st_release_sys(peer_sent_word(P, slice), s);
}

// The receive block, before it writes round s: block-wide; false when the wait failed.
__device__ __forceinline__ bool peer_wait_sent(const FcPeer& P, fc_u32 slice, fc_u64 s) {
    int bad = 0;
    if (threadIdx.x == 0) {
        const fc_u64* w = peer_sent_word(P, slice);
        fc_u32 polls = 0;
        fc_u64 since = 0;
        fc_u64 v;
        while ((v = ld_acquire_sys(w)) < s) {
            if (!engine_keep_waiting(P, polls, since, FC_WHAT_SENT, P.rank, s, v)) {
                bad = 1;
                break;
            }
        }
    }
    return __syncthreads_or(bad) == 0;
}

// FC_PEER_TRACE (a diagnostic, FERROCCL_KERNEL_DEFINES=FC_PEER_TRACE=64): block 0's thread 0
// takes the SM clock at each step of an all-reduce round and prints the steps' cycles for every
// 64th round; off (and compiled out) otherwise.
#ifdef FC_PEER_TRACE
__device__ fc_u64 fc_peer_trace[10];
#define FC_PEER_STAMP(i) \
    if (threadIdx.x == 0 && blockIdx.x == 0) fc::fc_peer_trace[i] = clock64()
#else
#define FC_PEER_STAMP(i)
#endif

// Whether `rank`'s 2-rank fold puts its own operand first: reduce_as folds (received, local), so
// rank 0 gets (rank 1's, rank 0's). Sum, its pre-multiplied and averaged forms, and Prod give the
// same bits either way round; Max and Min may not (a signed zero, a NaN's payload), so rank 1
// swaps its operands and both ranks fold in one operand order. Every 2-rank fold asks here:
// fold_pair (the staged one-shot, the pull, the copy-and-fold) and the line rounds' line_fold.
template <bool SUM>
__device__ __forceinline__ bool fold_swaps(fc_u32 redop, fc_u32 rank) {
    return !SUM && rank == 1u && (redop == FC_OP_MAX || redop == FC_OP_MIN);
}

// out = the fold of the peer's and this rank's operands on 2 ranks, in one operand order on both
// (fold_swaps).
template <typename D, bool SUM, int U = FC_REDUCE_UNROLL>
__device__ __forceinline__ void fold_pair(const FcOp& op, fc_u32 rank, fc_u8* out, const fc_u8* theirs, const fc_u8* mine,
                                          fc_u64 len) {
    const bool swap = fold_swaps<SUM>(op.redop, rank);
    reduce_as<D, SUM, U>(op, out, nullptr, swap ? mine : theirs, swap ? theirs : mine, len, true, true);
}

// ---- line rounds (FcPeer::lines; the tuner's Protocol::LL128, tune::peer_lines) ----------------
// The one-shot all-reduce, the reduce-scatter and the reduce on 2 ranks with no flag word: each
// warp stores its part of the round into the peer's slots as 128-byte lines that carry the
// round's flag, and one step behind its own stores folds the peer's lines at the same places of
// its own slots as they land, with its own operand for them still in its registers (the
// all-reduce's is what it stored; the reduce-scatter stores the peer's share and folds its own;
// a reduce's root only folds and its peer only stores). So no release drains a block's stores before
// a flag, no flag crosses on its own, and nobody waits for the whole round before folding: the
// link stays busy through the fold, for 1/16 more bytes on it.
// A warp stores 512 bytes at once: four lines, lane l's 16 bytes at l * 16. The last lane of each
// line (7, 15, 23, 31) stores 8 data bytes and the flag, the others 16 data bytes: 480 data bytes
// a store, a contiguous run of the round's bytes (lanes 0-6, 8-14, 16-22 and 24-30 its first 448
// bytes in that order, 16 each, the flag lanes its last 32, 8 each). NVLink carries a warp's
// 128-byte store whole, so a line whose flag is the round's holds the round's 120 data bytes (the
// property NCCL's LL128 protocol takes; the communicator offers lines only where every link is
// NVLink), and a warp's load of a whole line reads it as one access, so the data read with a
// round's flag is that round's (FC_LINE_RELOAD reads it again after the flags, for doubt). The
// flag is the round mixed with the communicator's salt (FcPeer::lines): between line rounds the
// slots hold raw data (staged rounds, the copy engine), which must never pass for a flag.
// Flow control: a round ends in a block barrier, after which the warps start the next round's
// lines; so a rank that has read every line of the peer's round s + 1 (its own barrier at the end
// of round s + 1 says so) knows the peer is done with round s's slots, which round s + 2 reuses.
// A reduce has no such return traffic: its root acknowledges each round once the round's barrier
// has ended its reads, and the sender looks for room before every round (the flow model's
// `LinesToRoot`). The next launch after a symmetric line round may skip its room check, as after
// any symmetric one; a launch's first round after a rooted one looks at the acknowledgements, as
// the staged rounds do.
// In place, a warp folds only groups whose own operand it loaded itself (the same warp, the same
// places), so no fold overwrites input not yet sent; a reduce-scatter's output, its own share,
// is never what it sends.
// Measured on 2 x H200 (docs/PERFORMANCE.md sections 23-24): faster than the staged rounds to
// 1 MiB (the tuner's default), slower from 2 MiB (the lines' stores reach about 290 GB/s against
// the staged rounds' 320); separate store and fold warps were slower at every size, and so was a
// system fence after a warp's last stores (about 1 us a round; it did not end the slow rows that
// FC_LINE_POLL_NS ends).
// A warp's store of four lines, FC_LINE_GROUP bytes of which FC_LINE_GROUP_DATA data: types.cuh.
// Groups a warp loads and stores at once (its loads in flight together); it folds them a step
// later, once the next step's lines are stored.
#ifndef FC_LINE_STEP
#define FC_LINE_STEP 2
#endif
// 1: the lines read again once their flags are seen (see line_round); 0, the default: the data
// read with the flags is used (0 to 0.5 us a round faster; both exact in the check sweeps).
#ifndef FC_LINE_RELOAD
#define FC_LINE_RELOAD 0
#endif

// Nanoseconds a warp pauses between polls that found a stale line. Without a pause, in about
// 0.2 % of the rows measured (each a CUDA graph of 80 operations; 47 of 22,500) every operation
// ran at under 1 GB/s, 100-600 us where its neighbours took 5-10; with this pause 1 of 12,600 (2
// of 25,200 across the variants with a 100-200 ns pause; docs/PERFORMANCE.md section 24). The
// suspicion, not proven: polls of the lines that the link is writing hold those writes back, and
// two ranks stay in step that way from one operation to the next.
#ifndef FC_LINE_POLL_NS
#define FC_LINE_POLL_NS 200
#endif
// A diagnostic (FERROCCL_KERNEL_DEFINES=FC_LINE_DEADLINE_NS=N): a line wait fails once N ns have
// passed since its 256th stale poll (engine_keep_waiting starts the clock there; 0: the
// communicator's timeout only), reported as a timeout naming the block, the round waited for and
// the round the stale line held (an arbitrary number where the line holds raw data).
#ifndef FC_LINE_DEADLINE_NS
#define FC_LINE_DEADLINE_NS 0
#endif

__device__ __forceinline__ fc_u64 line_flag(const FcPeer& P, fc_u64 s) { return P.lines ^ (s * 0x9e3779b97f4a7c15ull); }
// The round whose flag a line holds (the multiplier's inverse mod 2^64), for error records: a
// line that never carried a flag (raw data of other rounds) reads as an arbitrary number.
__device__ __forceinline__ fc_u64 line_round_of(const FcPeer& P, fc_u64 flag) { return (flag ^ P.lines) * 0xf1de83e19937733dull; }

// Where lane l's data lies in its group's 480 bytes.
__device__ __forceinline__ fc_u32 line_lane_off(fc_u32 lane) {
    return (lane & 7u) == 7u ? 448u + (lane >> 3) * 8u : ((lane >> 3) * 7u + (lane & 7u)) * 16u;
}

// The bytes of group g this lane carries: `width` (16, or 8 on a flag lane) where the round's
// `bytes` reach past them, fewer in its last group, none beyond.
__device__ __forceinline__ fc_u32 line_valid(fc_u64 g, fc_u32 off, fc_u32 width, fc_u64 bytes) {
    const fc_u64 a = g * FC_LINE_GROUP_DATA + off;
    return a >= bytes ? 0u : (bytes - a < width ? (fc_u32)(bytes - a) : width);
}

// n (0-16) bytes at p as two little-endian words, zero past n: one 16-byte load where they are
// whole and aligned, else load8's (any element alignment).
__device__ __forceinline__ void line_get(const fc_u8* p, fc_u32 n, fc_u64& x, fc_u64& y) {
    if (n == 16u && ((fc_u64)p & 15u) == 0) {
        const uint4 v = __ldcg((const uint4*)p);
        x = (fc_u64)v.x | ((fc_u64)v.y << 32);
        y = (fc_u64)v.z | ((fc_u64)v.w << 32);
        return;
    }
    x = load8(p, n < 8u ? n : 8u);
    y = n > 8u ? load8(p + 8, n - 8u) : 0;
}

// And back: the first n bytes of (x, y) to p.
__device__ __forceinline__ void line_put(fc_u8* p, fc_u32 n, fc_u64 x, fc_u64 y) {
    if (n == 16u && ((fc_u64)p & 15u) == 0) {
        *(uint4*)p = make_uint4((fc_u32)x, (fc_u32)(x >> 32), (fc_u32)y, (fc_u32)(y >> 32));
        return;
    }
    store8(p, x, n < 8u ? n : 8u);
    if (n > 8u) store8(p + 8, y, n - 8u);
}

__device__ __forceinline__ void line_store(fc_u8* p, fc_u64 x, fc_u64 y) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(x), "l"(y) : "memory");
}

__device__ __forceinline__ void line_load(const fc_u8* p, fc_u64& x, fc_u64& y) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(x), "=l"(y) : "l"(p) : "memory");
}

// The sender's side of a PreMulSum: its operand times its own scalar (as transform_as does for
// the staged rounds), so that each rank's scalar is applied once, by that rank.
template <typename D>
__device__ __forceinline__ void line_premul(fc_u64& x, fc_u64& y, typename D::C scalar) {
    x = transform_word<D>(x, true, false, scalar, 1u);
    y = transform_word<D>(y, true, false, scalar, 1u);
}

// (x, y) = the fold of the peer's (tx, ty) and this rank's (x, y), element by element, in the
// operand order fold_swaps gives, with reduce_elem's scalar and average (fold_word: the 1- and
// 2-byte types a 32-bit word at a time, a bfloat16 or half Sum by the packed add; in a warp's
// fold after the lines land, one instruction a pair instead of two widenings, an add and a
// narrowing an element, docs/PERFORMANCE.md section 31).
template <typename D>
__device__ __forceinline__ void line_fold(fc_u64& x, fc_u64& y, fc_u64 tx, fc_u64 ty, fc_u32 k, bool pre, bool post, bool swap,
                                          typename D::C scalar, fc_u32 nranks) {
    x = fold_word<D>(swap ? x : tx, swap ? tx : x, k, pre, post, scalar, nranks);
    y = fold_word<D>(swap ? y : ty, swap ? ty : y, k, pre, post, scalar, nranks);
}

// One line round of block b over `len` elements (see above): what this rank sends starts at
// `src` (where it `sends`), its own operand at `own` and its result at `out` (where it
// `receives`). The all-reduce sends and folds the same elements (src == own); the
// reduce-scatter sends the peer's share and folds its own; a reduce's root only receives and
// its peer only sends. false, on every thread, when a wait failed. Ends in a barrier (the flow
// control's), after which a reduce's root acknowledges the round (`ack_round`), as nothing
// else tells its peer that the slots are free again.
template <typename D, bool SUM>
__device__ bool line_round(const FcPeer& P, const fc_u8* src, const fc_u8* own, fc_u8* out, fc_u64 len, fc_u64 s, bool check_room,
                           bool sends, bool receives, bool ack_round, fc_u32 b) {
    const fc_u32 me = P.rank, q = 1u - me;
    const FcOp& op = P.op;
    const fc_u64 es = sizeof(typename D::S), bytes = len * es;
    const bool same = src == own;
    fc_u8* far = peer_slot(P, q, b, me, 0, s);
    const fc_u8* near = peer_slot(P, me, b, q, 0, s);
    const fc_u64 flag = line_flag(P, s);
    const fc_u32 k = SUM ? FC_OP_SUM : op.redop;
    const bool pre = k == FC_OP_PREMULSUM, post = k == FC_OP_AVG;
    const bool swap = fold_swaps<SUM>(k, me);
    const typename D::C scalar = pre ? scalar_of<D>(op) : typename D::C(0);
    const fc_u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const bool flagger = (lane & 7u) == 7u;
    const fc_u32 off = line_lane_off(lane), width = flagger ? 8u : 16u;
    // This warp's groups: warp, warp + nw, ...; a step is FC_LINE_STEP of them.
    const fc_u64 groups = (bytes + FC_LINE_GROUP_DATA - 1u) / FC_LINE_GROUP_DATA;
    const fc_u64 mine = groups > warp ? (groups - warp + nw - 1u) / nw : 0;
    const fc_u64 steps = (mine + FC_LINE_STEP - 1u) / FC_LINE_STEP;
    // Every condition below is the warp's own (warp, step, group), so its votes see every lane.
    int bad = sends && check_room && !peer_room(P, b, s, q);
    // The step before's own operand, kept for its fold.
    fc_u64 px[FC_LINE_STEP], py[FC_LINE_STEP];
    for (fc_u64 st = 0; st <= steps && !bad; ++st) {
        fc_u64 x[FC_LINE_STEP], y[FC_LINE_STEP];
        if (st < steps) {
            // What this step stores: the own operand itself where the two are the same.
            fc_u64 sx[FC_LINE_STEP], sy[FC_LINE_STEP];
#pragma unroll
            for (int u = 0; u < FC_LINE_STEP; ++u) {
                const fc_u64 i = st * FC_LINE_STEP + u, g = warp + i * nw;
                if (i >= mine) continue;
                const fc_u32 n = line_valid(g, off, width, bytes);
                if (receives) line_get(own + g * FC_LINE_GROUP_DATA + off, n, x[u], y[u]);
                if (!sends) continue;
                if (receives && same) {
                    sx[u] = x[u];
                    sy[u] = y[u];
                } else {
                    line_get(src + g * FC_LINE_GROUP_DATA + off, n, sx[u], sy[u]);
                }
            }
            if (sends) {
#pragma unroll
                for (int u = 0; u < FC_LINE_STEP; ++u) {
                    const fc_u64 i = st * FC_LINE_STEP + u, g = warp + i * nw;
                    if (i >= mine) continue;
                    if (pre) line_premul<D>(sx[u], sy[u], scalar);
                    line_store(far + g * FC_LINE_GROUP + lane * 16u, sx[u], flagger ? flag : sy[u]);
                }
            }
        }
        if (st > 0 && receives) {
            // The step before's groups: wait until every line carries this round's flag.
            fc_u64 tx[FC_LINE_STEP], ty[FC_LINE_STEP];
            fc_u32 polls = 0;
            fc_u64 since = 0;
            for (;;) {
                bool stale = false;
                fc_u64 held = flag;
#pragma unroll
                for (int u = 0; u < FC_LINE_STEP; ++u) {
                    const fc_u64 i = (st - 1u) * FC_LINE_STEP + u, g = warp + i * nw;
                    if (i >= mine) continue;
                    line_load(near + g * FC_LINE_GROUP + lane * 16u, tx[u], ty[u]);
                    if (flagger && ty[u] != flag) {
                        stale = true;
                        held = ty[u];
                    }
                }
                const fc_u32 stale_lanes = __ballot_sync(0xffffffffu, stale);
                if (stale_lanes == 0u) break;
                // The first stale lane's line, for the error record.
                held = __shfl_sync(0xffffffffu, held, __ffs(stale_lanes) - 1);
                int go = 1;
                if (lane == 0) {
                    const fc_u64 seen = line_round_of(P, held);
                    go = engine_keep_waiting(P, polls, since, FC_WHAT_DATA, q, s, seen) ? 1 : 0;
#if FC_LINE_DEADLINE_NS
                    if (go && since != 0 && globaltimer() - since > (fc_u64)FC_LINE_DEADLINE_NS) {
                        engine_error(P, FC_ERR_TIMEOUT, FC_WHAT_DATA, q, (fc_u64)FC_LINE_DEADLINE_NS, globaltimer() - since, s, seen);
                        go = 0;
                    }
#endif
                }
                if (__shfl_sync(0xffffffffu, go, 0) == 0) {
                    bad = 1;
                    break;
                }
#if FC_LINE_POLL_NS
                __nanosleep(FC_LINE_POLL_NS);
#endif
            }
            if (bad) break;
#if FC_LINE_RELOAD
            // Every flag seen, the lines read again: should a warp's load of a line ever be
            // served sector by sector, data read with its flag could predate the line's arrival;
            // a load after the flag was seen cannot.
#pragma unroll
            for (int u = 0; u < FC_LINE_STEP; ++u) {
                const fc_u64 i = (st - 1u) * FC_LINE_STEP + u, g = warp + i * nw;
                if (i < mine) line_load(near + g * FC_LINE_GROUP + lane * 16u, tx[u], ty[u]);
            }
#endif
#pragma unroll
            for (int u = 0; u < FC_LINE_STEP; ++u) {
                const fc_u64 i = (st - 1u) * FC_LINE_STEP + u, g = warp + i * nw;
                if (i >= mine) continue;
                line_fold<D>(px[u], py[u], tx[u], ty[u], k, pre, post, swap, scalar, op.nranks);
                line_put(out + g * FC_LINE_GROUP_DATA + off, line_valid(g, off, width, bytes), px[u], py[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < FC_LINE_STEP; ++u) {
            px[u] = x[u];
            py[u] = y[u];
        }
    }
    if (__syncthreads_or(bad) != 0) return false;
    // The barrier ended every warp's reads of the round; the release orders them before it.
    if (ack_round && threadIdx.x == q) st_release_sys(peer_flag(P, q, b, me, 2), s);
    return true;
}

// One round of block b over elements [at, at + len) of its slice; false when a wait failed.
// `first`: the launch's first round on this block after a rooted operation's round (or none),
// which must look at the acknowledgements. D: the element type; SHAPE: the instance's
// (reduce.cuh, FC_SHAPE_*).
template <typename D, int SHAPE>
__device__ bool peer_round(const FcPeer& P, fc_u64 at, fc_u64 len, fc_u64 s, bool first, bool last, fc_u32 slice, fc_u32 role, const PeerDirect& DR) {
    const fc_u32 n = P.nranks, me = P.rank, b = slice, t = P.root;
    const fc_u32 kind = shape_kind<SHAPE>(P.kind);
    // The reduction is Sum wherever the shape says so: the loops need not choose it.
    constexpr bool SUM = SHAPE != FC_SHAPE_ANY;
    const FcOp& op = P.op;
    const fc_u64 es = sizeof(typename D::S), c = P.count;
    const fc_u8* in = (const fc_u8*)op.send;
    fc_u8* out = (fc_u8*)op.recv;
    // Where every rank sends to every rank, the phase-0 flags of round s - 1 that this block
    // waited for told it that its receivers were done with round s - 2, whether round s - 1 was
    // this launch's or the last of the one before (the kernel boundary keeps the order): only a
    // launch's first round after a rooted operation's and rooted rounds look at the
    // acknowledgements.
    const bool symmetric = flows_symmetric(P);
    // A send block of a split launch hears of its receivers' reads only from their
    // acknowledgements: it looks before every round.
    const bool check_room = first || !symmetric || role == FC_ROLE_SEND;
    // Acknowledgements within a launch matter only to rooted rounds; the launch's last round is
    // acknowledged at the start of the next, for whatever runs then. A split launch's receive
    // blocks acknowledge every round themselves, at its end.
    const fc_u64 ack = (symmetric || role != FC_ROLE_BOTH) ? 0 : s - 1;
    const bool sending = role != FC_ROLE_RECV, receiving = role != FC_ROLE_SEND;
    if (P.lines != 0) {
        // Line rounds, 2 ranks (peer_main refuses the rest): the all-reduce, the reduce-scatter
        // (the peer's share out, the own share folded) and the reduce (into the root).
        const fc_u32 q = 1u - me;
        const fc_u8* src = in + ((kind == FC_KIND_REDUCE_SCATTER ? q * c : 0) + at) * es;
        const fc_u8* own = in + ((kind == FC_KIND_REDUCE_SCATTER ? me * c : 0) + at) * es;
        const bool rooted = kind == FC_KIND_REDUCE;
        const bool sends = !rooted || me != t, receives = !rooted || me == t;
        // A Sum folds in the Sum loop in every kernel, not only the all-reduce's own: a reduce's
        // root folds the whole buffer, and the per-element choice of the reduction cost bfloat16
        // about 1 us a MiB there (docs/PERFORMANCE.md section 30).
        if (!SUM && op.redop == FC_OP_SUM) {
            return line_round<D, true>(P, src, own, out + at * es, len, s, check_room, sends, receives, rooted && me == t, b);
        }
        return line_round<D, SUM>(P, src, own, out + at * es, len, s, check_room, sends, receives, rooted && me == t, b);
    }
    if (P.pull != 0) {
        // A pull (FcPeer::pull, 2 ranks; an all-reduce out of place, or a reduce): no store phase
        // and no slot. Each rank says its input is there (and, as every flag does, that it is done
        // with its earlier rounds' slots), waits for the peer to say the same, then reads the
        // peer's input over the link straight out of the peer's window and folds it with its own,
        // the link's reads overlapping the fold's HBM traffic. A second flag says the peer's input
        // is read; a launch ends only once its peer has read this rank's input, which the caller
        // may overwrite after it. A reduce's root alone reads and folds; its peer flags and waits
        // alike (one protocol for both kinds: the flow model's Pull, which reads fewer here).
        const fc_u32 q = 1u - me;
        if (!peer_signal(P, b, 0, s, FC_PEER_ALL, 0, ack)) return false;
        if (!peer_wait(P, b, 0, s, FC_PEER_ALL)) return false;
        if (kind == FC_KIND_ALL_REDUCE || me == t) {
            fold_pair<D, SUM>(op, me, out + at * es, (const fc_u8*)P.pull + at * es, in + at * es, len);
        }
        // Counted with the direct rounds: a round taken straight from the peer's buffer.
        if (threadIdx.x == 0 && P.stats != 0) atomicAdd((unsigned long long*)P.stats, 1ull);
        if (!peer_signal(P, b, 1, s, q, 0, 0)) return false;
        return !last || peer_wait(P, b, 1, s, q);
    }
    if (kind == FC_KIND_ALL_REDUCE && P.oneshot) {
        // One crossing on 2 ranks (the host's choice): each rank stores its whole round (twice a
        // slot, both phases' slots of the parity) into the peer's staging, and both fold the two
        // in the same order. The link carries what the two-shot's two crossings carry (half a
        // round each way, twice), without the second flag, wait and copy.
        const fc_u32 q = 1u - me;
        FC_PEER_STAMP(1);
        if (sending) {
            const int bad = check_room && !peer_room(P, b, s, FC_PEER_ALL);
            FC_PEER_STAMP(2);
            if (!bad) transform_as<D, SUM>(op, peer_msg(P, me, q, b, 0, s), in + at * es, len, true, false);
            FC_PEER_STAMP(3);
            if (!peer_signal(P, b, 0, s, FC_PEER_ALL, bad, ack)) return false;
            if (split_in_place(P, kind, role)) peer_say_sent(P, b, s);
        }
        if (!receiving) return true;
        FC_PEER_STAMP(4);
        if (!peer_wait(P, b, 0, s, FC_PEER_ALL)) return false;
        if (split_in_place(P, kind, role) && !peer_wait_sent(P, b, s)) return false;
        FC_PEER_STAMP(5);
        fold_pair<D, SUM>(op, me, out + at * es, peer_msg(P, q, me, b, 0, s), in + at * es, len);
        // A receive block acknowledges its round at once (peer_signal's barrier ends the reads).
        if (role == FC_ROLE_RECV) peer_signal(P, b, FC_PEER_PHASES, s, FC_PEER_ALL, 0, s);
        // No second crossing: the trace's steps after the reduce read 0.
        FC_PEER_STAMP(6);
        FC_PEER_STAMP(7);
        FC_PEER_STAMP(8);
        FC_PEER_STAMP(9);
        return true;
    }
    if (kind == FC_KIND_ALL_REDUCE) {
        // Share q of the round: [at + cut(q), at + cut(q + 1)).
        FC_PEER_STAMP(1);
        const int bad = check_room && !peer_room(P, b, s, FC_PEER_ALL);
        FC_PEER_STAMP(2);
        for (fc_u32 j = 1; j < n && !bad; ++j) {
            const fc_u32 q = (me + j) % n;
            const fc_u64 a = cut(len, n, q), e = cut(len, n, q + 1);
            if (e > a) transform_as<D, SUM>(op, peer_slot(P, q, b, me, 0, s), in + (at + a) * es, e - a, true, false);
        }
        FC_PEER_STAMP(3);
        if (!peer_signal(P, b, 0, s, FC_PEER_ALL, bad, ack)) return false;
        FC_PEER_STAMP(4);
        if (!peer_wait(P, b, 0, s, FC_PEER_ALL)) return false;
        FC_PEER_STAMP(5);
        const fc_u64 a = cut(len, n, me), e = cut(len, n, me + 1);
        fc_u8* own = out + (at + a) * es;
        if (e > a) {
            for (fc_u32 i = 0; i + 1 < n; ++i) {
                const fc_u32 q = (me + 1 + i) % n;
                const bool last = i + 2 == n;
                // With one peer the result goes to its slot in the same pass.
                fc_u8* also = (last && n == 2) ? peer_slot(P, q, b, me, 1, s) : nullptr;
                const fc_u8* local = i == 0 ? in + (at + a) * es : own;
                // A pass reads what the previous one wrote, by other threads where the two
                // passes' alignments (vector or element loop) differ.
                if (i > 0) __syncthreads();
                reduce_as<D, SUM>(op, own, also, peer_slot(P, me, b, q, 0, s), local, e - a, i == 0, last);
            }
            if (n > 2) {
                __syncthreads();
                for (fc_u32 j = 1; j < n; j += 2) {
                    fc_u8* d0 = peer_slot(P, (me + j) % n, b, me, 1, s);
                    fc_u8* d1 = j + 1 < n ? peer_slot(P, (me + j + 1) % n, b, me, 1, s) : nullptr;
                    copy_bytes(d0, d1, own, (e - a) * es);
                }
            }
        }
        FC_PEER_STAMP(6);
        if (!peer_signal(P, b, 1, s, FC_PEER_ALL, 0, 0)) return false;
        FC_PEER_STAMP(7);
        if (!peer_wait(P, b, 1, s, FC_PEER_ALL)) return false;
        FC_PEER_STAMP(8);
        for (fc_u32 j = 1; j < n; ++j) {
            const fc_u32 q = (me + n - j) % n;
            const fc_u64 qa = cut(len, n, q), qe = cut(len, n, q + 1);
            if (qe > qa) copy_bytes(out + (at + qa) * es, nullptr, peer_slot(P, me, b, q, 1, s), (qe - qa) * es);
        }
        FC_PEER_STAMP(9);
        return true;
    }

    const fc_u64 bytes = len * es;
    // Who sends to whom this round: everyone to everyone, the root to everyone, or everyone
    // to the root; the root's own part moves locally.
    const bool to_root = kind == FC_KIND_REDUCE || kind == FC_KIND_GATHER;
    const bool from_root = kind == FC_KIND_BROADCAST || kind == FC_KIND_SCATTER;
    const fc_u32 targets = to_root ? t : FC_PEER_ALL;
    const fc_u32 sources = from_root ? t : FC_PEER_ALL;
    const bool sends = !(to_root && me == t) && !(from_root && me != t);
    const bool receives = !(to_root && me != t) && !(from_root && me == t);
    const bool reduces = kind == FC_KIND_REDUCE_SCATTER || kind == FC_KIND_REDUCE;
    // Where each receiver keeps what a sender sends it: per sender, or one block.
    const bool per_sender = kind != FC_KIND_BROADCAST && kind != FC_KIND_SCATTER;
    const fc_u64* direct_to = DR.on ? DR.to + (s & 1u) * FC_PEER_MAX_RANKS : nullptr;
    const int bad = sending && sends && check_room && !peer_room(P, b, s, targets, direct_to);
    if (sending && sends && !bad) {
        for (fc_u32 j = 1; j < n; ++j) {
            const fc_u32 q = (me + j) % n;
            if (!peer_in(P, q, targets)) continue;
            // q's staging slot, or its output where q posted it (a direct round).
            fc_u8* slot = direct_to != nullptr && direct_to[q] != 0 ? (fc_u8*)direct_to[q] + ((per_sender ? me * c : 0) + at) * es
                                                                    : peer_msg(P, me, q, b, 0, s);
            // The block of this rank's input that q gets.
            const bool per_peer = kind == FC_KIND_REDUCE_SCATTER || kind == FC_KIND_ALL_TO_ALL || kind == FC_KIND_SCATTER;
            const fc_u8* src = in + ((per_peer ? q * c : 0) + at) * es;
            if (reduces) transform_as<D, SUM>(op, slot, src, len, true, false);
            else copy_bytes(slot, nullptr, src, bytes);
        }
    }
    if (sending && sends) peer_direct_mark(P, DR, b, s, targets);
    // This rank's own block, where it moves without a reduction.
    const fc_u8* own_src;
    fc_u8* own_dst;
    own_copy(kind, me, t, c, at, es, in, out, own_src, own_dst);
    const bool own_moves = own_src != nullptr && own_src != own_dst;
    // Who copies it: the block that sends, but in a split launch on a rank that receives nothing
    // (a scatter's or broadcast's root), the receive block, which otherwise only acknowledges:
    // on the send block the copy held each round's stores back (a scatter of 64 MiB out of place
    // 111 us against 103 in place on 2 x H200, docs/PERFORMANCE.md section 46).
    const bool own_by_recv = role != FC_ROLE_BOTH && !receives;
    if (sending) {
        if (!peer_signal(P, b, sends ? 0u : FC_PEER_PHASES, s, targets, bad, ack)) return false;
        if (split_in_place(P, kind, role)) peer_say_sent(P, b, s);
        // Every round ends in a barrier, which orders each look before the reads two rounds on.
        if (sends && !last) peer_direct_look(P, DR, b, s, targets);
        // After the flags: the receivers start on their copies while this block makes its own.
        if (own_moves && !own_by_recv) copy_bytes(own_dst, nullptr, own_src, bytes);
    }
    if (receiving && receives) {
        if (!peer_wait(P, b, 0, s, sources, &DR)) return false;
        if (split_in_place(P, kind, role) && !peer_wait_sent(P, b, s)) return false;
        if (reduces) {
            fc_u8* o = out + at * es;
            const fc_u8* mine = in + ((kind == FC_KIND_REDUCE_SCATTER ? me * c : 0) + at) * es;
            for (fc_u32 i = 0; i + 1 < n; ++i) {
                const fc_u32 q = (me + 1 + i) % n;
                if (i > 0) __syncthreads();
                reduce_as<D, SUM>(op, o, nullptr, peer_msg(P, q, me, b, 0, s), i == 0 ? mine : o, len, i == 0, i + 2 == n);
            }
        } else {
            if (DR.on && threadIdx.x == 0 && P.stats != 0) {
                fc_u64 got = 0;
                for (fc_u32 q = 0; q < n; ++q) got += peer_in(P, q, sources) && DR.from[q] != 0 ? 1u : 0u;
                if (got != 0) atomicAdd((unsigned long long*)P.stats, (unsigned long long)got);
            }
            for (fc_u32 j = 1; j < n; ++j) {
                const fc_u32 q = (me + n - j) % n;
                // A direct round is in the output already.
                if (!peer_in(P, q, sources) || (DR.on && DR.from[q] != 0)) continue;
                copy_bytes(out + ((per_sender ? q * c : 0) + at) * es, nullptr, peer_msg(P, q, me, b, 0, s), bytes);
            }
        }
    }
    // Every round, whether this rank received in it or not, so that the counters move alike.
    if (role == FC_ROLE_RECV) peer_signal(P, b, FC_PEER_PHASES, s, FC_PEER_ALL, 0, s);
    // After the acknowledgement, which it must not hold back: the input is the caller's from the
    // launch on, and nothing else writes this rank's output (it receives nothing).
    if (role == FC_ROLE_RECV && own_by_recv && own_moves) copy_bytes(own_dst, nullptr, own_src, bytes);
    return true;
}

}  // namespace fc

namespace fc {

// One kernel per element type and one more for all-reduces with Sum (ferroccl_peer_<type>[_sum],
// the host picks by the operation; the type and reduction tests only guard): see reduce_as.
template <typename D, fc_u32 DTYPE, int SHAPE>
__device__ __forceinline__ void peer_main(const FcPeer& P) {
    if (blockIdx.x >= P.nblocks || P.nranks < 2u || P.nranks > FC_PEER_MAX_RANKS || P.rank >= P.nranks) return;
    if (P.nblocks > P.blocks || P.blocks > FC_PEER_MAX_BLOCKS) return;
    // A split launch: an even grid, one-phase rounds (the host's choice; see FC_ROLE_*).
    if (P.split != 0u && ((P.nblocks & 1u) != 0u || (P.kind == FC_KIND_ALL_REDUCE && P.oneshot == 0u))) return;
    if (P.op.dtype != DTYPE || !fc::redop_valid(P.op.redop) || P.chunk == 0) return;
    if (!fc::shape_serves<SHAPE>(P.kind, P.op.redop)) return;
    if (P.oneshot != 0u && (P.kind != FC_KIND_ALL_REDUCE || P.nranks != 2u)) return;
    // A pull and line rounds run only what the tuner gives them (tune::peer_pulls, tune::peer_lines):
    // a whole-block one-shot all-reduce on 2 ranks, and for both also a whole-block reduce on 2
    // ranks, for lines a reduce-scatter too. A pull folds the peer's raw input, so never a
    // PreMulSum (whose scalar may differ by rank); lines are never a pull, and a round's lines
    // fit its parity's two slots (tune::peer_line_round_elems). Refused loudly: the peer would wait.
    const bool pair_oneshot = P.kind == FC_KIND_ALL_REDUCE && P.oneshot != 0u && P.nranks == 2u && P.split == 0u;
    const bool pair_reduce = P.kind == FC_KIND_REDUCE && P.nranks == 2u && P.split == 0u;
    const bool bad_pull = P.pull != 0 && (!(pair_oneshot || pair_reduce) || P.op.redop == FC_OP_PREMULSUM || P.read != 0u);
    const bool line_kind = pair_oneshot || (P.nranks == 2u && P.split == 0u && (P.kind == FC_KIND_REDUCE_SCATTER || P.kind == FC_KIND_REDUCE));
    const bool bad_lines = P.lines != 0 && (!line_kind || P.pull != 0 || blockDim.x % 32u != 0u ||
                                            P.chunk * sizeof(typename D::S) > 2u * P.slot_bytes / FC_LINE_GROUP * FC_LINE_GROUP_DATA);
    if (bad_pull || bad_lines) {
        if (threadIdx.x == 0) fc::engine_error(P, FC_ERR_PLAN, FC_WHAT_PLAN, 1u - (P.rank & 1u), DTYPE, P.op.dtype, 0, 0);
        return;
    }
    fc::prior_grid_wait();
    const volatile FcError* err = (const volatile FcError*)P.error;
    // A launch queued behind a failure does nothing: the counters may disagree by now.
    if (err != nullptr && err->claimed != 0u) return;
    // Every thread reads the counter itself; thread 0 advances it at the end, past the rounds'
    // barriers (a block without rounds leaves it as it is).
    const bool split = P.split != 0u;
    const fc_u32 nslices = split ? P.nblocks / 2u : P.nblocks;
    const fc_u32 slice = split ? blockIdx.x % nslices : blockIdx.x;
    const fc_u32 role = !split ? FC_ROLE_BOTH : (blockIdx.x < nslices ? FC_ROLE_SEND : FC_ROLE_RECV);
    volatile fc_u64* seqs = (volatile fc_u64*)P.seqs;
    const fc_u64 word = seqs[role == FC_ROLE_RECV ? FC_PEER_MAX_BLOCKS + slice : slice];
    const fc_u64 seq = word & ~FC_AFTER_SYMMETRIC;
    const bool after_symmetric = (word & FC_AFTER_SYMMETRIC) != 0;
    // The previous launch's last round is over here (see the top); in a split launch the receive
    // block says so, as its own later acknowledgements (same thread, same line) must not be
    // overtaken by this one.
    if (seq > 0 && role != FC_ROLE_SEND && fc::peer_in(P, threadIdx.x, FC_PEER_ALL)) {
        fc::st_relaxed_sys(fc::peer_flag(P, threadIdx.x, slice, P.rank, 2), seq);
    }
    const fc_u64 start = fc::cut(P.count, nslices, slice), end = fc::cut(P.count, nslices, slice + 1);
    // Direct rounds (see the top): the receiving side posts its output, the sending side looks
    // for its receivers' posts, at the end of every round but the last.
    // The first two rounds are staged: a post is rarely there as both ranks start.
    __shared__ fc_u64 direct_to[2 * FC_PEER_MAX_RANKS];
    __shared__ fc_u32 direct_from[FC_PEER_MAX_RANKS], direct_marked[FC_PEER_MAX_RANKS];
    const fc::PeerDirect DR{P.direct != 0u && fc::movement_kind(P.kind) && start < end, seq + 1, direct_to, direct_from, direct_marked};
    if (DR.on) {
        const fc_u32 q = threadIdx.x;
        if (P.post != 0u && role != FC_ROLE_SEND && fc::peer_in(P, q, FC_PEER_ALL)) {
            fc_u8* line = (fc_u8*)fc::peer_flag(P, q, slice, P.rank, 2);
            fc::st_relaxed_sys((fc_u64*)(line + FC_PEER_POST_ADDR), P.views[q]);
            fc::st_release_sys((fc_u64*)(line + FC_PEER_POST_SEQ), DR.s0);
        }
        if (q < FC_PEER_MAX_RANKS) {
            direct_to[q] = 0;
            direct_to[FC_PEER_MAX_RANKS + q] = 0;
            direct_from[q] = 0;
            direct_marked[q] = 0;
        }
        // The ranks this one's rounds store into (as peer_round names them).
        if (role != FC_ROLE_RECV) {
            const bool from_root = P.kind == FC_KIND_BROADCAST || P.kind == FC_KIND_SCATTER;
            const bool to_root = P.kind == FC_KIND_GATHER;
            if (!(from_root && P.rank != P.root) && !(to_root && P.rank == P.root)) {
                fc::peer_direct_wait(P, DR, slice, to_root ? P.root : FC_PEER_ALL);
            }
        }
        __syncthreads();
    }
    fc_u64 s = seq;
    for (fc_u64 at = start; at < end; at += P.chunk) {
        const fc_u64 len = end - at < P.chunk ? end - at : P.chunk;
        ++s;
        if (!fc::peer_round<D, SHAPE>(P, at, len, s, s == seq + 1 && !after_symmetric, at + len >= end, slice, role, DR)) return;
    }
    fc::release_next_grid();
    // Each block writes its own counter (a block doing both, both). A split launch's flags say
    // nothing of its receive blocks' reads, so the next launch looks for room as after a rooted
    // one.
    if (threadIdx.x == 0 && s > seq) {
        const fc_u64 next = s | (fc::flows_symmetric(P) && !split ? FC_AFTER_SYMMETRIC : 0);
        if (role != FC_ROLE_RECV) seqs[slice] = next;
        if (role != FC_ROLE_SEND) seqs[FC_PEER_MAX_BLOCKS + slice] = next;
    }
#ifdef FC_PEER_TRACE
    if (threadIdx.x == 0 && blockIdx.x == 0 && P.kind == FC_KIND_ALL_REDUCE && s % FC_PEER_TRACE == 0) {
        const fc_u64* t = fc::fc_peer_trace;
        printf("peer trace rank %u round %llu cycles: room %lld stores %lld signal %lld wait %lld reduce %lld "
               "signal %lld wait %lld copy %lld end %lld\n",
               P.rank, (unsigned long long)s, (long long)(t[2] - t[1]), (long long)(t[3] - t[2]),
               (long long)(t[4] - t[3]), (long long)(t[5] - t[4]), (long long)(t[6] - t[5]), (long long)(t[7] - t[6]),
               (long long)(t[8] - t[7]), (long long)(t[9] - t[8]), (long long)(clock64() - t[9]));
    }
#endif
}

}  // namespace fc

namespace fc {

// ferroccl_fold_<type>[_plain]: the local half of a copy-and-fold reduction (FcFold): out = op(own
// operand, what the peer's copy engines landed in out), piece by piece as each piece's lane word
// reaches its count (copy_engine.rs `fold_pieces`: the pieces end where `ends` says, tapering
// towards the end; piece k on lane k % FC_CE_LANES, the (k / FC_CE_LANES + 1)-th of its lane).
// Each block takes its slice of every piece (cut at 64 elements); thread 0 polls the word (this
// GPU's memory) with an acquire, and the barrier orders the block's loads after it. Both ranks
// fold in the same order, (the peer's, the own) for the commutative reductions and rank 0's
// operands first for Max and Min, so every rank gets the same bits. What landed is the peer's raw
// input, so a PreMulSum (whose scalar may differ by rank) cannot be folded here: the tuner never
// gives it one (tune::fold_pays), and the kernel refuses it.
// Pairs of 16-byte loads in flight per thread in the fold (FC_REDUCE_UNROLL elsewhere): the fold
// must keep ahead of the link with few blocks, and 16 blocks with 4 pairs each folded about 410
// GB/s of landed pieces on an H200, barely over the link's 376-394 (with 8: the copy-and-fold at
// 2 GiB as with 32 blocks; docs/PERFORMANCE.md section 36).
#ifndef FC_FOLD_UNROLL
#define FC_FOLD_UNROLL 8
#endif

template <typename D, fc_u32 DTYPE, int SHAPE>
__device__ __forceinline__ void fold_main(const FcFold& P) {
    if (blockIdx.x >= P.nblocks) return;
    // A launch it cannot fold (the host's choice or pick gone wrong, or pieces that do not end
    // at the count) fails loudly: the output would otherwise keep the peer's operand.
    const fc_u64 n = P.count, pieces = P.pieces;
    bool cut_ok = pieces != 0 && pieces <= FC_FOLD_MAX_PIECES && P.ends[pieces - 1u] == n;
    for (fc_u64 k = 1; cut_ok && k < pieces; ++k) cut_ok = P.ends[k - 1u] <= P.ends[k];
    if (!cut_ok || P.rank > 1u ||
        P.op.dtype != DTYPE || !fc::redop_valid(P.op.redop) || P.op.redop == FC_OP_PREMULSUM ||
        !fc::shape_serves<SHAPE>(FC_KIND_ALL_REDUCE, P.op.redop)) {
        if (threadIdx.x == 0) fc::engine_error(P, FC_ERR_PLAN, FC_WHAT_PLAN, 1u - (P.rank & 1u), DTYPE, P.op.dtype, 0, 0);
        return;
    }
    fc::prior_grid_wait();
    const volatile FcError* err = (const volatile FcError*)P.error;
    if (err != nullptr && err->claimed != 0u) return;
    constexpr bool SUM = SHAPE != FC_SHAPE_ANY;
    const fc_u64 es = sizeof(typename D::S);
    const fc_u8* mine = (const fc_u8*)P.mine;
    fc_u8* out = (fc_u8*)P.out;
    fc_u64 a = 0;
    for (fc_u64 k = 0; k < pieces; ++k) {
        const fc_u64 end = P.ends[k];
        int bad = 0;
        if (threadIdx.x == 0) {
            const fc_u32* w = (const fc_u32*)P.words[k % FC_CE_LANES];
            const fc_u32 want = (fc_u32)(k / FC_CE_LANES + 1u);
            fc_u32 polls = 0, v;
            fc_u64 since = 0;
            while ((v = fc::ld_acquire_sys_u32(w)) < want) {
                if (!fc::engine_keep_waiting(P, polls, since, FC_WHAT_DATA, 1u - P.rank, want, v)) {
                    bad = 1;
                    break;
                }
            }
        }
        if (__syncthreads_or(bad)) return;
        if (k + 1u == pieces) fc::release_next_grid();
        const fc_u64 len = end - a;
        const fc_u64 s0 = fc::cut(len, P.nblocks, blockIdx.x), s1 = fc::cut(len, P.nblocks, blockIdx.x + 1u);
        if (s1 > s0) {
            fc_u8* o = out + (a + s0) * es;
            const fc_u8* m = mine + (a + s0) * es;
            fc::fold_pair<D, SUM, FC_FOLD_UNROLL>(P.op, P.rank, o, o, m, s1 - s0);
        }
        a = end;
    }
}

}  // namespace fc

#define FC_FOLD_ENTRY(TYPE, D, DTYPE)                                                         \
    FC_ENTRY(ferroccl_fold_##TYPE, FC_PEER_THREADS, FcFold, (fc::fold_main<D, DTYPE, FC_SHAPE_ANY>)) \
    FC_ENTRY(ferroccl_fold_##TYPE##_plain, FC_PEER_THREADS, FcFold, (fc::fold_main<D, DTYPE, FC_SHAPE_PLAIN>))
FC_FOR_EACH_TYPE(FC_FOLD_ENTRY)

#define FC_PEER_ENTRY(TYPE, D, DTYPE)                                                     \
    FC_ENTRY(ferroccl_peer_##TYPE, FC_PEER_THREADS, FcPeer, (fc::peer_main<D, DTYPE, FC_SHAPE_ANY>)) \
    FC_ENTRY(ferroccl_peer_##TYPE##_sum, FC_PEER_THREADS, FcPeer, (fc::peer_main<D, DTYPE, FC_SHAPE_AR_SUM>))
FC_FOR_EACH_TYPE(FC_PEER_ENTRY)

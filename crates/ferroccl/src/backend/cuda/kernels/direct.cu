// ferroccl_direct: the direct engine. One-shot collectives (algo/oneshot.rs) for small
// operations: one round of messages, each block storing its slice of every message straight
// into the receiver's slots as LL lines (8 data bytes and two copies of the flag per 16-byte
// line, each half written by one 8-byte-atomic part of a vector store), so a receiver needs no
// fence, no head word and no length: a line whose flags carry this epoch holds this epoch's
// data. Every thread owns the same 8-byte words of every message and of the output, and does
// their whole life (send, wait, fold, store) itself: no barrier between the phases, which is
// what makes the engine fast for small messages and safe in place.
//
// Reductions fold all n contributions in rank order, the own one at its rank's place, so every
// rank computes the same bits; each contribution is pre-multiplied (and rounded to the element
// type) once, as its sender does, and the average divides once, after the last combine, as the
// ring's last step does.
//
// Epochs: block b of every rank counts its launches (epochs[b]); ranks launch the same
// operations with the same blocks, so their counts agree. Slots alternate by epoch parity, and
// a sender reuses a parity only when the receiver acknowledged the epoch two before. Every rank
// acknowledges the previous epoch to every peer, whether it received from it or not, at the
// start of its next launch: that launch begins only once the previous one is complete and its
// memory operations performed (stream order, or griddepcontrol.wait under an early start), so
// the kernel boundary orders every read of the old slots before the acknowledgement and a
// relaxed store carries it. A release store at the end of each launch did the same at the cost
// of a system-scope fence there (0.8 us a launch on an H100: bench/probes/graph_launch.cu).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "types.cuh"
#include "fifo.cuh"
#include "reduce.cuh"

namespace fc {

// Where block b of `from` puts its line `i` for `to`, given `to`'s slots base.
__device__ __forceinline__ fc_u8* direct_line(fc_u64 base, fc_u32 b, fc_u32 from, fc_u32 n, fc_u32 parity, fc_u64 i) {
    const fc_u64 slot = ((fc_u64)b * n + from) * 2u + parity;
    return (fc_u8*)base + slot * (2u * FC_DIRECT_SLOT_DATA) + i * 16u;
}

// The elements of one 8-byte word (reduce.cuh's fold_word and transform_word: the 1- and 2-byte
// types a 32-bit half at a time).
template <typename D>
struct Word {
    typedef typename D::C C;
    // Each element pre-multiplied and rounded to the element type, as a sender stores it.
    static __device__ __forceinline__ fc_u64 pre(fc_u64 w, C scalar) { return transform_word<D>(w, true, false, scalar, 1u); }
    // acc = combine(v, acc) element-wise, rounded; on the last contribution, divided by n
    // first when `post` (one rounding, as the ring's last step).
    static __device__ __forceinline__ fc_u64 fold(fc_u64 acc, fc_u64 v, fc_u32 k, bool last_post, fc_u32 n) {
        return fold_word<D>(v, acc, k, false, last_post, C(0), n);
    }
    static __device__ __forceinline__ fc_u64 post(fc_u64 w, fc_u32 n) { return transform_word<D>(w, false, true, C(0), n); }
};

// Whether this rank sends to q, and from which block of its input.
__device__ __forceinline__ bool sends_to(const FcDirect& P, fc_u32 kind, fc_u32 q, fc_u64& src_block) {
    const fc_u32 me = P.rank, t = P.root;
    src_block = 0;
    if (q == me) return false;
    switch (kind) {
        case FC_KIND_ALL_REDUCE: case FC_KIND_ALL_GATHER: return true;
        case FC_KIND_REDUCE_SCATTER: case FC_KIND_ALL_TO_ALL: src_block = q; return true;
        case FC_KIND_REDUCE: case FC_KIND_GATHER: return q == t;
        case FC_KIND_BROADCAST: return me == t;
        default: src_block = q; return me == t;  // scatter
    }
}

// Whether this rank receives from q, and into which block of its output.
__device__ __forceinline__ bool receives_from(const FcDirect& P, fc_u32 kind, fc_u32 q, fc_u64& dst_block) {
    const fc_u32 me = P.rank, t = P.root;
    dst_block = 0;
    if (q == me) return false;
    switch (kind) {
        case FC_KIND_ALL_REDUCE: case FC_KIND_REDUCE_SCATTER: return true;
        case FC_KIND_REDUCE: return me == t;
        case FC_KIND_ALL_GATHER: case FC_KIND_ALL_TO_ALL: dst_block = q; return true;
        case FC_KIND_GATHER: dst_block = q; return me == t;
        default: return q == t;  // broadcast, scatter
    }
}

// `check_room`: look at the acknowledgements before storing (see the loop below).
template <typename D, int SHAPE>
__device__ void direct_run(const FcDirect& P, fc_u64 epoch, bool check_room) {
    typedef Word<D> W;
    typedef typename D::C C;
    const fc_u32 b = blockIdx.x, n = P.nranks, me = P.rank, t = P.root;
    const fc_u64 es = sizeof(typename D::S), c = P.count;
    const fc_u64 s = cut(c, P.nblocks, b), e = cut(c, P.nblocks, b + 1);
    const fc_u64 mb = (e - s) * es;
    const fc_u64 lines = (mb + 7u) / 8u;
    const fc_u32 flag = (fc_u32)(epoch % 0xffffffffull) + 1u;
    const fc_u32 parity = (fc_u32)(epoch & 1u);
    const fc_u8* in = (const fc_u8*)P.op.send;
    fc_u8* out = (fc_u8*)P.op.recv;
    const fc_u32 kind = shape_kind<SHAPE>(P.kind);
    const fc_u32 k = shape_redop<SHAPE>(P.op.redop);
    const bool red = kind_reduces(kind);
    const bool pre = red && k == FC_OP_PREMULSUM;
    const bool post = red && k == FC_OP_AVG;
    const C scalar = pre ? scalar_of<D>(P.op) : C(0);

    // A receiver's slots of our parity are free once it acknowledged the epoch two before. Each
    // thread checks for itself (the same few local words for all: no barrier on the way to the
    // first store), and usually finds them acknowledged long ago. After an epoch that exchanged
    // lines with every peer there is nothing to check: this block received that epoch's lines
    // from every peer, which each stored only after its launch of the epoch before had ended
    // (the kernel boundary), its reads of our slots included.
    for (fc_u32 q = 0; q < n && check_room; ++q) {
        fc_u64 blk;
        if (!sends_to(P, kind, q, blk)) continue;
        const fc_u64* ack = (const fc_u64*)P.acks[me] + (fc_u64)b * n + q;
        fc_u32 polls = 0;
        fc_u64 since = 0;
        fc_u64 v;
        while ((v = ld_acquire_sys(ack)) + 2u < epoch) {
            if (!engine_keep_waiting(P, polls, since, FC_WHAT_ROOM, q, epoch - 2u, v)) return;
        }
    }

    // Sends: every message's lines, this thread's words of each.
    for (fc_u32 q = 0; q < n; ++q) {
        fc_u64 blk;
        if (!sends_to(P, kind, q, blk)) continue;
        const fc_u8* src = in + (blk * c + s) * es;
        for (fc_u64 i = threadIdx.x; i < lines; i += blockDim.x) {
            const fc_u32 nbytes = (fc_u32)(mb - i * 8u < 8u ? mb - i * 8u : 8u);
            fc_u64 v = load8(src + i * 8u, nbytes);
            if (pre) v = W::pre(v, scalar);
            ll_store(direct_line(P.slots[q], b, me, n, parity, i), v, flag);
        }
    }

    // Receives: a fold of all contributions in rank order, or each message to its block.
    const bool folds = red && (kind != FC_KIND_REDUCE || me == t);
    const fc_u64 own_block = kind == FC_KIND_REDUCE_SCATTER ? me : 0;
    for (fc_u64 i = threadIdx.x; i < lines; i += blockDim.x) {
        const fc_u32 nbytes = (fc_u32)(mb - i * 8u < 8u ? mb - i * 8u : 8u);
        if (folds) {
            fc_u64 acc = 0;
            bool ok = true;
            for (fc_u32 q = 0; q < n && ok; ++q) {
                fc_u64 v;
                if (q == me) {
                    v = load8(in + (own_block * c + s) * es + i * 8u, nbytes);
                    if (pre) v = W::pre(v, scalar);
                } else {
                    ok = ll_wait_line(P, direct_line(P.slots[me], b, q, n, parity, i), flag, q, v);
                }
                const bool last = q + 1u == n;
                acc = q == 0 ? (last && post ? W::post(v, n) : v) : W::fold(acc, v, k, last && post, n);
            }
            if (!ok) break;
            store8(out + s * es + i * 8u, acc, nbytes);
            continue;
        }
        bool ok = true;
        for (fc_u32 q = 0; q < n && ok; ++q) {
            fc_u64 blk, v;
            if (!receives_from(P, kind, q, blk)) continue;
            ok = ll_wait_line(P, direct_line(P.slots[me], b, q, n, parity, i), flag, q, v);
            if (ok) store8(out + (blk * c + s) * es + i * 8u, v, nbytes);
        }
        if (!ok) break;
    }

    // This rank's own block, where the operation copies it.
    const fc_u8* own_src;
    fc_u8* own_dst;
    own_copy(kind, me, t, c, s, es, in, out, own_src, own_dst);
    if (own_src != nullptr && own_src != own_dst) copy8(own_dst, own_src, mb);
}

}  // namespace fc

namespace fc {

// One kernel per element type (ferroccl_direct_<type>, the type as nccl-tests names it; the
// host picks by the operation's type):
// one kernel holding every type's loops behind a switch took 0.85 us more per 8-byte
// all-reduce in CUDA graphs on an H100 (3.78 against 2.93 us; twelve times the code, the
// likely cost being its instruction fetches at every launch; not measured apart).
template <typename D, fc_u32 DTYPE, int SHAPE>
__device__ __forceinline__ void direct_main(const FcDirect& P) {
    // (The host launches the kernel of the operation's type and shape; these tests only guard.)
    if (blockIdx.x >= P.nblocks || P.nranks > FC_DIRECT_MAX_RANKS || P.rank >= P.nranks || P.op.dtype != DTYPE) return;
    if (!shape_serves<SHAPE>(P.kind, P.op.redop)) return;
    prior_grid_wait();
    // Every thread reads the epoch itself, before thread 0 advances it past the barrier.
    const fc_u64 word = ((const volatile fc_u64*)P.epochs)[blockIdx.x];
    const fc_u64 ep = (word & ~FC_AFTER_SYMMETRIC) + 1u;
    const bool symmetric = symmetric_kind(shape_kind<SHAPE>(P.kind));
    // This epoch exchanges lines with every peer (a symmetric operation, and this block's slice
    // is not empty: with none it neither stores nor waits, and proves nothing to the next).
    const bool exchanges = symmetric && cut(P.count, P.nblocks, blockIdx.x + 1) > cut(P.count, P.nblocks, blockIdx.x);
    __syncthreads();
    // A launch queued behind a failure does nothing (the ranks' epochs may disagree by now).
    const volatile FcError* err = (const volatile FcError*)P.error;
    if (err != nullptr && err->claimed != 0u) return;
    if (threadIdx.x == 0) ((volatile fc_u64*)P.epochs)[blockIdx.x] = ep | (exchanges ? FC_AFTER_SYMMETRIC : 0);
    // The previous epoch is over here (see the top): the peers may reuse its slots' parity.
    if (ep > 1u && threadIdx.x < P.nranks && threadIdx.x != P.rank) {
        st_relaxed_sys((fc_u64*)P.acks[threadIdx.x] + (fc_u64)blockIdx.x * P.nranks + P.rank, ep - 1u);
    }
    direct_run<D, SHAPE>(P, ep, !(symmetric && (word & FC_AFTER_SYMMETRIC) != 0));
    release_next_grid();
}

}  // namespace fc

#define FC_DIRECT_ENTRY(TYPE, D, DTYPE)                                                                       \
    FC_ENTRY(ferroccl_direct_##TYPE, FC_DIRECT_THREADS, FcDirect, (fc::direct_main<D, DTYPE, FC_SHAPE_ANY>))          \
    FC_ENTRY(ferroccl_direct_##TYPE##_plain, FC_DIRECT_THREADS, FcDirect, (fc::direct_main<D, DTYPE, FC_SHAPE_PLAIN>)) \
    FC_ENTRY(ferroccl_direct_##TYPE##_sum, FC_DIRECT_THREADS, FcDirect, (fc::direct_main<D, DTYPE, FC_SHAPE_AR_SUM>))
FC_FOR_EACH_TYPE(FC_DIRECT_ENTRY)

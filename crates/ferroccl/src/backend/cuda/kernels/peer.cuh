// ferroccl_peer: the peer engine. All-reduce (two-shot), reduce-scatter, all-gather and
// all-to-all (one-shot) of one operation, in rounds (algo/direct.rs `all_reduce_two_shot` and
// algo/oneshot.rs, with the tuner's chunk as the round): block b of every rank takes the same
// slice of the operation (cut as algo::channel_slice) and walks it round by round. In a round a
// block stores each peer's message straight into that peer's staging slot, with 16-byte
// vector stores over NVLink, then raises one flag line per peer; the peer waits for the flags
// of all its senders and reads its own slots, which are local memory. No FIFO, no head or
// length words, no per-slot handshake: one flag per block, peer, phase and round.
//
// Phases of a round s (slots alternate by s's parity):
//  0: every rank stores what each peer needs of its input (all-reduce: the peer's share of the
//     round, pre-multiplied as the plan's Send says) into the peer's input slot, and flags it;
//  then all-reduce: each rank reduces its share (own input first, then the peers' in the
//     plan's order: the same order on every rank, and each element reduced once, by its
//     owner, so every rank gets the same bits), stores the result into its output and every
//     peer's output slot (phase 1), flags it, waits for the peers' results and copies them
//     into its output; the others: each rank reduces or copies what it received.
//
// Why two parities and no acknowledgements: every round has every rank send to and receive
// from every peer, so a rank that got a peer's phase-0 flag of round s+1 knows the peer has
// finished round s (it sends s+1 only after), hence read its slots of round s. A rank writes
// parity p again in round s+2, after it waited for every peer's phase-0 flag of round s+1.
// Round counters live per block on each rank (seqs[b]) and advance by the same number of
// rounds on every rank, whatever mix of operations runs, because every rank cuts every
// operation alike.
//
// This file is included by plan_exec.cu: one NVRTC compile, one module, and the same copy and
// reduce loops as the plan kernel.
#pragma once
#include "types.cuh"
#include "fifo.cuh"
#include "reduce.cuh"

namespace fc {

__device__ void peer_error(const FcPeer& P, fc_u32 code, fc_u32 what, fc_u32 peer, fc_u64 expected, fc_u64 got) {
    FcError* e = (FcError*)P.error;
    if (e == nullptr) return;
    if (atomicCAS(&e->claimed, 0u, 1u) != 0u) return;
    volatile FcError* v = e;
    v->lane = blockIdx.x;
    v->step = 0;
    v->peer = peer;
    v->what = what;
    v->conn = -1;
    v->rank = P.rank;
    v->expected = expected;
    v->got = got;
    __threadfence_system();
    v->code = code;
}

// Called on every unsuccessful poll; true while the wait may go on.
__device__ __forceinline__ bool peer_keep_waiting(const FcPeer& P, fc_u32& polls, fc_u64& since, fc_u32 peer) {
    if ((++polls % FC_POLLS_PER_CHECK) != 0u) return true;
    const volatile int* ab = (const volatile int*)P.abort;
    if (ab != nullptr && *ab != 0) {
        peer_error(P, FC_ERR_ABORTED, FC_WHAT_DATA, peer, 0, 0);
        return false;
    }
    const volatile FcError* e = (const volatile FcError*)P.error;
    if (e != nullptr && e->claimed != 0u) return false;
    const fc_u64 now = globaltimer();
    if (since == 0) since = now;
    if (P.timeout_ns != 0 && now - since > P.timeout_ns) {
        peer_error(P, FC_ERR_TIMEOUT, FC_WHAT_DATA, peer, P.timeout_ns, now - since);
        return false;
    }
    return true;
}

// Slot [b][from][phase][parity] in `owner`'s staging (no slots for the owner itself).
__device__ __forceinline__ fc_u8* peer_slot(const FcPeer& P, fc_u32 owner, fc_u32 b, fc_u32 from, fc_u32 phase, fc_u64 s) {
    const fc_u32 f = from < owner ? from : from - 1u;
    const fc_u64 i = (((fc_u64)b * (P.nranks - 1u) + f) * 2u + phase) * 2u + (s & 1u);
    return (fc_u8*)P.stage[owner] + i * P.slot_bytes;
}

// Flag line [b][from][phase] in `owner`'s flag area, 128 bytes each.
__device__ __forceinline__ fc_u64* peer_flag(const FcPeer& P, fc_u32 owner, fc_u32 b, fc_u32 from, fc_u32 phase) {
    return (fc_u64*)(P.flags[owner] + (((fc_u64)b * P.nranks + from) * 2u + phase) * 128u);
}

// Block-wide: this block's stores of the phase are done; tell every peer (the ordering of
// fifo.cuh: the barrier puts every thread's stores before the fence, the release orders the
// flag after them).
__device__ __forceinline__ void peer_signal(const FcPeer& P, fc_u32 phase, fc_u64 s) {
    __syncthreads();
    const fc_u32 q = threadIdx.x;
    if (q < P.nranks && q != P.rank) {
        __threadfence_system();
        st_release_sys(peer_flag(P, q, blockIdx.x, P.rank, phase), s);
    }
}

// Block-wide: waits until every peer flagged the phase of round s (thread q polls peer q);
// false, on every thread, when a wait failed (abort, deadline, another block's failure).
__device__ __forceinline__ bool peer_wait(const FcPeer& P, fc_u32 phase, fc_u64 s) {
    int bad = 0;
    const fc_u32 q = threadIdx.x;
    if (q < P.nranks && q != P.rank) {
        const fc_u64* f = peer_flag(P, P.rank, blockIdx.x, q, phase);
        fc_u32 polls = 0;
        fc_u64 since = 0;
        while (ld_acquire_sys(f) < s) {
            if (!peer_keep_waiting(P, polls, since, q)) {
                bad = 1;
                break;
            }
        }
    }
    // The barrier also orders every thread's slot loads after the acquiring poll.
    return __syncthreads_or(bad) == 0;
}

// One round of block b over elements [at, at + len) of its slice; false when a wait failed.
__device__ bool peer_round(const FcPeer& P, fc_u64 at, fc_u64 len, fc_u64 s) {
    const fc_u32 n = P.nranks, me = P.rank, b = blockIdx.x;
    const FcOp& op = P.op;
    const fc_u64 es = op.elem_size, c = P.count;
    const fc_u8* in = (const fc_u8*)op.send;
    fc_u8* out = (fc_u8*)op.recv;

    if (P.kind == FC_KIND_ALL_REDUCE) {
        // Share q of the round: [at + cut(q), at + cut(q + 1)).
        for (fc_u32 j = 1; j < n; ++j) {
            const fc_u32 q = (me + j) % n;
            const fc_u64 a = cut(len, n, q), e = cut(len, n, q + 1);
            if (e > a) transform(op, peer_slot(P, q, b, me, 0, s), in + (at + a) * es, e - a, true, false);
        }
        peer_signal(P, 0, s);
        if (!peer_wait(P, 0, s)) return false;
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
                reduce(op, own, also, peer_slot(P, me, b, q, 0, s), local, e - a, i == 0, last);
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
        peer_signal(P, 1, s);
        if (!peer_wait(P, 1, s)) return false;
        for (fc_u32 j = 1; j < n; ++j) {
            const fc_u32 q = (me + n - j) % n;
            const fc_u64 qa = cut(len, n, q), qe = cut(len, n, q + 1);
            if (qe > qa) copy_bytes(out + (at + qa) * es, nullptr, peer_slot(P, me, b, q, 1, s), (qe - qa) * es);
        }
        return true;
    }

    const fc_u64 bytes = len * es;
    // Phase 0: each peer's message.
    for (fc_u32 j = 1; j < n; ++j) {
        const fc_u32 q = (me + j) % n;
        fc_u8* slot = peer_slot(P, q, b, me, 0, s);
        switch (P.kind) {
            case FC_KIND_REDUCE_SCATTER: transform(op, slot, in + (q * c + at) * es, len, true, false); break;
            case FC_KIND_ALL_GATHER: copy_bytes(slot, nullptr, in + at * es, bytes); break;
            default: copy_bytes(slot, nullptr, in + (q * c + at) * es, bytes); break;  // all-to-all
        }
    }
    // This rank's own block, where it moves (nothing in place: the same bytes).
    const fc_u8* own_src = P.kind == FC_KIND_ALL_GATHER ? in + at * es : in + (me * c + at) * es;
    fc_u8* own_dst = out + (me * c + at) * es;
    if (P.kind != FC_KIND_REDUCE_SCATTER && own_src != own_dst) copy_bytes(own_dst, nullptr, own_src, bytes);
    peer_signal(P, 0, s);
    if (!peer_wait(P, 0, s)) return false;
    if (P.kind == FC_KIND_REDUCE_SCATTER) {
        fc_u8* o = out + at * es;
        for (fc_u32 i = 0; i + 1 < n; ++i) {
            const fc_u32 q = (me + 1 + i) % n;
            const fc_u8* local = i == 0 ? in + (me * c + at) * es : o;
            if (i > 0) __syncthreads();
            reduce(op, o, nullptr, peer_slot(P, me, b, q, 0, s), local, len, i == 0, i + 2 == n);
        }
        return true;
    }
    for (fc_u32 j = 1; j < n; ++j) {
        const fc_u32 q = (me + n - j) % n;
        copy_bytes(out + (q * c + at) * es, nullptr, peer_slot(P, me, b, q, 0, s), bytes);
    }
    return true;
}

}  // namespace fc

extern "C" __global__ void __launch_bounds__(FC_PEER_THREADS, 1) ferroccl_peer(const __grid_constant__ FcPeer P) {
    if (blockIdx.x >= P.nblocks || P.nranks < 2u || P.nranks > FC_PEER_MAX_RANKS || P.rank >= P.nranks) return;
    if (!fc::dtype_valid(P.op.dtype) || !fc::redop_valid(P.op.redop) || P.chunk == 0) return;
    const volatile FcError* err = (const volatile FcError*)P.error;
    // A launch queued behind a failure does nothing: the counters may disagree by now.
    if (err != nullptr && err->claimed != 0u) return;
    // Every thread reads the counter itself: nobody writes it before the end of the launch.
    const fc_u64 seq = ((const volatile fc_u64*)P.seqs)[blockIdx.x];
    const fc_u64 start = fc::cut(P.count, P.nblocks, blockIdx.x), end = fc::cut(P.count, P.nblocks, blockIdx.x + 1);
    fc_u64 s = seq;
    for (fc_u64 at = start; at < end; at += P.chunk) {
        const fc_u64 len = end - at < P.chunk ? end - at : P.chunk;
        ++s;
        if (!fc::peer_round(P, at, len, s)) return;
    }
    __syncthreads();
    if (threadIdx.x == 0) ((volatile fc_u64*)P.seqs)[blockIdx.x] = s;
}

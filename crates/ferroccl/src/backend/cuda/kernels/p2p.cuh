// ferroccl_p2p: the plan kernel's point-to-point form. A launch whose plan holds only sends and
// receives (sendrecv, batched isend/irecv, pipeline stages, an all-to-all made of sends and
// receives) runs here instead of in ferroccl_plan_exec: the same steps on the same connections,
// with the same protocols (LL and simple) and piece cut (fifo.cuh), so that either kernel may
// sit at either end of a connection and the decision stays local to each rank. Sends to
// oneself (a copy into the matching receive, the plan's self lane) come along. What it leaves
// out is the plan kernel's generality, which is most of a small message's time there: no step
// tables to load (the host puts each step, with its connection's addresses, in the parameter),
// no window of steps staged through shared memory, and for LL no thread 0 doing the waiting
// while the block waits at barriers and no staging of lines: every thread moves its own 8-byte
// words straight between the buffer and the lines; an LL send needs no barrier at all, an LL
// receive one per piece before it frees the slot. A simple-protocol piece keeps the plan
// kernel's handshake (thread 0 waits for the head and checks the length; one barrier before
// the copy, one before the head or tail moves) and its copy loop. Two kernels: a lean one for
// a few LL steps, one for the rest (see below).
//
// Counters: like the plan kernel's lanes, a block binds one send and one receive connection at
// a time, reads a connection's counter word when it binds it and writes it back when it moves
// to another or ends (thread 0; a barrier orders a write-back before a later re-read of the
// word). The host gives each connection's steps to one block only.
#pragma once
#include "types.cuh"
#include "fifo.cuh"
#include "reduce.cuh"

namespace fc {

// Each warp for itself, before its first store into slot `seq`: the receiver freed the slot's
// previous use (lane 0 polls the local tail word with acquire; the warp barrier orders the
// lanes' stores after it), so no block barrier stands between the launch and the first store.
// `tail_seen` is warp-uniform. False on abort, deadline or another block's failure.
template <typename Param>
__device__ __forceinline__ bool p2p_room(const Param& P, const FcP2pStep& s, fc_u64 seq, fc_u64& tail_seen) {
    if (seq < tail_seen + s.slots) return true;
    int ok = 1;
    fc_u64 t = 0;
    if ((threadIdx.x & 31u) == 0) {
        fc_u32 polls = 0;
        fc_u64 since = 0;
        while ((t = ld_acquire_sys((const fc_u64*)s.tail)) + s.slots <= seq) {
            if (!engine_keep_waiting(P, polls, since, FC_WHAT_ROOM, s.peer, seq + 1u - s.slots, t, s.conn)) {
                ok = 0;
                break;
            }
        }
    }
    __syncwarp();
    tail_seen = __shfl_sync(0xffffffffu, t, 0);
    return __shfl_sync(0xffffffffu, ok, 0) != 0;
}

// An LL send: each piece into the connection's next slot, every thread its own lines, no
// barrier. False on failure, warp by warp (the caller agrees block-wide).
template <typename Param>
__device__ bool p2p_send_ll(const Param& P, const FcP2pStep& s, fc_u64& seq) {
    const fc_u8* src = (const fc_u8*)s.buf;
    fc_u64 tail_seen = 0;
    for (fc_u64 off = 0; off < s.bytes; off += s.piece, ++seq) {
        if (!p2p_room(P, s, seq, tail_seen)) return false;
        const fc_u64 nb = s.bytes - off < s.piece ? s.bytes - off : s.piece;
        fc_u8* slot = (fc_u8*)s.base + (seq % s.slots) * (2ull * FC_LL_DATA);
        const fc_u32 flag = ll_flag(seq);
        for (fc_u64 i = threadIdx.x; i * 8u < nb; i += blockDim.x) {
            const fc_u32 n = (fc_u32)(nb - i * 8u < 8u ? nb - i * 8u : 8u);
            ll_store(slot + i * 16u, load8(src + off + i * 8u, n), flag);
        }
    }
    return true;
}

// A simple-protocol send: the block copies each piece into the next slot with the plan
// kernel's loop, then (barrier) thread 0 writes its length and releases the head, as
// `publish` does. False on failure, on every thread.
template <typename Param>
__device__ bool p2p_send_simple(const Param& P, const FcP2pStep& s, fc_u64& seq) {
    const fc_u8* src = (const fc_u8*)s.buf;
    const FcConn* c = (const FcConn*)P.conns + s.conn;
    const fc_u64 stride = c->slot_bytes;
    fc_u64 tail_seen = 0;
    for (fc_u64 off = 0; off < s.bytes; off += s.piece, ++seq) {
        // The block copies the piece together: it leaves together too.
        if (__syncthreads_or(!p2p_room(P, s, seq, tail_seen))) return false;
        const fc_u64 nb = s.bytes - off < s.piece ? s.bytes - off : s.piece;
        copy_bytes((fc_u8*)s.base + (seq % s.slots) * stride, nullptr, src + off, nb);
        // Every thread's stores before thread 0's release (cumulative), as in fifo.cuh.
        __syncthreads();
        if (threadIdx.x == 0) fifo_publish(c->lens, c->head, s.slots, seq, (fc_u32)nb);
    }
    return true;
}

// An LL receive: each piece's lines, every thread waiting for its own and storing their data;
// then the barrier (every load of the slot has returned) and thread 0 frees the slot with a
// relaxed store, as release_ll does. False, on every thread, when a wait failed.
template <typename Param>
__device__ bool p2p_recv_ll(const Param& P, const FcP2pStep& s, fc_u64& seq) {
    fc_u8* dst = (fc_u8*)s.buf;
    for (fc_u64 off = 0; off < s.bytes; off += s.piece, ++seq) {
        const fc_u64 nb = s.bytes - off < s.piece ? s.bytes - off : s.piece;
        const fc_u8* slot = (const fc_u8*)s.base + (seq % s.slots) * (2ull * FC_LL_DATA);
        const fc_u32 flag = ll_flag(seq);
        int bad = 0;
        for (fc_u64 i = threadIdx.x; i * 8u < nb; i += blockDim.x) {
            fc_u64 v;
            if (!ll_wait_line<FC_P2P_LL_POLL_NS>(P, slot + i * 16u, flag, s.peer, v, s.conn)) {
                bad = 1;
                break;
            }
            store8(dst + off + i * 8u, v, (fc_u32)(nb - i * 8u < 8u ? nb - i * 8u : 8u));
        }
        if (__syncthreads_or(bad)) return false;
        if (threadIdx.x == 0) st_relaxed_sys((fc_u64*)s.tail, seq + 1u);
    }
    return true;
}

// A simple-protocol receive: thread 0 waits until the sender published the piece and checks
// its length (a mismatch means the plans disagree), the block copies it out, then (barrier)
// thread 0 releases the tail, as `release` does. False, on every thread, on failure.
template <typename Param>
__device__ bool p2p_recv_simple(const Param& P, const FcP2pStep& s, fc_u64& seq) {
    fc_u8* dst = (fc_u8*)s.buf;
    const FcConn* c = (const FcConn*)P.conns + s.conn;
    const fc_u64 stride = c->slot_bytes;
    for (fc_u64 off = 0; off < s.bytes; off += s.piece, ++seq) {
        const fc_u64 nb = s.bytes - off < s.piece ? s.bytes - off : s.piece;
        int bad = 0;
        if (threadIdx.x == 0) {
            fc_u32 polls = 0;
            fc_u64 since = 0;
            fc_u64 h;
            while ((h = ld_acquire_sys((const fc_u64*)c->head)) <= seq) {
                if (!engine_keep_waiting(P, polls, since, FC_WHAT_DATA, s.peer, seq + 1u, h, s.conn)) {
                    bad = 1;
                    break;
                }
            }
            const fc_u32 len = bad ? (fc_u32)nb : ((const volatile fc_u32*)c->lens)[seq % s.slots];
            if (len != nb) {
                engine_error(P, FC_ERR_LENGTH, FC_WHAT_LENGTH, s.peer, nb, len, 0, 0, s.conn);
                bad = 1;
            }
        }
        // Also orders every thread's loads of the slot after thread 0's acquire.
        if (__syncthreads_or(bad)) return false;
        copy_bytes(dst + off, nullptr, (const fc_u8*)s.base + (seq % s.slots) * stride, nb);
        __syncthreads();
        if (threadIdx.x == 0) st_release_sys((fc_u64*)s.tail, seq + 1u);
    }
    return true;
}

// A block's binding of one connection direction: its counter word and position.
struct P2pBind {
    fc_u64* counter;
    fc_u64 seq;
};

// Binds `b` to `counter` (all threads alike); writes the old position back first (thread 0),
// and then lets every thread see it before any reads a word.
__device__ __forceinline__ void p2p_bind(P2pBind& b, fc_u64 counter) {
    if (b.counter == (fc_u64*)counter) return;
    if (b.counter != nullptr) {
        if (threadIdx.x == 0) *(volatile fc_u64*)b.counter = b.seq;
        __syncthreads();
    }
    b.counter = (fc_u64*)counter;
    b.seq = *(const volatile fc_u64*)b.counter;
}

// The kernels. A block binds one send and one receive connection at a time and finds its steps
// in the parameter, which come in block order.
//
// WIDE = false (`ferroccl_p2p`): LL steps and copies only, at most FC_P2P_SMALL_STEPS, found by
// a scan. Its code is kept to what those need (compiled apart with `if constexpr`): the same
// launch with the simple protocol's paths and a binary search beside them took 0.3-0.5 us
// more in CUDA graphs on an H100 (the code a launch fetches, as with the direct engine's one
// kernel per type). The host gives it nothing else.
// WIDE = true (`ferroccl_p2p_wide`): any step, up to FC_P2P_MAX_STEPS, a block's first found by
// binary search (a scan of 64 cost a large launch about a microsecond of parameter loads).
template <bool WIDE, typename Param>
__device__ __forceinline__ void p2p_main(const Param& P) {
    if (P.nsteps > sizeof(P.steps) / sizeof(P.steps[0])) return;
    prior_grid_wait();
    // A launch queued behind a failure does nothing: the counters may disagree by now.
    const volatile FcError* err = (const volatile FcError*)P.error;
    if (err != nullptr && err->claimed != 0u) return;
    P2pBind send = {nullptr, 0}, recv = {nullptr, 0};
    bool ok = true;
    fc_u32 i = 0;
    if constexpr (WIDE) {
        fc_u32 hi = P.nsteps;
        while (i < hi) {
            const fc_u32 mid = (i + hi) / 2;
            if (P.steps[mid].block < blockIdx.x) i = mid + 1;
            else hi = mid;
        }
    }
    for (; i < P.nsteps && ok; ++i) {
        const FcP2pStep& s = P.steps[i];
        if (s.block != blockIdx.x) {
            if constexpr (WIDE) break;
            else continue;
        }
        if (s.dir == FC_P2P_COPY) {
            // A send to oneself, into the matching receive.
            copy8((fc_u8*)s.base, (const fc_u8*)s.buf, s.bytes);
            // A later step may read what it wrote, through other threads (as in run_lane).
            __syncthreads();
        } else if (s.dir == FC_CONN_SEND) {
            p2p_bind(send, s.counter);
            // A send fails warp by warp (a room wait); the block agrees before its next barrier.
            bool sent;
            if constexpr (WIDE) sent = s.ll ? p2p_send_ll(P, s, send.seq) : p2p_send_simple(P, s, send.seq);
            else sent = p2p_send_ll(P, s, send.seq);
            ok = !__syncthreads_or(!sent);
        } else {
            p2p_bind(recv, s.counter);
            if constexpr (WIDE) ok = s.ll ? p2p_recv_ll(P, s, recv.seq) : p2p_recv_simple(P, s, recv.seq);
            else ok = p2p_recv_ll(P, s, recv.seq);
        }
    }
    release_next_grid();
    // After a failure the positions do not matter: every later launch leaves at its start.
    if (threadIdx.x == 0 && ok) {
        if (send.counter != nullptr) *(volatile fc_u64*)send.counter = send.seq;
        if (recv.counter != nullptr) *(volatile fc_u64*)recv.counter = recv.seq;
    }
}

}  // namespace fc

FC_ENTRY(ferroccl_p2p, FC_P2P_THREADS / 2, FcP2pSmall, fc::p2p_main<false>)
FC_ENTRY(ferroccl_p2p_wide, FC_P2P_THREADS, FcP2p, fc::p2p_main<true>)

// ferroccl_p2p: the plan kernel's point-to-point form. A launch whose plan holds only LL sends
// and receives (small send/recv groups: sendrecv, batched isend/irecv, pipeline stages) runs
// here instead of in ferroccl_plan_exec: the same steps on the same connections, with the same
// LL protocol and piece cut (fifo.cuh), so that either kernel may sit at either end of a
// connection and the decision stays local to each rank. What it leaves out is the plan
// kernel's generality, which is most of a small message's time there: no step tables to load
// (the host puts each step, with its connection's addresses, in the parameter), no thread 0
// doing the waiting while the block waits at barriers, no staging of lines through shared
// memory. Sends to oneself (a copy into the matching receive, the plan's self lane) come
// along. Every thread moves its own 8-byte words of a piece straight between the buffer and
// the LL lines; a send needs no barrier at all, a receive one per piece before it frees the
// slot.
//
// Counters: like the plan kernel's lanes, a block binds one send and one receive connection at
// a time, reads a connection's counter word when it binds it and writes it back when it moves
// to another or ends (thread 0; a barrier orders a write-back before a later re-read of the
// word). The host gives each connection's steps to one block only.
#pragma once
#include "types.cuh"
#include "fifo.cuh"

namespace fc {

// One send: each piece into the connection's next slot. Each warp checks for room itself (lane
// 0 polls the local tail word, with acquire; the warp barrier orders the lanes' stores after
// it), so no block barrier stands between the launch and the first store. False on abort,
// deadline or another block's failure.
__device__ bool p2p_send(const FcP2p& P, const FcP2pStep& s, fc_u64& seq) {
    const fc_u8* src = (const fc_u8*)s.buf;
    fc_u64 tail_seen = 0;  // warp-uniform: lane 0's, shuffled
    for (fc_u64 off = 0; off < s.bytes; off += s.piece, ++seq) {
        if (seq >= tail_seen + s.slots) {
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
            if (__shfl_sync(0xffffffffu, ok, 0) == 0) return false;
            tail_seen = __shfl_sync(0xffffffffu, t, 0);
        }
        const fc_u64 nb = s.bytes - off < s.piece ? s.bytes - off : s.piece;
        fc_u8* slot = (fc_u8*)s.ll + (seq % s.slots) * (2ull * FC_LL_DATA);
        const fc_u32 flag = ll_flag(seq);
        for (fc_u64 i = threadIdx.x; i * 8u < nb; i += blockDim.x) {
            const fc_u32 n = (fc_u32)(nb - i * 8u < 8u ? nb - i * 8u : 8u);
            ll_store(slot + i * 16u, load8(src + off + i * 8u, n), flag);
        }
    }
    return true;
}

// A send to oneself, into the matching receive: every thread its own 8-byte words.
__device__ void p2p_copy(const FcP2pStep& s) {
    const fc_u8* src = (const fc_u8*)s.buf;
    fc_u8* dst = (fc_u8*)s.dst;
    for (fc_u64 i = threadIdx.x; i * 8u < s.bytes; i += blockDim.x) {
        const fc_u32 n = (fc_u32)(s.bytes - i * 8u < 8u ? s.bytes - i * 8u : 8u);
        store8(dst + i * 8u, load8(src + i * 8u, n), n);
    }
}

// One receive: each piece's lines, every thread waiting for its own and storing their data;
// then the barrier (every load of the slot has returned) and thread 0 frees the slot with a
// relaxed store, as release_ll does. False, on every thread, when a wait failed.
__device__ bool p2p_recv(const FcP2p& P, const FcP2pStep& s, fc_u64& seq) {
    fc_u8* dst = (fc_u8*)s.buf;
    for (fc_u64 off = 0; off < s.bytes; off += s.piece, ++seq) {
        const fc_u64 nb = s.bytes - off < s.piece ? s.bytes - off : s.piece;
        const fc_u8* slot = (const fc_u8*)s.ll + (seq % s.slots) * (2ull * FC_LL_DATA);
        const fc_u32 flag = ll_flag(seq);
        int bad = 0;
        for (fc_u64 i = threadIdx.x; i * 8u < nb; i += blockDim.x) {
            fc_u64 v;
            if (!ll_wait_line(P, slot + i * 16u, flag, s.peer, v, s.conn)) {
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

}  // namespace fc

extern "C" __global__ void __launch_bounds__(FC_P2P_THREADS, 1) ferroccl_p2p(const __grid_constant__ FcP2p P) {
    if (P.nsteps > FC_P2P_MAX_STEPS) return;
    fc::prior_grid_wait();
    // A launch queued behind a failure does nothing: the counters may disagree by now.
    const volatile FcError* err = (const volatile FcError*)P.error;
    if (err != nullptr && err->claimed != 0u) return;
    fc::P2pBind send = {nullptr, 0}, recv = {nullptr, 0};
    bool ok = true;
    for (fc_u32 i = 0; i < P.nsteps && ok; ++i) {
        const FcP2pStep& s = P.steps[i];
        if (s.block != blockIdx.x) continue;
        if (s.dir == FC_P2P_COPY) {
            fc::p2p_copy(s);
            // A later step may read what it wrote, through other threads (as in run_lane).
            __syncthreads();
        } else if (s.dir == FC_CONN_SEND) {
            fc::p2p_bind(send, s.counter);
            // A send fails warp by warp (a room wait); the block agrees before its next barrier.
            ok = !__syncthreads_or(!fc::p2p_send(P, s, send.seq));
        } else {
            fc::p2p_bind(recv, s.counter);
            ok = fc::p2p_recv(P, s, recv.seq);
        }
    }
    fc::release_next_grid();
    // After a failure the positions do not matter: every later launch leaves at its start.
    if (threadIdx.x == 0 && ok) {
        if (send.counter != nullptr) *(volatile fc_u64*)send.counter = send.seq;
        if (recv.counter != nullptr) *(volatile fc_u64*)recv.counter = recv.seq;
    }
}

// The two ends of a slot FIFO, as thread 0 of a lane's block drives them, plus the error record.
//
// Memory ordering (PTX memory model, system scope because the peer is another GPU or the host):
//  producer: all threads store the slot -> __syncthreads -> thread 0: lens[k] = bytes,
//            st.release.sys head = k + 1. The barrier puts the other threads' stores in
//            causality order before thread 0's release, which is cumulative: it orders them, and
//            lens, before head (NCCL's barrier, fence.acq_rel.sys and store are the same
//            thing). A fence.sc.sys before it, as there was, cost 0.6 us more per slot on an
//            H100 (bench/probes/graph_launch.cu) and ordered nothing more.
//  consumer: thread 0 polls head with ld.acquire.sys -> reads lens -> __syncthreads -> all
//            threads load the slot with ld.global.cg (L2; the producer's stores land in this
//            GPU's L2, and L1 could still hold the slot's previous contents).
//  freeing:  all threads finish loading the slot -> __syncthreads -> thread 0: st.release.sys
//            tail = k + 1. The release keeps the loads before the store that lets the producer
//            overwrite the slot; the producer polls tail with ld.acquire.sys before writing.
// Only thread 0 ever touches head, tail, lens and the counters.
#pragma once
#include "types.cuh"

namespace fc {

__device__ __forceinline__ fc_u64 ld_acquire_sys(const fc_u64* p) {
    fc_u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ fc_u32 ld_acquire_sys_u32(const fc_u32* p) {
    fc_u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(fc_u64* p, fc_u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Programmatic dependent launch (compute capability 9.0 and up). The engines' kernels are
// launched allowed to start while the kernel ahead of them in the stream (the user's, or the
// previous operation's) is still finishing, which hides their launch behind it. Every block
// therefore waits for that kernel to be complete and its memory visible before it touches
// global memory (the inputs, counters, epochs and the error record may all be that kernel's
// writes). Without the launch attribute this does nothing.
__device__ __forceinline__ void prior_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the launch behind this one start early (it waits the same way if it is ours; a user's
// kernel launched so must call griddepcontrol.wait, or cudaGridDependencySynchronize, before
// it reads our output, as PDL requires of it anyway). Each block calls it once it needs
// nothing more from a peer: an early-started kernel holds its SMs while it waits, and it must
// only ever wait for a kernel that will finish on its own, never for one still waiting on
// another GPU whose own kernels may need those SMs.
__device__ __forceinline__ void release_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A store other GPUs may read, without ordering of its own: for words whose order with earlier
// memory operations a kernel boundary already gives.
__device__ __forceinline__ void st_relaxed_sys(fc_u64* p, fc_u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ fc_u64 globaltimer() {
    fc_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Polls between checks of the abort word, the error record and the clock: the abort word may
// sit in host memory, a PCIe round trip, while a poll of head or tail is an L2 or NVLink one.
#define FC_POLLS_PER_CHECK 256u

// Thread 0's view of one lane: which connections it is bound to and their positions. The
// counters are read from their persistent words when a step first uses a connection and
// written back when the lane moves to another connection or ends, so a lane that stays on one
// pair of connections (every ring lane) touches them once per launch.
struct Lane {
    const FcLaunch* L;
    fc_u32 lane;
    fc_u32 step;  // index within the lane, for error records
    fc_i32 rc;    // bound receive connection, -1 = none
    fc_u64 consumed;
    fc_u64 head_seen;  // a lower bound of head (it only grows)
    fc_i32 sc;         // bound send connection, -1 = none
    fc_u64 produced;
    fc_u64 tail_seen;  // a lower bound of tail
    // The error record's claim as this launch began (loaded at entry, first used at the first
    // unsuccessful poll, so its latency hides behind the work before): a launch queued behind
    // a failure leaves at its first wait instead of polling 256 times per wait first.
    fc_u32 failed_before;
};

__device__ __forceinline__ const FcConn* conn_at(const Lane& x, fc_i32 i) {
    return ((const FcConn*)x.L->conns) + i;
}

// First failure wins the record; later ones (and blocks that merely noticed it) only leave.
__device__ void record_error(const Lane& x, fc_u32 code, fc_u32 what, fc_i32 conn, fc_u64 expected, fc_u64 got) {
    FcError* e = (FcError*)x.L->error;
    if (e == nullptr) return;
    if (atomicCAS(&e->claimed, 0u, 1u) != 0u) return;
    volatile FcError* v = e;
    v->lane = x.lane;
    v->step = x.step;
    v->peer = (conn >= 0 && (fc_u32)conn < x.L->nconns) ? conn_at(x, conn)->peer : 0xffffffffu;
    v->what = what;
    v->conn = conn;
    v->rank = x.L->rank;
    v->expected = expected;
    v->got = got;
    __threadfence_system();
    v->code = code;
}

// The one-kernel engines (the direct and peer kernels), whose parameter `P` carries error,
// abort, timeout_ns and rank: their first failure, as record_error with the block for the
// lane, and their waits' checks, as keep_waiting.
// `conn`: the connection waited on, where the engine runs on the plan kernel's FIFOs (the
// point-to-point kernel), else -1.
template <typename Param>
__device__ void engine_error(const Param& P, fc_u32 code, fc_u32 what, fc_u32 peer, fc_u64 expected, fc_u64 got, fc_u64 wanted, fc_u64 seen,
                             fc_i32 conn = -1) {
    FcError* e = (FcError*)P.error;
    if (e == nullptr) return;
    if (atomicCAS(&e->claimed, 0u, 1u) != 0u) return;
    volatile FcError* v = e;
    v->lane = blockIdx.x;
    v->step = 0;
    v->peer = peer;
    v->what = what;
    v->conn = conn;
    v->rank = P.rank;
    v->expected = expected;
    v->got = got;
    v->wanted = wanted;
    v->seen = seen;
    __threadfence_system();
    v->code = code;
}

// Called on every unsuccessful poll; true while the wait may go on (as keep_waiting).
template <typename Param>
// `wanted`: the value the wait is for; `seen`: the value last read (for the error record).
__device__ __forceinline__ bool engine_keep_waiting(const Param& P, fc_u32& polls, fc_u64& since, fc_u32 what, fc_u32 peer, fc_u64 wanted, fc_u64 seen,
                                                    fc_i32 conn = -1) {
    if ((++polls % FC_POLLS_PER_CHECK) != 0u) return true;
    const volatile int* ab = (const volatile int*)P.abort;
    if (ab != nullptr && *ab != 0) {
        engine_error(P, FC_ERR_ABORTED, what, peer, 0, 0, wanted, seen, conn);
        return false;
    }
    const volatile FcError* e = (const volatile FcError*)P.error;
    if (e != nullptr && e->claimed != 0u) return false;
    const fc_u64 now = globaltimer();
    if (since == 0) since = now;
    if (P.timeout_ns != 0 && now - since > P.timeout_ns) {
        engine_error(P, FC_ERR_TIMEOUT, what, peer, P.timeout_ns, now - since, wanted, seen, conn);
        return false;
    }
    return true;
}

// The collectives in which every rank sends to and receives from every rank (the one-kernel
// engines' "symmetric" operations): a round of one proves the peers done with the round before.
__device__ __forceinline__ bool symmetric_kind(fc_u32 kind) {
    return kind == FC_KIND_ALL_REDUCE || kind == FC_KIND_REDUCE_SCATTER || kind == FC_KIND_ALL_GATHER || kind == FC_KIND_ALL_TO_ALL;
}

// The kinds that only move data (no reduction): what a peer-engine sender may store straight into
// its receiver's output.
__device__ __forceinline__ bool movement_kind(fc_u32 kind) {
    return kind == FC_KIND_ALL_GATHER || kind == FC_KIND_ALL_TO_ALL || kind == FC_KIND_BROADCAST || kind == FC_KIND_GATHER ||
           kind == FC_KIND_SCATTER;
}

// The top bit of a one-kernel engine's per-block counter (direct: epoch; peer: round): the
// block's last round exchanged with every peer, so the next needs no acknowledgement check.
#define FC_AFTER_SYMMETRIC (1ull << 63)

// The one-kernel engines' own copy: where elements [at, at + len) of this rank's block move
// locally in a data-movement operation, as (src, dst); both null where nothing moves (the
// reductions fold their own block; a rooted operation's non-roots have none). Callers copy
// only when src != dst: in place they are the same bytes.
__device__ __forceinline__ void own_copy(fc_u32 kind, fc_u32 me, fc_u32 root, fc_u64 c, fc_u64 at, fc_u64 es, const fc_u8* in, fc_u8* out,
                                         const fc_u8*& src, fc_u8*& dst) {
    src = nullptr;
    dst = nullptr;
    switch (kind) {
        case FC_KIND_ALL_GATHER: src = in + at * es; dst = out + (me * c + at) * es; break;
        case FC_KIND_ALL_TO_ALL: src = in + (me * c + at) * es; dst = out + (me * c + at) * es; break;
        case FC_KIND_BROADCAST: if (me == root) { src = in + at * es; dst = out + at * es; } break;
        case FC_KIND_GATHER: if (me == root) { src = in + at * es; dst = out + (me * c + at) * es; } break;
        case FC_KIND_SCATTER: if (me == root) { src = in + (me * c + at) * es; dst = out + at * es; } break;
        default: break;
    }
}

__device__ __forceinline__ bool failed_elsewhere(const Lane& x) {
    const volatile FcError* e = (const volatile FcError*)x.L->error;
    return e != nullptr && e->claimed != 0u;
}

// Called on every unsuccessful poll; true while the wait may go on.
__device__ __forceinline__ bool keep_waiting(const Lane& x, fc_u32& polls, fc_u64& since, fc_u32 what, fc_i32 conn) {
    if (++polls == 1u && x.failed_before != 0u) return false;
    if ((polls % FC_POLLS_PER_CHECK) != 0u) return true;
    const volatile int* ab = (const volatile int*)x.L->abort;
    if (ab != nullptr && *ab != 0) {
        record_error(x, FC_ERR_ABORTED, what, conn, 0, 0);
        return false;
    }
    if (failed_elsewhere(x)) return false;
    const fc_u64 now = globaltimer();
    if (since == 0) since = now;
    if (x.L->timeout_ns != 0 && now - since > x.L->timeout_ns) {
        record_error(x, FC_ERR_TIMEOUT, what, conn, x.L->timeout_ns, now - since);
        return false;
    }
    return true;
}

__device__ __forceinline__ void unbind_recv(Lane& x) {
    if (x.rc >= 0) *(fc_u64*)conn_at(x, x.rc)->counter = x.consumed;
    x.rc = -1;
}
__device__ __forceinline__ void unbind_send(Lane& x) {
    if (x.sc >= 0) *(fc_u64*)conn_at(x, x.sc)->counter = x.produced;
    x.sc = -1;
}

__device__ __forceinline__ void bind_recv(Lane& x, fc_i32 c) {
    if (x.rc == c) return;
    unbind_recv(x);
    x.rc = c;
    x.consumed = *(const volatile fc_u64*)conn_at(x, c)->counter;
    x.head_seen = x.consumed;
}
__device__ __forceinline__ void bind_send(Lane& x, fc_i32 c) {
    if (x.sc == c) return;
    unbind_send(x);
    x.sc = c;
    x.produced = *(const volatile fc_u64*)conn_at(x, c)->counter;
    x.tail_seen = 0;
}

// Waits for a free slot on the bound send connection; returns its address, or null on failure.
__device__ fc_u8* wait_room(Lane& x, const FcConn& c) {
    if (x.produced - x.tail_seen >= c.slots) {
        fc_u32 polls = 0;
        fc_u64 since = 0;
        for (;;) {
            x.tail_seen = ld_acquire_sys((const fc_u64*)c.tail);
            if (x.produced - x.tail_seen < c.slots) break;
            if (!keep_waiting(x, polls, since, FC_WHAT_ROOM, x.sc)) return nullptr;
        }
    }
    return (fc_u8*)c.data + (x.produced % c.slots) * (fc_u64)c.slot_bytes;
}

// Waits for the next slot on the bound receive connection and checks that it holds `bytes`;
// returns its address, or null on failure. `direct` says whether the sender wrote the data
// straight into our output (zero-copy) instead of into the slot.
__device__ const fc_u8* wait_data(Lane& x, const FcConn& c, fc_u32 bytes, bool& direct) {
    if (x.head_seen <= x.consumed) {
        fc_u32 polls = 0;
        fc_u64 since = 0;
        for (;;) {
            x.head_seen = ld_acquire_sys((const fc_u64*)c.head);
            if (x.head_seen > x.consumed) break;
            if (!keep_waiting(x, polls, since, FC_WHAT_DATA, x.rc)) return nullptr;
        }
    }
    const fc_u64 k = x.consumed % c.slots;
    const fc_u32 len = ((const volatile fc_u32*)c.lens)[k];
    direct = len == (bytes | FC_LEN_DIRECT);
    if (len != bytes && !direct) {
        record_error(x, FC_ERR_LENGTH, FC_WHAT_LENGTH, x.rc, bytes, len);
        return nullptr;
    }
    return (const fc_u8*)c.data + k * (fc_u64)c.slot_bytes;
}

// ---- zero-copy handshake (plan/zcopy.rs) -------------------------------------------------------
// The receiver posts {first message of its run + 1, output address, bytes} into the sender's
// memory when its lane starts an op's run; the sender's first message of the matching run waits
// until the post carries that run's number. A post is overwritten only after every message of
// its run was consumed, so later sends of the run read it without waiting.

// Thread 0: posts on the bound receive connection.
__device__ __forceinline__ void post_output(Lane& x, const FcConn& c, fc_u64 addr, fc_u64 bytes) {
    volatile fc_u64* p = (volatile fc_u64*)c.post;
    p[1] = addr;
    p[2] = bytes;
    st_release_sys((fc_u64*)c.post, x.consumed + 1);
}

// Thread 0: waits for the post of the run whose first message is the next one produced on the
// bound send connection. False on abort, deadline or another block's failure.
__device__ bool wait_post(Lane& x, const FcConn& c) {
    fc_u32 polls = 0;
    fc_u64 since = 0;
    while (ld_acquire_sys((const fc_u64*)c.post) != x.produced + 1) {
        if (!keep_waiting(x, polls, since, FC_WHAT_POST, x.sc)) return false;
    }
    return true;
}

// ---- LL protocol ------------------------------------------------------------------------------
// For small messages the fence and the separate head store of the simple protocol, and the
// receiver's poll-then-read, cost more than the data. In LL every 16-byte line carries 8 data
// bytes as two {4 data bytes, flag} halves, each written by one 8-byte-atomic part of a vector
// store; a reader that sees both flags equal to the message's flag has the line's data, with no
// fence on either side. The flag is the message's sequence number on the connection (+1, never
// 0, the value of fresh memory), so a line left from an earlier use of the slot never matches.
// LL slots live apart from the data slots: simple payloads must never pass for flags. Messages
// still take slots in the same sequence (the same counters), and the consumer still frees each
// slot through `tail`, so the producer never overwrites a line that is being read.

__device__ __forceinline__ fc_u32 ll_flag(fc_u64 seq) { return (fc_u32)(seq % 0xffffffffull) + 1u; }

__device__ __forceinline__ fc_u64 ll_piece_bytes(const FcConn& c) {
    const fc_u64 b = c.slot_bytes < FC_LL_DATA ? c.slot_bytes : FC_LL_DATA;
    return b & ~(fc_u64)7;
}

__device__ __forceinline__ fc_u8* ll_slot(const FcConn& c, fc_u64 seq) {
    return (fc_u8*)c.ll + (seq % c.slots) * (fc_u64)(2u * FC_LL_DATA);
}

// One LL line: 8 data bytes (a little-endian word) and the flag twice, in one vector store.
__device__ __forceinline__ void ll_store(fc_u8* line, fc_u64 v, fc_u32 flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line), "r"((fc_u32)v), "r"(flag),
                 "r"((fc_u32)(v >> 32)), "r"(flag)
                 : "memory");
}

// Nanoseconds an LL wait pauses between polls that found a stale line: the direct engine's
// (FC_LL_POLL_NS, default 0: none) and the point-to-point kernel's (FC_P2P_LL_POLL_NS, default
// 200). The line rounds' rare slow rows became about 25 x rarer with such a pause (peer.cu,
// FC_LINE_POLL_NS; docs/PERFORMANCE.md section 24), and these waits poll lines that the link is
// writing in the same way. Measured on 2 x H200 (section 32): sendrecv of 32-128 KiB in CUDA
// graphs, 3 of 150 rows at 135-169 us against 5 without a pause, none of 150 with it, medians
// level; the direct engine's all-reduce of 8 B - 32 KiB in graphs 0.07-0.15 us slower with it and
// no slow row either way, so it keeps none.
#ifndef FC_LL_POLL_NS
#define FC_LL_POLL_NS 0
#endif
#ifndef FC_P2P_LL_POLL_NS
#define FC_P2P_LL_POLL_NS 200
#endif

// The one-kernel engines, each thread for itself: waits until the line carries `flag`, then
// gives its 8 data bytes; false on abort, deadline or another block's failure (`peer`, `conn`
// and the flag name the wait in the error record). PAUSE_NS: the pause between stale polls.
template <int PAUSE_NS = FC_LL_POLL_NS, typename Param>
__device__ __forceinline__ bool ll_wait_line(const Param& P, const fc_u8* line, fc_u32 flag, fc_u32 peer, fc_u64& v, fc_i32 conn = -1) {
    fc_u32 polls = 0;
    fc_u64 since = 0;
    for (;;) {
        fc_u32 d0, f0, d1, f1;
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                     : "l"(line)
                     : "memory");
        if (f0 == flag && f1 == flag) {
            v = (fc_u64)d0 | ((fc_u64)d1 << 32);
            return true;
        }
        if (!engine_keep_waiting(P, polls, since, FC_WHAT_DATA, peer, flag, f0, conn)) return false;
        if (PAUSE_NS > 0) __nanosleep(PAUSE_NS);
    }
}

// Up to 8 bytes at p (a little-endian word; bytes past n are zero), and back: an LL line's data
// from and to buffers of any element alignment.
__device__ __forceinline__ fc_u64 load8(const fc_u8* p, fc_u32 n) {
    if (n == 8u && ((fc_u64)p & 7u) == 0) return *(const fc_u64*)p;
    fc_u64 v = 0;
    for (fc_u32 k = 0; k < n; ++k) v |= (fc_u64)p[k] << (8u * k);
    return v;
}
__device__ __forceinline__ void store8(fc_u8* p, fc_u64 v, fc_u32 n) {
    if (n == 8u && ((fc_u64)p & 7u) == 0) {
        *(fc_u64*)p = v;
        return;
    }
    for (fc_u32 k = 0; k < n; ++k) p[k] = (fc_u8)(v >> (8u * k));
}

// All threads, each its own 8-byte words: `bytes` from src to dst, either of any element
// alignment (the one-kernel engines' local copies of small messages).
__device__ __forceinline__ void copy8(fc_u8* dst, const fc_u8* src, fc_u64 bytes) {
    const fc_u64 lines = (bytes + 7u) / 8u;
    for (fc_u64 i = threadIdx.x; i < lines; i += blockDim.x) {
        const fc_u32 n = (fc_u32)(bytes - i * 8u < 8u ? bytes - i * 8u : 8u);
        store8(dst + i * 8u, load8(src + i * 8u, n), n);
    }
}

// All threads: writes `bytes` of staged data (shared memory) as LL lines into a peer's slot.
__device__ __forceinline__ void ll_pack(fc_u8* slot, const fc_u8* stage, fc_u64 bytes, fc_u32 flag) {
    const fc_u64 lines = (bytes + 7) / 8;
    for (fc_u64 i = threadIdx.x; i < lines; i += blockDim.x) ll_store(slot + i * 16, *(const fc_u64*)(stage + i * 8), flag);
}

// All threads: waits for the lines of an LL message and unpacks its data into shared memory.
// False when the wait ends by abort, deadline, or another block's failure.
__device__ bool ll_unpack(const Lane& x, fc_i32 conn, fc_u8* stage, const fc_u8* slot, fc_u64 bytes, fc_u32 flag) {
    const fc_u64 lines = (bytes + 7) / 8;
    fc_u32 polls = 0;
    fc_u64 since = 0;
    for (fc_u64 i = threadIdx.x; i < lines; i += blockDim.x) {
        fc_u32 d0, f0, d1, f1;
        for (;;) {
            asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                         : "l"(slot + i * 16)
                         : "memory");
            if (f0 == flag && f1 == flag) break;
            if (!keep_waiting(x, polls, since, FC_WHAT_DATA, conn)) return false;
        }
        *(fc_u32*)(stage + i * 8) = d0;
        *(fc_u32*)(stage + i * 8 + 4) = d1;
    }
    return true;
}

// After the block's __syncthreads that ends the piece. `len` is the byte count, with
// FC_LEN_DIRECT when the data went straight to the receiver's output.
// Thread 0, after the barrier that ends slot `seq`'s stores: its length, then the head past it
// (the release orders the block's stores and the length before it).
__device__ __forceinline__ void fifo_publish(const fc_u64 lens, const fc_u64 head, fc_u32 slots, fc_u64 seq, fc_u32 len) {
    ((volatile fc_u32*)lens)[seq % slots] = len;
    st_release_sys((fc_u64*)head, seq + 1u);
}

__device__ __forceinline__ void publish(Lane& x, const FcConn& c, fc_u32 len) {
    fifo_publish(c.lens, c.head, c.slots, x.produced, len);
    x.produced += 1;
}

// An LL slot is freed as soon as the block has unpacked it (the values are in shared memory),
// before the step computes and forwards: a release store here would first wait for this
// step's earlier writes over NVLink to be acknowledged, on every hop of a ring. A relaxed store
// is enough because every load of the slot has returned its value before the barrier that
// precedes this store.
__device__ __forceinline__ void release_ll(Lane& x, const FcConn& c) {
    x.consumed += 1;
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(c.tail), "l"(x.consumed) : "memory");
}

__device__ __forceinline__ void release(Lane& x, const FcConn& c) {
    x.consumed += 1;
    st_release_sys((fc_u64*)c.tail, x.consumed);
}

}  // namespace fc

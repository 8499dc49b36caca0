// ferroccl_plan_exec: the GPU twin of backend/host/exec.rs. One block per lane of the plan; a
// block runs its lane's steps in order, each step one FIFO slot (a piece) at a time, exactly
// as the host executor does, so both backends move the same bytes in the same messages and
// a GPU rank can talk to a host rank's FIFO layout.
//
// Thread 0 does all waiting and signalling; the other threads wait at __syncthreads, then the
// whole block moves the piece. All blocks of a launch must be resident at once (grid = lanes,
// a few dozen at most), since a lane may wait for another lane of the same GPU.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "types.cuh"
#include "fifo.cuh"
#include "reduce.cuh"

#ifndef FC_MAX_THREADS
#define FC_MAX_THREADS 1024
#endif

namespace fc {

// What thread 0 hands the block for one piece.
struct Shared {
    const fc_u8* in;  // the received slot (LL: its lines; zero-copy: where it landed)
    fc_u8* out;       // the slot being filled (LL: its lines; zero-copy: the peer's output)
    fc_u64 n;         // elements in this piece
    fc_u32 rflag;     // LL flags of the incoming and outgoing messages
    fc_u32 sflag;
    int exit;
    int rdirect;      // the incoming data is already in dst (zero-copy)
    int sdirect;      // the outgoing data goes straight to the peer's output
};

// LL messages pass through shared memory: unpacked here on receipt, composed here for sending.
struct LLStage {
    fc_u8 in[FC_LL_DATA];
    fc_u8 out[FC_LL_DATA];
};

__device__ __forceinline__ fc_u8* region(const FcOp& op, fc_u32 buf, fc_u64 off) {
    return (fc_u8*)(buf == FC_BUF_INPUT ? op.send : op.recv) + off * op.elem_size;
}

__device__ __forceinline__ bool step_has_recv(fc_u32 kind) {
    return kind == FC_STEP_RECV || kind == FC_STEP_RECV_REDUCE || kind == FC_STEP_RECV_COPY;
}
__device__ __forceinline__ bool step_has_send(const FcStep& s) {
    return s.kind == FC_STEP_SEND || ((s.kind == FC_STEP_RECV_REDUCE || s.kind == FC_STEP_RECV_COPY) &&
                                      (s.flags & FC_FLAG_HAS_TO) != 0u);
}

// Steps are read a window at a time into shared memory, with the op and the two connections
// each names: a step then costs thread 0 no dependent global loads (step -> op -> connection
// was three round trips to L2 per step, on every hop of a ring).
#define FC_WINDOW 16u
struct Window {
    FcStep steps[FC_WINDOW];
    FcOp ops[FC_WINDOW];
    FcConn conns[FC_WINDOW][2];  // [0]: recv_conn, [1]: send_conn; zero where out of range
};

// All threads: loads steps [first, first + n) of the lane and what they name.
__device__ void load_window(const FcLaunch& L, const FcStep* steps, fc_u32 first, fc_u32 n, Window& w) {
    const fc_u32 S8 = sizeof(FcStep) / 8, O8 = sizeof(FcOp) / 8, C8 = sizeof(FcConn) / 8;
    // Every thread is past its reads of the previous window (a step without pieces has no
    // barrier of its own).
    __syncthreads();
    for (fc_u32 i = threadIdx.x; i < n * S8; i += blockDim.x) ((fc_u64*)w.steps)[i] = ((const fc_u64*)(steps + first))[i];
    __syncthreads();
    const FcOp* ops = L.nops <= FC_INLINE_OPS ? L.inline_ops : (const FcOp*)L.ops;
    for (fc_u32 i = threadIdx.x; i < n * O8; i += blockDim.x) {
        const fc_u32 k = i / O8, j = i % O8, o = w.steps[k].op;
        ((fc_u64*)&w.ops[k])[j] = o < L.nops ? ((const fc_u64*)(ops + o))[j] : 0;
    }
    for (fc_u32 i = threadIdx.x; i < n * 2 * C8; i += blockDim.x) {
        const fc_u32 k = i / (2 * C8), r = (i / C8) % 2, j = i % C8;
        const fc_i32 c = r == 0 ? w.steps[k].recv_conn : w.steps[k].send_conn;
        ((fc_u64*)&w.conns[k][r])[j] = (c >= 0 && (fc_u32)c < L.nconns) ? ((const fc_u64*)((const FcConn*)L.conns + c))[j] : 0;
    }
    __syncthreads();
}

// Thread 0, at a step's first piece: the connections named by the step exist and play the
// role the step gives them, and both agree on the piece size (the peers cut messages by it).
// `c` are the window's copies of the step's connections.
__device__ bool check_conns(const Lane& x, const FcStep& s, const FcOp& op, const FcConn* c) {
    const fc_u32 n = x.L->nconns;
    fc_u32 slot_bytes = 0;
    if (step_has_recv(s.kind)) {
        if (s.recv_conn < 0 || (fc_u32)s.recv_conn >= n) return false;
        if (c[0].dir != FC_CONN_RECV || c[0].slots == 0 || c[0].slot_bytes < op.elem_size) return false;
        slot_bytes = c[0].slot_bytes;
    }
    if (step_has_send(s)) {
        if (s.send_conn < 0 || (fc_u32)s.send_conn >= n) return false;
        if (c[1].dir != FC_CONN_SEND || c[1].slots == 0 || c[1].slot_bytes < op.elem_size) return false;
        if (slot_bytes != 0 && slot_bytes != c[1].slot_bytes) return false;
    }
    return true;
}

// All threads, uniformly (they read the same words), so no barrier is needed to agree.
__device__ __forceinline__ bool op_ok(const FcLaunch& L, const FcStep& s, const FcOp& op) {
    if (s.op >= L.nops || s.kind > FC_STEP_POST) return false;
    return dtype_valid(op.dtype) && redop_valid(op.redop) && op.elem_size == dtype_size(op.dtype) && op.nranks != 0;
}

__device__ void run_lane(const FcLaunch& L) {
    __shared__ Shared sh;
    __shared__ __align__(16) LLStage st;
    __shared__ __align__(16) Window win;
    const bool t0 = threadIdx.x == 0;
    Lane x;
    x.L = &L;
    x.lane = blockIdx.x;
    x.step = 0;
    x.rc = -1;
    x.sc = -1;
    x.consumed = x.head_seen = x.produced = x.tail_seen = 0;
    x.failed_before = L.error != 0 ? ((const volatile FcError*)L.error)->claimed : 0u;

    const FcLane ln = ((const FcLane*)L.lanes)[blockIdx.x];
    if ((fc_u64)ln.first_step + ln.nsteps > L.nsteps) {
        if (t0) record_error(x, FC_ERR_PLAN, FC_WHAT_PLAN, -1, L.nsteps, (fc_u64)ln.first_step + ln.nsteps);
        return;
    }
    const FcStep* steps = (const FcStep*)L.steps + ln.first_step;
    bool stop = false;
    for (fc_u32 si = 0; si < ln.nsteps && !stop; ++si) {
        if (si % FC_WINDOW == 0) load_window(L, steps, si, min(FC_WINDOW, ln.nsteps - si), win);
        const fc_u32 wi = si % FC_WINDOW;
        const FcStep s = win.steps[wi];
        x.step = si;
        const FcOp op = win.ops[wi];
        if (!op_ok(L, s, op)) {
            if (t0) record_error(x, FC_ERR_PLAN, FC_WHAT_PLAN, -1, 0, s.op);
            break;
        }

        if (s.kind == FC_STEP_POST) {
            // All threads decide alike from the window; thread 0 posts.
            const FcConn& c = win.conns[wi][0];
            if (s.recv_conn < 0 || (fc_u32)s.recv_conn >= L.nconns || c.dir != FC_CONN_RECV || c.post == 0) {
                if (t0) record_error(x, FC_ERR_PLAN, FC_WHAT_PLAN, s.recv_conn, 0, 0);
                break;
            }
            if (t0) {
                bind_recv(x, s.recv_conn);
                post_output(x, c, s.src_off, s.count);
            }
            continue;
        }

        if (s.kind == FC_STEP_COPY) {
            // Local, whole region at once (no FIFO, so no pieces), like the host. The
            // destination may be another op's buffer (a send to oneself lands in the matching
            // receive): that op is read here, every thread alike.
            if (s.dst_op >= L.nops) {
                if (t0) record_error(x, FC_ERR_PLAN, FC_WHAT_PLAN, -1, 0, s.dst_op);
                break;
            }
            const FcOp dop = s.dst_op == s.op ? op : (L.nops <= FC_INLINE_OPS ? L.inline_ops : (const FcOp*)L.ops)[s.dst_op];
            fc_u8* src = region(op, s.src_buf, s.src_off);
            fc_u8* dst = region(dop, s.dst_buf, s.dst_off);
            transform(op, dst, src, s.count, (s.flags & FC_FLAG_PRE) != 0u, (s.flags & FC_FLAG_POST) != 0u);
            // A later step may read what this one wrote, through other threads.
            __syncthreads();
            continue;
        }

        const bool has_recv = step_has_recv(s.kind);
        const bool has_send = step_has_send(s);
        const bool has_dst = s.kind == FC_STEP_RECV || (s.flags & FC_FLAG_HAS_DST) != 0u;
        const bool ll = (s.flags & FC_FLAG_LL) != 0u;
        FcConn rc, sc;  // thread 0's copies, read once per step
        fc_u64 piece = 0;
        // Zero-copy: the receiver's output as we map it, and its bytes (0: through the FIFO).
        fc_u64 rbase = 0, rbytes = 0;
        if (t0) {
            bool ok = check_conns(x, s, op, win.conns[wi]);
            if (ok) {
                if (has_recv) {
                    rc = win.conns[wi][0];
                    bind_recv(x, s.recv_conn);
                }
                if (has_send) {
                    sc = win.conns[wi][1];
                    bind_send(x, s.send_conn);
                }
                piece = (ll ? ll_piece_bytes(has_recv ? rc : sc) : (has_recv ? rc.slot_bytes : sc.slot_bytes)) / op.elem_size;
                if (has_send && !ll && (s.flags & FC_FLAG_WAIT_POST) != 0u && !wait_post(x, sc)) piece = 0;
                if (has_send && !ll && (s.flags & FC_FLAG_RDST) != 0u && sc.slot_bytes >= 8u) {
                    rbase = ((const volatile fc_u64*)sc.post)[1];
                    rbytes = ((const volatile fc_u64*)sc.post)[2];
                }
            } else {
                record_error(x, FC_ERR_PLAN, FC_WHAT_PLAN, has_recv ? s.recv_conn : s.send_conn, 0, 0);
                piece = 0;
            }
        }

        for (fc_u64 done = 0; done < s.count;) {
            if (t0) {
                bool ok = piece != 0;
                const fc_u64 n = s.count - done < piece ? s.count - done : piece;
                const fc_u32 bytes = (fc_u32)(n * op.elem_size);
                fc_u8* out = nullptr;
                const fc_u8* in = nullptr;
                // The outgoing slot first, as on the host: a full peer must not make this rank
                // hold an incoming slot it cannot pass on.
                if (ok && has_send) ok = (out = wait_room(x, sc)) != nullptr;
                sh.sdirect = 0;
                sh.rdirect = 0;
                if (ok && rbase != 0) {
                    // Straight into the receiver's output, inside what it posted; the slot only
                    // carries the offset, for the receiver to check.
                    const fc_u64 off = s.rdst_off + done;
                    if ((off + n) * op.elem_size > rbytes) {
                        record_error(x, FC_ERR_PLAN, FC_WHAT_POST, s.send_conn, rbytes, (off + n) * op.elem_size);
                        ok = false;
                    } else {
                        *(volatile fc_u64*)out = off;
                        out = (fc_u8*)rbase + off * op.elem_size;
                        sh.sdirect = 1;
                    }
                }
                if (ll) {
                    // The lines carry their own flags: every thread waits for its own below.
                    if (ok && has_send) out = ll_slot(sc, x.produced);
                    if (ok && has_recv) in = ll_slot(rc, x.consumed);
                    sh.sflag = ll_flag(x.produced);
                    sh.rflag = ll_flag(x.consumed);
                } else if (ok && has_recv) {
                    bool direct = false;
                    ok = (in = wait_data(x, rc, bytes, direct)) != nullptr;
                    if (ok && direct) {
                        // The sender wrote into our output: where this step stores the message,
                        // and nowhere else, or the plans disagree.
                        const fc_u64 want = s.dst_off + done;
                        const fc_u64 got = *(const volatile fc_u64*)in;
                        if (!has_dst || s.dst_buf != FC_BUF_OUTPUT || s.kind == FC_STEP_RECV_REDUCE || got != want) {
                            record_error(x, FC_ERR_LENGTH, FC_WHAT_LENGTH, s.recv_conn, want, got);
                            ok = false;
                        } else {
                            in = region(op, s.dst_buf, s.dst_off + done);
                            sh.rdirect = 1;
                        }
                    }
                }
                sh.in = in;
                sh.out = out;
                sh.n = n;
                sh.exit = !ok;
            }
            __syncthreads();
            if (sh.exit) {
                stop = true;
                break;
            }
            const fc_u64 n = sh.n;
            const fc_u8* in = sh.in;
            fc_u8* out = sh.out;
            fc_u8* ll_lines = out;
            if (ll) {
                bool ok = true;
                if (has_recv) ok = ll_unpack(x, s.recv_conn, st.in, in, n * op.elem_size, sh.rflag);
                if (__syncthreads_or(!ok)) {
                    stop = true;
                    break;
                }
                if (t0 && has_recv) release_ll(x, rc);
                in = st.in;
                if (has_send) out = st.out;
            }
            fc_u8* dst = has_dst ? region(op, s.dst_buf, s.dst_off + done) : nullptr;
            switch (s.kind) {
                case FC_STEP_SEND:
                    transform(op, out, region(op, s.src_buf, s.src_off + done), n, (s.flags & FC_FLAG_PRE) != 0u, false);
                    break;
                case FC_STEP_RECV:
                    if (!sh.rdirect) copy_bytes(dst, nullptr, in, n * op.elem_size);
                    break;
                case FC_STEP_RECV_REDUCE: {
                    fc_u8* d0 = dst != nullptr ? dst : out;
                    fc_u8* d1 = dst != nullptr ? out : nullptr;
                    if (d0 != nullptr)
                        reduce(op, d0, d1, in, region(op, s.src_buf, s.src_off + done), n,
                               (s.flags & FC_FLAG_PRE_LOCAL) != 0u, (s.flags & FC_FLAG_POST) != 0u);
                    break;
                }
                default: {  // FC_STEP_RECV_COPY
                    // Landed in dst already (zero-copy): only the forward is left.
                    fc_u8* d0 = dst != nullptr && !sh.rdirect ? dst : out;
                    fc_u8* d1 = dst != nullptr && !sh.rdirect ? out : nullptr;
                    if (d0 != nullptr) copy_bytes(d0, d1, in, n * op.elem_size);
                    break;
                }
            }
            // Ends the piece for every thread: the slot is fully read and written before thread 0
            // signals, and sh may be overwritten for the next piece.
            __syncthreads();
            if (ll && has_send) {
                ll_pack(ll_lines, st.out, n * op.elem_size, sh.sflag);
                // st.out and sh are reused by the next piece.
                __syncthreads();
            }
            if (t0) {
                if (has_send) {
                    if (ll) x.produced += 1;
                    else publish(x, sc, (fc_u32)(n * op.elem_size) | (sh.sdirect ? FC_LEN_DIRECT : 0u));
                }
                if (has_recv && !ll) release(x, rc);
            }
            done += n;
        }
    }
    if (t0) {
        unbind_recv(x);
        unbind_send(x);
    }
}

}  // namespace fc

extern "C" __global__ void __launch_bounds__(FC_MAX_THREADS, 1) ferroccl_plan_exec(const __grid_constant__ FcLaunch L) {
    if (blockIdx.x >= L.nlanes) return;
    fc::prior_grid_wait();
    fc::run_lane(L);
    fc::release_next_grid();
}

// The plan kernel's point-to-point form shares this module (one NVRTC compile) and its loops.
#include "p2p.cuh"

// What the copy engine's zero-copy handshake costs between two GPUs, per operation, measured on
// the GPUs alone: every variant is captured into a CUDA graph per GPU (K operations), so that no
// host enqueue cost enters the figure. One operation is what `copy_engine.rs`'s
// `zcopy_schedule` issues on a peer lane, forked from and joined to a "user" stream:
//
//   sep:      write(peer.ready=1) wait(my.ready==1) write(my.ready=0) copy(S to the peer)
//             write(peer.full=1) wait(my.full==1) write(my.full=0)       (7 commands, as today)
//   batch:    the same, the three memory operations around the copy in one cuStreamBatchMemOp each
//   batch-nb: batch, with every write but full's without the memory barrier (the driver refused
//             such a batch on host words on 2 x H200: tried last, on GPU words, its error printed)
//   copy:     the copy alone (no handshake: the floor)
//   memcpy:   each flag raised by a 4-byte copy from a word of ones in this GPU's memory (what
//             NCCL 2.28's copy-engine collectives do), then a batch of the wait and the reset
//   kernel:   each handshake a one-warp kernel: a system-scope store of the peer's flag, a poll of
//             its own, its reset
//   user:     batch, on the user stream itself (no fork and join of a lane)
//
// with the words in host memory (as today) or in the waiting GPU's memory (written by the peer
// over NVLink). Then the copy-and-fold's pieces: one lane copies S in P pieces, each followed by
// a piece word raised in the peer's memory (a stream write with its barrier, or a 4-byte copy),
// against the same on two lanes taking pieces in turn.
//
// `./ce_handshake local` times instead what an out-of-place all-gather or all-to-all adds to the
// peer copy: the rank's own block copied locally beside it, by the copy engine on the user
// stream (as copy_engine.rs does), on a second lane, or by an SM kernel of 16 or 32 blocks.
//
//   nvcc -O2 -o ce_handshake bench/probes/ce_handshake.cu -lcuda && ./ce_handshake [local]
//
// Prints one line per measurement: microseconds per operation (median of 5 runs of K each).
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(r_, &s); \
    std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); std::exit(1); } } while (0)
#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

static const int K = 50;
static const size_t BUF = 64 << 20;

struct Gpu {
    cudaStream_t user, lane[2];
    cudaEvent_t fork, join[2], t0, t1;
    CUdeviceptr src, dst, words;  // words: 4 KiB of this GPU's memory
};

static Gpu g[2];

__global__ void handshake(unsigned* peer, unsigned* mine) {
    if (threadIdx.x != 0) return;
    __threadfence_system();
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(peer), "r"(1u) : "memory");
    unsigned v = 0;
    do {
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory");
    } while (v != 1u);
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(mine), "r"(0u) : "memory");
}
static unsigned* host;  // 4 KiB per GPU, mapped
static CUdeviceptr hostdev;

enum Where { HOST, DEV };
// Word w (0: ready, 1: full, 2..: piece words) of GPU `owner`, 128 bytes apart.
static CUdeviceptr word(Where where, int owner, int w) {
    if (where == HOST) return hostdev + owner * 4096 + w * 128;
    return g[owner].words + w * 128;
}

static void reset_words() {
    std::memset(host, 0, 2 * 4096);
    for (int d = 0; d < 2; d++) {
        RK(cudaSetDevice(d));
        CK(cuMemsetD8(g[d].words, 0, 2048));  // the word of ones at 2048 stays
        RK(cudaDeviceSynchronize());
    }
}

static CUstreamBatchMemOpParams wr(CUdeviceptr a, unsigned v, bool barrier) {
    CUstreamBatchMemOpParams p;
    std::memset(&p, 0, sizeof p);
    p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    p.writeValue.address = a;
    p.writeValue.value = v;
    p.writeValue.flags = barrier ? CU_STREAM_WRITE_VALUE_DEFAULT : CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER;
    return p;
}
static CUstreamBatchMemOpParams wt(CUdeviceptr a, unsigned v) {
    CUstreamBatchMemOpParams p;
    std::memset(&p, 0, sizeof p);
    p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
    p.waitValue.address = a;
    p.waitValue.value = v;
    p.waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
    return p;
}
static bool refused = false;
static void issue(CUstream s, std::vector<CUstreamBatchMemOpParams> ops, bool batch) {
    if (batch) {
        CUresult r = cuStreamBatchMemOp(s, (unsigned)ops.size(), ops.data(), 0);
        if (r != CUDA_SUCCESS && !refused) {
            const char* e;
            cuGetErrorString(r, &e);
            std::printf("cuStreamBatchMemOp refused: %s\n", e);
        }
        refused |= r != CUDA_SUCCESS;
        return;
    }
    for (auto& p : ops) {
        if (p.operation == CU_STREAM_MEM_OP_WAIT_VALUE_32)
            CK(cuStreamWaitValue32(s, p.waitValue.address, p.waitValue.value, p.waitValue.flags));
        else
            CK(cuStreamWriteValue32(s, p.writeValue.address, p.writeValue.value, p.writeValue.flags));
    }
}

// Captures K operations of `one(d, lanes)` on GPU d into a graph (forked to `lanes` lanes and
// joined per operation), launches both GPUs' graphs together, returns us per operation on GPU 0.
static double run(int lanes, const std::function<void(int, cudaStream_t*)>& one) {
    cudaGraphExec_t ex[2];
    for (int d = 0; d < 2; d++) {
        RK(cudaSetDevice(d));
        cudaGraph_t graph;
        RK(cudaStreamBeginCapture(g[d].user, cudaStreamCaptureModeRelaxed));
        for (int i = 0; i < K; i++) {
            if (lanes > 0) RK(cudaEventRecord(g[d].fork, g[d].user));
            for (int l = 0; l < lanes; l++) RK(cudaStreamWaitEvent(g[d].lane[l], g[d].fork, 0));
            one(d, lanes > 0 ? g[d].lane : &g[d].user);
            if (refused) break;  // the capture is invalidated: end it
            for (int l = 0; l < lanes; l++) {
                RK(cudaEventRecord(g[d].join[l], g[d].lane[l]));
                RK(cudaStreamWaitEvent(g[d].user, g[d].join[l], 0));
            }
        }
        cudaError_t ended = cudaStreamEndCapture(g[d].user, &graph);
        if (refused) {
            if (ended == cudaSuccess) RK(cudaGraphDestroy(graph));
            (void)cudaGetLastError();
            refused = false;
            return -1.0;
        }
        RK(ended);
        RK(cudaGraphInstantiate(&ex[d], graph, 0));
        RK(cudaGraphDestroy(graph));
    }
    std::vector<double> t;
    for (int run = 0; run < 6; run++) {
        reset_words();
        for (int d = 0; d < 2; d++) {
            RK(cudaSetDevice(d));
            RK(cudaEventRecord(g[d].t0, g[d].user));
            RK(cudaGraphLaunch(ex[d], g[d].user));
            RK(cudaEventRecord(g[d].t1, g[d].user));
        }
        for (int d = 0; d < 2; d++) {
            RK(cudaSetDevice(d));
            RK(cudaEventSynchronize(g[d].t1));
        }
        float ms;
        RK(cudaEventElapsedTime(&ms, g[0].t0, g[0].t1));
        if (run > 0) t.push_back(ms * 1000.0 / K);  // the first run uploads the graph
    }
    for (int d = 0; d < 2; d++) {
        RK(cudaSetDevice(d));
        RK(cudaGraphExecDestroy(ex[d]));
    }
    std::sort(t.begin(), t.end());
    return t[2];
}

__global__ void copy16(const uint4* src, uint4* dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

static void local_copies() {
    CUdeviceptr ldst[2];
    for (int d = 0; d < 2; d++) {
        RK(cudaSetDevice(d));
        CK(cuMemAlloc(&ldst[d], BUF));
    }
    for (size_t S : {(size_t)32 << 20, (size_t)64 << 20}) {
        const char* names[] = {"peer alone", "local CE alone", "local k16 alone", "local k32 alone",
                               "peer + local CE (user stream)", "peer + local CE (2nd lane)",
                               "peer + local k16 (user stream)", "peer + local k32 (user stream)"};
        for (int v = 0; v < 8; v++) {
            double us = run(v == 5 ? 2 : 1, [&](int d, cudaStream_t* lane) {
                int p = 1 - d;
                bool peer = v == 0 || v >= 4;
                if (peer) CK(cuMemcpyDtoDAsync(g[p].dst, g[d].src, S, (CUstream)lane[0]));
                if (v == 1 || v == 4) CK(cuMemcpyDtoDAsync(ldst[d], g[d].src, S, (CUstream)g[d].user));
                if (v == 5) CK(cuMemcpyDtoDAsync(ldst[d], g[d].src, S, (CUstream)lane[1]));
                if (v == 2 || v == 3 || v == 6 || v == 7) {
                    int blocks = (v == 2 || v == 6) ? 16 : 32;
                    copy16<<<blocks, 512, 0, g[d].user>>>((const uint4*)g[d].src, (uint4*)ldst[d], S / 16);
                }
            });
            std::printf("local S %3zu MiB %-32s %8.2f us (peer copy at %.1f GB/s if it alone set the time)\n", S >> 20,
                        names[v], us, S / us / 1e3);
            std::fflush(stdout);
        }
        // With the zero-copy handshakes (batched, host words) around the peer copy, as
        // copy_engine.rs issues an out-of-place all-gather: the local copy on the user stream
        // issued before the lane's commands (as it does), after them, or not at all.
        for (int v = 0; v < 3; v++) {
            double us = run(1, [&](int d, cudaStream_t* lane) {
                CUstream s = (CUstream)lane[0];
                int p = 1 - d;
                if (v == 1) CK(cuMemcpyDtoDAsync(ldst[d], g[d].src, S, (CUstream)g[d].user));
                issue(s, {wr(word(HOST, p, 0), 1, true), wt(word(HOST, d, 0), 1), wr(word(HOST, d, 0), 0, true)}, true);
                CK(cuMemcpyDtoDAsync(g[p].dst, g[d].src, S, s));
                issue(s, {wr(word(HOST, p, 1), 1, true), wt(word(HOST, d, 1), 1), wr(word(HOST, d, 1), 0, true)}, true);
                if (v == 2) CK(cuMemcpyDtoDAsync(ldst[d], g[d].src, S, (CUstream)g[d].user));
            });
            const char* hn[] = {"handshakes, no local copy", "handshakes, local copy first", "handshakes, local copy last"};
            std::printf("local S %3zu MiB %-32s %8.2f us\n", S >> 20, hn[v], us);
            std::fflush(stdout);
        }
    }
}

int main(int argc, char** argv) {
    for (int d = 0; d < 2; d++) {
        RK(cudaSetDevice(d));
        RK(cudaFree(0));
        RK(cudaDeviceEnablePeerAccess(1 - d, 0));
        RK(cudaStreamCreateWithFlags(&g[d].user, cudaStreamNonBlocking));
        for (int l = 0; l < 2; l++) {
            RK(cudaStreamCreateWithFlags(&g[d].lane[l], cudaStreamNonBlocking));
            RK(cudaEventCreateWithFlags(&g[d].join[l], cudaEventDisableTiming));
        }
        RK(cudaEventCreateWithFlags(&g[d].fork, cudaEventDisableTiming));
        RK(cudaEventCreate(&g[d].t0));
        RK(cudaEventCreate(&g[d].t1));
        CK(cuMemAlloc(&g[d].src, BUF));
        CK(cuMemAlloc(&g[d].dst, BUF));
        CK(cuMemAlloc(&g[d].words, 4096));
    }
    RK(cudaHostAlloc((void**)&host, 2 * 4096, cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cuMemHostGetDevicePointer(&hostdev, host, 0));

    if (argc > 1 && std::strcmp(argv[1], "local") == 0) {
        local_copies();
        return 0;
    }
    const size_t sizes[] = {0, 1 << 20, 16 << 20, 64 << 20};
    const char* names[] = {"sep", "batch", "batch-nb", "copy", "memcpy", "kernel", "user"};
    // A word of ones in each GPU's memory, for the memcpy variant's flags.
    for (int d = 0; d < 2; d++) {
        RK(cudaSetDevice(d));
        unsigned one = 1;
        CK(cuMemcpyHtoD(g[d].words + 2048, &one, 4));
    }
    for (size_t S : sizes) {
        for (int where = 0; where < 2; where++) {
            for (int v : {0, 1, 3, 4, 5, 6, 2}) {
                if (v == 3 && where == 1) continue;  // no words
                if (v == 2 && where == 0) continue;  // refused on host words
                Where W = (Where)where;
                double us = run(v == 6 ? 0 : 1, [&](int d, cudaStream_t* lane) {
                    CUstream s = (CUstream)lane[0];
                    int p = 1 - d;
                    bool batch = v == 1 || v == 2 || v == 6, nb = v == 2;
                    auto hand = [&](int w) {
                        if (v == 4) {
                            CK(cuMemcpyDtoDAsync(word(W, p, w), g[d].words + 2048, 4, s));
                            issue(s, {wt(word(W, d, w), 1), wr(word(W, d, w), 0, true)}, true);
                        } else if (v == 5) {
                            handshake<<<1, 32, 0, lane[0]>>>((unsigned*)word(W, p, w), (unsigned*)word(W, d, w));
                        } else if (v != 3) {
                            issue(s, {wr(word(W, p, w), 1, w == 1 || !nb), wt(word(W, d, w), 1), wr(word(W, d, w), 0, !nb)}, batch);
                        }
                    };
                    hand(0);
                    if (refused) return;
                    if (S > 0) CK(cuMemcpyDtoDAsync(g[p].dst, g[d].src, S, s));
                    hand(1);
                });
                double floor = S / 395e3;
                if (us < 0) continue;
                std::printf("zcopy %-8s words %-4s S %8zu KiB: %8.2f us  (over 395 GB/s: %+.2f us)\n", names[v],
                            where == 0 ? "host" : "gpu", S >> 10, us, us - floor);
                std::fflush(stdout);
            }
        }
    }
    // Pieces: S = 64 MiB in P pieces, a piece word written (barrier) after each, one lane or two.
    for (int how = 0; how < 2; how++)
    for (int lanes = 1; lanes <= 2; lanes++) {
        for (int P : {1, 4, 16, 32}) {
            if (how == 1 && P < 16) continue;
            const size_t S = 64 << 20, piece = S / P;
            double us = run(lanes, [&](int d, cudaStream_t* lane) {
                int p = 1 - d;
                for (int k = 0; k < P; k++) {
                    CUstream s = (CUstream)lane[k % lanes];
                    CK(cuMemcpyDtoDAsync(g[p].dst + k * piece, g[d].src + k * piece, piece, s));
                    if (how == 0)
                        CK(cuStreamWriteValue32(s, word(DEV, p, 2 + k % lanes), k / lanes + 1, CU_STREAM_WRITE_VALUE_DEFAULT));
                    else
                        CK(cuMemcpyDtoDAsync(word(DEV, p, 2 + k % lanes), g[d].words + 2048, 4, s));
                }
            });
            std::printf("pieces %s lanes %d P %2d of %zu KiB: %8.2f us  (%.1f GB/s; over 395 GB/s: %+.2f us, %+.2f a piece)\n",
                        how == 0 ? "write" : "memcpy", lanes, P, piece >> 10, us, S / us / 1e3, us - S / 395e3, (us - S / 395e3) / P);
            std::fflush(stdout);
        }
    }
    return 0;
}

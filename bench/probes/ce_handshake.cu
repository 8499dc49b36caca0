// What the copy engine's zero-copy handshake costs between two GPUs, per operation, measured on
// the GPUs alone: every variant is captured into a CUDA graph per GPU (K operations), so that no
// host enqueue cost enters the figure. One operation is what `copy_engine.rs`'s
// `zcopy_schedule` issues on a peer lane, forked from and joined to a "user" stream:
//
//   sep:      write(peer.ready=1) wait(my.ready==1) write(my.ready=0) copy(S to the peer)
//             write(peer.full=1) wait(my.full==1) write(my.full=0)       (7 commands, as today)
//   batch:    the same, the three memory operations around the copy in one cuStreamBatchMemOp each
//   batch-nb: batch, with every write but full's without the memory barrier
//   copy:     the copy alone (no handshake: the floor)
//
// with the words in host memory (as today) or in the waiting GPU's memory (written by the peer
// over NVLink). Then the copy-and-fold's pieces: one lane copies S in P pieces, each followed by
// a write of a piece word (with its barrier) into the peer's memory, against the same on two
// lanes taking pieces in turn.
//
//   nvcc -O2 -o ce_handshake bench/probes/ce_handshake.cu -lcuda && ./ce_handshake
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
        CK(cuMemsetD8(g[d].words, 0, 4096));
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
static void issue(CUstream s, std::vector<CUstreamBatchMemOpParams> ops, bool batch) {
    if (batch) {
        CK(cuStreamBatchMemOp(s, (unsigned)ops.size(), ops.data(), 0));
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
            RK(cudaEventRecord(g[d].fork, g[d].user));
            for (int l = 0; l < lanes; l++) RK(cudaStreamWaitEvent(g[d].lane[l], g[d].fork, 0));
            one(d, g[d].lane);
            for (int l = 0; l < lanes; l++) {
                RK(cudaEventRecord(g[d].join[l], g[d].lane[l]));
                RK(cudaStreamWaitEvent(g[d].user, g[d].join[l], 0));
            }
        }
        RK(cudaStreamEndCapture(g[d].user, &graph));
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

int main() {
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

    const size_t sizes[] = {0, 1 << 20, 16 << 20, 64 << 20};
    const char* names[] = {"sep", "batch", "batch-nb", "copy"};
    for (size_t S : sizes) {
        for (int where = 0; where < 2; where++) {
            for (int v = 0; v < 4; v++) {
                if (v == 3 && where == 1) continue;  // no words
                Where W = (Where)where;
                double us = run(1, [&](int d, cudaStream_t* lane) {
                    CUstream s = (CUstream)lane[0];
                    int p = 1 - d;
                    bool batch = v == 1 || v == 2, nb = v == 2;
                    if (v != 3)
                        issue(s, {wr(word(W, p, 0), 1, !nb), wt(word(W, d, 0), 1), wr(word(W, d, 0), 0, !nb)}, batch);
                    if (S > 0) CK(cuMemcpyDtoDAsync(g[p].dst, g[d].src, S, s));
                    if (v != 3)
                        issue(s, {wr(word(W, p, 1), 1, true), wt(word(W, d, 1), 1), wr(word(W, d, 1), 0, !nb)}, batch);
                });
                double floor = S / 395e3;
                std::printf("zcopy %-8s words %-4s S %8zu KiB: %8.2f us  (over 395 GB/s: %+.2f us)\n", names[v],
                            where == 0 ? "host" : "gpu", S >> 10, us, us - floor);
                std::fflush(stdout);
            }
        }
    }
    // Pieces: S = 64 MiB in P pieces, a piece word written (barrier) after each, one lane or two.
    for (int lanes = 1; lanes <= 2; lanes++) {
        for (int P : {1, 4, 16, 32}) {
            const size_t S = 64 << 20, piece = S / P;
            double us = run(lanes, [&](int d, cudaStream_t* lane) {
                int p = 1 - d;
                for (int k = 0; k < P; k++) {
                    CUstream s = (CUstream)lane[k % lanes];
                    CK(cuMemcpyDtoDAsync(g[p].dst + k * piece, g[d].src + k * piece, piece, s));
                    CK(cuStreamWriteValue32(s, word(DEV, p, 2 + k % lanes), k / lanes + 1, CU_STREAM_WRITE_VALUE_DEFAULT));
                }
            });
            std::printf("pieces lanes %d P %2d of %zu KiB: %8.2f us  (%.1f GB/s; over 395 GB/s: %+.2f us, %+.2f a piece)\n",
                        lanes, P, piece >> 10, us, S / us / 1e3, us - S / 395e3, (us - S / 395e3) / P);
            std::fflush(stdout);
        }
    }
    return 0;
}

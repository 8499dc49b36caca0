// What the copy engine's handshake costs on one GPU: stream memory operations on a word in
// host memory (what copy_engine.rs uses, so that an abort can free a wait with a CPU store)
// against a word in GPU memory, and device-to-device copies, timed by CUDA events.
//
//   nvcc -O2 -o memop_latency bench/probes/memop_latency.cu -lcuda && ./memop_latency
//
// Prints one line per measurement: microseconds per operation (median of 5 runs).
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(r_, &s); \
    std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); std::exit(1); } } while (0)
#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

static const int N = 2000;

// Median over 5 runs of f(a, b) (which enqueues N operations on a, b), in us per operation.
template <class F> static double per_op(CUstream a, CUstream b, F f) {
    std::vector<double> t;
    for (int run = 0; run < 5; run++) {
        cudaEvent_t e0, e1;
        RK(cudaEventCreate(&e0));
        RK(cudaEventCreate(&e1));
        RK(cudaDeviceSynchronize());
        RK(cudaEventRecord(e0, a));
        RK(cudaStreamWaitEvent(b, e0, 0));
        f(a, b);
        cudaEvent_t eb;
        RK(cudaEventCreate(&eb));
        RK(cudaEventRecord(eb, b));
        RK(cudaStreamWaitEvent(a, eb, 0));
        RK(cudaEventRecord(e1, a));
        RK(cudaEventSynchronize(e1));
        float ms;
        RK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.0 / N);
    }
    std::sort(t.begin(), t.end());
    return t[2];
}

int main() {
    RK(cudaSetDevice(0));
    RK(cudaFree(0));
    CUstream a, b;
    CK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    CK(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
    // Two words in host memory (mapped) and two in GPU memory.
    unsigned* host;
    RK(cudaHostAlloc(&host, 4096, cudaHostAllocMapped | cudaHostAllocPortable));
    CUdeviceptr hw;
    CK(cuMemHostGetDevicePointer(&hw, host, 0));
    CUdeviceptr gw;
    CK(cuMemAlloc(&gw, 4096));
    for (int where = 0; where < 2; where++) {
        const char* name = where == 0 ? "host" : "gpu";
        CUdeviceptr w = where == 0 ? hw : gw;  // w: word 0, w + 128: word 1
        auto set = [&](unsigned v0, unsigned v1) {
            if (where == 0) { host[0] = v0; host[32] = v1; }
            else { unsigned h[33] = {}; h[0] = v0; h[32] = v1; CK(cuMemcpyHtoD(w, h, sizeof h)); }
        };
        set(1, 0);
        double wait_set = per_op(a, b, [&](CUstream s, CUstream) {
            for (int i = 0; i < N; i++) CK(cuStreamWaitValue32(s, w, 1, CU_STREAM_WAIT_VALUE_EQ));
        });
        double write = per_op(a, b, [&](CUstream s, CUstream) {
            for (int i = 0; i < N; i++) CK(cuStreamWriteValue32(s, w + 128, i, CU_STREAM_WRITE_VALUE_DEFAULT));
        });
        double wait_write = per_op(a, b, [&](CUstream s, CUstream) {
            for (int i = 0; i < N; i++) {
                CK(cuStreamWaitValue32(s, w, 1, CU_STREAM_WAIT_VALUE_EQ));
                CK(cuStreamWriteValue32(s, w + 128, i, CU_STREAM_WRITE_VALUE_DEFAULT));
            }
        });
        // Ping-pong between two streams: a round trip per iteration (values only grow).
        set(0, 0);
        double pingpong = per_op(a, b, [&](CUstream s, CUstream t) {
            for (int i = 1; i <= N; i++) {
                CK(cuStreamWriteValue32(s, w, i, CU_STREAM_WRITE_VALUE_DEFAULT));
                CK(cuStreamWaitValue32(t, w, i, CU_STREAM_WAIT_VALUE_GEQ));
                CK(cuStreamWriteValue32(t, w + 128, i, CU_STREAM_WRITE_VALUE_DEFAULT));
                CK(cuStreamWaitValue32(s, w + 128, i, CU_STREAM_WAIT_VALUE_GEQ));
            }
        });
        std::printf("%s word: wait (already true) %.2f us, write %.2f us, wait+write %.2f us, two-stream round trip %.2f us\n",
                    name, wait_set, write, wait_write, pingpong);
    }
    // Device-to-device copies: small (the command's own cost) and 4 MiB (a piece).
    CUdeviceptr x, y;
    CK(cuMemAlloc(&x, 64 << 20));
    CK(cuMemAlloc(&y, 64 << 20));
    double small = per_op(a, b, [&](CUstream s, CUstream) {
        for (int i = 0; i < N; i++) CK(cuMemcpyDtoDAsync(y, x, 4, s));
    });
    double big = per_op(a, b, [&](CUstream s, CUstream) {
        for (int i = 0; i < N; i++) CK(cuMemcpyDtoDAsync(y + (i % 8) * (4 << 20), x + (i % 8) * (4 << 20), 4 << 20, s));
    });
    std::printf("copy DtoD 4 B %.2f us, 4 MiB %.2f us (%.0f GB/s)\n", small, big, (4 << 20) / big / 1e3);
    // Events between streams (the fork and join of every operation).
    CUevent ev;
    CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    double fork = per_op(a, b, [&](CUstream s, CUstream t) {
        for (int i = 0; i < N; i++) {
            CK(cuEventRecord(ev, s));
            CK(cuStreamWaitEvent(t, ev, 0));
            CK(cuEventRecord(ev, t));
            CK(cuStreamWaitEvent(s, ev, 0));
        }
    });
    std::printf("event fork and join between two streams %.2f us\n", fork);
    return 0;
}

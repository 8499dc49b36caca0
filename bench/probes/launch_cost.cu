// What a host launch costs the calling thread, taken apart on a machine with 2 GPUs: the
// driver's `cuLaunchKernel` of an empty kernel by the size of its parameter (ferroccl's engines
// pass 300-600 bytes by value), with the early-start attribute (`cuLaunchKernelEx`), the context
// switch and the event record ferroccl adds, and the cases of the latency issue's one thread
// driving both GPUs: one thread alternating between them, two threads launching at once, each
// on its own GPU (does the driver serialise launches to different contexts?), and one thread
// handing GPU 1's launch to a spinning helper as ferroccl does (`launch/fanout.rs`). Last, on
// one GPU, the other single driver calls that could order a communication in a stream in place
// of a launch (a graph's launch, a stream memory operation, an event record, a 4-byte memset):
// an enqueue of 2 us needs one of them well under that.
// Per call: the mean over N calls, in microseconds; the stream is drained every 256 calls so
// that no call waits for room in the launch queue.
//
//   nvcc -O2 -arch=sm_90 -o launch_cost bench/probes/launch_cost.cu -lcuda && ./launch_cost
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s_ = nullptr; cuGetErrorString(r_, &s_); \
    std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); std::exit(1); } } while (0)
#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

template <int P> struct Arg { unsigned char b[P]; };
template <int P> __global__ void k(Arg<P> a) {
    if (a.b[P - 1] == 77 && threadIdx.x == 100000) asm volatile("trap;");
}

static const int N = 4000;
using clk = std::chrono::steady_clock;

struct Gpu {
    CUcontext ctx;
    CUstream s;
    CUevent ev;
    CUfunction f[6];
};
static const int SIZES[6] = {8, 64, 256, 528, 1024, 2048};
static Gpu g[2];

template <int P> static CUfunction fn() {
    cudaFunction_t f;
    RK(cudaGetFuncBySymbol(&f, (const void*)k<P>));
    return (CUfunction)f;
}

static void setup(int d) {
    RK(cudaSetDevice(d));
    RK(cudaFree(0));
    CK(cuCtxGetCurrent(&g[d].ctx));
    CK(cuStreamCreate(&g[d].s, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&g[d].ev, CU_EVENT_DISABLE_TIMING));
    g[d].f[0] = fn<8>(); g[d].f[1] = fn<64>(); g[d].f[2] = fn<256>();
    g[d].f[3] = fn<528>(); g[d].f[4] = fn<1024>(); g[d].f[5] = fn<2048>();
}

static unsigned char argbuf[2048];

// flags: 1 = cuLaunchKernelEx with programmatic stream serialization, 2 = event record after,
// 4 = cuCtxSetCurrent before, 8 = cuStreamIsCapturing before.
static inline void launch(int d, int si, int grid, int block, int flags) {
    if (flags & 4) CK(cuCtxSetCurrent(g[d].ctx));
    if (flags & 8) { CUstreamCaptureStatus st; CK(cuStreamIsCapturing(g[d].s, &st)); }
    void* params[1] = {argbuf};
    if (flags & 1) {
        CUlaunchAttribute attr;
        attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        CUlaunchConfig cfg = {};
        cfg.gridDimX = grid; cfg.gridDimY = 1; cfg.gridDimZ = 1;
        cfg.blockDimX = block; cfg.blockDimY = 1; cfg.blockDimZ = 1;
        cfg.hStream = g[d].s; cfg.attrs = &attr; cfg.numAttrs = 1;
        CK(cuLaunchKernelEx(&cfg, g[d].f[si], params, nullptr));
    } else {
        CK(cuLaunchKernel(g[d].f[si], grid, 1, 1, block, 1, 1, 0, g[d].s, params, nullptr));
    }
    if (flags & 2) CK(cuEventRecord(g[d].ev, g[d].s));
}

static void drain(int d) { CK(cuCtxSetCurrent(g[d].ctx)); CK(cuStreamSynchronize(g[d].s)); }

// The calling thread's mean us of call(i) over N calls, after 300 untimed; drain_queues() runs
// untimed every 256 calls.
template <class D, class F> static double mean_us(D drain_queues, F call) {
    auto body = [&](int n) {
        double busy = 0;
        for (int i = 0; i < n; i++) {
            if (i % 256 == 0) drain_queues();
            auto t0 = clk::now();
            call(i);
            busy += std::chrono::duration<double, std::micro>(clk::now() - t0).count();
        }
        return busy / n;
    };
    body(300);
    return body(N);
}

// One thread: mean us a call on GPU d (or both GPUs alternately: d = 2, a call = one launch to
// each).
static double one_thread(int d, int si, int grid, int block, int flags) {
    return mean_us(
        [&] {
            if (d == 2) { drain(0); drain(1); } else { drain(d); CK(cuCtxSetCurrent(g[d].ctx)); }
        },
        [&](int) {
            if (d == 2) { launch(0, si, grid, block, flags | 4); launch(1, si, grid, block, flags | 4); }
            else launch(d, si, grid, block, flags);
        });
}

// Two threads at once, thread d on GPU d; returns the slower thread's mean us a call.
static double two_threads(int si, int grid, int block, int flags) {
    std::atomic<int> ready{0};
    double res[2];
    auto th = [&](int d) {
        CK(cuCtxSetCurrent(g[d].ctx));
        ready++;
        while (ready.load() < 2) {}
        double busy = 0;
        for (int i = 0; i < N; i++) {
            if (i % 256 == 0) { drain(d); }
            auto t0 = clk::now();
            launch(d, si, grid, block, flags);
            busy += std::chrono::duration<double, std::micro>(clk::now() - t0).count();
        }
        res[d] = busy / N;
    };
    std::thread a(th, 0), b(th, 1);
    a.join(); b.join();
    return res[0] > res[1] ? res[0] : res[1];
}

// One thread's call to both GPUs with a spinning helper, as ferroccl's `launch/fanout.rs` makes
// it: the caller hands GPU 1's launch to the helper through one cache line, makes GPU 0's itself
// and waits until the helper's is made. The driver's part of a one-thread call with nothing of
// ferroccl's around it. Returns the caller's mean and median us a call.
static void handed(int si, int flags, double& mean, double& median) {
    alignas(64) static std::atomic<long> posted{0};
    alignas(64) static std::atomic<long> done{0};
    posted = 0;
    done = 0;
    std::atomic<bool> stop{false};
    std::thread helper([&] {
        CK(cuCtxSetCurrent(g[1].ctx));
        long seen = 0;
        while (!stop.load(std::memory_order_relaxed)) {
            long p = posted.load(std::memory_order_acquire);
            if (p == seen) continue;
            seen = p;
            if (p % 256 == 1) drain(1);
            launch(1, si, 1, 256, flags);
            done.store(p, std::memory_order_release);
        }
    });
    CK(cuCtxSetCurrent(g[0].ctx));
    std::vector<double> t;
    t.reserve(N + 300);
    for (long i = 1; i <= N + 300; i++) {
        if (i % 256 == 1) drain(0);
        auto t0 = clk::now();
        posted.store(i, std::memory_order_release);
        launch(0, si, 1, 256, flags);
        while (done.load(std::memory_order_acquire) != i) {}
        t.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
    }
    stop = true;
    helper.join();
    t.erase(t.begin(), t.begin() + 300);
    double sum = 0;
    for (double x : t) sum += x;
    mean = sum / t.size();
    std::sort(t.begin(), t.end());
    median = t[t.size() / 2];
}

// One GPU: the caller's mean us of one driver call `f` (GPU 0's stream drained every 256 calls).
template <class F> static double per_call(F f) {
    return mean_us([] { drain(0); }, f);
}

// The single driver calls besides a launch that can put work in a stream's order.
static void other_calls() {
    CK(cuCtxSetCurrent(g[0].ctx));
    CUstream s = g[0].s;
    // A graph of one kernel node (the 528-byte parameter's kernel), instantiated once.
    CUgraph graph;
    CK(cuGraphCreate(&graph, 0));
    CUDA_KERNEL_NODE_PARAMS kp = {};
    void* params[1] = {argbuf};
    kp.func = g[0].f[3];
    kp.gridDimX = 1; kp.gridDimY = 1; kp.gridDimZ = 1;
    kp.blockDimX = 256; kp.blockDimY = 1; kp.blockDimZ = 1;
    kp.kernelParams = params;
    CUgraphNode node;
    CK(cuGraphAddKernelNode(&node, graph, nullptr, 0, &kp));
    CUgraphExec exec;
    CK(cuGraphInstantiate(&exec, graph, 0));
    CUdeviceptr dword;
    CK(cuMemAlloc(&dword, 64));
    CK(cuMemsetD32(dword, 0, 16));
    unsigned* hword;
    CK(cuMemHostAlloc((void**)&hword, 64, CU_MEMHOSTALLOC_DEVICEMAP));
    *hword = 0;
    CUdeviceptr hdev;
    CK(cuMemHostGetDevicePointer(&hdev, hword, 0));
    double launch8 = per_call([&](int) { launch(0, 0, 1, 256, 0); });
    double launch528 = per_call([&](int) { launch(0, 3, 1, 256, 1); });
    double glaunch = per_call([&](int) { CK(cuGraphLaunch(exec, s)); });
    // New parameters every call (the kernel node's, then the launch): a new buffer's address.
    double gset = per_call([&](int i) {
        argbuf[0] = (unsigned char)i;
        CK(cuGraphExecKernelNodeSetParams(exec, node, &kp));
        CK(cuGraphLaunch(exec, s));
    });
    double setonly = per_call([&](int i) {
        argbuf[0] = (unsigned char)i;
        CK(cuGraphExecKernelNodeSetParams(exec, node, &kp));
    });
    // The early start asked of the graph's node (valid only for launches, by the driver's
    // documentation: what the driver says to it).
    CUlaunchAttributeValue early;
    std::memset(&early, 0, sizeof early);
    early.programmaticStreamSerializationAllowed = 1;
    CUresult er = cuGraphKernelNodeSetAttribute(node, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, &early);
    const char* es = nullptr;
    cuGetErrorString(er, &es);
    double wr_dev = per_call([&](int i) { CK(cuStreamWriteValue32(s, dword, (unsigned)i, 0)); });
    double wr_host = per_call([&](int i) { CK(cuStreamWriteValue32(s, hdev, (unsigned)i, 0)); });
    double wait_dev = per_call([&](int) { CK(cuStreamWaitValue32(s, dword, 0, CU_STREAM_WAIT_VALUE_GEQ)); });
    double ev = per_call([&](int) { CK(cuEventRecord(g[0].ev, s)); });
    double memset = per_call([&](int i) { CK(cuMemsetD32Async(dword + 4, (unsigned)i, 1, s)); });
    std::printf("one GPU, one driver call: launch 8 B %.2f, ex+early 528 B %.2f, graph launch (1 node) %.2f, "
                "new parameters + graph launch %.2f, new parameters alone %.2f, early start on the node: %s; write value (GPU word) %.2f, (host word) %.2f, wait value (met) %.2f, event record %.2f, "
                "4-byte memset %.2f\n",
                launch8, launch528, glaunch, gset, setonly, es ? es : "?", wr_dev, wr_host, wait_dev, ev, memset);
    drain(0);
    CK(cuGraphExecDestroy(exec));
    CK(cuGraphDestroy(graph));
    CK(cuMemFree(dword));
    CK(cuMemFreeHost(hword));
}

int main() {
    CK(cuInit(0));
    int n = 0;
    RK(cudaGetDeviceCount(&n));
    int ng = n >= 2 ? 2 : 1;
    for (int d = 0; d < ng; d++) setup(d);
    int drv = 0;
    CK(cuDriverGetVersion(&drv));
    std::printf("driver %d, %d GPUs; us a call, mean of %d\n", drv, n, N);
    for (int rep = 0; rep < 2; rep++) {
        std::printf("-- pass %d\n", rep + 1);
        other_calls();
        for (int si = 0; si < 6; si++) {
            CK(cuCtxSetCurrent(g[0].ctx));
            double a = one_thread(0, si, 1, 256, 0);
            double b = one_thread(0, si, 1, 256, 1);
            double c = one_thread(0, si, 64, 512, 1);
            std::printf("param %4d B: launch %.2f  ex+early %.2f  ex 64x512 %.2f\n", SIZES[si], a, b, c);
        }
        CK(cuCtxSetCurrent(g[0].ctx));
        double ev = one_thread(0, 3, 1, 256, 1 | 2), bind = one_thread(0, 3, 1, 256, 1 | 4);
        double cap = one_thread(0, 3, 1, 256, 1 | 8), all = one_thread(0, 3, 1, 256, 1 | 2 | 4 | 8);
        std::printf("528 B ex: +event %.2f  +ctx bind %.2f  +capturing %.2f  all three %.2f\n", ev, bind, cap, all);
        if (ng == 2) {
            for (int si : {0, 3}) {
                // Each figure in a statement of its own: the cases run in this order.
                double alone = one_thread(1, si, 1, 256, 1);
                double both = one_thread(2, si, 1, 256, 1), both_ev = one_thread(2, si, 1, 256, 1 | 2);
                double two = two_threads(si, 1, 256, 1), two_ev = two_threads(si, 1, 256, 1 | 2);
                double hm, hmed, em, emed;
                handed(si, 1, hm, hmed);
                handed(si, 1 | 2, em, emed);
                std::printf("%4d B ex, one thread with a spinning helper, both GPUs a call: mean %.2f median %.2f (+event: %.2f %.2f)\n",
                            SIZES[si], hm, hmed, em, emed);
                std::printf("%4d B ex, GPU 1 alone %.2f; one thread, both GPUs a call %.2f (+event %.2f); two threads at once, slower %.2f (+event %.2f)\n",
                            SIZES[si], alone, both, both_ev, two, two_ev);
            }
        }
    }
    return 0;
}

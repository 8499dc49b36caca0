// Can the copy engines and the SMs together move more over NVLink than either alone? On 2 GPUs
// the engines carry 391-395 GB/s a direction and a plain SM copy about 355-371: if the link's
// own limit is higher than both (NV18: 18 links), an operation that splits its bytes between a
// copy-engine copy and a kernel, each on its own stream, would move large messages faster than
// either path. This probe splits one buffer of S bytes: the first f x S by `cudaMemcpyPeerAsync`
// (copy engines), the rest by a kernel of B blocks that stores into the peer (push) or, launched
// on the receiver, loads from it (pull); one direction (GPU 0 -> 1) or both at once. Throughput
// over R back-to-back repetitions (the two streams run on freely: each part's rate is its own,
// the sum of bytes over the slower stream's time is what a split operation would see once its
// parts are sized to finish together), GB/s of the whole buffer per direction.
//
//   nvcc -O3 -arch=sm_90 -o link_shared bench/probes/link_shared.cu && ./link_shared
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

// 16-byte copy, four loads in flight a thread.
__global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

static const size_t MAXB = 512ull << 20;
static char* src[2];
static char* dst[2];
static cudaStream_t ce[2], sm[2];

// One repetition: direction d -> 1-d for each d in dirs; CE part f of S, kernel the rest.
static void issue(int dirs, size_t S, double f, int blocks, bool pull) {
    for (int d = 0; d < 2; d++) {
        if (!(dirs & (1 << d))) continue;
        int o = 1 - d;
        size_t ceb = ((size_t)(S * f)) & ~(size_t)4095;
        if (ceb > S) ceb = S;
        if (ceb) {
            RK(cudaSetDevice(d));
            RK(cudaMemcpyPeerAsync(dst[o], o, src[d], d, ceb, ce[d]));
        }
        size_t rest = S - ceb;
        if (rest && blocks) {
            int g = pull ? o : d;
            RK(cudaSetDevice(g));
            copy16<<<blocks, 512, 0, sm[g]>>>((const uint4*)(src[d] + ceb), (uint4*)(dst[o] + ceb), rest / 16);
            RK(cudaGetLastError());
        }
    }
}

static double run(int dirs, size_t S, double f, int blocks, bool pull, int reps) {
    for (int d = 0; d < 2; d++) { RK(cudaSetDevice(d)); RK(cudaDeviceSynchronize()); }
    issue(dirs, S, f, blocks, pull);
    for (int d = 0; d < 2; d++) { RK(cudaSetDevice(d)); RK(cudaDeviceSynchronize()); }
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; r++) issue(dirs, S, f, blocks, pull);
    for (int d = 0; d < 2; d++) { RK(cudaSetDevice(d)); RK(cudaDeviceSynchronize()); }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return (double)S * reps / s / 1e9;
}

int main() {
    int n = 0;
    RK(cudaGetDeviceCount(&n));
    if (n < 2) { std::printf("needs 2 GPUs\n"); return 1; }
    for (int d = 0; d < 2; d++) {
        RK(cudaSetDevice(d));
        RK(cudaDeviceEnablePeerAccess(1 - d, 0));
        RK(cudaMalloc(&src[d], MAXB));
        RK(cudaMalloc(&dst[d], MAXB));
        RK(cudaMemset(src[d], d + 1, MAXB));
        RK(cudaStreamCreateWithFlags(&ce[d], cudaStreamNonBlocking));
        RK(cudaStreamCreateWithFlags(&sm[d], cudaStreamNonBlocking));
    }
    std::printf("%-6s %-5s %5s %6s %6s %4s  GB/s a direction (median of 3)\n", "dirs", "kind", "MiB", "f_ce", "blocks", "pull");
    const size_t sizes[] = {32ull << 20, 256ull << 20};
    const double fs[] = {0.0, 1.0, 0.5, 0.6, 0.7, 0.8, 0.9};
    const int bl[] = {16, 32, 64, 132};
    for (int dirs : {1, 3}) {
        for (size_t S : sizes) {
            int reps = (int)((4ull << 30) / S);
            for (double f : fs) {
                for (int b : bl) {
                    if (f == 1.0 && b != 16) continue;
                    for (int pull = 0; pull < 2; pull++) {
                        if (f == 1.0 && pull) continue;
                        double v[3];
                        for (int k = 0; k < 3; k++) v[k] = run(dirs, S, f, f == 1.0 ? 0 : b, pull, reps);
                        // median of three
                        double a = v[0], bb = v[1], c = v[2];
                        double med = a > bb ? (bb > c ? bb : (a > c ? c : a)) : (a > c ? a : (bb > c ? c : bb));
                        std::printf("%-6s %-5s %5zu %6.2f %6d %4d  %7.1f\n", dirs == 1 ? "0->1" : "both",
                                    f == 1.0 ? "ce" : (f == 0.0 ? "sm" : "split"), S >> 20, f, f == 1.0 ? 0 : b, pull, med);
                        std::fflush(stdout);
                    }
                }
            }
        }
    }
    return 0;
}

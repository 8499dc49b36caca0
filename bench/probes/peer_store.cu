// What bounds the peer engine's large rounds over NVLink (2 GPUs): a kernel shaped like
// peer.cu's round (blocks of 512 threads, 16-byte loads from local memory, U of them in flight
// per thread, stored into the peer's memory), with and without the round's end (a block
// barrier and a system-scope release of a flag line in the peer's memory, which waits for the
// block's stores to land), and with the receiver's copy out of its staging after each round
// (what the symmetric kinds do in the same block), one way and both ways at once.
//
//   nvcc -O3 -arch=sm_90 -o peer_store bench/probes/peer_store.cu && ./peer_store
//
// Prints one line per configuration: GB/s per direction (bytes sent by one GPU over the
// slowest GPU's time, median of 5 runs).
#include <algorithm>
#include <vector>

#include "peer_common.cuh"

// Block b moves its share of `bytes` from src to dst in rounds of `round` bytes. fence: end
// each round as peer.cu does (barrier, thread 0's release of a flag line at `flags`). out: after
// each round, copy the same bytes from `stage` to `out` (both local: the receiver's copy-out).
template <int U>
__global__ void __launch_bounds__(512) push(uint4* dst, const uint4* src, size_t bytes, size_t round, int fence,
                                            u64* flags, uint4* out, const uint4* stage) {
    const size_t share = bytes / gridDim.x;
    const size_t base = share * blockIdx.x / 16;
    u64 r = 0;
    for (size_t at = 0; at < share; at += round) {
        const size_t len = (share - at < round ? share - at : round) / 16;
        copy16<U>(dst + base + at / 16, src + base + at / 16, len);
        if (fence) {
            __syncthreads();
            if (threadIdx.x == 0) st_release_sys(flags + blockIdx.x * 16, ++r);
        }
        if (out) {
            copy16<U>(out + base + at / 16, stage + base + at / 16, len);
        }
    }
}

struct Gpu {
    int dev;
    uint4 *src, *recv, *out;
    u64* flags;
    cudaStream_t s;
    cudaEvent_t e0, e1;
};

int main() {
    const size_t bytes = size_t(1) << 30;
    Gpu g[2];
    for (int d = 0; d < 2; ++d) {
        g[d].dev = d;
        open_gpu(d, g[d]);
        RK(cudaMalloc(&g[d].src, bytes));
        RK(cudaMalloc(&g[d].recv, bytes));
        RK(cudaMalloc(&g[d].out, bytes));
        RK(cudaMalloc(&g[d].flags, 64 * 128));
        RK(cudaMemset(g[d].src, d + 1, bytes));
    }
    for (int d = 0; d < 2; ++d) { RK(cudaSetDevice(d)); RK(cudaDeviceSynchronize()); }
    std::printf("%-9s %6s %2s %8s %5s %4s %9s\n", "ways", "blocks", "U", "round", "fence", "out", "GB/s");
    for (int ways = 1; ways <= 2; ++ways)
        for (int out = 0; out <= 1; ++out)
            for (int blocks : {16, 32, 48, 64})
                for (int u : {4, 8})
                    for (size_t round : {size_t(128) << 10, size_t(256) << 10, size_t(1) << 20, size_t(0)}) {
                        if (out && (ways == 1 || u == 8)) continue;  // the copy-out belongs to symmetric rounds
                        const int fence = round != 0;
                        const size_t r = round ? round : bytes;
                        std::vector<double> rates;
                        for (int rep = 0; rep < 6; ++rep) {
                            for (int d = 0; d < ways; ++d) {
                                RK(cudaSetDevice(d));
                                RK(cudaEventRecord(g[d].e0, g[d].s));
                                uint4* dst = g[1 - d].recv;
                                uint4* o = out ? g[d].out : nullptr;
                                if (u == 4) push<4><<<blocks, 512, 0, g[d].s>>>(dst, g[d].src, bytes, r, fence, g[1 - d].flags, o, g[d].recv);
                                else push<8><<<blocks, 512, 0, g[d].s>>>(dst, g[d].src, bytes, r, fence, g[1 - d].flags, o, g[d].recv);
                                RK(cudaGetLastError());
                                RK(cudaEventRecord(g[d].e1, g[d].s));
                            }
                            const double rate = slowest_rate(g, ways, bytes);
                            if (rep > 0) rates.push_back(rate);  // the first warms up
                        }
                        std::sort(rates.begin(), rates.end());
                        std::printf("%-9s %6d %2d %7zuK %5d %4d %9.1f\n", ways == 1 ? "one-way" : "both", blocks, u,
                                    round >> 10, fence, out, rates[rates.size() / 2]);
                        std::fflush(stdout);
                    }
    return 0;
}

// Stores against loads over NVLink (2 GPUs): do SM blocks that read the peer's memory into
// their own (a pull, as NCCL's P2P read mode and ferroccl's pulling all-reduce do) move more
// bytes a second than blocks that store into the peer's memory (a push, every peer-engine round
// today)? peer_store.cu put 64 blocks' stores at 367 GB/s one way and 363 both ways, the copy
// engines 391-395, NCCL's rooted operations and sendrecv reach 366-372 at 2 GiB: this says whether
// a rooted or point-to-point protocol that pulls can pass the stores' ceiling, and with how
// many blocks.
//
//   nvcc -O3 -arch=sm_90 -o peer_pull bench/probes/peer_pull.cu && ./peer_pull
//
// Prints one line per configuration: GB/s per direction (bytes one GPU moves over the slowest
// GPU's time, median of 5 runs after a warm-up), 1 GiB a direction; "ce-push" and "ce-pull" are
// one cudaMemcpyPeerAsync per direction, for the copy engines' rate on the same buffers.
#include <algorithm>
#include <vector>

#include "peer_common.cuh"

// Block b copies its share of `bytes` from src to dst, U 16-byte loads in flight per thread:
// push when dst is the peer's memory, pull when src is.
template <int U>
__global__ void __launch_bounds__(512) move(uint4* dst, const uint4* src, size_t bytes) {
    const size_t share = bytes / gridDim.x / 16 * 16;
    const size_t base = share * blockIdx.x / 16;
    copy16<U>(dst + base, src + base, share / 16);
}

struct Gpu {
    uint4 *src, *dst;
    cudaStream_t s;
    cudaEvent_t e0, e1;
};

// One kernel per GPU taking part: GPU d moves `bytes` from GPU d's src to GPU 1-d's dst (push)
// or from GPU 1-d's src to GPU d's dst (pull); with blocks 0 GPU d's stream has a copy engine do
// the same (ce-push, ce-pull).
static void launch(Gpu* g, int d, bool pull, int blocks, int u, size_t bytes) {
    uint4* dst = pull ? g[d].dst : g[1 - d].dst;
    const uint4* src = pull ? g[1 - d].src : g[d].src;
    if (blocks == 0) {
        RK(cudaMemcpyPeerAsync(dst, pull ? d : 1 - d, src, pull ? 1 - d : d, bytes, g[d].s));
        return;
    }
    switch (u) {
        case 4: move<4><<<blocks, 512, 0, g[d].s>>>(dst, src, bytes); break;
        case 8: move<8><<<blocks, 512, 0, g[d].s>>>(dst, src, bytes); break;
        default: move<16><<<blocks, 512, 0, g[d].s>>>(dst, src, bytes); break;
    }
    RK(cudaGetLastError());
}

int main() {
    const size_t bytes = size_t(1) << 30;
    Gpu g[2];
    for (int d = 0; d < 2; ++d) {
        open_gpu(d, g[d]);
        RK(cudaMalloc(&g[d].src, bytes));
        RK(cudaMalloc(&g[d].dst, bytes));
        RK(cudaMemset(g[d].src, d + 1, bytes));
    }
    for (int d = 0; d < 2; ++d) { RK(cudaSetDevice(d)); RK(cudaDeviceSynchronize()); }
    std::printf("%-8s %-7s %6s %2s %9s\n", "ways", "how", "blocks", "U", "GB/s");
    for (int ways = 1; ways <= 2; ++ways)
        for (int pull = 0; pull <= 1; ++pull)
            for (int blocks : {0, 16, 32, 64, 128})
                for (int u : {4, 8, 16}) {
                    if (blocks == 0 && u != 4) continue;  // the copy engine once
                    std::vector<double> rates;
                    for (int rep = 0; rep < 6; ++rep) {
                        for (int d = 0; d < ways; ++d) {
                            RK(cudaSetDevice(d));
                            RK(cudaEventRecord(g[d].e0, g[d].s));
                            launch(g, d, pull != 0, blocks, u, bytes);
                            RK(cudaEventRecord(g[d].e1, g[d].s));
                        }
                        const double rate = slowest_rate(g, ways, bytes);
                        if (rep > 0) rates.push_back(rate);  // the first warms up
                    }
                    std::sort(rates.begin(), rates.end());
                    std::printf("%-8s %-7s %6d %2d %9.1f\n", ways == 1 ? "one-way" : "both",
                                blocks == 0 ? (pull ? "ce-pull" : "ce-push") : pull ? "pull" : "push",
                                blocks, blocks == 0 ? 0 : u, rates[rates.size() / 2]);
                    std::fflush(stdout);
                }
    return 0;
}

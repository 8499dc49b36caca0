// What a rooted round costs beyond the stores (2 GPUs): the peer engine's one-way protocol
// (broadcast, reduce, gather, scatter on 2 ranks) taken apart. GPU 0's blocks store rounds into
// GPU 1's staging (P slots per block, round r into slot r % P) and raise a flag line per round;
// GPU 1's blocks wait for each flag, copy the round out of the staging into the output (or not),
// and acknowledge it in GPU 0's memory; GPU 0 stores into a slot again only once the round that
// last used it is acknowledged (or never waits). peer_store.cu measured the stores alone at 367
// GB/s with 64 blocks; the engine's rooted operations reach 348-353 (docs/PERFORMANCE.md,
// section 17): this says which part of the protocol takes the difference.
//
//   nvcc -O3 -arch=sm_90 -o peer_rooted bench/probes/peer_rooted.cu && ./peer_rooted
//
// Prints one line per configuration: GB/s (bytes over the later GPU's time, median of 5 runs).
#include <algorithm>
#include <vector>

#include "peer_common.cuh"

// Thread 0 waits until *f reaches v; the barrier orders the block's later accesses after it.
__device__ __forceinline__ void wait_for(const u64* f, u64 v) {
    if (threadIdx.x == 0) {
        while (ld_acquire_sys(f) < v) {
        }
    }
    __syncthreads();
}

struct Shape {
    size_t bytes;    // per run, over all blocks
    size_t round;    // bytes of one round of one block
    int parities;    // slots per block in the staging
    int acks;        // 0: the sender never waits for room (the receiver still acknowledges)
    int copyout;     // 0: the receiver only waits and acknowledges
};

// GPU 0: block b stores its share in rounds into the peer's slots [b][r % P], flags each round.
__global__ void __launch_bounds__(512) sender(Shape s, uint4* stage_peer, const uint4* src, u64* flags_peer, const u64* acks) {
    const size_t share = s.bytes / gridDim.x / 16 * 16, base = share * blockIdx.x;
    u64 r = 0;
    for (size_t at = 0; at < share; at += s.round) {
        ++r;
        const size_t len = share - at < s.round ? share - at : s.round;
        if (s.acks && r > (u64)s.parities) wait_for(acks + blockIdx.x * 16, r - s.parities);
        uint4* slot = stage_peer + (((size_t)blockIdx.x * s.parities + (r % s.parities)) * s.round) / 16;
        copy16<4>(slot, src + (base + at) / 16, len / 16);
        __syncthreads();
        if (threadIdx.x == 0) st_release_sys(flags_peer + blockIdx.x * 16, r);
    }
}

// GPU 1: block b waits for each round, copies it out of its slot, acknowledges it.
__global__ void __launch_bounds__(512) receiver(Shape s, const uint4* stage, uint4* out, const u64* flags, u64* acks_peer) {
    const size_t share = s.bytes / gridDim.x / 16 * 16, base = share * blockIdx.x;
    u64 r = 0;
    for (size_t at = 0; at < share; at += s.round) {
        ++r;
        const size_t len = share - at < s.round ? share - at : s.round;
        wait_for(flags + blockIdx.x * 16, r);
        const uint4* slot = stage + (((size_t)blockIdx.x * s.parities + (r % s.parities)) * s.round) / 16;
        if (s.copyout) copy16<4>(out + (base + at) / 16, slot, len / 16);
        __syncthreads();
        if (threadIdx.x == 0) st_release_sys(acks_peer + blockIdx.x * 16, r);
    }
}

int main() {
    int n = 0;
    RK(cudaGetDeviceCount(&n));
    if (n < 2) { std::fprintf(stderr, "needs 2 GPUs\n"); return 1; }
    const size_t bytes = size_t(1) << 30, stage_bytes = size_t(64) * 4 * (1 << 20);
    uint4 *src, *stage, *out;
    u64 *flags, *acks;  // flags in GPU 1's memory (the receiver's), acks in GPU 0's
    cudaStream_t s0, s1;
    cudaEvent_t a0, a1, b0, b1;
    RK(cudaSetDevice(0));
    RK(cudaDeviceEnablePeerAccess(1, 0));
    RK(cudaMalloc(&src, bytes));
    RK(cudaMemset(src, 7, bytes));
    RK(cudaMalloc(&acks, 64 * 128));
    RK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    RK(cudaEventCreate(&a0));
    RK(cudaEventCreate(&a1));
    RK(cudaSetDevice(1));
    RK(cudaDeviceEnablePeerAccess(0, 0));
    RK(cudaMalloc(&stage, stage_bytes));
    RK(cudaMalloc(&out, bytes));
    RK(cudaMalloc(&flags, 64 * 128));
    RK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    RK(cudaEventCreate(&b0));
    RK(cudaEventCreate(&b1));
    std::printf("%6s %8s %8s %4s %7s %9s\n", "blocks", "round", "parities", "room", "copyout", "GB/s");
    for (int blocks : {32, 64})
        for (size_t round : {size_t(128) << 10, size_t(256) << 10})
            for (int parities : {2, 4})
                for (int room : {1, 0})
                    for (int copyout : {1, 0}) {
                        if (!room && parities == 4) continue;  // without waiting, the depth is moot
                        const Shape sh{bytes, round, parities, room, copyout};
                        std::vector<double> rates;
                        for (int rep = 0; rep < 6; ++rep) {
                            RK(cudaSetDevice(0));
                            RK(cudaMemset(acks, 0, 64 * 128));
                            RK(cudaDeviceSynchronize());
                            RK(cudaSetDevice(1));
                            RK(cudaMemset(flags, 0, 64 * 128));
                            RK(cudaDeviceSynchronize());
                            // The receiver first: it waits for the sender's flags.
                            RK(cudaEventRecord(b0, s1));
                            receiver<<<blocks, 512, 0, s1>>>(sh, stage, out, flags, acks);
                            RK(cudaGetLastError());
                            RK(cudaEventRecord(b1, s1));
                            RK(cudaSetDevice(0));
                            RK(cudaEventRecord(a0, s0));
                            sender<<<blocks, 512, 0, s0>>>(sh, stage, src, flags, acks);
                            RK(cudaGetLastError());
                            RK(cudaEventRecord(a1, s0));
                            RK(cudaEventSynchronize(a1));
                            RK(cudaSetDevice(1));
                            RK(cudaEventSynchronize(b1));
                            float ms0, ms1;
                            RK(cudaEventElapsedTime(&ms0, a0, a1));
                            RK(cudaEventElapsedTime(&ms1, b0, b1));
                            // The later of the two spans: the receiver's starts first (it waits
                            // for the sender's launch, a few us of a run of milliseconds) and ends
                            // with the last copy-out.
                            if (rep > 0) rates.push_back(bytes / (std::max(ms0, ms1) * 1e-3) / 1e9);
                        }
                        std::sort(rates.begin(), rates.end());
                        std::printf("%6d %7zuK %8d %4d %7d %9.1f\n", blocks, round >> 10, parities, room, copyout, rates[rates.size() / 2]);
                        std::fflush(stdout);
                    }
    return 0;
}

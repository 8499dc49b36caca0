// What bounds the peer engine's line rounds over NVLink (2 GPUs, both ways at once): a kernel
// shaped like peer.cu's `line_round` for the one-shot all-reduce (blocks of 512 threads; each
// warp loads STEP groups of 480 bytes of its input, stores them into the peer's slots as
// 128-byte lines whose last 8 bytes carry the round's flag, then polls its own slots for the
// peer's lines of the step before and folds them with the input it kept in registers), taken
// apart: with and without the receiving side, volatile (NCCL's LL128 store, the engine's) or
// plain stores, with and without the pause between stale polls, STEP 1-4, 64-128 blocks, 512 or
// 1024 threads, and where each lane's data comes from (LOAD, below); beside a plain SM copy into
// the peer (peer_store.cu's ceiling) in the same run. The engine's line rounds carry about 290
// GB/s of data where its staged rounds' stores carry 320-330 (docs/PERFORMANCE.md sections 23
// and 26); this says which part costs it.
//
//   nvcc -O3 -arch=sm_90 -Xptxas -v -o peer_lines bench/probes/peer_lines.cu && ./peer_lines
//
// Each configuration runs N rounds back to back on both GPUs (each GPU's stream held at a gate
// until the host opens both, so neither times the other's late start), five times after a
// warm-up; prints us a round and GB/s of data a direction (bytes a GPU sends over the slowest
// GPU's time per round), median. Then one checked round per data layout: every output element
// compared with the sum of the two inputs.
//
// Found on 2 x H200 (calls s31a-s31f, docs/PERFORMANCE.md section 41; GB/s of data at 64 MiB,
// us a round at 4 MiB): the copy 355 / 14.1-14.4; the engine's form 290-292 / 17.9; its stores
// alone 302-304 / 15.8-16.0, volatile or plain alike, the pause and STEP 1-4 alike; the same
// loop with every lane loading 16 bytes of a 512-byte group (no flags) 349-350 / 14.4-14.5: the
// packed 480-byte groups' per-lane loads, not the lines' stores, hold the stores back. Loaded
// flat into shared memory and read from there: stores alone 320-328, the whole round at STEP 4
// 317 / 16.8-17.0, at STEP 2 304 / 17.3-17.7; 128 blocks 322-329. In the engine's kernel (at
// 127-128 registers, STEP 2) the shared-memory form ran 5-10 % slower than its old form (s31g).
#include <algorithm>
#include <cstring>
#include <vector>

#include "peer_common.cuh"

typedef unsigned char u8;
#define GROUP 512u
#define GROUP_DATA 480u

__device__ __forceinline__ unsigned lane_off(unsigned lane) {
    return (lane & 7u) == 7u ? 448u + (lane >> 3) * 8u : ((lane >> 3) * 7u + (lane & 7u)) * 16u;
}

template <int VOL>
__device__ __forceinline__ void line_store(u8* p, u64 x, u64 y) {
    if (VOL) asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(x), "l"(y) : "memory");
    else asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(x), "l"(y) : "memory");
}

__device__ __forceinline__ void line_load(const u8* p, u64& x, u64& y) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(x), "=l"(y) : "l"(p) : "memory");
}

__device__ __forceinline__ u64 fadd2(u64 a, u64 b) {
    float2 fa, fb;
    std::memcpy(&fa, &a, 8);
    std::memcpy(&fb, &b, 8);
    fa.x += fb.x;
    fa.y += fb.y;
    u64 r;
    std::memcpy(&r, &fa, 8);
    return r;
}

struct Args {
    u8* far;          // the peer's slots (this round's parity)
    const u8* near;   // this GPU's slots, where the peer stores (same parity)
    const u8* src;    // this GPU's input
    u8* out;          // this GPU's output
    size_t groups;    // groups of GROUP_DATA bytes in the round
    u64 flag;
};

// Where each lane's data lies (LOAD): 0, the engine's: warp w takes groups w, w + nw, ... of its
// block's slice, each 480 bytes of the input packed after the one before (so most groups start
// off a 128-byte line); 1, flat: every lane loads and stores 16 bytes of a 512-byte group (no
// flag: a plain copy's pattern in this loop); 2, the engine's lanes but each group at 512-byte
// strides of the input (480 bytes used), aligned; 3, packed groups, each warp a contiguous run;
// 4, as 3, with each step's 4 groups (1920 bytes, 15 lines of 128) loaded flat into shared
// memory and read from there in the lines' lane order (NCCL's LL128 stages through shared
// memory likewise); 5, as 4, the fold's results too, stored out flat from shared memory;
// 6, the block's warps taking runs of 4 groups in turn (run k of warp w is the block's
// (k * nw + w)-th), each loaded flat into shared memory at the run's first step and read from
// there over the run's steps (STEP 2: two steps a load); 7, as 6 with runs of STEP groups, a
// load every step (the engine's first staged form, s31e: slower than LOAD 0 at STEP 2).
#define QUAD 4u
template <int LOAD, int STEP>
__device__ __forceinline__ size_t group_of(size_t g0, size_t i, unsigned warp, unsigned nw, size_t run) {
    constexpr size_t R = LOAD == 7 ? STEP : QUAD;
    if (LOAD >= 6) return g0 + (i / R * nw + warp) * R + i % R;
    return LOAD >= 3 ? g0 + warp * run + i : g0 + warp + i * nw;
}

template <int STEP, int VOL, int RECV, int POLL, int LOAD, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) lines(Args a) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    // Modes 3 and 4 cut the round in quads of groups, so that every warp's run starts on a line.
    const size_t unit = LOAD >= 3 ? QUAD : 1, units = a.groups / unit;
    const size_t g0 = units * blockIdx.x / gridDim.x * unit, g1 = units * (blockIdx.x + 1) / gridDim.x * unit;
    const bool flagger = LOAD != 1 && (lane & 7u) == 7u;
    const unsigned off = LOAD == 1 ? lane * 16u : lane_off(lane);
    const size_t gdata = LOAD == 1 || LOAD == 2 ? GROUP : GROUP_DATA;
    const size_t n = g1 - g0;
    const size_t run = LOAD >= 3 ? (n / unit + nw - 1) / nw * unit : 0;
    constexpr size_t R = LOAD == 7 ? STEP : QUAD;
    const size_t runs6 = n / R;
    const size_t mine = LOAD >= 6   ? (runs6 > warp ? (runs6 - warp + nw - 1) / nw : 0) * R
                        : LOAD >= 3 ? (n > warp * run ? (n - warp * run < run ? n - warp * run : run) : 0)
                                    : (n > warp ? (n - warp + nw - 1) / nw : 0);
    const size_t steps = (mine + STEP - 1) / STEP;
    __shared__ __align__(16) u8 stage[LOAD >= 4 ? THREADS / 32 * QUAD * GROUP_DATA : 16];
    u8* mystage = stage + (LOAD >= 4 ? warp * QUAD * GROUP_DATA : 0);
    u64 px[STEP], py[STEP];
    for (size_t st = 0; st <= steps; ++st) {
        u64 x[STEP], y[STEP];
        if (st < steps) {
            if (LOAD >= 4) {
                // The step's groups are contiguous bytes on a line boundary (modes 4, 5: the
                // step's own; 6, 7: the run's, loaded at its first step).
                const size_t i0 = st * STEP;
                const size_t at = LOAD >= 6 ? i0 % R : 0;
                if (LOAD < 6 || at == 0) {
                    const u8* base = a.src + group_of<LOAD, STEP>(g0, i0, warp, nw, run) * GROUP_DATA;
                    const size_t span = LOAD >= 6 ? R : STEP;
                    const size_t have = (mine - i0 < span ? mine - i0 : span) * GROUP_DATA / 16;
                    __syncwarp();
#pragma unroll
                    for (unsigned j = 0; j < 4; ++j) {
                        const unsigned k = lane + 32u * j;
                        if (k < have) *(uint4*)(mystage + k * 16) = __ldcg((const uint4*)(base + k * 16));
                    }
                    __syncwarp();
                }
#pragma unroll
                for (int u = 0; u < STEP; ++u) {
                    const u8* p = mystage + (at + u) * GROUP_DATA + off;
                    if (flagger) {
                        x[u] = *(const u64*)p;
                        y[u] = 0;
                    } else {
                        const uint4 v = *(const uint4*)p;
                        x[u] = (u64)v.x | ((u64)v.y << 32);
                        y[u] = (u64)v.z | ((u64)v.w << 32);
                    }
                }
                __syncwarp();
            } else {
#pragma unroll
                for (int u = 0; u < STEP; ++u) {
                    const size_t i = st * STEP + u, g = group_of<LOAD, STEP>(g0, i, warp, nw, run);
                    if (i >= mine) continue;
                    const u8* p = a.src + g * gdata + off;
                    if (flagger) {
                        x[u] = __ldcg((const unsigned long long*)p);
                        y[u] = 0;
                    } else {
                        const uint4 v = __ldcg((const uint4*)p);
                        x[u] = (u64)v.x | ((u64)v.y << 32);
                        y[u] = (u64)v.z | ((u64)v.w << 32);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < STEP; ++u) {
                const size_t i = st * STEP + u, g = group_of<LOAD, STEP>(g0, i, warp, nw, run);
                if (i >= mine) continue;
                line_store<VOL>(a.far + g * GROUP + lane * 16u, x[u], flagger ? a.flag : y[u]);
            }
        }
        if (RECV && st > 0) {
            u64 tx[STEP], ty[STEP];
            for (;;) {
                bool stale = false;
#pragma unroll
                for (int u = 0; u < STEP; ++u) {
                    const size_t i = (st - 1) * STEP + u, g = group_of<LOAD, STEP>(g0, i, warp, nw, run);
                    if (i >= mine) continue;
                    line_load(a.near + g * GROUP + lane * 16u, tx[u], ty[u]);
                    if (flagger && ty[u] != a.flag) stale = true;
                }
                if (__ballot_sync(0xffffffffu, stale) == 0u) break;
                if (POLL) __nanosleep(POLL);
            }
#pragma unroll
            for (int u = 0; u < STEP; ++u) {
                const size_t i = (st - 1) * STEP + u, g = group_of<LOAD, STEP>(g0, i, warp, nw, run);
                if (i >= mine) continue;
                // Mode 5 folds into the shared-memory stage and stores it out flat below.
                u8* o = LOAD == 5 ? mystage + u * GROUP_DATA + off : a.out + g * gdata + off;
                if (flagger) {
                    *(u64*)o = fadd2(px[u], tx[u]);
                } else {
                    const u64 rx = fadd2(px[u], tx[u]), ry = fadd2(py[u], ty[u]);
                    *(uint4*)o = make_uint4((unsigned)rx, (unsigned)(rx >> 32), (unsigned)ry, (unsigned)(ry >> 32));
                }
            }
            if (LOAD == 5) {
                __syncwarp();
                const size_t i0 = (st - 1) * STEP;
                u8* base = a.out + group_of<LOAD, STEP>(g0, i0, warp, nw, run) * GROUP_DATA;
                const size_t have = (mine - i0 < STEP ? mine - i0 : STEP) * GROUP_DATA / 16;
#pragma unroll
                for (unsigned j = 0; j < 4; ++j) {
                    const unsigned k = lane + 32u * j;
                    if (k < have) *(uint4*)(base + k * 16) = *(const uint4*)(mystage + k * 16);
                }
                __syncwarp();
            }
        }
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            px[u] = x[u];
            py[u] = y[u];
        }
    }
}

// Holds a stream until the host writes 1 at `gate` (host memory mapped for the GPU).
__global__ void hold(const volatile int* gate) {
    while (*gate == 0) __nanosleep(1000);
}

// The ceiling beside: 16-byte loads of the input stored into the peer's slots, U in flight a
// thread, no flag and no receiver (peer_store.cu's push).
template <int U>
__global__ void __launch_bounds__(512, 1) push(uint4* dst, const uint4* src, size_t bytes) {
    const size_t share = bytes / gridDim.x / 16 * 16;
    copy16<U>(dst + share * blockIdx.x / 16, src + share * blockIdx.x / 16, share / 16);
}

struct Gpu {
    u8 *src, *out, *slots;
    cudaStream_t s;
    cudaEvent_t e0, e1;
};

struct Conf {
    const char* name;
    int step, vol, recv, poll, blocks, flat, threads;  // step 0: push with U = vol; flat: LOAD
};

typedef void (*Kernel)(Args);

static Kernel pick(const Conf& c) {
#define K(S, V, R, P, F, T) \
    if (c.step == S && c.vol == V && c.recv == R && c.poll == P && c.flat == F && c.threads == T) return lines<S, V, R, P, F, T>;
    K(2, 1, 1, 200, 0, 512) K(2, 0, 1, 200, 0, 512) K(2, 1, 1, 0, 0, 512) K(4, 1, 1, 200, 0, 512)
    K(2, 1, 1, 200, 0, 1024) K(2, 1, 0, 200, 0, 512) K(2, 0, 0, 200, 0, 512) K(2, 1, 0, 200, 1, 512)
    K(2, 1, 0, 200, 2, 512) K(2, 1, 1, 200, 3, 512) K(4, 1, 1, 200, 4, 512) K(2, 1, 1, 200, 4, 512)
    K(4, 1, 0, 200, 4, 512) K(2, 1, 0, 200, 4, 512) K(4, 1, 1, 200, 5, 512) K(2, 1, 1, 200, 6, 512)
    K(4, 1, 1, 200, 6, 512) K(2, 1, 1, 200, 7, 512)
#undef K
    std::fprintf(stderr, "no kernel for %s\n", c.name);
    std::exit(1);
}

static const size_t kSlots = size_t(160) << 20;  // both parities' lines of the largest round

// The groups a round of `bytes` carries (modes 3 and 4 whole quads only).
static size_t done_groups(const Conf& c, size_t bytes) {
    const size_t g = bytes / GROUP_DATA;
    return c.flat >= 3 ? g / QUAD * QUAD : g;
}

static u64 flag_of(u64 r) { return 0x5a17ull ^ (r * 0x9e3779b97f4a7c15ull); }

// Enqueues rounds [r0, r0 + n) of `bytes` on both GPUs behind a closed gate, opens it, and
// returns us a round on the slowest GPU.
static double run(Gpu* g, volatile int* gate, int* gate_dev, const Conf& c, size_t bytes, u64 r0, int n) {
    const size_t groups = bytes / GROUP_DATA;
    const size_t parity = kSlots / 2;
    *gate = 0;
    for (int d = 0; d < 2; ++d) {
        RK(cudaSetDevice(d));
        hold<<<1, 1, 0, g[d].s>>>(gate_dev);
        RK(cudaEventRecord(g[d].e0, g[d].s));
        for (int k = 0; k < n; ++k) {
            const u64 r = r0 + k;
            if (c.step == 0) {
                uint4* dst = (uint4*)(g[1 - d].slots + (r & 1) * parity);
                const uint4* src = (const uint4*)g[d].src;
                if (c.vol == 1) push<1><<<c.blocks, 512, 0, g[d].s>>>(dst, src, bytes);
                else if (c.vol == 2) push<2><<<c.blocks, 512, 0, g[d].s>>>(dst, src, bytes);
                else if (c.vol == 4) push<4><<<c.blocks, 512, 0, g[d].s>>>(dst, src, bytes);
                else push<8><<<c.blocks, 512, 0, g[d].s>>>(dst, src, bytes);
            } else {
                Args a{g[1 - d].slots + (r & 1) * parity, g[d].slots + (r & 1) * parity, g[d].src, g[d].out,
                       c.flat == 1 ? bytes / GROUP : groups, flag_of(r)};
                pick(c)<<<c.blocks, c.threads, 0, g[d].s>>>(a);
            }
        }
        RK(cudaGetLastError());
        RK(cudaEventRecord(g[d].e1, g[d].s));
    }
    *gate = 1;
    double worst = 0;
    for (int d = 0; d < 2; ++d) {
        RK(cudaSetDevice(d));
        RK(cudaEventSynchronize(g[d].e1));
        float ms;
        RK(cudaEventElapsedTime(&ms, g[d].e0, g[d].e1));
        worst = std::max(worst, (double)ms);
    }
    return worst * 1e3 / n;
}

int main() {
    const size_t max_bytes = size_t(80) << 20;  // 64 MiB rounds at 512-byte strides: 68
    Gpu g[2];
    for (int d = 0; d < 2; ++d) {
        open_gpu(d, g[d]);
        RK(cudaMalloc(&g[d].src, max_bytes));
        RK(cudaMalloc(&g[d].out, max_bytes));
        RK(cudaMalloc(&g[d].slots, kSlots));
        RK(cudaMemset(g[d].slots, 0, kSlots));
        // Small integers as floats: every sum exact.
        std::vector<float> h(max_bytes / 4);
        for (size_t i = 0; i < h.size(); ++i) h[i] = (float)((i * 7 + d * 13) % 1021) * (d + 1);
        RK(cudaMemcpy(g[d].src, h.data(), max_bytes, cudaMemcpyHostToDevice));
    }
    int* gate_host;
    RK(cudaHostAlloc(&gate_host, 64, cudaHostAllocMapped | cudaHostAllocPortable));
    int* gate_dev;
    RK(cudaHostGetDevicePointer(&gate_dev, gate_host, 0));
    volatile int* gate = gate_host;
    for (int d = 0; d < 2; ++d) { RK(cudaSetDevice(d)); RK(cudaDeviceSynchronize()); }

    const Conf confs[] = {
        {"copy-u4 (ceiling)", 0, 4, 0, 0, 64, 0, 512},
        {"lines (engine)", 2, 1, 1, 200, 64, 0, 512},
        {"lines, plain stores", 2, 0, 1, 200, 64, 0, 512},
        {"lines, no pause", 2, 1, 1, 0, 64, 0, 512},
        {"lines, step 4", 4, 1, 1, 200, 64, 0, 512},
        {"lines, 1024 threads", 2, 1, 1, 200, 64, 0, 1024},
        {"lines, 128 blocks", 2, 1, 1, 200, 128, 0, 512},
        {"store only", 2, 1, 0, 200, 64, 0, 512},
        {"store only, plain", 2, 0, 0, 200, 64, 0, 512},
        {"store only, flat", 2, 1, 0, 200, 64, 1, 512},
        {"store only, 512 stride", 2, 1, 0, 200, 64, 2, 512},
        {"lines, warp runs", 2, 1, 1, 200, 64, 3, 512},
        {"lines, smem, step 4", 4, 1, 1, 200, 64, 4, 512},
        {"lines, smem, step 2", 2, 1, 1, 200, 64, 4, 512},
        {"store only, smem, step 4", 4, 1, 0, 200, 64, 4, 512},
        {"store only, smem, step 2", 2, 1, 0, 200, 64, 4, 512},
        {"lines, smem in and out", 4, 1, 1, 200, 64, 5, 512},
        {"lines, 4-runs, step 2", 2, 1, 1, 200, 64, 6, 512},
        {"lines, 4-runs, step 4", 4, 1, 1, 200, 64, 6, 512},
        {"lines, 2-runs, step 2", 2, 1, 1, 200, 64, 7, 512},
        {"lines, smem, 128 blocks", 4, 1, 1, 200, 128, 4, 512},
    };
    u64 r = 1;
    std::printf("%-28s %6s %6s %9s %9s\n", "configuration", "blocks", "MiB", "us/round", "GB/s");
    for (size_t bytes : {size_t(1) << 20, size_t(4) << 20, size_t(16) << 20, size_t(64) << 20}) {
        const int n = bytes >= (size_t(16) << 20) ? 20 : 100;
        for (const Conf& c : confs) {
            std::vector<double> t;
            for (int rep = 0; rep < 6; ++rep) {
                const double us = run(g, gate, gate_dev, c, bytes, r, n);
                r += n;
                if (rep > 0) t.push_back(us);
            }
            std::sort(t.begin(), t.end());
            const double us = t[t.size() / 2];
            // Data a direction: the lines carry 512 bytes for 480 of it.
            const double data = c.step == 0 || c.flat == 1 ? (double)bytes : (double)(done_groups(c, bytes) * GROUP_DATA);
            std::printf("%-28s %6d %6zu %9.2f %9.1f\n", c.name, c.blocks, bytes >> 20, us, data / (us * 1e-6) / 1e9);
            std::fflush(stdout);
        }
    }
    // One checked round per store kind at 4 MiB: out = src0 + src1 on both GPUs.
    for (int mode : {0, 4, 5, 6, 7}) {
        const char* names[] = {"check engine", "", "", "", "check smem", "check smem in and out", "check 4-runs, step 2", "check 2-runs, step 2"};
        const Conf c{names[mode], mode == 4 || mode == 5 ? 4 : 2, 1, 1, 200, 64, mode, 512};
        const size_t bytes = size_t(4) << 20, n = done_groups(c, bytes) * GROUP_DATA / 4;
        for (int d = 0; d < 2; ++d) { RK(cudaSetDevice(d)); RK(cudaMemset(g[d].out, 0xff, bytes)); RK(cudaDeviceSynchronize()); }
        run(g, gate, gate_dev, c, bytes, r, 1);
        r += 1;
        std::vector<float> a(n), b(n), o(n);
        RK(cudaSetDevice(0));
        RK(cudaMemcpy(a.data(), g[0].src, n * 4, cudaMemcpyDeviceToHost));
        RK(cudaSetDevice(1));
        RK(cudaMemcpy(b.data(), g[1].src, n * 4, cudaMemcpyDeviceToHost));
        size_t wrong = 0;
        for (int d = 0; d < 2; ++d) {
            RK(cudaSetDevice(d));
            RK(cudaMemcpy(o.data(), g[d].out, n * 4, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < n; ++i) wrong += o[i] != a[i] + b[i];
        }
        std::printf("%s: %zu of %zu elements wrong\n", c.name, wrong, 2 * n);
    }
    return 0;
}

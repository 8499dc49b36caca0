# Large collectives as a PyTorch user runs them: torch.distributed's "nccl" backend, one process
# per GPU, tensors from PyTorch's default caching allocator (cudaMalloc segments, which ferroccl
# lends its peers by CUDA IPC handles), eager host launches, on whichever libnccl.so.2 the process
# loads (NVIDIA's, or ferroccl's through LD_PRELOAD). Each (op, size) is checked exact once on
# fresh small integers, then timed: WARMUP untimed calls, then ITERS calls between two CUDA events
# on the current stream (the backend orders its stream after it and the events after the work).
# Rank 0 prints one JSON line per (op, size): {"op", "bytes", "us", "ok", "libnccl"}.
# Usage (GPU machine): [LD_PRELOAD=.../libnccl.so] python3 torch_bw.py [SIZES_MIB] [ITERS]
#   SIZES_MIB: comma-separated per-rank message sizes in MiB (default 8,32,128,512)
import json, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

WARMUP = 5

def loaded_nccl():
    with open("/proc/self/maps") as f:
        return sorted({l.split()[-1] for l in f if "libnccl" in l})

def ints(count, seed, dev):
    # Small integers: sums of a few are exact in float32.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 64, (count,), generator=g).float().to(dev)

def ops(rank, n, dev, count, seed):
    """Each op as (name, prep(), run(), check()): prep() sets its in-place buffer from the fresh
    input, run() issues it (in place where PyTorch's call is: all_reduce, broadcast, reduce),
    check() after one prep() and run() says whether the output is exact. The timed loop repeats
    run() alone (in-place results then grow; the time does not depend on the values)."""
    peer = (rank + 1) % n
    src = lambda q, salt=0: ints(count, seed * 131 + q * 7 + salt, dev)
    x = src(rank); y = torch.empty_like(x)
    big_in = ints(n * count, seed * 131 + rank * 7 + 3, dev)
    gathered = torch.empty(n * count, device=dev)
    part = torch.empty(count, device=dev)
    a2a = torch.empty(n * count, device=dev)
    everyone = lambda salt=0: [src(q, salt) for q in range(n)]
    def sendrecv():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, (rank - 1) % n)])
        for r in reqs: r.wait()
    fill = lambda: y.copy_(x)
    none = lambda: None
    bigs = lambda: [ints(n * count, seed * 131 + q * 7 + 3, dev) for q in range(n)]
    return [
        ("all_reduce", fill, lambda: dist.all_reduce(y), lambda: torch.equal(y, sum(everyone()))),
        ("broadcast", fill, lambda: dist.broadcast(y, src=0), lambda: torch.equal(y, src(0))),
        ("reduce", fill, lambda: dist.reduce(y, dst=0), lambda: rank != 0 or torch.equal(y, sum(everyone()))),
        ("all_gather", none, lambda: dist.all_gather_into_tensor(gathered, x), lambda: torch.equal(gathered, torch.cat(everyone()))),
        ("reduce_scatter", none, lambda: dist.reduce_scatter_tensor(part, big_in),
         lambda: torch.equal(part, sum(bigs())[rank * count:(rank + 1) * count])),
        ("all_to_all", none, lambda: dist.all_to_all_single(a2a, big_in),
         lambda: torch.equal(a2a, torch.cat([b[rank * count:(rank + 1) * count] for b in bigs()]))),
        ("sendrecv", none, sendrecv, lambda: torch.equal(y, src((rank - 1) % n))),
    ]

def worker(rank, n, port, sizes, iters, seed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=dev)
    lib = loaded_nccl()
    for mib in sizes:
        count = (mib << 20) // 4
        for name, prep, run, check in ops(rank, n, dev, count, seed + mib):
            prep(); run(); torch.cuda.synchronize(); ok = bool(check())
            for _ in range(WARMUP): run()
            torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters): run()
            b.record(); b.synchronize()
            us = a.elapsed_time(b) * 1000 / iters
            oks = [None] * n; dist.all_gather_object(oks, ok)
            if rank == 0:
                print(json.dumps({"op": name, "bytes": mib << 20, "us": round(us, 2), "ok": all(oks), "libnccl": lib}), flush=True)
        torch.cuda.empty_cache()
    dist.destroy_process_group()

if __name__ == "__main__":
    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8,32,128,512").split(",")]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    n = torch.cuda.device_count()
    mp.spawn(worker, args=(n, 29500 + os.getpid() % 1000, sizes, iters, int(time.time()) % 100000), nprocs=n)

# PyTorch's torch.distributed "nccl" backend, run on whichever libnccl.so.2 the process loads
# (NVIDIA's, or ferroccl's through LD_PRELOAD): exact collectives on fresh random integers,
# send/recv, barrier, new_group (a split), a CUDA-graph-captured all-reduce, the collectives
# again at 300,007 elements a rank (and one captured), a small DDP run,
# and destroy_process_group, timed. One process per GPU. Prints one JSON line per rank.
# Usage (GPU machine): python3 torch_nccl.py [NRANKS] (default: one per GPU)
import hashlib, json, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def loaded_nccl():
    with open("/proc/self/maps") as f:
        return sorted({l.split()[-1] for l in f if "libnccl" in l})

def ints(shape, gen, dev, dtype=torch.float32, lo=-64, hi=64):
    # Small integers: every sum of a few of them is exact in float32 and bfloat16.
    return torch.randint(lo, hi, shape, generator=gen).to(dtype).to(dev)

def graph_all_reduce(rank, shape, mine):
    # An all-reduce captured in a CUDA graph, replayed on new data in the same buffer.
    buf = mine(shape)[rank].clone(); s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_reduce(buf); torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            dist.all_reduce(buf)
    torch.cuda.synchronize()
    fresh = mine(shape)
    buf.copy_(fresh[rank]); graph.replay(); torch.cuda.synchronize()
    return torch.equal(buf, sum(fresh))

def checks(rank, n, dev, seed):
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(n)]
    mine = lambda shape, dtype=torch.float32: [ints(shape, g, dev, dtype) for g in gens]
    ok = {}
    for dtype in (torch.float32, torch.bfloat16):
        xs = mine((4099,), dtype)
        y = xs[rank].clone(); dist.all_reduce(y)
        ok[f"all_reduce_sum_{dtype}"] = torch.equal(y, sum(xs))
        y = xs[rank].clone(); dist.all_reduce(y, op=dist.ReduceOp.MAX)
        ok[f"all_reduce_max_{dtype}"] = torch.equal(y, torch.stack(xs).amax(0))
    xs = mine((1000,))
    out = torch.empty(n * 1000, device=dev); dist.all_gather_into_tensor(out, xs[rank])
    ok["all_gather"] = torch.equal(out, torch.cat(xs))
    lst = [torch.empty(1000, device=dev) for _ in range(n)]; dist.all_gather(lst, xs[rank])
    ok["all_gather_list"] = all(torch.equal(a, b) for a, b in zip(lst, xs))
    big = mine((n * 1000,))
    out = torch.empty(1000, device=dev); dist.reduce_scatter_tensor(out, big[rank])
    ok["reduce_scatter"] = torch.equal(out, sum(big)[rank * 1000:(rank + 1) * 1000])
    out = torch.empty(n * 100, device=dev); a2a = mine((n * 100,))
    dist.all_to_all_single(out, a2a[rank])
    ok["all_to_all"] = torch.equal(out, torch.cat([a2a[q][rank * 100:(rank + 1) * 100] for q in range(n)]))
    root = n - 1
    y = xs[rank].clone(); dist.broadcast(y, src=root)
    ok["broadcast"] = torch.equal(y, xs[root])
    y = xs[rank].clone(); dist.reduce(y, dst=root)
    ok["reduce"] = rank != root or torch.equal(y, sum(xs))
    # Send/receive around the ring, batched (a group) so that any rank count works.
    recv = torch.empty(1000, device=dev)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, xs[rank], (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)])
    for r in reqs: r.wait()
    ok["send_recv_ring"] = torch.equal(recv, xs[(rank - 1) % n])
    # Plain send and recv between 0 and 1.
    if n >= 2 and rank < 2:
        y = torch.empty(1000, device=dev)
        if rank == 0: dist.send(xs[0], 1); dist.recv(y, 1); ok["send_recv"] = torch.equal(y, xs[1])
        else: dist.recv(y, 0); dist.send(xs[1], 0); ok["send_recv"] = torch.equal(y, xs[0])
    dist.barrier()
    # new_group: every rank but the last when there are more than 2, else all (a split).
    members = list(range(n - 1)) if n > 2 else list(range(n))
    g = dist.new_group(members)
    if rank in members:
        y = xs[rank].clone(); dist.all_reduce(y, group=g)
        ok["new_group_all_reduce"] = torch.equal(y, sum(xs[q] for q in members))
    ok["graph_all_reduce"] = graph_all_reduce(rank, (1000,), mine)
    # Large operations (beyond 256 KiB per rank: ferroccl's peer engine, staging shared across
    # processes), odd sizes, and one captured in a graph.
    c = 300_007
    for dtype in (torch.float32, torch.bfloat16):
        xs = mine((c,), dtype)
        y = xs[rank].clone(); dist.all_reduce(y)
        ok[f"big_all_reduce_{dtype}"] = torch.equal(y, sum(xs))
    xs = mine((c,))
    out = torch.empty(n * c, device=dev); dist.all_gather_into_tensor(out, xs[rank])
    ok["big_all_gather"] = torch.equal(out, torch.cat(xs))
    big = mine((n * c,))
    out = torch.empty(c, device=dev); dist.reduce_scatter_tensor(out, big[rank])
    ok["big_reduce_scatter"] = torch.equal(out, sum(big)[rank * c:(rank + 1) * c])
    out = torch.empty(n * c, device=dev); dist.all_to_all_single(out, big[rank])
    ok["big_all_to_all"] = torch.equal(out, torch.cat([big[q][rank * c:(rank + 1) * c] for q in range(n)]))
    y = xs[rank].clone(); dist.broadcast(y, src=root)
    ok["big_broadcast"] = torch.equal(y, xs[root])
    y = xs[rank].clone(); dist.reduce(y, dst=root)
    ok["big_reduce"] = rank != root or torch.equal(y, sum(xs))
    ok["big_graph_all_reduce"] = graph_all_reduce(rank, (c,), mine)
    return ok

def ddp(rank, n, dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(30):
        x = torch.randn(32, 64, generator=g).to(dev); t = torch.randint(0, 10, (32,), generator=g).to(dev)
        opt.zero_grad(); loss = torch.nn.functional.cross_entropy(ddp(x), t); loss.backward(); opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    # With 2 ranks a gradient sum is one addition: any library gives the same bits.
    return {"loss": float(loss), "params_sum": float(flat.sum()), "params_sha256": hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]}

def worker(rank, n, port, seed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    # More ranks than GPUs (NRANKS above the GPU count) share them round-robin: NVIDIA's NCCL
    # refuses that, ferroccl runs it, which lets a one-GPU machine check two ranks.
    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu); dev = torch.device("cuda", gpu)
    t0 = time.time()
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=dev)
    init_s = time.time() - t0
    rec = {"rank": rank, "nranks": n, "nccl_version": list(torch.cuda.nccl.version()), "libnccl": loaded_nccl(), "init_s": round(init_s, 3)}
    t0 = time.time(); rec["checks"] = checks(rank, n, dev, seed); rec["checks_s"] = round(time.time() - t0, 3)
    # Before DDP, which fails on its own if a collective went wrong: what the checks found.
    print(json.dumps({"rank": rank, "checks": rec["checks"], "checks_s": rec["checks_s"]}), file=sys.stderr, flush=True)
    rec["ddp"] = ddp(rank, n, dev)
    t0 = time.time(); dist.destroy_process_group(); rec["destroy_s"] = round(time.time() - t0, 3)
    print(json.dumps(rec), flush=True)

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    mp.spawn(worker, args=(n, 29500 + os.getpid() % 1000, int(time.time()) % 100000), nprocs=n)

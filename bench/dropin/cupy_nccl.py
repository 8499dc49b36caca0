# CuPy's NCCL bindings on whichever libnccl.so.2 the process loads (NVIDIA's, or ferroccl's
# through LD_PRELOAD): NcclCommunicator.initAll over every GPU from one process, one process per
# GPU from a unique id, and cupyx.distributed's send/recv and all_reduce. Exact checks on fresh
# random integers. Prints one JSON line per part. Usage (GPU machine): python3 cupy_nccl.py
import json, multiprocessing as mp, os, sys, time

def loaded_nccl():
    with open("/proc/self/maps") as f:
        return sorted({l.split()[-1] for l in f if "libnccl" in l})

def data(cp, rank, n, seed):
    rs = cp.random.RandomState(seed * 1000 + rank)
    return rs.randint(-64, 64, size=n).astype(cp.float32)

def init_all(seed):
    import cupy as cp
    from cupy.cuda import nccl
    ndev = cp.cuda.runtime.getDeviceCount()
    comms = nccl.NcclCommunicator.initAll(list(range(ndev)))
    count = 10007
    sends, recvs, streams = [], [], []
    for d in range(ndev):
        with cp.cuda.Device(d):
            sends.append(data(cp, d, count, seed)); recvs.append(cp.zeros(count * ndev, cp.float32)); streams.append(cp.cuda.Stream())
    ok = {}
    nccl.groupStart()
    for d, c in enumerate(comms):
        with cp.cuda.Device(d):
            c.allReduce(sends[d].data.ptr, recvs[d].data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, streams[d].ptr)
    nccl.groupEnd()
    want = sum(cp.asnumpy(s) for s in sends)
    ok["allReduce"] = all((cp.asnumpy(recvs[d][:count]) == want).all() for d in range(ndev))
    nccl.groupStart()
    for d, c in enumerate(comms):
        with cp.cuda.Device(d):
            c.allGather(sends[d].data.ptr, recvs[d].data.ptr, count, nccl.NCCL_FLOAT32, streams[d].ptr)
    nccl.groupEnd()
    import numpy as np
    want = np.concatenate([cp.asnumpy(s) for s in sends])
    ok["allGather"] = all((cp.asnumpy(recvs[d]) == want).all() for d in range(ndev))
    nccl.groupStart()
    for d, c in enumerate(comms):
        with cp.cuda.Device(d):
            c.bcast(sends[d].data.ptr, count, nccl.NCCL_FLOAT32, ndev - 1, streams[d].ptr)
    nccl.groupEnd()
    want = cp.asnumpy(sends[ndev - 1])
    ok["bcast"] = all((cp.asnumpy(sends[d]) == want).all() for d in range(ndev))
    for c in comms:
        c.destroy()
    print(json.dumps({"part": "initAll", "ndev": ndev, "libnccl": loaded_nccl(), "nccl_version": nccl.get_version(), "checks": ok}), flush=True)
    return all(ok.values())

def per_process(rank, n, uid, seed, q):
    import cupy as cp
    from cupy.cuda import nccl
    cp.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(n, uid, rank)
    count, ok = 4099, {}
    x = data(cp, rank, count, seed); y = cp.zeros(count, cp.float32)
    s = cp.cuda.Stream()
    comm.allReduce(x.data.ptr, y.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_MAX, s.ptr); s.synchronize()
    want = cp.stack([data(cp, r, count, seed) for r in range(n)]).max(axis=0)
    ok["allReduce_max"] = bool((y == want).all())
    big = data(cp, rank, 1000 * n, seed + 1); out = cp.zeros(1000, cp.float32)
    comm.reduceScatter(big.data.ptr, out.data.ptr, 1000, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr); s.synchronize()
    want = sum(data(cp, r, 1000 * n, seed + 1) for r in range(n))[rank * 1000:(rank + 1) * 1000]
    ok["reduceScatter"] = bool((out == want).all())
    # send/recv between neighbours, in a group.
    r_buf = cp.zeros(count, cp.float32)
    nccl.groupStart()
    comm.send(x.data.ptr, count, nccl.NCCL_FLOAT32, (rank + 1) % n, s.ptr)
    comm.recv(r_buf.data.ptr, count, nccl.NCCL_FLOAT32, (rank - 1) % n, s.ptr)
    nccl.groupEnd(); s.synchronize()
    ok["send_recv"] = bool((r_buf == data(cp, (rank - 1) % n, count, seed)).all())
    comm.destroy()
    q.put({"part": "per_process", "rank": rank, "libnccl": loaded_nccl(), "checks": ok})

def distributed(rank, n, port, seed, q):
    import cupy as cp
    import cupyx.distributed
    import multiprocessing
    # cupyx's TCP store runs in a child process of its own, which it makes with the default
    # start method: inside this spawned worker that was spawn, which cannot pickle the store
    # (on NVIDIA's library and ferroccl's alike, 2 x H200, session 12). The store's process
    # touches no GPU, so a fork is safe.
    multiprocessing.set_start_method("fork", force=True)
    cp.cuda.Device(rank).use()
    comm = cupyx.distributed.init_process_group(n, rank, backend="nccl", host="127.0.0.1", port=port)
    ok, count = {}, 3000
    x = data(cp, rank, count, seed)
    out = cp.zeros(count, cp.float32)
    comm.all_reduce(x, out, op="sum"); cp.cuda.Device().synchronize()
    ok["all_reduce"] = bool((out == sum(data(cp, r, count, seed) for r in range(n))).all())
    if n >= 2 and rank < 2:
        got = cp.zeros(count, cp.float32)
        if rank == 0: comm.send(x, 1); comm.recv(got, 1)
        else: comm.recv(got, 0); comm.send(x, 0)
        cp.cuda.Device().synchronize()
        ok["send_recv"] = bool((got == data(cp, 1 - rank, count, seed)).all())
    q.put({"part": "cupyx.distributed", "rank": rank, "libnccl": loaded_nccl(), "checks": ok})

if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    seed = int(time.time()) % 100000
    good = init_all(seed)
    import cupy as cp
    from cupy.cuda import nccl
    n = cp.cuda.runtime.getDeviceCount()
    ctx = mp.get_context("spawn")
    port = 13000 + os.getpid() % 1000
    uid = nccl.get_unique_id()
    for target, args in [(per_process, lambda r: (r, n, uid, seed)), (distributed, lambda r: (r, n, port, seed))]:
        q = ctx.Queue()
        ps = [ctx.Process(target=target, args=args(r) + (q,)) for r in range(n)]
        for p in ps: p.start()
        recs = [q.get(timeout=120) for _ in ps]
        for p in ps: p.join(60)
        for r in sorted(recs, key=lambda r: r["rank"]):
            print(json.dumps(r), flush=True)
            good &= all(r["checks"].values())
        good &= all(p.exitcode == 0 for p in ps)
    sys.exit(0 if good else 1)

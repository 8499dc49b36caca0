# CuPy's NCCL bindings driving ferroccl's libnccl.so.2 on its host backend (no GPU needed): a
# process per rank, NcclCommunicator from a unique id, allReduce / allGather / grouped send-recv
# on host memory, each checked exactly. Needs CuPy (pip install cupy-cuda13x):
#   FERROCCL_NCCL_BACKEND=host LD_PRELOAD=target/release/libnccl.so python3 bench/dropin/cupy_host.py
import multiprocessing as mp, numpy as np, sys
def rank_main(r, n, uid, q):
    from cupy.cuda import nccl
    c = nccl.NcclCommunicator(n, uid, r)
    x = (np.arange(1000, dtype=np.float32) + r * 1000)
    y = np.zeros(1000, np.float32)
    c.allReduce(x.ctypes.data, y.ctypes.data, 1000, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    ok = bool((y == sum(np.arange(1000, dtype=np.float32) + k * 1000 for k in range(n))).all())
    g = np.zeros(1000 * n, np.float32)
    c.allGather(x.ctypes.data, g.ctypes.data, 1000, nccl.NCCL_FLOAT32, 0)
    ok &= bool((g == np.concatenate([np.arange(1000, dtype=np.float32) + k * 1000 for k in range(n)])).all())
    got = np.zeros(1000, np.float32)
    nccl.groupStart()
    c.send(x.ctypes.data, 1000, nccl.NCCL_FLOAT32, (r + 1) % n, 0)
    c.recv(got.ctypes.data, 1000, nccl.NCCL_FLOAT32, (r - 1) % n, 0)
    nccl.groupEnd()
    ok &= bool((got == np.arange(1000, dtype=np.float32) + ((r - 1) % n) * 1000).all())
    c.destroy()
    q.put((r, ok))
if __name__ == "__main__":
    from cupy.cuda import nccl
    n = 3
    uid = nccl.get_unique_id()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, n, uid, q)) for r in range(n)]
    [p.start() for p in ps]
    res = sorted(q.get(timeout=60) for _ in ps)
    [p.join(30) for p in ps]
    print("ranks exact:", res)
    sys.exit(0 if all(ok for _, ok in res) and all(p.exitcode == 0 for p in ps) else 1)

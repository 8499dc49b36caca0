#!/usr/bin/env bash
# Session 8, one GPU, the final tree: PyTorch through the drop-in library (two processes
# sharing the GPU, peer engine on and off; then NVIDIA's library and ours, one rank, with CuPy:
# bench/dropin/run.sh), the host cost of one call (one rank; two ranks sharing the GPU), and the
# graph latency rows of the final build.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONUNBUFFERED=1
OUT0=$OUT; OUT=$K/torch2; bash $(dirname $0)/torch2.sh 2>&1 | tee $K/torch2.log; OUT=$OUT0  # torch2.sh was .dev/exp20.sh
bash bench/dropin/run.sh $K/dropin $PWD/.dev/libnccl.so.2 2>&1 | tail -8 | tee $K/dropin.log
for d in "" "0,0"; do echo "== enqueue devices=${d:-all}"; FERROCCL_PROBE_DEVICES=$d timeout 120 .dev/enqueue_cost 3000 2>&1 | tail -9; done 2>&1 | sed 's/^/  /' | tee $K/enqueue.log
timeout 120 .dev/ferroccl bench all -b 8 -e 1M -f 8 -n 100 -w 20 --graph 20 --devices 0,0 --json $K/graph-all.json > $K/graph-all.log 2>&1
timeout 120 .dev/ferroccl bench all-reduce -b 8 -e 16M -f 2 -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 --json $K/graph-ar.json > $K/graph-ar.log 2>&1
grep -E '^ +[0-9]+ ' $K/graph-ar.log | awk '{print $1, $6}' | tr '\n' ';'; echo
tar czf $OUT/exp49.tgz -C $K .

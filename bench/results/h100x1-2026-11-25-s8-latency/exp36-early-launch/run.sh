#!/usr/bin/env bash
# Session 8, one GPU: early launch (programmatic dependent launch) of the engines' kernels, on
# against off: the driver's launch cost, the host cost of one call, and per-operation times of
# graphs and host launches with 2 ranks sharing the GPU, alternated.
B=$PWD/.dev/ferroccl
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for i in 1 2; do for e in 0 1; do
  echo "== enqueue early=$e run $i"; FERROCCL_GPU_EARLY_LAUNCH=$e timeout 120 .dev/enqueue_cost 3000 2>&1 | tail -9
done; done > $K/enqueue.log 2>&1
cat $K/enqueue.log
for i in 1 2; do for e in 0 1; do
  FERROCCL_GPU_EARLY_LAUNCH=$e timeout 120 $B bench all-reduce -b 8 -e 4M -f 2 -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/graph-ar-e$e-r$i.log 2>&1
  FERROCCL_GPU_EARLY_LAUNCH=$e timeout 120 $B bench all-reduce -b 8 -e 4M -f 4 -n 200 -w 20 --devices 0,0 -d bfloat16 > $K/host-ar-e$e-r$i.log 2>&1
done; done
for e in 0 1; do
  FERROCCL_GPU_EARLY_LAUNCH=$e timeout 200 $B bench all -b 8 -e 1M -f 8 -n 100 -w 20 --graph 20 --devices 0,0 > $K/graph-all-e$e.log 2>&1
done
cd $K; for f in graph-ar-*.log host-ar-*.log; do echo "== $f"; grep -E '^ +[0-9]+ ' $f | awk '{print $1, $6}' | tr '\n' ';'; echo; done
for f in graph-all-*.log; do echo "== $f"; grep -E '^ +[0-9]+ |^# (op|[a-z-]+:)' $f | awk '{print $1, $2, $6}' | tr '\n' ';'; echo; done
tar czf $OUT/exp36.tgz -C $K .

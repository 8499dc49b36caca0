#!/usr/bin/env bash
# Session 8, one GPU: why host launches got slower with one direct kernel per type (exp42):
# both builds with early launch on and off, threads and one thread; the host cost of one call
# of 2 ranks sharing the GPU (the direct engine's path).
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do for e in 1 0; do for b in c new; do
  B=.dev/ferroccl; [ $b = c ] && B=.dev/ferroccl_c
  FERROCCL_GPU_EARLY_LAUNCH=$e timeout 120 $B bench all-reduce -b 8 -e 8 -n 2000 -w 50 --devices 0,0 -d bfloat16 > $K/host-$b-e$e-r$i.log 2>&1
  FERROCCL_GPU_EARLY_LAUNCH=$e timeout 120 $B bench all-reduce -b 8 -e 8 -n 2000 -w 50 --devices 0,0 --one-thread -d bfloat16 > $K/host1t-$b-e$e-r$i.log 2>&1
done; done; done
cd $K; for f in host-*.log host1t-*.log; do echo "$f $(grep -E '^ +[0-9]+ ' $f | awk '{print $6, $10}')"; done; cd - >/dev/null
for e in 1 0; do echo "== probe early=$e"; FERROCCL_GPU_EARLY_LAUNCH=$e FERROCCL_PROBE_DEVICES=0,0 timeout 120 .dev/enqueue_cost 3000 2>&1 | tail -9; done | tee $K/enqueue.log
tar czf $OUT/exp43.tgz -C $K .

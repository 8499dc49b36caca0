#!/usr/bin/env bash
# Session 8, one GPU: the graph-launch probe; then correctness with early launch on (the
# default): every GPU test, the check sweep with 2 ranks in 3 modes and 3 ranks.
B=$PWD/.dev/ferroccl
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
nvcc -O2 -arch=sm_90 -o $K/graph_launch bench/probes/graph_launch.cu && $K/graph_launch | tee $K/graph_launch.log
t0=$SECONDS
FERROCCL_GPU_TEST=1 timeout 240 .dev/gputests --ignored --test-threads 1 > $K/gputest.log 2>&1; echo "gpu tests rc=$? $((SECONDS-t0))s"; grep -E 'test result|panicked|FAILED' $K/gputest.log | head -8
S="all -b 8 -e 64M -f 4 -d all -o all --check -n 1 -w 1"
for v in "threads2|--devices 0,0" "onethread2|--devices 0,0 --one-thread" "register2|--devices 0,0 --register" "threads3|--devices 0,0,0"; do
  IFS='|' read -r name a <<<"$v"; t0=$SECONDS
  timeout 150 $B bench $S $a --json $K/check-$name.json > $K/check-$name.log 2>&1; rc=$?
  echo "check $name rc=$rc $((SECONDS-t0))s ok=$(grep -c 'Out of bounds values : 0 OK' $K/check-$name.log) bad=$(grep -c 'Out of bounds values : [1-9]' $K/check-$name.log) $(grep -m1 holds $K/check-$name.log | cut -c1-120)"
  grep -m3 -iE 'error|panic|FAILED|timed out' $K/check-$name.log
done
tar czf $OUT/exp37.tgz -C $K .

#!/usr/bin/env bash
# Session 8, one GPU: where an all-reduce round of the peer engine spends its time: SM cycles
# per step of block 0 (FC_PEER_TRACE), 2 ranks sharing the GPU, graphs, 1 MiB and 16 MiB.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm --format=csv
for size in 1M 16M; do
  FERROCCL_KERNEL_DEFINES=FC_PEER_TRACE=64 timeout 120 .dev/ferroccl bench all-reduce -b $size -e $size -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/trace-$size.log 2>&1
  echo "== $size: $(grep -E '^ +[0-9]+ ' $K/trace-$size.log | awk '{print $6" us"}')"; grep 'peer trace' $K/trace-$size.log | tail -6
  timeout 120 .dev/ferroccl bench all-reduce -b $size -e $size -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/plain-$size.log 2>&1
  echo "   without the trace: $(grep -E '^ +[0-9]+ ' $K/plain-$size.log | awk '{print $6" us"}')"
done
tar czf $OUT/exp45.tgz -C $K .

#!/usr/bin/env bash
# Session 8, one GPU: the peer engine's blocks per byte: a block per 32 KiB of the largest
# buffer (D), per 64 KiB and per 128 KiB (so that each thread has 4 words a step, the copy and
# reduce loops' unrolled pass); graphs, 2 ranks sharing the GPU, alternated.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do for b in 32 64 128; do
  B=.dev/ferroccl_pb$b; [ $b = 32 ] && B=.dev/ferroccl
  timeout 120 $B bench all-reduce -b 256K -e 16M -f 2 -n 50 -w 10 --graph 10 --devices 0,0 -d bfloat16 > $K/graph-ar-$b-r$i.log 2>&1
  timeout 200 $B bench all -b 512K -e 4M -f 8 -n 50 -w 10 --graph 10 --devices 0,0 > $K/graph-all-$b-r$i.log 2>&1
done; done
cd $K; for f in graph-ar-*.log graph-all-*.log; do echo "== $f"; grep -E '^ +[0-9]+ ' $f | awk '{print $1, $6}' | tr '\n' ';'; echo; done
tar czf $OUT/exp47.tgz -C $K .

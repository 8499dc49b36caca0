#!/usr/bin/env bash
# Session 8, one GPU: the direct kernel launched with a thread per line (whole warps, at most
# 256) against always 256 (0a8c1a1), graphs, 2 ranks sharing the GPU, alternated; the kernels'
# resource use (registers, stack) from the compiled-kernel cache.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do for b in d new; do
  B=.dev/ferroccl; [ $b = d ] && B=.dev/ferroccl_d
  timeout 120 $B bench all-reduce -b 8 -e 256K -f 4 -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/graph-ar-$b-r$i.log 2>&1
  timeout 200 $B bench all -b 8 -e 32K -f 64 -n 100 -w 20 --graph 20 --devices 0,0 > $K/graph-all-$b-r$i.log 2>&1
done; done
cd $K; for f in graph-ar-*.log graph-all-*.log; do echo "== $f"; grep -E '^ +[0-9]+ ' $f | awk '{print $1, $6}' | tr '\n' ';'; echo; done; cd - >/dev/null
C=${XDG_CACHE_HOME:-$HOME/.cache}/ferroccl/kernels; ls -la $C | head
for f in $C/*; do echo "== $f"; cuobjdump -res-usage $f 2>&1 | grep -E "Function|REG|STACK" | sed 's/^ *//' ; done > $K/res-usage.log 2>&1
grep -A1 -E "Function (ferroccl_direct_bfloat16|ferroccl_peer|ferroccl_plan_exec)" $K/res-usage.log | head -12
tar czf $OUT/exp44.tgz -C $K .

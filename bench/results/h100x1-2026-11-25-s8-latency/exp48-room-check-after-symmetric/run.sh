#!/usr/bin/env bash
# Session 8, one GPU: a symmetric launch after a symmetric launch skips the room check of its
# first round (the counter keeps whether the last round was symmetric), against 0a8c1a1; graphs,
# 2 ranks sharing the GPU, alternated; the round traced; checks (including odd sizes).
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do for b in f new; do
  B=.dev/ferroccl; [ $b = f ] && B=.dev/ferroccl_f
  timeout 120 $B bench all-reduce -b 256K -e 64M -f 2 -n 50 -w 10 --graph 10 --devices 0,0 -d bfloat16 > $K/graph-ar-$b-r$i.log 2>&1
  timeout 200 $B bench all -b 256K -e 16M -f 8 -n 50 -w 10 --graph 10 --devices 0,0 > $K/graph-all-$b-r$i.log 2>&1
done; done
cd $K; for f in graph-ar-*.log graph-all-*.log; do echo "== $f"; grep -E '^ +[0-9]+ ' $f | awk '{print $1, $6}' | tr '\n' ';'; echo; done; cd - >/dev/null
FERROCCL_KERNEL_DEFINES=FC_PEER_TRACE=64 timeout 120 .dev/ferroccl bench all-reduce -b 1M -e 1M -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/trace-1M.log 2>&1; grep 'peer trace' $K/trace-1M.log | tail -4
B=$PWD/.dev/ferroccl
FERROCCL_GPU_TEST=1 timeout 240 .dev/gputests --ignored --test-threads 1 > $K/gputest.log 2>&1; echo "gpu tests rc=$?"; grep -E '^test .*ok$' $K/gputest.log | grep -c ok
for v in "threads2|--devices 0,0|-b 8 -e 64M -f 4" "onethread2|--devices 0,0 --one-thread|-b 8 -e 64M -f 4" "register2|--devices 0,0 --register|-b 8 -e 64M -f 4" "threads3|--devices 0,0,0|-b 8 -e 64M -f 4" "odd2|--devices 0,0|-b 1000 -e 50M -f 7" "odd3|--devices 0,0,0|-b 1000 -e 50M -f 7"; do
  IFS='|' read -r name a sz <<<"$v"; t0=$SECONDS
  timeout 150 $B bench all $sz -d all -o all --check -n 2 -w 1 $a --json $K/check-$name.json > $K/check-$name.log 2>&1; rc=$?
  echo "check $name rc=$rc $((SECONDS-t0))s ok=$(grep -c 'Out of bounds values : 0 OK' $K/check-$name.log) bad=$(grep -c 'Out of bounds values : [1-9]' $K/check-$name.log)"
  grep -m3 -iE 'error|panic|FAILED|timed out' $K/check-$name.log
done
tar czf $OUT/exp48.tgz -C $K .

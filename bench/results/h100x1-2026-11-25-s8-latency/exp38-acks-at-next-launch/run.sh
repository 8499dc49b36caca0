#!/usr/bin/env bash
# Session 8, one GPU: acknowledgements at the next launch's start (relaxed) instead of a release
# store at the launch's end, both builds with early launch: graphs, 2 ranks sharing the GPU,
# alternated; then correctness (one-GPU GPU tests, check sweeps 2 ranks x 3 modes, 3 ranks).
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do for b in a new; do
  B=.dev/ferroccl; [ $b = a ] && B=.dev/ferroccl_a
  timeout 120 $B bench all-reduce -b 8 -e 4M -f 2 -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/graph-ar-$b-r$i.log 2>&1
  timeout 200 $B bench all -b 8 -e 1M -f 8 -n 100 -w 20 --graph 20 --devices 0,0 > $K/graph-all-$b-r$i.log 2>&1
done; done
cd $K; for f in graph-ar-*.log graph-all-*.log; do echo "== $f"; grep -E '^ +[0-9]+ ' $f | awk '{print $1, $6}' | tr '\n' ';'; echo; done; cd - >/dev/null
B=$PWD/.dev/ferroccl
t0=$SECONDS
FERROCCL_GPU_TEST=1 timeout 240 .dev/gputests --ignored --test-threads 1 > $K/gputest.log 2>&1; echo "gpu tests rc=$? $((SECONDS-t0))s"; grep -E '^test .*ok$|test result' $K/gputest.log | grep -c ok
S="all -b 8 -e 64M -f 4 -d all -o all --check -n 2 -w 1"
for v in "threads2|--devices 0,0" "onethread2|--devices 0,0 --one-thread" "register2|--devices 0,0 --register" "threads3|--devices 0,0,0"; do
  IFS='|' read -r name a <<<"$v"; t0=$SECONDS
  timeout 150 $B bench $S $a --json $K/check-$name.json > $K/check-$name.log 2>&1; rc=$?
  echo "check $name rc=$rc $((SECONDS-t0))s ok=$(grep -c 'Out of bounds values : 0 OK' $K/check-$name.log) bad=$(grep -c 'Out of bounds values : [1-9]' $K/check-$name.log) $(grep -m1 holds $K/check-$name.log | cut -c1-120)"
  grep -m3 -iE 'error|panic|FAILED|timed out' $K/check-$name.log
done
tar czf $OUT/exp38.tgz -C $K .

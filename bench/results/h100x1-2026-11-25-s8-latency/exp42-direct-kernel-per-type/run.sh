#!/usr/bin/env bash
# Session 8, one GPU: one direct kernel per element type against one with a type switch
# (b354c17), graphs and host launches (threads, one thread), 2 ranks sharing the GPU,
# alternated; the host cost of one call; correctness of the new build.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do for b in c new; do
  B=.dev/ferroccl; [ $b = c ] && B=.dev/ferroccl_c
  timeout 120 $B bench all-reduce -b 8 -e 256K -f 4 -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/graph-ar-$b-r$i.log 2>&1
  timeout 200 $B bench all -b 8 -e 32K -f 64 -n 100 -w 20 --graph 20 --devices 0,0 > $K/graph-all-$b-r$i.log 2>&1
  timeout 120 $B bench all-reduce -b 8 -e 64K -f 8 -n 500 -w 50 --devices 0,0 -d bfloat16 > $K/host-ar-$b-r$i.log 2>&1
  timeout 120 $B bench all-reduce -b 8 -e 64K -f 8 -n 500 -w 50 --devices 0,0 --one-thread -d bfloat16 > $K/host1t-ar-$b-r$i.log 2>&1
done; done
cd $K; for f in graph-ar-*.log graph-all-*.log host-ar-*.log host1t-ar-*.log; do echo "== $f"; grep -E '^ +[0-9]+ ' $f | awk '{print $1, $6}' | tr '\n' ';'; echo; done; cd - >/dev/null
FERROCCL_GPU_TEST=1 timeout 120 .dev/enqueue_cost 3000 2>&1 | tail -9 | tee $K/enqueue.log
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
tar czf $OUT/exp42.tgz -C $K .

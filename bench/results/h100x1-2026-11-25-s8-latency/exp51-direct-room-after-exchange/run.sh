#!/usr/bin/env bash
# Session 8, one GPU: the direct engine skips the acknowledgements' check after an epoch that
# exchanged lines with every peer, against the build before (0d54377 kernels); graphs, 2 ranks
# sharing the GPU, alternated; checks (odd sizes too); the one-GPU GPU tests.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do for b in g new; do
  B=.dev/ferroccl; [ $b = g ] && B=.dev/ferroccl_g
  timeout 120 $B bench all-reduce -b 8 -e 256K -f 4 -n 100 -w 20 --graph 20 --devices 0,0 -d bfloat16 > $K/graph-ar-$b-r$i.log 2>&1
  timeout 200 $B bench all -b 8 -e 32K -f 64 -n 100 -w 20 --graph 20 --devices 0,0 > $K/graph-all-$b-r$i.log 2>&1
done; done
cd $K; for f in graph-ar-*.log graph-all-*.log; do echo "== $f"; grep -E '^ +[0-9]+ ' $f | awk '{print $1, $6}' | tr '\n' ';'; echo; done; cd - >/dev/null
B=$PWD/.dev/ferroccl
FERROCCL_GPU_TEST=1 timeout 300 .dev/gputests --ignored --test-threads 1 > $K/gputest.log 2>&1; echo "gpu tests rc=$?"; grep -E '^test .*ok$' $K/gputest.log | grep -c ok
for v in "threads2|--devices 0,0|-b 8 -e 64M -f 4" "onethread2|--devices 0,0 --one-thread|-b 8 -e 64M -f 4" "register2|--devices 0,0 --register|-b 8 -e 64M -f 4" "threads3|--devices 0,0,0|-b 8 -e 64M -f 4" "odd2|--devices 0,0|-b 4 -e 50M -f 3" "odd3|--devices 0,0,0|-b 4 -e 50M -f 3"; do
  IFS='|' read -r name a sz <<<"$v"; t0=$SECONDS
  timeout 150 $B bench all $sz -d all -o all --check -n 2 -w 1 $a --json $K/check-$name.json > $K/check-$name.log 2>&1; rc=$?
  echo "check $name rc=$rc $((SECONDS-t0))s ok=$(grep -c 'Out of bounds values : 0 OK' $K/check-$name.log) bad=$(grep -c 'Out of bounds values : [1-9]' $K/check-$name.log)"
  grep -m3 -iE 'error|panic|FAILED|timed out' $K/check-$name.log
done
tar czf $OUT/exp51.tgz -C $K .

#!/usr/bin/env bash
# Session 8, one GPU: the new GPU test that an early-started operation waits for the kernel
# ahead (a producer that releases its dependents at once and writes the input 200 us later),
# on the final tree and on a mutant without the engines' griddepcontrol.wait (it must fail);
# then every one-GPU GPU test of the final tree.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for b in gputests gputests_mutant; do
  FERROCCL_GPU_TEST=1 timeout 200 .dev/$b --ignored --test-threads 1 --nocapture an_early_started > $K/$b-early.log 2>&1
  echo "$b: rc=$? $(grep -E '^test |panicked|elements wrong' $K/$b-early.log | head -3 | tr '\n' ' ' | cut -c1-400)"
done
FERROCCL_GPU_TEST=1 timeout 300 .dev/gputests --ignored --test-threads 1 > $K/gputest.log 2>&1; echo "gpu tests rc=$?"; grep -E '^test .*ok$' $K/gputest.log
tar czf $OUT/exp50.tgz -C $K .

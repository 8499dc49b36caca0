#!/usr/bin/env bash
# Session 8, one GPU, the last commit (600c8ce): PyTorch through the drop-in library, two
# processes sharing the GPU (peer engine off and on), then NVIDIA's and ours with one rank and
# CuPy (bench/dropin/run.sh).
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONUNBUFFERED=1
OUT0=$OUT; OUT=$K/torch2; bash $(dirname $0)/torch2.sh 2>&1 | tee $K/torch2.log; OUT=$OUT0
bash bench/dropin/run.sh $K/dropin $PWD/.dev/libnccl.so.2 2>&1 | tail -12 | tee $K/dropin.log
tar czf $OUT/exp52.tgz -C $K .

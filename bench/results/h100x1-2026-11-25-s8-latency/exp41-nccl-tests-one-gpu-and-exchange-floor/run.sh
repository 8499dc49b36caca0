#!/usr/bin/env bash
# Session 8, one GPU: nccl-tests through the drop-in libnccl.so.2 with two ranks sharing the
# GPU (-t 2 -g 1: two threads; and mpirun -np 2 where there is one), every op, type and
# reduction, checked, host launches and graphs; then the exchange-floor probe.
K=/tmp/k; mkdir -p $K
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
LIB=$PWD/.dev/libnccl.so.2
NV=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')
mkdir -p /tmp/nh/lib; ln -sf $NV/include /tmp/nh/include; ln -sf $NV/lib/libnccl.so.2 /tmp/nh/lib/libnccl.so
(cd .dev/nccl-tests && make -j16 NCCL_HOME=/tmp/nh CUDA_HOME=/usr/local/cuda NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" > $K/nt-build.log 2>&1); echo "nccl-tests build rc=$?"
echo "mpirun: $(command -v mpirun || echo none)"
T=.dev/nccl-tests/build
for t in all_reduce all_gather reduce_scatter alltoall broadcast reduce gather scatter sendrecv; do for G in 0 10; do
  log=$K/nt-$t-t2-G$G.log; t0=$SECONDS
  LD_PRELOAD=$LIB NCCL_DEBUG=INFO timeout 100 $T/${t}_perf -t 2 -g 1 -b 8 -e 16M -f 8 -c 1 -d all -o all -w 1 -n 2 -G $G > $log 2>&1
  echo "nccl-tests $t -t 2 -G $G: rc=$? $((SECONDS-t0))s banner=$(grep -c 'ferroccl 0' $log) ranks=$(grep -c 'Rank  *[0-9]' $log) $(grep -h 'Out of bounds' $log) $(grep -m1 -iE 'error|invalid|fail' $log | cut -c1-160)"
done; done
nvcc -O2 -arch=sm_90 -o $K/graph_launch bench/probes/graph_launch.cu && $K/graph_launch > $K/graph_launch.log 2>&1; tail -4 $K/graph_launch.log
tar czf $OUT/exp41.tgz -C $K --exclude nt-build.log . 

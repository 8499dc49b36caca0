#!/usr/bin/env bash
# PyTorch and CuPy on NVIDIA's libnccl.so.2 and on ferroccl's (LD_PRELOAD), side by side, then
# compare.py; and nccl-tests when NCCL_TESTS names a directory of their built binaries (build
# them by hand on the GPU machine against NVIDIA's headers: nothing in this repository does).
# Usage (GPU machine): bash bench/dropin/run.sh OUT /path/to/ferroccl/libnccl.so
set -uo pipefail
OUT=${1:?output directory}; LIB=$(realpath "${2:?ferroccl libnccl.so}")
HERE=$(dirname "$0")
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
for who in nvidia ferroccl; do
    pre=""; [ "$who" = ferroccl ] && pre="$LIB"
    LD_PRELOAD="$pre" NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout 300 python3 "$HERE/torch_nccl.py" >"$OUT/torch-$who.jsonl" 2>"$OUT/torch-$who.err"
    echo "torch on $who: exit $?"
    LD_PRELOAD="$pre" NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout 300 python3 "$HERE/cupy_nccl.py" >"$OUT/cupy-$who.jsonl" 2>"$OUT/cupy-$who.err"
    echo "cupy on $who: exit $?"
done
python3 "$HERE/compare.py" "$OUT" "$LIB" | tee "$OUT/compare.json"
if [ -n "${NCCL_TESTS:-}" ]; then
    # Every op, type and reduction, 8 B to 256 MiB, checked (-c 1), with host launches and with
    # CUDA graphs (-G 10), one process driving every GPU (-g N), a thread per GPU (-t N), and,
    # where the binaries were built with MPI=1 and mpirun exists, a process per GPU. NT_OPS and
    # NT_MODES ("g t mpi") pick a part, to fit one run's time limit.
    N=${GPUS:-$(nvidia-smi -L | grep -c '^GPU ')}
    modes=()
    for m in ${NT_MODES:-g t mpi}; do
        case $m in
            g) modes+=("-g $N") ;;
            t) modes+=("-t $N -g 1") ;;
            mpi) command -v mpirun >/dev/null && modes+=("mpi") ;;
        esac
    done
    for t in ${NT_OPS:-all_reduce all_gather reduce_scatter alltoall broadcast reduce gather scatter sendrecv}; do
        for mode in "${modes[@]}"; do
            for graph in 0 10; do
                log="$OUT/nccl-tests-${t}-${mode// /}-G$graph.log"
                args=(-b 8 -e 256M -f 4 -c 1 -d all -o all -w 1 -n 2 -G $graph)
                if [ "$mode" = mpi ]; then
                    # Each rank finds the library through LD_PRELOAD, passed on by mpirun.
                    timeout 600 mpirun --allow-run-as-root -np "$N" -x LD_PRELOAD="$LIB" -x NCCL_DEBUG=INFO -x NCCL_NVLS_ENABLE=0 \
                        "$NCCL_TESTS/${t}_perf" -g 1 "${args[@]}" >"$log" 2>&1
                else
                    LD_PRELOAD="$LIB" NCCL_DEBUG=INFO timeout 600 "$NCCL_TESTS/${t}_perf" $mode "${args[@]}" >"$log" 2>&1
                fi
                echo "nccl-tests $t $mode -G $graph: exit $?, $(grep -c 'ferroccl' "$log") ferroccl banner line(s), $(grep -h 'Out of bounds' "$log")"
            done
        done
    done
fi

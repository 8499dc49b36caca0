#!/usr/bin/env bash
# nccl-tests on ferroccl's libnccl.so.2 (LD_PRELOAD): every op, type and reduction from 4 B to
# 256 MiB, checked (-c 1), with host launches and CUDA graphs (-G 10), one process driving every
# GPU (-g N), a thread per GPU (-t N), and a process per GPU (mpirun, where the binaries were
# built with MPI=1 and mpirun exists). The binaries are the public NVIDIA/nccl-tests, built by
# hand on the GPU machine against NVIDIA's nccl.h: nothing in this repository builds them.
# Usage (GPU machine): bash bench/dropin/nccl_tests.sh OUT /path/to/ferroccl/libnccl.so NT_DIR
#   NT_OPS, NT_MODES ("g t mpi"), NT_GRAPHS ("0 10") pick a part; NT_EXTRA adds arguments (e.g.
#   "-R 2": buffers from ncclMemAlloc registered as symmetric windows), NT_DTYPE (all) the types;
#   NT_MIN (4) and NT_MAX (256M)
#   the sizes (times 4 from NT_MIN: 4 B, 16 B, ... 256 MiB); DEADLINE (seconds, 0 = none) skips
#   what would start after it; RUN_CAP (600) bounds one run.
# Writes OUT/nccl-tests-<op>-<mode>-G<n>.log and one line per run in OUT/nccl-tests-summary.txt:
# exit status, seconds, ferroccl's banner count (proof the library loaded is ours), the number
# of result lines with a nonzero #wrong, and nccl-tests' "Out of bounds" verdict.
set -uo pipefail
OUT=${1:?output directory}; LIB=$(realpath "${2:?ferroccl libnccl.so}"); NT=$(realpath "${3:?nccl-tests build dir}")
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
N=${GPUS:-$(nvidia-smi -L | grep -c '^GPU ')}
DEADLINE=${DEADLINE:-0}; T0=$(date +%s)
SUM="$OUT/nccl-tests-summary.txt"
# A result line is "size count type redop root time algbw busbw #wrong time algbw busbw #wrong";
# the #wrong columns are the 9th (out of place) and 13th (in place; "N/A" where the op has no
# in-place form: alltoall, sendrecv) fields.
# nccl-tests prints large counts in floating point (6.71089e+07): anything but 0 and N/A counts.
wrong_lines() { awk '$1 ~ /^[0-9]+$/ && NF >= 13 && (($9 != "0" && $9 != "N/A") || ($13 != "0" && $13 != "N/A")) {n++} END {print n+0}' "$1"; }
run_one() { # op mode graph
    local t=$1 mode=$2 graph=$3 log start rc
    local extra=${NT_EXTRA:-}
    log="$OUT/nccl-tests-${t}-${mode// /}-G$graph${extra:+-${extra// /}}.log"
    # shellcheck disable=SC2206 # NT_EXTRA is words on purpose
    local args=(-b "${NT_MIN:-4}" -e "${NT_MAX:-256M}" -f 4 -c 1 -d "${NT_DTYPE:-all}" -o all -w 1 -n 2 -G "$graph" $extra)
    start=$(date +%s)
    if [ "$mode" = mpi ]; then
        # Each rank finds the library through LD_PRELOAD, passed on by mpirun.
        timeout "${RUN_CAP:-600}" mpirun --allow-run-as-root --oversubscribe -np "$N" -x LD_PRELOAD="$LIB" -x NCCL_DEBUG=INFO \
            -x NCCL_NVLS_ENABLE=0 "$NT/${t}_perf" -g 1 "${args[@]}" >"$log" 2>&1
    else
        LD_PRELOAD="$LIB" NCCL_DEBUG=INFO timeout "${RUN_CAP:-600}" "$NT/${t}_perf" $mode "${args[@]}" >"$log" 2>&1
    fi
    rc=$?
    echo "$t ${mode// /} G$graph${extra:+ $extra}: exit $rc, $(( $(date +%s) - start )) s, $(grep -c 'ferroccl .*drop-in' "$log") banner(s), $(grep -c '^ *[0-9]' "$log") result lines, $(wrong_lines "$log") with #wrong > 0, $(grep -h 'Out of bounds' "$log" | tr -s ' ')" | tee -a "$SUM"
}
modes=()
for m in ${NT_MODES:-g t mpi}; do
    case $m in
        g) modes+=("-g $N") ;;
        t) modes+=("-t $N -g 1") ;;
        mpi) command -v mpirun >/dev/null && modes+=("mpi") || echo "no mpirun: process-per-GPU mode skipped" | tee -a "$SUM" ;;
    esac
done
for graph in ${NT_GRAPHS:-0 10}; do
    for mode in "${modes[@]}"; do
        for t in ${NT_OPS:-all_reduce all_gather reduce_scatter alltoall broadcast reduce gather scatter sendrecv}; do
            if (( DEADLINE > 0 && $(date +%s) - T0 > DEADLINE )); then
                echo "$t ${mode// /} G$graph${NT_EXTRA:+ $NT_EXTRA}: not run (deadline)" | tee -a "$SUM"; continue
            fi
            run_one "$t" "$mode" "$graph"
        done
    done
done

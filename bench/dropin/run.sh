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
    bash "$HERE/nccl_tests.sh" "$OUT" "$LIB" "$NCCL_TESTS"
fi

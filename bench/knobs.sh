#!/usr/bin/env bash
# One sweep of ferroccl alone under several settings of its knobs, for tuning: the same bench
# command once per configuration, each a line of VAR=VALUE words (empty: the defaults), with
# the busbw table and the memory line of each kept in OUTDIR/<n>.log and a summary printed.
#
#   bench/knobs.sh OUTDIR BINARY "BENCH ARGS" "CONFIG" ["CONFIG" ...]
#   bench/knobs.sh out target/release/ferroccl "all -g 2 -b 32M -e 2G -f 8 -n 5 -w 2" \
#       "" "FERROCCL_GPU_P2P_CHANNELS=32"
#
# A performance claim never comes from this script: it finds what to try beside NCCL.
set -uo pipefail

out=${1:?usage: knobs.sh OUTDIR BINARY "BENCH ARGS" CONFIG...}
bin=$(realpath "${2:?binary}")
read -r -a bargs <<<"${3:?bench arguments}"
shift 3
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0

i=0
for cfg in "$@"; do
    i=$((i + 1))
    read -r -a envs <<<"$cfg"
    echo "== [$i] ${cfg:-defaults}: ferroccl bench ${bargs[*]}" | tee "$out/$i.log"
    t0=$SECONDS
    env "${envs[@]}" timeout 300 "$bin" bench "${bargs[@]}" >>"$out/$i.log" 2>&1
    rc=$?
    echo "rc=$rc seconds=$((SECONDS - t0))" >>"$out/$i.log"
    # The op headers, the rows from 16 MiB up, the memory lines.
    awk '/^# [a-z-]+$/ || /GPU memory/ || /^rc=/ || ($1 ~ /^[0-9]+$/ && $1 >= 16777216)' "$out/$i.log"
done

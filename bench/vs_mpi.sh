#!/usr/bin/env bash
# Host all-reduce, ferroccl against Open MPI: 64 MiB of float32, 2 processes on this machine,
# 5 warm-up and 20 timed iterations each, out of place, the slowest rank's time. A benchmark,
# not a test: it prints both figures and the ratio and writes a JSON record to
# target/bench/host-vs-mpi.json, or with --record to bench/results/host-vs-mpi-<date>/ (for a
# run worth keeping: the repository's results are not a scratch space).
#
# usage: bench/vs_mpi.sh [--record]   (as root where Open MPI is not installed yet)
set -euo pipefail

cd "$(dirname "$0")/.."
RECORD=0
case "${1:-}" in
    --record) RECORD=1 ;;
    "") ;;
    *) echo "usage: $0 [--record]" >&2; exit 2 ;;
esac
BYTES=$((64 << 20))
ITERS=20
WARMUP=5
NP=2

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    echo "installing Open MPI (Debian packages)" >&2
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y openmpi-bin libopenmpi-dev
fi

cargo build --release -p ferroccl-cli
mkdir -p target/bench bench/results
mpicc -O2 -o target/bench/mpi_allreduce bench/mpi_allreduce.c

# mpirun refuses root without the flag; --oversubscribe lets 2 ranks run on fewer slots
# than Open MPI counts (it counts cores, and may see only one in a container).
MPI_CMD=(mpirun --allow-run-as-root --oversubscribe -np "$NP" target/bench/mpi_allreduce "$BYTES" "$ITERS" "$WARMUP")
FCCL_JSON=target/bench/ferroccl-allreduce.json
FCCL_CMD=(target/release/ferroccl run -n "$NP" target/release/ferroccl bench all-reduce
          -b "$BYTES" -e "$BYTES" -d float -n "$ITERS" -w "$WARMUP" --json "$FCCL_JSON")

echo "+ ${MPI_CMD[*]}" >&2
# Captured, then echoed to stderr: `tee /dev/stderr` reopens stderr's file and truncates a log
# that stderr is redirected to.
mpi_out=$("${MPI_CMD[@]}")
printf '%s\n' "$mpi_out" >&2
mpi_line=$(grep '^mpi_allreduce ' <<<"$mpi_out")
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }
mpi_time=$(field time_us "$mpi_line")
mpi_algbw=$(field algbw "$mpi_line")
mpi_busbw=$(field busbw "$mpi_line")
mpi_wrong=$(field wrong "$mpi_line")

echo "+ ${FCCL_CMD[*]}" >&2
fccl_out=$("${FCCL_CMD[@]}")
printf '%s\n' "$fccl_out" >&2
# The table row of this size: size count type redop root | time algbw busbw #wrong | in place.
read -r fccl_time fccl_algbw fccl_busbw fccl_ip_time fccl_ip_busbw < <(
    awk -v b="$BYTES" '$1 == b { print $6, $7, $8, $10, $12 }' <<<"$fccl_out")

ratio=$(awk -v f="$fccl_busbw" -v m="$mpi_busbw" 'BEGIN { printf "%.2f", (m > 0 ? f / m : 0) }')

printf '\nall-reduce, %d MiB float32, %d processes, out of place (slowest rank, %d iterations):\n' $((BYTES >> 20)) "$NP" "$ITERS"
printf '  %-10s %12s %12s %12s\n' "" "time (us)" "algbw (GB/s)" "busbw (GB/s)"
printf '  %-10s %12s %12s %12s\n' "ferroccl" "$fccl_time" "$fccl_algbw" "$fccl_busbw"
printf '  %-10s %12s %12s %12s\n' "Open MPI" "$mpi_time" "$mpi_algbw" "$mpi_busbw"
printf '  ferroccl / Open MPI busbw: %sx   (ferroccl in place: %s us, %s GB/s)\n' "$ratio" "$fccl_ip_time" "$fccl_ip_busbw"

if [ "$RECORD" = 1 ]; then
    out=bench/results/host-vs-mpi-$(date -u +%Y-%m-%d)/host-vs-mpi.json
else
    out=target/bench/host-vs-mpi.json
fi
mkdir -p "$(dirname "$out")"
jstr() { printf '"%s"' "$(sed 's/\\/\\\\/g; s/"/\\"/g' <<<"$1")"; }
{
    printf '{\n'
    printf '  "benchmark": "host all-reduce, ferroccl vs Open MPI",\n'
    printf '  "date": %s,\n' "$(jstr "$(date -u +%Y-%m-%dT%H:%M:%SZ)")"
    printf '  "commit": %s,\n' "$(jstr "$(git rev-parse HEAD 2>/dev/null || echo unknown)")"
    printf '  "machine": {"hostname": %s, "cpu": %s, "cores": %s, "kernel": %s},\n' \
        "$(jstr "$(hostname)")" \
        "$(jstr "$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)")" \
        "$(nproc)" "$(jstr "$(uname -r)")"
    printf '  "bytes": %d, "dtype": "float32", "op": "sum", "nranks": %d, "iters": %d, "warmup": %d,\n' "$BYTES" "$NP" "$ITERS" "$WARMUP"
    printf '  "mpi": {"command": %s, "version": %s, "time_us": %s, "algbw_gbs": %s, "busbw_gbs": %s, "wrong": %s},\n' \
        "$(jstr "${MPI_CMD[*]}")" "$(jstr "$(mpirun --version 2>&1 | head -1)")" "$mpi_time" "$mpi_algbw" "$mpi_busbw" "$mpi_wrong"
    printf '  "ferroccl": {"command": %s, "time_us": %s, "algbw_gbs": %s, "busbw_gbs": %s, "in_place_time_us": %s, "in_place_busbw_gbs": %s},\n' \
        "$(jstr "${FCCL_CMD[*]}")" "$fccl_time" "$fccl_algbw" "$fccl_busbw" "$fccl_ip_time" "$fccl_ip_busbw"
    printf '  "ferroccl_over_mpi_busbw": %s,\n' "$ratio"
    printf '  "ferroccl_report": '
    cat "$FCCL_JSON"
    printf '}\n'
} >"$out"
echo "wrote $out" >&2

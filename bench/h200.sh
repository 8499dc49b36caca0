#!/usr/bin/env bash
# ferroccl against NCCL on one GPU machine, in one go: every operation, float32 and bfloat16,
# 8 B to 2 GiB, the three launch modes (one thread driving every GPU, a thread per GPU, a
# process per GPU), without and with CUDA graphs, with registered buffers (NCCL's symmetric
# windows, ferroccl's windows) and on cuMemAlloc buffers (cudaMalloc's, lent by CUDA IPC handles),
# so that each cell can be compared with NCCL's best; plus a
# short checked pass in which both libraries' outputs are verified element by element. Writes one JSON record and one log per
# run, and SVG plots (each run's, and each library's best size by size: best-float.svg,
# best-bfloat16.svg), into OUTDIR. Fits in 10 minutes on 4 x H200 (the iteration budget gives
# large sizes fewer iterations; a run that would pass the deadline is cut short and named).
#
# Needs no Rust: copy the release binary over (target/release/ferroccl) and run
#   bench/h200.sh OUTDIR [path/to/ferroccl]
# NCCL: the Python package nvidia-nccl's library when there is one (the newest on the lent
# hosts), else as `ferroccl bench --vs-nccl` finds it (the loader's libnccl.so.2);
# NCCL=/path/to/libnccl.so.2 overrides. GPUS (default: all
# visible, at most 8), TOTAL (seconds, default 570) and FACTOR (size step, default 2) adjust it;
# ANCHOR=path/to/torch_symm_allreduce.py runs that anchor right after, outside the deadline
# (up to 300 s more: with TOTAL=280 both fit one 10-minute call); SKIP="check procs-reg ..."
# leaves out the runs it names. The last two runs time every power of 2 whatever FACTOR is, on
# registered buffers in CUDA graphs, where NCCL's symmetric kernels give its best small
# operations: ar-latency-graph all-reduce from 8 B to 8 MiB (the latency table's 64 KiB, 1 MiB and
# 4 MiB rows), small-graph every other op from 8 B to 1 MiB, float32 (the latency issue's rows).
set -euo pipefail

OUT=${1:?usage: bench/h200.sh OUTDIR [ferroccl binary]}
here=$(cd "$(dirname "$0")" && pwd)
BIN=${2:-}
if [[ -z $BIN ]]; then
    for c in "$here/../target/release/ferroccl" "$here/ferroccl" "$(command -v ferroccl || true)"; do
        [[ -n $c && -x $c ]] && { BIN=$c; break; }
    done
fi
[[ -n $BIN && -x $BIN ]] || { echo "h200.sh: no ferroccl binary (pass its path as the second argument)" >&2; exit 2; }
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")

if [[ -z ${GPUS:-} ]]; then
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    (( GPUS > 8 )) && GPUS=8
fi
(( GPUS >= 2 )) || { echo "h200.sh: needs at least 2 GPUs (found ${GPUS:-0})" >&2; exit 2; }
TOTAL=${TOTAL:-570}
# Never NVLink multicast on these hosts; ferroccl bench refuses anything but 0.
export NCCL_NVLS_ENABLE=0
# NCCL's best is the newest NCCL on the machine: on the lent hosts the Python package's (2.28.9)
# is newer than the system's (2.28.3), which the loader would find first. NCCL=... overrides.
if [[ -z ${NCCL:-} ]]; then
    pkg=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
    [[ -n $pkg && -e $pkg ]] && NCCL=$pkg
fi
VS=(--vs-nccl ${NCCL:+"$NCCL"})

mkdir -p "$OUT"
# What this script says (which runs failed and why) goes into OUTDIR too: a run's own log is
# empty when it dies before its first line.
exec > >(tee -a "$OUT/h200.log") 2>&1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

SWEEP=(all -b 8 -e 2G -f "${FACTOR:-2}" -d float,bfloat16 -n 20 -w 5)
# Eager rows: at most 4 GiB of data per half (2 GiB: 2 iterations); graphs replay 4 times, so
# they get half that.
EAGER=(--iter-budget 4G)
GRAPH=(--graph 4 --iter-budget 2G)

runs=(
    "check|threads, checked to 1 MiB|bench all -b 8 -e 1M -f 4 -d float,bfloat16 -n 2 -w 1 --check -g $GPUS"
    "onethread|one thread, host launches|bench ${SWEEP[*]} ${EAGER[*]} -g $GPUS --one-thread"
    "threads|a thread per GPU, host launches|bench ${SWEEP[*]} ${EAGER[*]} -g $GPUS"
    "procs|a process per GPU, host launches|run -n $GPUS $BIN bench ${SWEEP[*]} ${EAGER[*]} -g 1"
    "onethread-graph|one thread, CUDA graphs|bench ${SWEEP[*]} ${GRAPH[*]} -g $GPUS --one-thread"
    "threads-graph|a thread per GPU, CUDA graphs|bench ${SWEEP[*]} ${GRAPH[*]} -g $GPUS"
    "procs-graph|a process per GPU, CUDA graphs|run -n $GPUS $BIN bench ${SWEEP[*]} ${GRAPH[*]} -g 1"
    # Buffers from cuMemAlloc, as cudaMalloc and PyTorch's default allocator give them: nothing
    # ferroccl can lend its peers, so its zero-copy paths are off (docs/PERFORMANCE.md section 44).
    "procs-driver-graph|a process per GPU, cuMemAlloc buffers, CUDA graphs|run -n $GPUS $BIN bench ${SWEEP[*]} ${GRAPH[*]} -g 1 --buffers driver"
    # Registered buffers: NCCL's symmetric windows (its fastest small kernels), ferroccl's windows
    # (a process per GPU: copies between windows need ranks in processes of their own).
    "procs-reg|a process per GPU, registered windows, host launches|run -n $GPUS $BIN bench ${SWEEP[*]} ${EAGER[*]} -g 1 --register"
    "procs-reg-graph|a process per GPU, registered windows, CUDA graphs|run -n $GPUS $BIN bench ${SWEEP[*]} ${GRAPH[*]} -g 1 --register"
    "ar-latency-graph|all-reduce at every power of 2 to 8 MiB, a process per GPU, registered, CUDA graphs|run -n $GPUS $BIN bench all-reduce -b 8 -e 8M -f 2 -d float,bfloat16 -n 20 -w 5 ${GRAPH[*]} -g 1 --register"
    "small-graph|every op at every power of 2 to 1 MiB, a process per GPU, registered, CUDA graphs|run -n $GPUS $BIN bench all -b 8 -e 1M -f 2 -d float -n 20 -w 5 ${GRAPH[*]} -g 1 --register"
)

echo "# ferroccl vs NCCL on $GPUS GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
echo "# binary $BIN ($("$BIN" --version)); results in $OUT; deadline ${TOTAL}s"
echo "# NCCL: ${NCCL:-as the loader finds it}"
# The kernels' first compile (NVRTC, about a minute on a fresh machine; cached on disk after)
# happens here, outside every run's share of the deadline, so that the checked pass's 60 s are
# its own.
timeout 300 "$BIN" bench all-reduce -b 8 -e 8 -n 1 -w 1 -g "$GPUS" >"$OUT/warm.log" 2>&1 \
    && echo "# kernels compiled and cached (at $(elapsed) s)" \
    || echo "# warm-up failed (exit $?): see $OUT/warm.log"
failed=()
i=0
for r in "${runs[@]}"; do
    i=$((i + 1))
    IFS='|' read -r name what cmd <<<"$r"
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        echo "[$i/${#runs[@]}] $name: left out (SKIP)"
        continue
    fi
    # 20 s stay for the plots, 10 s for each run still to come.
    left=$(( TOTAL - $(elapsed) - 20 - 10 * (${#runs[@]} - i) ))
    # No run may starve the ones after it (each takes well under this on 4 x H200).
    if [[ $name == check ]]; then cap=60; else cap=150; fi
    (( left > cap )) && left=$cap
    if (( left < 20 )); then
        echo "[$i/${#runs[@]}] $name: skipped, the deadline is near ($(elapsed) s)"
        failed+=("$name (skipped)")
        continue
    fi
    echo "[$i/${#runs[@]}] $name: $what (at $(elapsed) s, at most $left s)"
    # shellcheck disable=SC2206
    args=($cmd)
    json=("--json" "$OUT/$name.json")
    set +e
    # The launcher form passes the bench options through to every rank.
    timeout --signal=INT --kill-after=15 "$left" "$BIN" "${args[@]}" "${VS[@]}" "${json[@]}" >"$OUT/$name.log" 2>&1
    rc=$?
    set -e
    grep -E '^# (Avg bus|GPU memory, rank 0|Wrong|NCCL )' "$OUT/$name.log" | sed 's/^/    /' || true
    if (( rc != 0 )); then
        echo "    FAILED (exit $rc; $( ((rc == 124)) && echo 'out of time' || tail -n 2 "$OUT/$name.log" | tr '\n' ' '))"
        failed+=("$name (exit $rc)")
    fi
done

jsons=()
for f in "$OUT"/*.json; do [[ -e $f ]] && jsons+=("$f"); done
if (( ${#jsons[@]} > 0 )); then
    eager=(); graph=()
    for f in "${jsons[@]}"; do
        case $f in *-graph.json) graph+=("$f") ;; */check.json) ;; *) eager+=("$f") ;; esac
    done
    (( ${#eager[@]} )) && "$BIN" plot "${eager[@]}" -o "$OUT/host-launches.svg"
    (( ${#graph[@]} )) && "$BIN" plot "${graph[@]}" -o "$OUT/cuda-graphs.svg"
    for f in "${eager[@]}" "${graph[@]}"; do "$BIN" plot "$f" -o "${f%.json}.svg" >/dev/null; done
    # Each library's best at every size over every run and both halves (the README's plot).
    for t in float bfloat16; do "$BIN" plot --best -d "$t" "${jsons[@]}" -o "$OUT/best-$t.svg" >/dev/null; done
fi
# PyTorch's SymmetricMemory beside NCCL on the same machine, right after (the bandwidth and
# latency issues ask for it): ANCHOR=path/to/torch_symm_allreduce.py (shared/anchors/).
if [[ -n ${ANCHOR:-} ]]; then
    echo "# anchor: $ANCHOR (at $(elapsed) s)"
    # It writes its JSON record into $OUT, which must exist.
    mkdir -p "$OUT/torch-symm"
    if ! OUT="$OUT/torch-symm" timeout 300 python3 "$ANCHOR" >"$OUT/torch-symm.log" 2>&1; then
        failed+=("torch-symm anchor (see torch-symm.log)")
    fi
fi
echo "# done in $(elapsed) s; files in $OUT"
if (( ${#failed[@]} )); then
    echo "# not complete: ${failed[*]}"
    exit 1
fi

#!/usr/bin/env bash
# Correctness sweep on GPUs: every operation, every type, every reduction (pre-mul-sum
# included), in place and out of place, 8 B to 1 GiB (x4 per row), every element of every
# output checked after every iteration, in the three launch modes (a thread per GPU, one thread
# driving every GPU, a process per GPU under `ferroccl run`), on 2 and on 4 GPUs.
#
# Runs on the GPU machine with a release binary copied over (no Rust there):
#   bench/check_sweep.sh OUTDIR [FERROCCL_BINARY] [GPU_COUNTS]
# CHECK_EXTRA adds arguments to every run (CHECK_EXTRA=--register: registered windows, zero-copy).
# Writes one bench JSON per (GPU count, mode), their logs, and OUTDIR/check-summary.json.
set -uo pipefail

out=${1:?usage: check_sweep.sh OUTDIR [BINARY] [GPU_COUNTS]}
bin=$(realpath "${2:-target/release/ferroccl}")
counts=${3:-"2 4"}
mkdir -p "$out"
# Never NVLink multicast on the shared machines.
export NCCL_NVLS_ENABLE=0
sweep=(all -b 8 -e 1G -f 4 -d all -o all --check -n 1 -w 1 ${CHECK_EXTRA:-})

run() { # name, command...
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name: $*"
    timeout 900 "$@" --json "$out/check-$name.json" >"$out/check-$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/check-times.txt"
}

for n in $counts; do
    devs=$(seq -s, 0 $((n - 1)))
    CUDA_VISIBLE_DEVICES=$devs run "g$n-threads" "$bin" bench "${sweep[@]}" -g "$n"
    CUDA_VISIBLE_DEVICES=$devs run "g$n-onethread" "$bin" bench "${sweep[@]}" -g "$n" --one-thread
    CUDA_VISIBLE_DEVICES=$devs run "g$n-processes" "$bin" run -n "$n" "$bin" bench "${sweep[@]}" -g 1
done

python3 - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
runs = []
for path in sorted(glob.glob(os.path.join(out, "check-g*.json"))):
    with open(path) as f:
        j = json.load(f)
    rows = j["rows"]
    runs.append({
        "file": os.path.basename(path),
        "mode": j.get("mode"),
        "nranks": j.get("nranks"),
        "rows": len(rows),
        "results_checked": sum(1 + (r.get("in_place") is not None) for r in rows),
        "ops": sorted({r["op"] for r in rows}),
        "largest_bytes": max(r["size"] for r in rows) if rows else 0,
        "wrong": j.get("wrong"),
        "commit": j.get("commit"),
        "command": " ".join(j.get("command", [])),
    })
times = open(os.path.join(out, "check-times.txt")).read().split("\n") if os.path.exists(os.path.join(out, "check-times.txt")) else []
summary = {"runs": runs, "times": [t for t in times if t], "total_wrong": sum((r["wrong"] or 0) for r in runs),
           "machine": json.load(open(glob.glob(os.path.join(out, "check-g*.json"))[0])).get("machine") if runs else None}
with open(os.path.join(out, "check-summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
for r in runs:
    print(f'{r["file"]}: {r["rows"]} rows, {r["results_checked"]} results, ops {len(r["ops"])}, up to {r["largest_bytes"]} B, wrong {r["wrong"]}')
print("total wrong:", summary["total_wrong"])
EOF

#!/usr/bin/env python3
"""Best of several `ferroccl bench --vs-nccl` records, cell by cell: for each op, type and size,
each library's best time (and bus bandwidth) over every record given and both halves (in and
out of place), which record gave it, and ferroccl's best over NCCL's best as a ratio.

    python3 bench/best_of.py DIR_OR_JSON... [--dtype float] [--redop sum] [--md] [--json OUT.json]

A cell compares the two libraries only where both were measured in the same records; a
record's NCCL is whatever it names in its `nccl` field (the newest on the machine for
bench/h200.sh). Records may be gzipped. Reductions count with one reduction (`--redop`, Sum by
default), halves a check found wrong never count, and records of different rank counts are
refused.
"""
import argparse, glob, gzip, json, os, sys

SIZES_MD = [8, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20, 128 << 20, 512 << 20, 2 << 30]


def load(paths):
    recs = []
    for p in paths:
        files = sorted(glob.glob(os.path.join(p, "*.json")) + glob.glob(os.path.join(p, "*.json.gz"))) if os.path.isdir(p) else [p]
        for f in files:
            opener = gzip.open if f.endswith(".gz") else open
            with opener(f, "rt") as h:
                j = json.load(h)
            if "rows" in j and j.get("tool", "").endswith("--vs-nccl"):
                recs.append((os.path.basename(f).split(".json")[0], j))
    return recs


def best(recs, dtype, redop="sum"):
    """Per (op, size), each library's least time over the records and both halves: rows of
    `dtype` only, reductions of `redop` only (the movement kinds' "none" always), halves a check
    found wrong left out."""
    cells = {}
    for name, j in recs:
        for r in j["rows"]:
            if r["dtype"] != dtype or "nccl" not in r or r.get("redop", "none") not in (redop, "none"):
                continue
            key = (r["op"], r["size"])
            c = cells.setdefault(key, {"ferroccl": None, "nccl": None})
            for lib in ("ferroccl", "nccl"):
                for half in ("out_of_place", "in_place"):
                    m = (r.get(lib) or {}).get(half)
                    if not m or m.get("time_us") is None or (m.get("wrong") or 0) > 0:
                        continue
                    if c[lib] is None or m["time_us"] < c[lib]["time_us"]:
                        c[lib] = {"time_us": m["time_us"], "busbw": m["busbw"], "record": name, "half": half,
                                  "blocks": (r.get(lib) or {}).get("blocks")}
    return cells


def fmt(c, size):
    if c is None:
        return "-"
    return f"{c['time_us']:.1f}" if size <= 512 << 10 else f"{c['busbw']:.0f}"


def md_cell(c, size):
    """ferroccl / NCCL, ferroccl in bold where it is ahead (time up to 512 KiB, busbw above)."""
    f, n = c["ferroccl"], c["nccl"]
    ahead = f and n and (f["time_us"] <= n["time_us"] if size <= 512 << 10 else f["busbw"] >= n["busbw"])
    mine = fmt(f, size)
    return f"{'**' + mine + '**' if ahead else mine} / {fmt(n, size)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--dtype", default="float")
    ap.add_argument("--redop", default="sum", help="the reduction of the reducing kinds' cells")
    ap.add_argument("--md", action="store_true", help="a markdown table: ferroccl / NCCL, us to 512 KiB, GB/s above, ferroccl bold where ahead")
    ap.add_argument("--json")
    a = ap.parse_args()
    recs = load(a.paths)
    if not recs:
        sys.exit("best_of.py: no --vs-nccl records")
    ranks = sorted({j.get("nranks") for _, j in recs}, key=str)
    if len(ranks) > 1:
        sys.exit(f"best_of.py: the records hold different rank counts ({ranks}); give one count's records")
    cells = best(recs, a.dtype, a.redop)
    ops = list(dict.fromkeys(op for op, _ in sorted(cells, key=lambda k: k[1])))
    if a.json:
        out = [{"op": op, "size": s, "dtype": a.dtype, **c,
                "ratio": (c["nccl"]["time_us"] / c["ferroccl"]["time_us"]) if c["ferroccl"] and c["nccl"] else None}
               for (op, s), c in sorted(cells.items())]
        with open(a.json, "w") as h:
            json.dump({"records": [n for n, _ in recs], "cells": out}, h, indent=1)
    if a.md:
        print("| op | " + " | ".join(size_str(s) for s in SIZES_MD) + " |")
        print("|---|" + "---|" * len(SIZES_MD))
        for op in ops:
            row = []
            for s in SIZES_MD:
                c = cells.get((op, s))
                row.append("-" if c is None else md_cell(c, s))
            print(f"| {op} | " + " | ".join(row) + " |")
        return
    print(f"# best of {len(recs)} records ({', '.join(n for n, _ in recs)}), {a.dtype}; ratio = NCCL time / ferroccl time")
    print(f"{'op':15} {'size':>10} {'ferroccl us':>12} {'GB/s':>7} {'NCCL us':>10} {'GB/s':>7} {'ratio':>6}  ferroccl's best from / NCCL's")
    for (op, s), c in sorted(cells.items(), key=lambda kv: (ops.index(kv[0][0]), kv[0][1])):
        f, n = c["ferroccl"], c["nccl"]
        if not f or not n:
            continue
        print(f"{op:15} {size_str(s):>10} {f['time_us']:12.2f} {f['busbw']:7.1f} {n['time_us']:10.2f} {n['busbw']:7.1f} {n['time_us'] / f['time_us']:6.2f}  {f['record']} / {n['record']}")


def size_str(s):
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if s >= 1 << k and s % (1 << k) == 0:
            return f"{s >> k} {unit}"
    return f"{s} B"


if __name__ == "__main__":
    main()

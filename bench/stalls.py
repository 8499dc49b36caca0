#!/usr/bin/env python3
"""Rows of `ferroccl bench` records that one stalled operation made slow: for each library, half
(in and out of place), op, type and reduction, a row whose time is over FACTOR times both of its
size neighbours' (and over FLOOR us) is counted as a stall. A stall of a few milliseconds in one
of a row's iterations reads so (docs/PERFORMANCE.md, section 23).

    python3 bench/stalls.py DIR_OR_JSON... [--factor 10] [--floor 50] [--by-dir]

Directories are searched recursively; records may be gzipped, and a file may bundle several
records by name (`{"records": {name: record}}`). Prints every stalled row (with its
size over its time in GB/s), then the count of rows and stalls for each library (and each
directory with --by-dir).
"""
import argparse, collections, glob, gzip, json, os


def files(paths):
    for p in paths:
        if os.path.isdir(p):
            for pat in ("**/*.json", "**/*.json.gz"):
                yield from sorted(glob.glob(os.path.join(p, pat), recursive=True))
        else:
            yield p


def records_of(path):
    """(label, rows) of each bench record in `path`: a record, or a bundle of records by name
    (`{"records": {"name": record, ...}}`, as bench/results keeps many small runs in one file)."""
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(d, dict):
        return []
    if isinstance(d.get("records"), dict):
        return [(f"{path}#{name}", r.get("rows", [])) for name, r in d["records"].items() if isinstance(r, dict)]
    return [(path, d.get("rows", []))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--floor", type=float, default=50.0)
    ap.add_argument("--by-dir", action="store_true")
    a = ap.parse_args()
    counts = collections.Counter()
    for label, rows in (rec for path in files(a.paths) for rec in records_of(path)):
        path = label
        where = os.path.dirname(label.split("#")[0]) if a.by_dir else ""
        series = collections.defaultdict(list)
        for r in rows:
            for lib in ("ferroccl", "nccl"):
                # A record of ferroccl alone (no --vs-nccl) keeps its halves in the row itself.
                side = r.get(lib) if ("ferroccl" in r or "nccl" in r) else (r if lib == "ferroccl" else None)
                for half in ("out_of_place", "in_place"):
                    t = ((side or {}).get(half) or {}).get("time_us")
                    if isinstance(t, (int, float)):
                        key = (lib, half, r.get("op"), r.get("dtype"), r.get("redop"))
                        series[key].append((r.get("size") or 0, t))
        for (lib, half, op, dtype, redop), pts in series.items():
            pts.sort()
            for i, (size, t) in enumerate(pts):
                counts[(where, lib, "rows")] += 1
                nb = [pts[j][1] for j in (i - 1, i + 1) if 0 <= j < len(pts)]
                if nb and t > a.floor and t > a.factor * max(nb):
                    counts[(where, lib, "stalls")] += 1
                    # The bytes over the time: a row whose every operation ran slow reads at
                    # about the same rate whatever its size (the line rounds' 0.7-0.9 GB/s,
                    # docs/PERFORMANCE.md section 24); one long stall reads lower as rows shrink.
                    print(f"{path}: {lib} {op} {dtype} {redop} {size} B {half}: {t:.1f} us (neighbours {', '.join(f'{x:.1f}' for x in nb)}; {size / t / 1e3:.2f} GB/s)")
    for where in sorted({k[0] for k in counts}):
        for lib in ("ferroccl", "nccl"):
            n, s = counts[(where, lib, "rows")], counts[(where, lib, "stalls")]
            if n:
                print(f"{where or 'all'}: {lib}: {s} stalled rows of {n}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Puts the runs of one `bench/knobs.sh` directory side by side: one column per setting, the best
(lowest) time of each setting's runs per op and size, in and out of place together, with every
run's figure after it. Settings given more than once (alternated, to see the noise) are merged.

    python3 bench/knobs_table.py OUTDIR [--min-bytes N] [--max-bytes N] [--ops a,b]

A performance claim never comes from this table: it finds what to measure beside NCCL.
"""
import argparse
import glob
import os
import re
import sys


def parse_log(path):
    """(setting, {(op, size): [time_us]}) of one knobs.sh log."""
    setting, rows, op = None, {}, None
    with open(path) as f:
        for line in f:
            m = re.match(r"^== \[\d+\] (.*): ferroccl bench ", line)
            if m:
                setting = m.group(1)
                continue
            m = re.match(r"^# ([a-z-]+)$", line.strip())
            if m:
                op = m.group(1)
                continue
            p = line.split()
            if not p or not p[0].isdigit() or op is None or len(p) < 6:
                continue
            times = []
            # size count type redop root time algbw busbw #wrong [time algbw busbw #wrong]
            for i in (5, 9):
                try:
                    times.append(float(p[i]))
                except (IndexError, ValueError):
                    pass
            if times:
                rows[(op, int(p[0]))] = min(times)
    return setting, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--min-bytes", type=int, default=0)
    ap.add_argument("--max-bytes", type=int, default=1 << 62)
    ap.add_argument("--ops", default="")
    a = ap.parse_args()
    logs = sorted(glob.glob(os.path.join(a.outdir, "*.log")),
                  key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
    if not logs:
        sys.exit(f"knobs_table: no logs in {a.outdir}")
    settings, runs = [], {}
    for path in logs:
        setting, rows = parse_log(path)
        if setting is None:
            continue
        if setting not in runs:
            settings.append(setting)
            runs[setting] = []
        runs[setting].append(rows)
    ops = set(filter(None, a.ops.split(",")))
    keys = sorted({k for rs in runs.values() for r in rs for k in r},
                  key=lambda k: (k[0], k[1]))
    print("| op | bytes | " + " | ".join(settings) + " |")
    print("|---|---|" + "---|" * len(settings))
    for k in keys:
        if (ops and k[0] not in ops) or not a.min_bytes <= k[1] <= a.max_bytes:
            continue
        cells = []
        for s in settings:
            v = [r[k] for r in runs[s] if k in r]
            cells.append("%.2f (%s)" % (min(v), " / ".join("%.2f" % x for x in v)) if v else "-")
        print(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Checks of bench/best_of.py on synthetic records (run by .ci/run): each library's best time
over records and halves, one reduction only, halves checked wrong left out, rank counts never
mixed."""
import json, os, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import best_of  # noqa: E402


def half(t, wrong=None):
    return {"time_us": t, "busbw": 1000.0 / t, "wrong": wrong}


def row(op, redop, size, f, n, f_in=None, n_in=None, dtype="float"):
    return {"op": op, "redop": redop, "size": size, "dtype": dtype,
            "ferroccl": {"out_of_place": f, "in_place": f_in}, "nccl": {"out_of_place": n, "in_place": n_in}}


def record(rows, nranks=2):
    return {"tool": "ferroccl bench --vs-nccl", "nranks": nranks, "rows": rows}


def main():
    a = record([
        row("all-reduce", "sum", 8, half(3.0), half(4.0), f_in=half(2.5)),
        # A faster half a check found wrong never counts; another reduction neither.
        row("all-reduce", "sum", 1024, half(1.0, wrong=7), half(6.0)),
        row("all-reduce", "max", 8, half(1.0), half(1.0)),
        row("all-gather", "none", 8, half(5.0), half(3.0)),
        row("all-reduce", "sum", 8, half(0.5), half(0.5), dtype="bfloat16"),
    ])
    b = record([
        row("all-reduce", "sum", 1024, half(5.0), half(4.5), n_in=half(4.0)),
        row("all-gather", "none", 8, half(2.0), half(3.5)),
    ])
    cells = best_of.best([("a", a), ("b", b)], "float")
    got = {k: (c["ferroccl"]["time_us"], c["ferroccl"]["record"], c["ferroccl"]["half"], c["nccl"]["time_us"])
           for k, c in cells.items()}
    want = {
        ("all-reduce", 8): (2.5, "a", "in_place", 4.0),
        ("all-reduce", 1024): (5.0, "b", "out_of_place", 4.0),
        ("all-gather", 8): (2.0, "b", "out_of_place", 3.0),
    }
    assert got == want, f"best: {got}"
    # Max instead of Sum: the Max row, and the movement kinds as before.
    cells = best_of.best([("a", a), ("b", b)], "float", "max")
    assert cells[("all-reduce", 8)]["ferroccl"]["time_us"] == 1.0 and ("all-reduce", 1024) not in cells
    assert cells[("all-gather", 8)]["ferroccl"]["time_us"] == 2.0
    # Records of different rank counts are refused, naming both counts.
    with tempfile.TemporaryDirectory() as d:
        for name, rec in (("a.json", a), ("c.json", record(b["rows"], nranks=4))):
            with open(os.path.join(d, name), "w") as h:
                json.dump(rec, h)
        p = subprocess.run([sys.executable, os.path.join(HERE, "best_of.py"), d, "--md"], capture_output=True, text=True)
        assert p.returncode != 0 and "rank counts" in p.stderr and "2" in p.stderr and "4" in p.stderr, p
        os.remove(os.path.join(d, "c.json"))
        p = subprocess.run([sys.executable, os.path.join(HERE, "best_of.py"), d, "--md"], capture_output=True, text=True)
        assert p.returncode == 0 and "| all-reduce | **2.5** / 4.0 |" in p.stdout, p
    print("best_of.py: ok")


if __name__ == "__main__":
    main()

# Reads run.sh's records: every check passed on both libraries, ferroccl's runs loaded ferroccl's
# library (and NVIDIA's runs did not), and the DDP runs ended with the same parameters on both.
# Usage: python3 compare.py OUT /path/to/ferroccl/libnccl.so
import json, os, sys

out, ours = sys.argv[1], os.path.realpath(sys.argv[2])
bad, summary = [], {}
def load(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        bad.append(f"{name}: missing"); return []
    recs = [json.loads(l) for l in open(path) if l.startswith("{")]
    if not recs: bad.append(f"{name}: no records")
    return recs
for lib in ("nvidia", "ferroccl"):
    for what in ("torch", "cupy"):
        recs = load(f"{what}-{lib}.jsonl")
        for r in recs:
            who = f"{what}-{lib} {r.get('part', '')} rank {r.get('rank', '-')}"
            failed = [k for k, v in r["checks"].items() if not v]
            if failed: bad.append(f"{who}: wrong: {failed}")
            loaded = [os.path.realpath(p) for p in r["libnccl"]]
            if (ours in loaded) != (lib == "ferroccl"): bad.append(f"{who}: loaded {loaded}")
        summary[f"{what}-{lib}"] = {"records": len(recs), "checks": sum(len(r["checks"]) for r in recs),
                                    "destroy_s": max((r.get("destroy_s", 0) for r in recs), default=None),
                                    "init_s": max((r.get("init_s", 0) for r in recs), default=None)}
ddp = {lib: sorted({r["ddp"]["params_sha256"] for r in load(f"torch-{lib}.jsonl")}) for lib in ("nvidia", "ferroccl")}
summary["ddp_params_sha256"] = ddp
if len(ddp["ferroccl"]) != 1: bad.append(f"ferroccl's DDP ranks disagree: {ddp['ferroccl']}")
if ddp["nvidia"] != ddp["ferroccl"]: bad.append(f"DDP parameters differ between the libraries: {ddp}")
summary["problems"] = bad
print(json.dumps(summary, indent=1))
sys.exit(1 if bad else 0)

"""Sums an `ncu --csv --metrics gpu__time_duration.sum` log by kernel name.

    python3 scripts/ncu-summary.py ncu.csv [top] [launches]

Prints each kernel's launch count, total and mean time and share of the whole,
largest first: the per-op profile of whatever ran under ncu. With `launches`
(comma-separated name prefixes, e.g. `badd,cast`), then every launch of those
kernels in launch order with its grid, block and time, so a profile can say
which op each launch was (its place among the GEMMs, its size from the grid).
"""
import csv
import sys
from collections import defaultdict


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    wanted = [w for w in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if w]
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    rows = csv.DictReader(lines)
    total = defaultdict(float)
    count = defaultdict(int)
    launches = []
    for i, r in enumerate(rows):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0][:90]
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-6, "nsecond": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}.get(unit, 1e-6)
        total[name] += v * scale
        count[name] += 1
        launches.append((r.get("ID", str(i)), name, r.get("Grid Size", "?"), r.get("Block Size", "?"), v * scale))
    all_ms = sum(total.values())
    print(f"{'kernel':90s} {'calls':>6s} {'total ms':>10s} {'mean us':>9s} {'share':>6s}")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name:90s} {count[name]:6d} {ms:10.3f} {1e3 * ms / count[name]:9.1f} {100 * ms / all_ms:5.1f}%")
    print(f"{'all kernels':90s} {sum(count.values()):6d} {all_ms:10.3f}")
    if wanted:
        print(f"\nlaunches of {', '.join(wanted)} in order (the GEMM before each named for context):")
        last_gemm = "-"
        for lid, name, grid, block, ms in launches:
            if name.startswith(("nvjet", "sm90", "cutlass", "ampere")):
                last_gemm = f"{name[:40]} #{lid}"
            if any(name.startswith(w) for w in wanted):
                print(f"  #{lid:>5} {name:28s} grid {grid:>16s} block {block:>12s} {ms:8.3f} ms  after {last_gemm}")


if __name__ == "__main__":
    main()

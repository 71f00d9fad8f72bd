#!/usr/bin/env python3
"""PyTorch CPU AdamW throughput on the same tensors as benches/adamw.rs.

Uses torch.optim.AdamW(..., fused=True) on CPU when this torch supports it
(torch >= 2.4), else foreach=True, else the default loop. Reports median and
min seconds per step, seconds per 1e8 params and GB/s at 28 bytes per param,
and writes JSON that `cargo bench --bench adamw` picks up for its summary.

    python3 benches/adamw_torch.py            # 2^23 params (quick)
    python3 benches/adamw_torch.py --full     # 1e8 params
    ADAMW_BENCH_PARAMS=100000000 python3 benches/adamw_torch.py

Environment (same meaning as in benches/adamw.rs): ADAMW_BENCH_PARAMS,
ADAMW_BENCH_SHAPE (default 4096x16384), ADAMW_BENCH_ITERS (default 10),
ADAMW_BENCH_WARMUP (default 2), ADAMW_TORCH_OUT (default
$BENCH_RESULTS_DIR/adamw_torch-<host>.json, the directory defaulting to
benches/results). Threads: torch's default
(torch.set_num_threads via ADAMW_TORCH_THREADS if set).
"""

import json
import os
import re
import socket
import statistics
import sys
import time

import torch

BYTES_PER_PARAM = 28.0


def env_int(key, default):
    v = os.environ.get(key)
    if v is None:
        return default
    return int(float(v.replace("_", "")))


def host_name():
    raw = os.environ.get("HOSTNAME") or socket.gethostname() or "unknown"
    s = re.sub(r"[^A-Za-z0-9-]", "_", raw.strip())
    return s or "unknown"


def shapes(total, rows, cols):
    """Same split as benches/adamw.rs: (rows, cols) matrices each followed by a
    rows-long bias, then a partial matrix and a last vector."""
    out, left = [], total
    while left >= rows * cols + rows:
        out += [[rows, cols], [rows]]
        left -= rows * cols + rows
    if left >= cols:
        r = left // cols
        out.append([r, cols])
        left -= r * cols
    if left > 0:
        out.append([left])
    return out


def make_optimizer(params, lr, wd):
    for kind, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("loop", {})):
        try:
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, **kw)
            opt.step()  # fused CPU support is only checked at the first step on some versions
            return kind, opt
        except (RuntimeError, TypeError, ValueError) as e:
            print(f"AdamW {kind} unavailable: {e}", file=sys.stderr)
    raise RuntimeError("no AdamW variant works")


def main():
    full = "--full" in sys.argv[1:]
    total = env_int("ADAMW_BENCH_PARAMS", 100_000_000 if full else 1 << 23)
    iters = max(1, env_int("ADAMW_BENCH_ITERS", 10))
    warmup = env_int("ADAMW_BENCH_WARMUP", 2)
    rows, cols = (int(x) for x in os.environ.get("ADAMW_BENCH_SHAPE", "4096x16384").split("x"))
    if "ADAMW_TORCH_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["ADAMW_TORCH_THREADS"]))
    host = host_name()
    results_dir = os.environ.get("BENCH_RESULTS_DIR", "benches/results")
    out = os.environ.get("ADAMW_TORCH_OUT", f"{results_dir}/adamw_torch-{host}.json")

    shp = shapes(total, rows, cols)
    params = []
    for s in shp:
        p = torch.nn.Parameter(torch.rand(s, dtype=torch.float32) * 2 - 1)
        p.grad = torch.rand(s, dtype=torch.float32) * 2 - 1
        params.append(p)
    kind, opt = make_optimizer(params, 1e-4, 0.01)
    print(
        f"torch {torch.__version__} AdamW ({kind}): {total} f32 params in {len(shp)} tensors, "
        f"{torch.get_num_threads()} threads, host {host}",
        file=sys.stderr,
    )

    with torch.no_grad():
        for _ in range(warmup):
            opt.step()
        samples = []
        for i in range(iters):
            t = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t
            print(f"  torch AdamW ({kind}) step {i}: {dt:.4f} s", file=sys.stderr)
            samples.append(dt)

    med = statistics.median(samples)
    s_per_1e8 = med * 1e8 / total
    gbs = BYTES_PER_PARAM * total / med / 1e9
    report = {
        "bench": "adamw_torch",
        "host": host,
        "torch": torch.__version__,
        "variant": kind,
        "threads": torch.get_num_threads(),
        "params": total,
        "tensors": shp,
        "dtype": "f32",
        "bytes_per_param": BYTES_PER_PARAM,
        "warmup": warmup,
        "samples_s": samples,
        "median_s": med,
        "min_s": min(samples),
        "s_per_1e8": s_per_1e8,
        "gb_per_s": gbs,
    }
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)

    print()
    print(f"torch {torch.__version__} AdamW ({kind}), {total} f32 params, {torch.get_num_threads()} threads")
    print(f"{'optimizer':<24} {'median s':>10} {'min s':>10} {'s per 1e8':>12} {'GB/s':>8}")
    print(f"{'torch AdamW ' + kind:<24} {med:>10.4f} {min(samples):>10.4f} {s_per_1e8:>12.4f} {gbs:>8.1f}")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()

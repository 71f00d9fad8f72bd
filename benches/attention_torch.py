"""PyTorch SDPA on the shapes of benches/attention.rs, for comparison in the same run.

bf16, B=1, H=16, D=128, N = 1k..16k, causal and not; the flash and cuDNN backends
of torch.nn.functional.scaled_dot_product_attention; forward and forward+backward
TFLOP/s with the same convention (forward 4*B*H*N^2*D, halved when causal;
forward+backward 3.5x forward). Median of CUDA-event timings after warm-up.

The masked peer (`--window N:W`, default 32768:4096; `--window none` skips it):
SDPA has no sliding window, so PyTorch's `flex_attention` (compiled, with a
block mask, which skips fully masked tiles) runs the bench's masked rows: a
causal window of W keys behind each query (W + 1 visible keys, as cqsa's
`window_left`) at N tokens, dense calls of W tokens, causal and not, and one
causal call of about the window's visible pairs. FLOPs are 4*B*H*D per visible
(query, key) pair, forward+backward 3.5x; `window` holds the window's time over
N / W dense calls and over the causal one, also per visible pair, as the
bench's `masked`.

The varlen peer (`--varlen DOCS:LEN`, default 8:2048; `none` skips it): the
bench's packed row (DOCS causal documents of LEN tokens in one row) as
cuDNN SDPA on the documents along the batch axis (no packing, the bound), and
as `flex_attention` on the packed row with a document mask; `varlen` holds
flex's time over cuDNN's.

    python benches/attention_torch.py [--out benches/results/attention-torch-h200.json] [--ns 1024,2048] [--d 64] [--reps 5] [--window 32768:4096] [--varlen 8:2048]
"""
import argparse
import json
import os

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_common import event_times_ms, median, warm_up

# Every flex shape compiles twice (with and without grad); past dynamo's limit
# (8) a call falls back, with one warning, to flex's unfused reference, and the
# varlen row, compiled last, measured that (1 TFLOP/s) once the window rows had
# four shapes.
torch._dynamo.config.recompile_limit = 64
if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never measure the fallback


REPS = 5


def median_ms(fn, warmup=2, reps=None):
    reps = reps or REPS
    warm_up(fn, warmup, reset_peak=False)
    return median(event_times_ms(fn, reps))


def visible_pairs(n, window, causal):
    """(query, key) pairs that a call of n tokens sees: all n^2, the causal
    triangle, or a causal window of `window` keys behind each query."""
    if window is not None:
        w = min(window, n - 1)
        return w * (w + 1) // 2 + (n - w) * (w + 1)
    return n * (n + 1) // 2 if causal else n * n


def timed_pair(call, q, k, v, g):
    """(forward ms, forward+backward ms) of `call(q, k, v)`."""
    with torch.no_grad():
        f = median_ms(lambda: call(q, k, v))

    def fb():
        q.grad = k.grad = v.grad = None
        call(q, k, v).backward(g)

    fbm = median_ms(fb)
    q.grad = k.grad = v.grad = None
    return f, fbm


def equal_work_causal_n(n, w):
    """The causal length, a multiple of w, of about the visible pairs of a causal window w at n (as the bench)."""
    pairs = n * w - w * w / 2
    return max(1, round((2 * pairs) ** 0.5 / w)) * w


def window_rows(spec, B, H, D, dt):
    """flex_attention on the bench's masked rows: (rows, ratios)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n, w = (int(x) for x in spec.split(":"))
    flex = torch.compile(flex_attention, dynamic=False)
    rows, runs = [], []
    n_equal = equal_work_causal_n(n, w)
    for mask, size, window, causal in ((f"window:{w}", n, w, True), ("none", w, None, True), ("none", w, None, False),
                                       ("none", n_equal, None, True)):
        def keep(b, h, qi, ki, window=window, causal=causal):
            ok = qi >= ki
            return ok & (qi - ki <= window) if window is not None else ok

        block = create_block_mask(keep, None, None, size, size) if causal else None
        q, k, v = (torch.randn(B, H, size, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, size, D, device="cuda", dtype=dt)
        f, fbm = timed_pair(lambda q, k, v: flex(q, k, v, block_mask=block), q, k, v, g)
        pairs = visible_pairs(size, window, causal)
        flops = 4 * B * H * D * pairs
        rows.append({"n": size, "b": B, "h": H, "d": D, "dtype": "bf16", "causal": causal, "backend": "flex",
                     "mask": mask, "visible_pairs": pairs, "fwd_ms": f, "fwd_tflops": flops / f / 1e9,
                     "fwd_bwd_ms": fbm, "fwd_bwd_tflops": 3.5 * flops / fbm / 1e9})
        runs.append((f, fbm, pairs))
        print(f"{size:>6} {str(causal):>6} {'flex':>7} | {rows[-1]['fwd_tflops']:>9.1f} {rows[-1]['fwd_bwd_tflops']:>9.1f}  mask {mask}")
    blocks = n // w

    def versus(dense, times):
        fwd, fwdbwd = runs[0][0] / (times * dense[0]), runs[0][1] / (times * dense[1])
        work = runs[0][2] / (times * dense[2])
        return {"fwd": fwd, "fwdbwd": fwdbwd, "work": work, "fwd_per_pair": fwd / work,
                "fwdbwd_per_pair": fwdbwd / work}

    ratios = {"system": "flex", "blocks": blocks, "window_over_blocks_of_dense_causal": versus(runs[1], blocks),
              "window_over_blocks_of_dense": versus(runs[2], blocks),
              "window_over_equal_work_causal": {"n": n_equal, **versus(runs[3], 1)}}
    print(f"flex: window / ({blocks} x dense {w}): causal {ratios['window_over_blocks_of_dense_causal']}, "
          f"non-causal {ratios['window_over_blocks_of_dense']}; / causal {n_equal}: "
          f"{ratios['window_over_equal_work_causal']}")
    return rows, ratios


def varlen_rows(spec, H, D, dt):
    """The bench's packed row: cuDNN batched and flex with a document mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    docs, n = (int(x) for x in spec.split(":"))
    pairs = docs * visible_pairs(n, None, True)
    flops = 4 * H * D * pairs
    doc = torch.arange(docs * n, device="cuda") // n

    def same_doc(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    block = create_block_mask(same_doc, None, None, docs * n, docs * n)
    flex = torch.compile(flex_attention, dynamic=False)

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows, times = [], {}
    for backend, b, size, call, mask in (("cudnn", docs, n, sdpa, "none"),
                                          ("flex", 1, docs * n, lambda q, k, v: flex(q, k, v, block_mask=block),
                                           f"varlen:{docs}x{n}")):
        q, k, v = (torch.randn(b, H, size, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        g = torch.randn(b, H, size, D, device="cuda", dtype=dt)
        f, fbm = timed_pair(call, q, k, v, g)
        times[backend] = (f, fbm)
        rows.append({"n": size, "b": b, "h": H, "d": D, "dtype": "bf16", "causal": True, "backend": backend,
                     "mask": mask, "visible_pairs": pairs, "fwd_ms": f, "fwd_tflops": flops / f / 1e9,
                     "fwd_bwd_ms": fbm, "fwd_bwd_tflops": 3.5 * flops / fbm / 1e9})
        print(f"{size:>6} {'True':>6} {backend:>7} | {rows[-1]['fwd_tflops']:>9.1f} {rows[-1]['fwd_bwd_tflops']:>9.1f}  "
              f"B={b} mask {mask}")
    ratio = {"fwd": times["flex"][0] / times["cudnn"][0], "fwdbwd": times["flex"][1] / times["cudnn"][1]}
    print(f"flex packed / cudnn batched: {ratio}")
    return rows, {"docs": docs, "len": n, "flex_packed_over_cudnn_batched": ratio}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benches/results/attention-torch-h200.json")
    p.add_argument("--ns", default="1024,2048,4096,8192,16384")
    p.add_argument("--d", type=int, default=128, help="head dim (benches/attention.rs: CQSA_BENCH_D)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per figure (benches/attention.rs: CQSA_BENCH_REPS)")
    p.add_argument("--window", default="32768:4096", help="masked peer N:W through flex_attention ('none' skips it)")
    p.add_argument("--varlen", default="8:2048", help="packed peer DOCS:LEN, cuDNN batched and flex ('none' skips it)")
    args = p.parse_args()
    global REPS
    REPS = args.reps
    B, H, D, dt = 1, 16, args.d, torch.bfloat16
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    print(f"{'N':>6} {'causal':>6} {'backend':>7} | {'fwd TF/s':>9} {'f+b TF/s':>9}")
    for n in [int(x) for x in args.ns.split(",")]:
        q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, n, D, device="cuda", dtype=dt)
        for causal in (False, True):
            fwd_flops = 4 * B * H * n * n * D / (2 if causal else 1)
            for name, be in backends.items():
                row = {"n": n, "b": B, "h": H, "d": D, "dtype": "bf16", "causal": causal, "backend": name}
                try:
                    with sdpa_kernel(be):
                        with torch.no_grad():
                            f = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

                        def fb():
                            # Fresh gradients each call (as cqsa's bench): no accumulation kernels.
                            q.grad = k.grad = v.grad = None
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            o.backward(g)

                        fbm = median_ms(fb)
                    row.update(fwd_ms=f, fwd_tflops=fwd_flops / f / 1e9,
                               fwd_bwd_ms=fbm, fwd_bwd_tflops=3.5 * fwd_flops / fbm / 1e9)
                    print(f"{n:>6} {str(causal):>6} {name:>7} | {row['fwd_tflops']:>9.1f} {row['fwd_bwd_tflops']:>9.1f}")
                except Exception as e:  # noqa: BLE001  (a backend may be unavailable)
                    row["error"] = str(e)[:200]
                    print(f"{n:>6} {str(causal):>6} {name:>7} | error: {row['error'][:60]}")
                rows.append(row)
                q.grad = k.grad = v.grad = None
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.window not in ("", "none"):
        try:
            masked, report["window"] = window_rows(args.window, B, H, D, dt)
            rows.extend(masked)
        except Exception as e:  # noqa: BLE001  (keep the SDPA rows when flex cannot run)
            report["window_error"] = str(e)[:500]
            print(f"flex window peer: error: {report['window_error']}")
    if args.varlen not in ("", "none"):
        try:
            packed, report["varlen"] = varlen_rows(args.varlen, H, D, dt)
            rows.extend(packed)
        except Exception as e:  # noqa: BLE001  (as above)
            report["varlen_error"] = str(e)[:500]
            print(f"varlen peer: error: {report['varlen_error']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

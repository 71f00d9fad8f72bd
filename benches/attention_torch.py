"""PyTorch SDPA on the shapes of benches/attention.rs, for comparison in the same run.

bf16, B=1, H=16, D=128, N = 1k..16k, causal and not; the flash and cuDNN backends
of torch.nn.functional.scaled_dot_product_attention; forward and forward+backward
TFLOP/s with the same convention (forward 4*B*H*N^2*D, halved when causal;
forward+backward 3.5x forward). Median of CUDA-event timings after warm-up.

    python benches/attention_torch.py [--out benches/results/attention-torch-h200.json] [--ns 1024,2048] [--d 64] [--reps 5]
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


REPS = 5


def median_ms(fn, warmup=2, reps=None):
    reps = reps or REPS
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benches/results/attention-torch-h200.json")
    p.add_argument("--ns", default="1024,2048,4096,8192,16384")
    p.add_argument("--d", type=int, default=128, help="head dim (benches/attention.rs: CQSA_BENCH_D)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per figure (benches/attention.rs: CQSA_BENCH_REPS)")
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
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""PyTorch reference for benches/gemm.rs, run in the same GPU device call: the MLP
block's GEMMs at the same shapes (bf16), as PyTorch's training step runs them
(addmm with bias for the forward, plain mm for the backward products).

    python benches/gemm_torch.py [--out benches/results/gemm-torch-h200.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F

# The CUDA-event median timer the attention reference uses (same folder).
from attention_torch import median_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benches/results/gemm-torch-h200.json")
    args = p.parse_args()
    rows = []
    for d, h, n in [(4096, 16384, 32768), (8192, 32768, 32768)]:
        r = lambda *s, scale=1.0: torch.randn(*s, device="cuda", dtype=torch.bfloat16) * scale
        x, wu, bu = r(n, d), r(h, d, scale=d**-0.5), r(h, scale=d**-0.5)
        hh, wd, bd = r(n, h), r(d, h, scale=d**-0.5), r(d, scale=d**-0.5)
        g, dz = r(n, d), r(n, h)
        cases = [
            ("fwd_up", "bias", lambda: F.linear(x, wu, bu)),
            ("fwd_up", "gelu_bias", lambda: torch._addmm_activation(bu, x, wu.t(), use_gelu=True)),
            ("fwd_down", "bias", lambda: F.linear(hh, wd, bd)),
            ("dw_down", "none", lambda: g.t() @ hh),
            ("dz", "none", lambda: g @ wd),
            ("dw_up", "none", lambda: dz.t() @ x),
            ("dx", "none", lambda: dz @ wu),
        ]
        flops = 2.0 * n * d * h
        for op, epi, f in cases:
            ms = median_ms(f, warmup=3, reps=10)
            tf = flops / (ms * 1e-3) / 1e12
            print(f"d{d} h{h} n{n} {op:<9} pytorch   {epi:<14} {ms:8.3f} ms {tf:6.1f} TFLOP/s", flush=True)
            rows.append({"system": "pytorch", "d": d, "h": h, "n": n, "op": op, "epilogue": epi,
                         "ms": ms, "tflops": tf})
        del x, wu, bu, hh, wd, bd, g, dz
        torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

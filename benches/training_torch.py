"""PyTorch reference for benches/training.rs, run in the same GPU device call.

The same MLP blocks (Linear(w,h), GELU tanh, Linear(h,w)), bf16 weights resident
on the GPU, MSE loss in f32 against a random target, torch.optim.AdamW(fused=True)
on the GPU: one full training step (forward, backward, optimizer), median of
CUDA-event timings after warm-up. Autograd keeps every activation (no recompute).

    python benches/training_torch.py [--out benches/results/training-torch-h200.json]
"""
import argparse
import json

import torch
import torch.nn as nn

from torch_common import event_times_ms, median, warm_up


CONFIGS = [(4096, 16384, 8, 32768), (8192, 32768, 4, 32768)]


def block(w, h):
    return nn.Sequential(nn.Linear(w, h), nn.GELU(approximate="tanh"), nn.Linear(h, w))


def step_ms(w, h, n, tokens, warmup=2, reps=5):
    torch.manual_seed(0)
    model = nn.Sequential(*[block(w, h) for _ in range(n)]).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(tokens, w, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(tokens, w, device="cuda")

    def step():
        loss = (model(x).float() - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    warm_up(step, warmup)
    ms = median(event_times_ms(step, reps))
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, x, target
    torch.cuda.empty_cache()
    return ms, peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benches/results/training-torch-h200.json")
    args = p.parse_args()
    rows = []
    for w, h, n, tokens in CONFIGS:
        ms, peak = step_ms(w, h, n, tokens)
        row = {"system": "pytorch", "blocks": f"w{w}x{n}", "w": w, "h": h, "n": n, "tokens": tokens,
               "mode": "resident", "activations": "keep", "step_ms": ms, "peak_device_gib": peak}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "what": "resident bf16 MLP training step, fused AdamW on the GPU, median of 5 after 2 warm-up",
           "results": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

"""transformers' loss curve for the same run as `train_lm`, and the comparison
of the curves (`scripts/gpu-loss-curve.sh` runs both on the GPU machine).

`train`: the same initial weights (a folder written by
`init_model --config ... --dtype f32`), the same byte-level batches (drawn as
`TokenCorpus::batch` draws them: SplitMix64 of seed ^ step * 0xD1B54A32D192ED03,
one window offset per sequence), the same learning rate per step (`lr_at`:
linear warm-up from lr / warmup, then half a cosine that would reach 0 at
--steps) and the same AdamW (betas 0.9 / 0.999, eps 1e-8, decoupled decay).

`--precision bf16`: f32 master weights and f32 AdamW state
(torch.optim.AdamW(fused=True)), forward and backward under
torch.autocast(bfloat16), which is what `train_lm --dtype bf16` does with f32
host masters. `--precision f32`: everything in f32 with TF32 off (the
reference against which both bf16 curves are judged).

    python benches/loss_curve_transformers.py train --model DIR --corpus data/corpus.txt \
        --steps 200 --batch 8 --seq 1024 --lr 3e-4 --warmup 20 --precision bf16 --out curve.json

`compare`: our `loss.csv` beside transformers' bf16 and f32 curves, into one
JSON and one SVG. The band: bf16 rounding alone moves transformers' own
curve by D = mean over steps of |bf16 - f32|; two bf16 implementations that
each stay about D from the f32 curve differ from each other by at most about
2 D (triangle inequality), so ours passes when the mean over steps of
|ours - transformers bf16| is at most 2 D, and the mean of the last 20 steps
is within 2 % of transformers' bf16.

    python benches/loss_curve_transformers.py compare --ours loss.csv \
        --bf16 bf16.json --f32 f32.json --out benches/results/loss-curve-h200
"""
import argparse
import json
import math
import sys
import time

MASK = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def batch(tokens, seed, step, b, seq):
    state = seed ^ ((step * 0xD1B54A32D192ED03) & MASK)
    xs, ys = [], []
    for _ in range(b):
        state, r = splitmix64(state)
        o = r % (len(tokens) - seq - 1)
        xs.append(tokens[o:o + seq])
        ys.append(tokens[o + 1:o + seq + 1])
    return xs, ys


def lr_at(step, peak, warmup, steps):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(argv):
    ap = argparse.ArgumentParser(prog="loss_curve_transformers.py train")
    ap.add_argument("--model", required=True)
    ap.add_argument("--corpus", default="data/corpus.txt")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with open(a.corpus, "rb") as f:
        tokens = torch.tensor(list(f.read()), dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=a.weight_decay, fused=True)
    vocab = model.config.vocab_size
    losses = []
    t0 = time.perf_counter()
    for s in range(a.steps):
        xs, ys = batch(tokens, a.seed, s, a.batch, a.seq)
        x, y = torch.stack(xs).cuda(), torch.stack(ys).cuda()
        for g in opt.param_groups:
            g["lr"] = lr_at(s, a.lr, a.warmup, a.steps)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if s % 20 == 0 or s + 1 == a.steps:
            print(f"{a.precision} step {s + 1}: loss {losses[-1]:.4f}", flush=True)
    wall = time.perf_counter() - t0
    out = {"system": "transformers", "precision": a.precision, "steps": a.steps,
           "batch": a.batch, "seq": a.seq, "lr": a.lr, "warmup": a.warmup,
           "weight_decay": a.weight_decay, "seed": a.seed, "wall_s": wall,
           "torch": torch.__version__, "losses": losses}
    with open(a.out, "w") as f:
        json.dump(out, f)


def read_csv(path):
    with open(path) as f:
        rows = [line.strip().split(",") for line in f.readlines()[1:] if line.strip()]
    return [float(loss) for _, loss in rows]


def mean(v):
    return sum(v) / len(v)


def svg(curves, title):
    """A plain SVG line plot of named loss curves (no plotting library needed)."""
    w, h, pad = 720, 420, 50
    n = max(len(c) for _, c in curves)
    lo = min(min(c) for _, c in curves)
    hi = max(max(c) for _, c in curves)
    colours = ["#d62728", "#1f77b4", "#7f7f7f", "#2ca02c"]
    x = lambda i: pad + (w - 2 * pad) * i / max(n - 1, 1)
    y = lambda v: h - pad - (h - 2 * pad) * (v - lo) / max(hi - lo, 1e-9)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle">{title}</text>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">step (1..{n})</text>',
           f'<text x="{pad - 5}" y="{h - pad}" text-anchor="end">{lo:.2f}</text>',
           f'<text x="{pad - 5}" y="{pad + 4}" text-anchor="end">{hi:.2f}</text>']
    for k, (name, c) in enumerate(curves):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(c))
        col = colours[k % len(colours)]
        out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.5" points="{pts}"/>')
        out.append(f'<text x="{w - pad - 220}" y="{pad + 16 * k}" fill="{col}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def compare(argv):
    ap = argparse.ArgumentParser(prog="loss_curve_transformers.py compare")
    ap.add_argument("--ours", required=True, help="train_lm's loss.csv")
    ap.add_argument("--bf16", required=True)
    ap.add_argument("--f32", required=True)
    ap.add_argument("--ours-bf16-state", help="train_lm's loss.csv with --optimizer-state bf16")
    ap.add_argument("--out", required=True, help="path without extension")
    ap.add_argument("--meta", default="{}", help="JSON object stored with the result")
    a = ap.parse_args(argv)
    ours = read_csv(a.ours)
    with open(a.bf16) as f:
        bf16 = json.load(f)
    with open(a.f32) as f:
        f32 = json.load(f)
    tb, tf = bf16["losses"], f32["losses"]
    if not len(ours) == len(tb) == len(tf):
        sys.exit(f"curves of different lengths: ours {len(ours)}, bf16 {len(tb)}, f32 {len(tf)}")
    d_ref = mean([abs(p - q) for p, q in zip(tb, tf)])
    d_ours = mean([abs(p - q) for p, q in zip(ours, tb)])
    d_ours_f32 = mean([abs(p - q) for p, q in zip(ours, tf)])
    tail_ours, tail_tb = mean(ours[-20:]), mean(tb[-20:])
    tail_rel = abs(tail_ours - tail_tb) / tail_tb
    ok = d_ours <= 2 * d_ref and tail_rel <= 0.02
    extra = {}
    if a.ours_bf16_state:
        b16 = read_csv(a.ours_bf16_state)
        if len(b16) != len(ours):
            sys.exit(f"--ours-bf16-state has {len(b16)} steps, ours {len(ours)}")
        extra = {
            "bf16_state": {
                "what": "train_lm --optimizer host --optimizer-state bf16 (AdamW moments in bf16, "
                        "stochastic rounding) against the same run with f32 moments",
                "mean_abs_vs_ours_f32_state": mean([abs(p - q) for p, q in zip(b16, ours)]),
                "mean_abs_vs_transformers_bf16": mean([abs(p - q) for p, q in zip(b16, tb)]),
                "last20_mean": mean(b16[-20:]),
                "losses": b16,
            }
        }
    result = {
        "meta": json.loads(a.meta),
        "band": "mean |ours - transformers bf16| <= 2 x mean |transformers bf16 - transformers f32|, "
                "and the last 20 steps' mean within 2 % of transformers bf16's",
        "mean_abs_ours_vs_transformers_bf16": d_ours,
        "mean_abs_ours_vs_transformers_f32": d_ours_f32,
        "mean_abs_transformers_bf16_vs_f32": d_ref,
        "last20_mean": {"ours": tail_ours, "transformers_bf16": tail_tb, "transformers_f32": mean(tf[-20:])},
        "last20_relative": tail_rel,
        "within_band": ok,
        "wall_s": {"transformers_bf16": bf16["wall_s"], "transformers_f32": f32["wall_s"]},
        "losses": {"ours_bf16": ours, "transformers_bf16": tb, "transformers_f32": tf},
        **extra,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    curves = [("ours (bf16, f32 masters)", ours), ("transformers bf16 autocast", tb),
              ("transformers f32", tf)]
    if extra:
        curves.append(("ours, bf16 AdamW moments", extra["bf16_state"]["losses"]))
    with open(a.out + ".svg", "w") as f:
        f.write(svg(curves, "train_lm vs transformers, same init and batches"))
    print(f"mean |ours - transformers bf16| = {d_ours:.4f}, |transformers bf16 - f32| = {d_ref:.4f}, "
          f"last-20 relative {tail_rel:.4f}: {'within' if ok else 'OUTSIDE'} the band")
    if extra:
        e = extra["bf16_state"]
        print(f"bf16 moments: mean |loss - f32 moments| = {e['mean_abs_vs_ours_f32_state']:.4f}, "
              f"last-20 mean {e['last20_mean']:.4f} (f32 moments {tail_ours:.4f})")
    for s in [0, 1, 2, 3, 9, 19, 49, 99, len(ours) - 1]:
        if s < len(ours):
            print(f"  step {s + 1}: ours {ours[s]:.4f}, transformers bf16 {tb[s]:.4f}, f32 {tf[s]:.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    cmds = {"train": train, "compare": compare}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        sys.exit("usage: loss_curve_transformers.py train|compare [options]")
    sys.exit(cmds[sys.argv[1]](sys.argv[2:]) or 0)

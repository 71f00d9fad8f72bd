"""transformers reference for benches/lm.rs, run in the same GPU device call.

LlamaForCausalLM with the shapes of our presets (1b: 16 x 2048 wide, 3b: 28 x
3072 wide; MLP 8192, 8 key-value heads, byte vocabulary of 256, tied
embeddings, rope theta 5e5), bf16 weights resident on the GPU, SDPA attention,
torch.optim.AdamW(fused=True) on the GPU, 16 x 2048 tokens per step; eager
("resident") and with gradient checkpointing ("resident_ckpt"). Median step of
5 after 2 warm-up steps; MFU = 6 x parameters x tokens/s / 990 TFLOP/s.

    python benches/lm_torch.py [--presets 1b,3b] [--out benches/results/lm-torch-h200.json]
"""
import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from torch_common import median, wall_times_s, warm_up

PRESETS = {"1b": (2048, 16, 32), "3b": (3072, 28, 24)}
PEAK = 990e12


def run(preset, ckpt, batch=16, seq=2048, warmup=2, steps=5):
    hidden, layers, heads = PRESETS[preset]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=8192, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=8, vocab_size=256,
                      max_position_embeddings=seq, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
    tokens = torch.randint(0, 256, (batch, seq), device="cuda")

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    warm_up(step, warmup)
    med = median(wall_times_s(step, steps))
    tps = batch * seq / med
    row = {"system": "transformers", "preset": preset, "mode": "resident_ckpt" if ckpt else "resident",
           "params": params, "tokens_per_step": batch * seq, "median_step_s": med, "tokens_per_s": tps,
           "mfu": 6 * params * tps / PEAK, "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30,
           "activation_policy": "gradient checkpointing" if ckpt else "keep (autograd)"}
    del model, opt, tokens
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="1b,3b")
    p.add_argument("--out", default="benches/results/lm-torch-h200.json")
    args = p.parse_args()
    rows = []
    for preset in args.presets.split(","):
        for ckpt in (False, True):
            try:
                row = run(preset, ckpt)
            except torch.OutOfMemoryError as e:
                row = {"system": "transformers", "preset": preset,
                       "mode": "resident_ckpt" if ckpt else "resident", "error": str(e)[:200]}
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
    import transformers
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                   "device": torch.cuda.get_device_name(0), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()

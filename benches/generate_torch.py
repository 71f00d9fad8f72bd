"""transformers + accelerate peer of `benches/generate.rs`, run in the same GPU call.

The workload of that bench (FlexGen's): random prompts of --prompt-len token
ids, --gen-len new tokens each, greedy, bf16, a batch of equal-length prompts
(no padding). The model is LlamaForCausalLM at Llama 3.1 8B shapes with random
weights (made on the CPU, no files), dispatched by accelerate as a user with a
GPU of --gpu-budget would: the kv cache and activations of the batch need
room, so the layers get the budget less the cache and --margin-gib, the rest
stay in host memory and accelerate's hooks copy them to the GPU at every
forward. One row per batch of --batches (skipped, with the reason, when the
cache alone exceeds the budget); the best is accelerate "at its best batch".

    python benches/generate_torch.py [--batches 1,16,64,128] [--gpu-budget-gib 24]
        [--out benches/results/generate-batch-torch-h200.json]
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def llama31_8b():
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       rope_theta=500000.0, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)


def random_model(cfg):
    """Random weights fast: parameters made on the meta device, given CPU
    memory, and filled from one random tile (the values do not matter for
    tokens/s: every row decodes --gen-len tokens); the rotary buffer rebuilt."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    t = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    tile = (torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for i in range(0, flat.numel(), tile.numel()):
                n = min(tile.numel(), flat.numel() - i)
                flat[i:i + n].copy_(tile[:n])
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)
    print(f"random init: {time.perf_counter() - t:.1f} s", flush=True)
    return model.eval()


def kv_gib(cfg, batch, positions):
    d = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * positions * batch * 2 / 2**30


def dispatched(model, weights_gib):
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.hooks import remove_hook_from_submodules
    remove_hook_from_submodules(model)
    model.to("cpu")
    torch.cuda.empty_cache()
    dmap = infer_auto_device_map(model, max_memory={0: f"{weights_gib:.2f}GiB", "cpu": "100GiB"},
                                 no_split_module_classes=["LlamaDecoderLayer"])
    on_gpu = sum(1 for v in dmap.values() if v == 0)
    return dispatch_model(model, device_map=dmap, main_device=0), on_gpu, len(dmap)


def row(model, cfg, a, batch):
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, cfg.vocab_size, (batch, a.prompt_len), generator=gen).to("cuda")
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0)
    model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **kw)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=a.gen_len, min_new_tokens=a.gen_len, **kw)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    new = (out.shape[1] - ids.shape[1]) * batch
    return {"secs": secs, "generated": new, "tokens_per_s": new / secs,
            "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-budget-gib", type=float, default=24.0)
    p.add_argument("--margin-gib", type=float, default=3.0)
    p.add_argument("--out", default="benches/results/generate-batch-torch-h200.json")
    a = p.parse_args()
    cfg = llama31_8b()
    model = random_model(cfg)
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        base = {"system": "transformers+accelerate", "model": "8b", "format": "bf16",
                "batch": batch, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                "device_budget_gib": a.gpu_budget_gib, "kv_place": "device"}
        weights = a.gpu_budget_gib - kv_gib(cfg, batch, a.prompt_len + a.gen_len) - a.margin_gib
        if weights <= 0:
            rows.append(dict(base, skipped="the kv cache and margin exceed the budget"))
            print(json.dumps(rows[-1]), flush=True)
            continue
        try:
            model, on_gpu, parts = dispatched(model, weights)
            with torch.no_grad():
                r = row(model, cfg, a, batch)
            rows.append(dict(base, weights_budget_gib=weights,
                             placement=f"{on_gpu} of {parts} modules on the GPU", **r))
        except Exception as e:  # the reason is the row
            rows.append(dict(base, skipped=repr(e)))
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "command": "python benches/generate_torch.py "
                   f"--batches {a.batches} --gpu-budget-gib {a.gpu_budget_gib}", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

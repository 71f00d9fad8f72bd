"""QLoRA as its users run it: transformers + PEFT + bitsandbytes, the base in
NF4 on the GPU (resident), LoRA adapters on every linear layer, gradient
checkpointing, torch AdamW over the adapters. The peer of the quantized rows
of `benches/lora.rs` (`LORA_BENCH_QUANTIZE=nf4`), at the same shapes and
tokens per step.

    python3 benches/qlora_torch.py [--models 8b,70b] [--batch 8] [--seq 2048] [--steps 3] [--r 16]
        [--modes lora,generate] [--prompt-len 512] [--gen-len 32]

`--modes generate` adds the peer of `benches/generate.rs` with
`GEN_BENCH_QUANTIZE=nf4`: the same NF4 base resident, batch 1, greedy,
--gen-len new tokens after a random prompt of --prompt-len, kv cache on.

bitsandbytes is not installed on the GPU machine: install the repacked wheel
first (`scripts/bnb-wheel.sh` here, then `pip install --no-deps --target DIR`
there and put DIR on PYTHONPATH). The model is built from random weights
layer by layer on the GPU (a 70B base never exists in bf16 anywhere), so it
needs no checkpoint and little host memory. Writes
`benches/results/qlora-torch-<card>.json` (BENCH_RESULTS_DIR, BENCH_DEVICE_TAG).
"""
import argparse
import json
import os
import resource
import time

import torch

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads (Llama 3.1)
    "8b": (4096, 14336, 32, 32, 8),
    "70b": (8192, 28672, 80, 64, 8),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config(name):
    import transformers

    h, m, layers, heads, kv = SHAPES[name]
    return transformers.LlamaConfig(
        hidden_size=h,
        intermediate_size=m,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        use_cache=False,
    )


def nf4_linear(lin):
    """`lin` (on the meta device) as a bitsandbytes NF4 layer of random
    weights, quantized on the GPU (plain absmax, as our nf4 rows)."""
    import bitsandbytes as bnb

    out_f, in_f = lin.out_features, lin.in_features
    q = bnb.nn.Linear4bit(
        in_f, out_f, bias=False, compute_dtype=torch.bfloat16,
        compress_statistics=False, quant_type="nf4", device="meta",
    )
    w = torch.empty(out_f, in_f, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
    p = bnb.nn.Params4bit(
        w, requires_grad=False, compress_statistics=False, quant_type="nf4", module=q
    )
    q.weight = p.to("cuda")
    return q


def materialize(model, cfg):
    """The dense parts (embedding, norms, head) in bf16 on the GPU."""
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if "norm" in name:
            t = torch.ones(p.shape, dtype=torch.bfloat16, device="cuda")
        else:
            t = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
        setattr(owner, name.rsplit(".", 1)[1], torch.nn.Parameter(t, requires_grad=False))
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg, device="cuda")


def build(name):
    import transformers

    cfg = config(name)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for t in TARGETS:
                if hasattr(parent, t):
                    setattr(parent, t, nf4_linear(getattr(parent, t)))
    materialize(model, cfg)
    return model


def qlora(model, r):
    import peft

    # from_pretrained(quantization_config=...) sets these; PEFT enables
    # gradient checkpointing only for a model that says it is loaded in 4 bits.
    for flag in ("is_loaded_in_4bit", "is_quantized"):
        try:
            setattr(model, flag, True)
        except AttributeError:  # a read-only property in some versions
            pass
    model = peft.prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    if not model.is_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lcfg = peft.LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(model, lcfg)


def run(name, args):
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model = qlora(build(name), args.r)
    print(
        f"{name}: built and adapted in {time.time() - t0:.1f} s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
        f"gradient checkpointing {model.base_model.model.is_gradient_checkpointing}",
        flush=True,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(0)
    losses, times = [], []
    for step in range(args.steps + 1):
        ids = torch.randint(0, 128256, (args.batch, args.seq), device="cuda", generator=g)
        torch.cuda.synchronize()
        t = time.time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.time() - t)
        losses.append(loss.item())
        print(f"  step {step}: loss {losses[-1]:.4f}, {times[-1]:.2f} s", flush=True)
    timed = times[1:]
    tokens = args.batch * args.seq
    row = {
        "system": "transformers+peft+bitsandbytes",
        "model": name,
        "format": "nf4",
        "mode": "lora",
        "r": args.r,
        "batch": args.batch,
        "seq": args.seq,
        "device_budget_gib": None,
        "tokens_per_s": tokens * len(timed) / sum(timed),
        "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": losses,
    }
    print(json.dumps(row), flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return row


def generate(name, args):
    """Batch-1 greedy decoding of the resident NF4 base (no adapters)."""
    torch.cuda.reset_peak_memory_stats()
    model = build(name).eval()
    model.config.use_cache = True
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 128256, (1, args.prompt_len), device="cuda", generator=g)
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **kw)
        torch.cuda.synchronize()
        t = time.time()
        out = model.generate(ids, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, **kw)
        torch.cuda.synchronize()
    secs = time.time() - t
    new = out.shape[1] - ids.shape[1]
    row = {
        "system": "transformers+bitsandbytes",
        "model": name,
        "format": "nf4",
        "mode": "generate",
        "batch": 1,
        "prompt_len": args.prompt_len,
        "gen_len": new,
        "placement": "resident",
        "device_budget_gib": None,
        "tokens_per_s": new / secs,
        "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    print(json.dumps(row), flush=True)
    del model
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="lora")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--models", default="8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--r", type=int, default=16)
    args = ap.parse_args()
    for mode in args.modes.split(","):
        if mode not in ("lora", "generate"):
            ap.error(f"--modes: unknown mode {mode!r} (lora, generate)")
    import bitsandbytes
    import peft
    import transformers

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }
    print(versions, flush=True)
    rows = []
    modes = {"lora": run, "generate": generate}
    for mode in args.modes.split(","):
        for name in args.models.split(","):
            try:
                rows.append(modes[mode](name, args))
            except torch.cuda.OutOfMemoryError as e:
                print(f"{name} {mode}: out of memory: {e}", flush=True)
                system = {"lora": "transformers+peft+bitsandbytes", "generate": "transformers+bitsandbytes"}
                rows.append({"system": system[mode], "model": name, "mode": mode,
                             "error": "out of memory"})
                torch.cuda.empty_cache()
    out = os.environ.get("BENCH_RESULTS_DIR", "benches/results")
    tag = os.environ.get("BENCH_DEVICE_TAG", "h200")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"qlora-torch-{tag}.json")
    with open(path, "w") as f:
        json.dump({"versions": versions, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

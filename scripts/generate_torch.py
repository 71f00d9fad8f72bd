"""transformers peer of `examples/generate --model DIR`, run in the same GPU call.

Loads the same Hugging Face folder (config.json, safetensors, tokenizer.json)
with LlamaForCausalLM in bf16, then greedy-decodes --max-tokens new tokens
from the same prompt with the kv cache, as ours does, timing prompt and decode
together (ours counts the prompt too). Two rows:

- "resident": the whole model on the GPU;
- "offloaded": accelerate's device_map with --gpu-budget on the GPU and the
  rest in host memory, the way a transformers user runs a model bigger than
  the GPU (skipped with the reason when accelerate is missing).

    python scripts/generate_torch.py --model DIR [--max-tokens 256]
        [--offload-tokens 16] [--out benches/results/generate-torch-h200.json]
"""
import argparse
import json
import time

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast


def timed_generate(model, ids, n):
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
              pad_token_id=0)
    model.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    return out.shape[1] - ids.shape[1], secs


def row(mode, model, ids, n):
    torch.cuda.reset_peak_memory_stats()
    new, secs = timed_generate(model, ids, n)
    r = {"system": "transformers", "mode": mode, "new_tokens": new, "prompt_tokens": ids.shape[1],
         "secs": secs, "tokens_per_s": new / secs,
         "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(r), flush=True)
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="Mr. Phileas Fogg")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--gpu-budget", default="4GiB")
    # Offloaded decoding moves every layer over PCIe per token: a few tokens suffice.
    p.add_argument("--offload-tokens", type=int, default=16)
    p.add_argument("--out", default="benches/results/generate-torch-h200.json")
    a = p.parse_args()
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{a.model}/tokenizer.json")
    rows = []
    model = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to("cuda").eval()
    ids = tok(a.prompt, return_tensors="pt").input_ids.to("cuda")
    with torch.no_grad():
        rows.append(row("resident", model, ids, a.max_tokens))
    del model
    torch.cuda.empty_cache()
    try:
        import accelerate  # noqa: F401
        model = LlamaForCausalLM.from_pretrained(
            a.model, dtype=torch.bfloat16, device_map="auto",
            max_memory={0: a.gpu_budget, "cpu": "120GiB"}).eval()
        with torch.no_grad():
            rows.append(row("offloaded", model, ids, a.offload_tokens))
    except Exception as e:  # the reason is the row
        rows.append({"system": "transformers", "mode": "offloaded", "skipped": repr(e)})
        print(rows[-1], flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "model": a.model,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

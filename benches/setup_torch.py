"""transformers peer of `benches/setup.rs`, run in the same GPU call.

Llama 3.1 8B shapes (the `8b` of `SETUP_BENCH`), random bf16 weights saved as
a safetensors folder, then loaded back on the host in f32 as a full fine-tune
keeps its masters: `LlamaForCausalLM.from_pretrained(dir, torch_dtype=float32)`,
timed (median of `--rounds`). Host only; the folder is removed after.

    python benches/setup_torch.py [--rounds 1] [--dir /tmp]
        -> $BENCH_RESULTS_DIR/setup-torch-<card>.json
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import torch
from transformers import LlamaForCausalLM

from generate_torch import llama31_8b, random_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    cfg = llama31_8b()
    folder = tempfile.mkdtemp(prefix="setup-torch-", dir=a.dir)
    try:
        model = random_model(cfg)
        model.save_pretrained(folder, safe_serialization=True)
        del model
        file_gb = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                      if f.endswith(".safetensors")) / 1e9
        times = []
        for _ in range(max(a.rounds, 1)):
            t = time.perf_counter()
            m = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
            times.append(time.perf_counter() - t)
            masters_gb = sum(p.numel() * p.element_size() for p in m.parameters()) / 1e9
            del m
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    times.sort()
    s = times[len(times) // 2]
    print(f"8b: {file_gb:.2f} GB of bf16 -> {masters_gb:.2f} GB of f32 weights by "
          f"from_pretrained: {s:.2f} s (threads {torch.get_num_threads()})", flush=True)
    row = {"system": "transformers (from_pretrained, torch_dtype=float32)", "model": "8b",
           "file_gb": file_gb, "master_dtype": "F32", "masters_gb": masters_gb, "seconds": s,
           "rounds": times, "masters_gb_per_s": masters_gb / s,
           "threads": torch.get_num_threads()}
    out = os.environ.get("BENCH_RESULTS_DIR", "benches/results")
    os.makedirs(out, exist_ok=True)
    tag = os.environ.get("BENCH_DEVICE_TAG", "h200")
    path = os.path.join(out, f"setup-torch-{tag}.json")
    with open(path, "w") as f:
        json.dump({"bench": "setup_torch", "rows": [row],
                   "versions": {"torch": torch.__version__}}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

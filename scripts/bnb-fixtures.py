#!/usr/bin/env python3
"""Fixtures of bitsandbytes' quantized formats, written by transformers +
bitsandbytes on the GPU machine (torch 2.11, transformers 5.x, bitsandbytes
0.50.2 from the wheel scripts/bnb-wheel.sh makes), for the `bnb_fixtures`
test topic (tests/bnb_fixtures.rs), which reads them with our loader when
BNB_FIXTURES names the folder.

    python3 scripts/bnb-fixtures.py DIR                 # write the fixtures
    python3 scripts/bnb-fixtures.py --check-resaved DIR # after the Rust test

Writing: a tiny random Llama (width 192, 2 layers, 4 query / 2 key-value
heads, MLP 320, byte vocabulary), saved in bf16 to DIR/dense, then loaded by
transformers with each BitsAndBytesConfig and saved to DIR/<variant>
(nf4-double, nf4, fp4, int8) with:
  dequantized.safetensors  every quantized Linear's weight as bitsandbytes
                           dequantizes it (dequantize_4bit: the quant state's
                           dtype, bf16; int8_vectorwise_dequant: f32), by its
                           HF weight name
  logits.safetensors       `tokens` (int64 [2, 16], seeded) and `logits`
                           (f32) of the quantized model
The width makes a q_proj 576 blocks of 64, so a double-quantized absmax has
two full nested blocks of 256 and a partial one.

--check-resaved: the Rust test saves every folder it read again with our
writer into DIR/<variant>/resaved; this loads each with transformers +
bitsandbytes and compares its logits with the variant's (the file ->
transformers round trip of our bitsandbytes layout). Exits 1 on a mismatch.
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

import bitsandbytes as bnb
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

SEED = 0
BF16 = torch.bfloat16


def variants():
    four = lambda qt, double: BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=qt,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=BF16,
    )
    return {
        "nf4-double": four("nf4", True),
        "nf4": four("nf4", False),
        "fp4": four("fp4", False),
        "int8": BitsAndBytesConfig(load_in_8bit=True),
    }


def dense_model(out):
    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        hidden_size=192,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(BF16)
    path = os.path.join(out, "dense")
    model.save_pretrained(path)
    return path


def dequantized(model):
    """Every quantized Linear's weight as bitsandbytes dequantizes it."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = m.weight
            out[name + ".weight"] = bnb.functional.dequantize_4bit(w.data, w.quant_state)
        elif isinstance(m, bnb.nn.Linear8bitLt):
            scb = m.weight.SCB if getattr(m.weight, "SCB", None) is not None else m.state.SCB
            out[name + ".weight"] = bnb.functional.int8_vectorwise_dequant(m.weight.data, scb)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def tokens():
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (2, 16), generator=g, dtype=torch.int64)


@torch.no_grad()
def logits(model, ids):
    return model(ids.to(model.device)).logits.float().cpu().contiguous()


def write(out):
    dense = dense_model(out)
    ids = tokens()
    for name, qc in variants().items():
        model = AutoModelForCausalLM.from_pretrained(
            dense, quantization_config=qc, dtype=BF16, device_map="cuda:0"
        )
        path = os.path.join(out, name)
        model.save_pretrained(path)
        deq = dequantized(model)
        assert deq, f"{name}: no bitsandbytes layers"
        save_file(deq, os.path.join(path, "dequantized.safetensors"))
        save_file({"tokens": ids, "logits": logits(model, ids)}, os.path.join(path, "logits.safetensors"))
        print(f"{path}: {len(deq)} quantized weights")
        del model
        torch.cuda.empty_cache()


def check_resaved(out):
    bad, seen = 0, 0
    for name in variants():
        path = os.path.join(out, name, "resaved")
        if not os.path.isdir(path):
            continue
        seen += 1
        want = load_file(os.path.join(out, name, "logits.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=BF16, device_map="cuda:0")
        got = logits(model, want["tokens"])
        diff = (got - want["logits"]).abs().max().item()
        scale = want["logits"].abs().max().item()
        ok = diff <= 1e-3 * scale
        bad += not ok
        print(f"{path}: logits differ by {diff:.3e} (max |logit| {scale:.3e}): {'ok' if ok else 'MISMATCH'}")
        del model
        torch.cuda.empty_cache()
    if seen == 0:
        sys.exit(f"{out}: no <variant>/resaved folders (run the bnb_fixtures test with BNB_FIXTURES={out})")
    sys.exit(1 if bad else 0)


def main():
    args = sys.argv[1:]
    if args[:1] == ["--check-resaved"] and len(args) == 2:
        check_resaved(args[1])
    elif len(args) == 1:
        os.makedirs(args[0], exist_ok=True)
        write(args[0])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()

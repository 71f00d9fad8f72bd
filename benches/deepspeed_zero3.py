"""DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU: the peer of
`benches/lora.rs` (`LORA_BENCH_MODES=full`) for issue 33, run in the same GPU call.

transformers' LlamaForCausalLM at the shapes of our presets (models/src/config.rs:
`tiny`, `350m`, `1b`, `3b`, and `8b` = Llama 3.1 8B's shapes with vocabulary
128256 and llama3 rope scaling), random init like ours (normal 0.02, o_proj and
down_proj scaled by 1/sqrt(2 x layers), norms 1), bf16, SDPA attention (flash),
activation checkpointing (gradient_checkpointing_enable), trained by DeepSpeed
ZeRO-3 with offload_param and offload_optimizer to the CPU (pinned), the
optimizer DeepSpeedCPUAdam (AdamW: lr 1e-4 peak, betas 0.9/0.999, eps 1e-8,
weight decay 0.01, f32 masters and moments on the host) and the learning rate
warmed up linearly over all steps, as `benches/lora.rs` does (step s of n runs
at 1e-4 x (s + 1) / n). Batches are byte tokens of data/corpus.txt drawn as
ours draws them (ByteCorpus::batch, seed 0: micro-batch m of step s is our
batch of step s x micro + m). A step is `--micro` micro-batches of `--batch`
x `--seq` tokens (gradient accumulation), then one optimizer step.

One process, no launcher: it sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
itself and calls deepspeed.init_distributed (NCCL, one rank).

Host memory is estimated before anything is allocated, and the run is refused
(a JSON row with "error", exit status 3) when the estimate exceeds the memory
available less a margin: a run that exhausts the host kills the whole device
call. ZeRO-3 with both offloads in DeepSpeed 0.19.8 holds on the host, per
parameter: the bf16 partitions pinned one by one at partitioning (2 bytes,
kept by torch's pinned-memory cache after they are copied into) the flat bf16
buffer (2), the f32 gradient partitions' flat buffer (4, pinned), each
sub-group's f32 gradient buffer (4, pinned), the f32 masters (4) and
DeepSpeedCPUAdam's two f32 moments (8): 24 bytes, plus one sub-group's f32
conversion in flight (4 x min(sub_group_size, params)) and the process's own
(torch, CUDA, NCCL, Python: --base-gib, 6 GiB). A watchdog also stops the
process (exit status 4) if the host's available memory drops under
--host-floor-gib while it runs.

    python3 benches/deepspeed_zero3.py --model 3b --batch 8 --seq 2048 --micro 1 \
        [--warmup 2] [--steps 3] [--out FILE.json] [--estimate-only]

Size overrides for small checks: --layers --hidden --heads --kv-heads
--intermediate --vocab (e.g. `--model 3b --layers 2 --hidden 512 --heads 8`).

Prints and appends to --out (a JSON list) one row: system, model, mode, seq,
batch, micro, tokens_per_step, device_budget_gib (null), optimizer_place
("host"), state_dtypes ("f32"), tokens_per_s (median step), mfu (6 x params x
tokens/s / 989e12), peak_device_gib (the driver's used memory, sampled through
NVML during the steps, warm-up included), peak_device_torch_reserved_gib,
host_rss_gib (peak RSS of the process and its children, sampled; the
compiler's processes of the cpu_adam JIT build included: host_rss_steps_gib is
the peak during the steps alone),
host_used_gib (peak of the host's total - available, less before the start),
host_estimate_gib, losses, step times and setup times.
"""
import argparse
import json
import math
import os
import resource
import socket
import sys
import threading
import time

PEAK_FLOPS = 989e12
LR = 1e-4
GIB = float(1 << 30)
SYSTEM = "deepspeed-zero3-offload"


def preset(name):
    """The presets of models/src/config.rs."""
    def b(hidden, layers, heads, kv, **kw):
        c = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                 intermediate=-(-(hidden * 8 // 3) // 128) * 128, vocab=256, eps=1e-5,
                 rope_theta=10_000.0, max_pos=2048, tie=False, rope_scaling=None)
        c.update(kw)
        return c
    if name == "tiny":
        return b(128, 4, 4, 2, max_pos=512)
    if name == "350m":
        return b(1024, 30, 16, 8)
    if name == "1b":
        return b(2048, 16, 32, 8, intermediate=8192, rope_theta=500_000.0, tie=True)
    if name == "3b":
        return b(3072, 28, 24, 8, intermediate=8192, rope_theta=500_000.0, tie=True)
    if name == "8b":
        return b(4096, 32, 32, 8, intermediate=14336, vocab=128256, rope_theta=500_000.0,
                 max_pos=131072,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192))
    raise SystemExit(f"unknown --model {name!r} (tiny, 350m, 1b, 3b or 8b)")


def count_params(c):
    """Parameters of the decoder (Llama layout), as LlamaConfig::num_params counts."""
    h, hd = c["hidden"], c["hidden"] // c["heads"]
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * c["intermediate"] + 2 * h
    return c["layers"] * layer + c["vocab"] * h * (1 if c["tie"] else 2) + h


def host_estimate(params, sub_group_size, base_gib):
    """Host bytes of ZeRO-3 with both offloads (see the module's doc), by part."""
    parts = {
        "bf16 partitions pinned at partitioning (2 B)": 2 * params,
        "bf16 flat partition buffer, pinned (2 B)": 2 * params,
        "f32 gradient partitions, pinned (4 B)": 4 * params,
        "f32 sub-group gradient buffers, pinned (4 B)": 4 * params,
        "f32 master partitions (4 B)": 4 * params,
        "DeepSpeedCPUAdam f32 moments (8 B)": 8 * params,
        "one sub-group's f32 conversion in flight": 4 * min(sub_group_size, params),
        "process (torch, CUDA, NCCL, Python)": int(base_gib * GIB),
    }
    return sum(parts.values()), parts


def host_available():
    """Bytes the host can still give: MemAvailable, bounded by a cgroup limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for lim, cur in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                     ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                      "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(lim) as f:
                v = f.read().strip()
            if v != "max" and int(v) < (1 << 60):
                with open(cur) as f:
                    left = int(v) - int(f.read().strip())
                avail = left if avail is None else min(avail, left)
            break
        except (OSError, ValueError):
            continue
    return avail


class SplitMix64:
    """models/src/checkpoint.rs's generator."""
    M = (1 << 64) - 1

    def __init__(self, seed):
        self.s = seed & self.M

    def next_u64(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & self.M
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.M
        return z ^ (z >> 31)

    def below(self, n):
        return self.next_u64() % n


def corpus_batch(tokens, seed, step, batch, seq):
    """ByteCorpus::batch: `batch` windows of `seq` tokens and their next tokens."""
    rng = SplitMix64(seed ^ ((step * 0xD1B54A32D192ED03) & SplitMix64.M))
    xs, ys = [], []
    for _ in range(batch):
        o = rng.below(len(tokens) - seq - 1)
        xs.append(tokens[o:o + seq])
        ys.append(tokens[o + 1:o + seq + 1])
    return xs, ys


class Sampler(threading.Thread):
    """Peaks of device memory (NVML, else cudaMemGetInfo), the process tree's RSS
    and the host's used memory; stops the process if the host runs low."""

    def __init__(self, floor_bytes, on_low):
        super().__init__(daemon=True)
        import psutil
        self.psutil, self.proc = psutil, psutil.Process(os.getpid())
        self.floor, self.on_low = floor_bytes, on_low
        self.stop_ev = threading.Event()
        self.dev_peak = self.rss_peak = self.used_peak = 0
        # The process tree's RSS peak while dev_on (the steps): without the
        # JIT build of cpu_adam (compiler processes) at initialize.
        self.rss_steps_peak = 0
        self.dev_on = False
        self.nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            idx = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self.nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(idx))
        except Exception as e:  # noqa: BLE001 - fall back to cudaMemGetInfo
            print(f"  (no NVML: {e}; device memory from cudaMemGetInfo)")

    def device_used(self):
        if self.nvml:
            pynvml, h = self.nvml
            return pynvml.nvmlDeviceGetMemoryInfo(h).used
        import torch
        free, total = torch.cuda.mem_get_info()
        return total - free

    def sample(self):
        try:
            rss = self.proc.memory_info().rss
            for c in self.proc.children(recursive=True):
                try:
                    rss += c.memory_info().rss
                except self.psutil.Error:
                    pass
        except self.psutil.Error:
            rss = 0
        vm = self.psutil.virtual_memory()
        self.rss_peak = max(self.rss_peak, rss)
        self.used_peak = max(self.used_peak, vm.total - vm.available)
        if self.dev_on:
            self.dev_peak = max(self.dev_peak, self.device_used())
            self.rss_steps_peak = max(self.rss_steps_peak, rss)
        avail = host_available()
        if avail is not None and avail < self.floor:
            self.on_low(avail)

    def run(self):
        while not self.stop_ev.wait(0.1):
            self.sample()


def write_row(path, row):
    print("ROW " + json.dumps(row), flush=True)
    if not path:
        return
    rows = []
    if os.path.exists(path):
        try:
            with open(path) as f:
                rows = json.load(f)
        except (OSError, ValueError):
            rows = []
    rows.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def hf_config(c, seq, attn):
    import transformers
    from transformers import LlamaConfig
    rope = dict(rope_type="default", rope_theta=c["rope_theta"])
    if c["rope_scaling"]:
        rope.update(c["rope_scaling"])
    kw = dict(hidden_size=c["hidden"], intermediate_size=c["intermediate"],
              num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
              num_key_value_heads=c["kv_heads"], vocab_size=c["vocab"],
              max_position_embeddings=max(c["max_pos"], seq), rms_norm_eps=c["eps"],
              tie_word_embeddings=c["tie"], attention_bias=False, mlp_bias=False,
              hidden_act="silu", initializer_range=0.02, use_cache=False,
              attn_implementation=attn)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = rope
    else:
        kw["rope_theta"] = c["rope_theta"]
        if c["rope_scaling"]:
            kw["rope_scaling"] = dict(c["rope_scaling"])
    return LlamaConfig(**kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="3b")
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    for k in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    ap.add_argument("--reentrant", type=int, default=1,
                    help="activation checkpointing with use_reentrant (1, HF Trainer + DeepSpeed's usual) or not (0)")
    ap.add_argument("--sub-group-size", type=int, default=1_000_000_000)
    ap.add_argument("--base-gib", type=float, default=6.0,
                    help="the process's own host memory in the estimate")
    ap.add_argument("--host-margin-gib", type=float, default=8.0,
                    help="refuse unless the estimate is this far under the available memory")
    ap.add_argument("--host-floor-gib", type=float, default=3.0,
                    help="stop the run if the host's available memory falls under this")
    ap.add_argument("--corpus", default="data/corpus.txt")
    ap.add_argument("--out", help="JSON list to append the row to")
    ap.add_argument("--estimate-only", action="store_true",
                    help="print the host estimate (and build the model on the meta device) and stop")
    ap.add_argument("--force", action="store_true", help="run even if the estimate does not fit")
    a = ap.parse_args()

    c = preset(a.model)
    name = a.model
    over = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
            "intermediate": a.intermediate, "vocab": a.vocab}
    if any(v is not None for v in over.values()):
        if a.hidden is not None and a.intermediate is None:
            c["intermediate"] = -(-(a.hidden * 8 // 3) // 128) * 128
        c.update({k: v for k, v in over.items() if v is not None})
        c["kv_heads"] = min(c["kv_heads"], c["heads"])
        name = f"{a.model}-custom(" + ",".join(f"{k}={c[k]}" for k in
                                              ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")) + ")"
    tokens_per_step = a.batch * a.seq * a.micro
    params = count_params(c)
    est, parts = host_estimate(params, a.sub_group_size, a.base_gib)
    avail = host_available()
    base = dict(system=SYSTEM, model=name, mode="full", seq=a.seq, batch=a.batch, micro=a.micro,
                tokens_per_step=tokens_per_step, device_budget_gib=None, optimizer_place="host",
                state_dtypes="f32", params=params, host_estimate_gib=est / GIB,
                host_available_gib=None if avail is None else avail / GIB)
    print(f"{SYSTEM} {name}: {params / 1e9:.3f} B parameters, {a.micro} x {a.batch} x {a.seq} "
          f"= {tokens_per_step} tokens a step")
    print(f"  host estimate {est / GIB:.1f} GiB (24 bytes/parameter + in flight + process):")
    for k, v in parts.items():
        print(f"    {v / GIB:8.2f} GiB  {k}")
    print("  host available " + ("unknown" if avail is None else f"{avail / GIB:.1f} GiB")
          + f", margin {a.host_margin_gib} GiB")
    fits = avail is None or est <= avail - a.host_margin_gib * GIB
    refusal = None
    if not fits:
        refusal = (f"refused: ZeRO-3 offload of {params / 1e9:.2f} B parameters needs about "
                   f"{est / GIB:.1f} GiB of host memory, more than the {avail / GIB:.1f} GiB available "
                   f"less a {a.host_margin_gib:.0f} GiB margin (a run that exhausts the host kills the call)")
        print("  " + refusal, flush=True)

    import torch
    from transformers import LlamaForCausalLM
    cfg = hf_config(c, a.seq, a.attn)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    n_meta = sum(p.numel() for p in meta.parameters())
    del meta
    print(f"  transformers' model: {n_meta / 1e9:.3f} B parameters (analytic {params / 1e9:.3f} B)"
          + ("" if n_meta == params else "  <-- MISMATCH"))
    if a.estimate_only:
        write_row(a.out, dict(base, estimate_only=True, fits=fits, error=refusal,
                              hf_params=n_meta))
        return 0
    if refusal and not a.force:
        write_row(a.out, dict(base, error=refusal))
        return 3

    # --- one process, one rank: no launcher ---------------------------------
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1"), ("DS_ACCELERATOR", "cuda")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions")

    t_start = time.perf_counter()
    state = {"row": base}

    def on_low(left):
        msg = (f"stopped: the host's available memory fell to {left / GIB:.1f} GiB "
               f"(floor {a.host_floor_gib} GiB) at {state.get('phase')}")
        print("  " + msg, flush=True)
        try:
            write_row(a.out, dict(state["row"], error=msg))
        finally:
            os._exit(4)

    sampler = Sampler(int(a.host_floor_gib * GIB), on_low)
    state["phase"] = "start"
    sampler.sample()
    used0 = sampler.used_peak
    sampler.used_peak = 0
    sampler.start()

    import deepspeed
    import transformers
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)

    with open(a.corpus, "rb") as f:
        corpus = f.read()
    if len(corpus) < a.seq + 2:
        raise SystemExit(f"the corpus has {len(corpus)} tokens, too few for sequences of {a.seq}")

    # --- the model, built on the GPU in bf16 (fast init), initialised like ours
    state["phase"] = "init"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    dflt = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(dflt)
    out_scale = 1.0 / math.sqrt(2.0 * c["layers"])
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 * (out_scale if pname.endswith(("o_proj.weight", "down_proj.weight")) else 1.0))
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": bool(a.reentrant)})
    model.train()
    init_s = time.perf_counter() - t0
    print(f"  model built on the GPU (bf16, {cfg._attn_implementation}): {init_s:.1f} s", flush=True)

    h = c["hidden"]
    ds_config = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": a.micro,
        "train_batch_size": a.batch * a.micro,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": a.sub_group_size,
            # HF Trainer's "auto" values for these.
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
        },
        "optimizer": {"type": "AdamW",
                      "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    state["phase"] = "deepspeed.initialize"
    t0 = time.perf_counter()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)
    del model
    ds_init_s = time.perf_counter() - t0
    inner = getattr(optimizer, "optimizer", optimizer)
    opt_name = type(inner).__name__
    print(f"  deepspeed.initialize (partition, offload, {opt_name}): {ds_init_s:.1f} s", flush=True)
    if opt_name != "DeepSpeedCPUAdam":
        print(f"  WARNING: the optimizer is {opt_name}, not DeepSpeedCPUAdam")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    total = a.warmup + a.steps
    step_s, losses = [], []
    sampler.dev_on = True
    state["phase"] = "steps"
    for s in range(total):
        lr = LR * (s + 1) / total
        for g in optimizer.param_groups:
            g["lr"] = lr
        torch.cuda.synchronize()
        t = time.perf_counter()
        step_loss = 0.0
        for m in range(a.micro):
            xs, ys = corpus_batch(corpus, 0, s * a.micro + m, a.batch, a.seq)
            x = torch.tensor([list(r) for r in xs], dtype=torch.long, device="cuda")
            y = torch.tensor([list(r) for r in ys], dtype=torch.long, device="cuda")
            logits = engine(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     y.reshape(-1))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / a.micro
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        losses.append(step_loss)
        if s >= a.warmup:
            step_s.append(dt)
        print(f"  step {s}{' (warm-up)' if s < a.warmup else ''}: {dt:.3f} s, loss {step_loss:.4f}, "
              f"lr {lr:.2e}", flush=True)
    sampler.dev_on = False
    sampler.sample()
    sampler.stop_ev.set()

    med = sorted(step_s)[len(step_s) // 2]
    tps = tokens_per_step / med
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    row = dict(base,
               tokens_per_s=tps, mfu=6 * params * tps / PEAK_FLOPS,
               step_s_median=med, step_s=step_s, warmup_steps=a.warmup,
               peak_device_gib=sampler.dev_peak / GIB if sampler.dev_peak else None,
               peak_device_torch_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
               peak_device_torch_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
               host_rss_gib=sampler.rss_peak / GIB,
               host_rss_steps_gib=sampler.rss_steps_peak / GIB,
               host_maxrss_self_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
               host_maxrss_children_gib=children / GIB,
               host_used_gib=max(0, sampler.used_peak - used0) / GIB,
               losses=losses, lr_peak=LR, attn=cfg._attn_implementation,
               activation_checkpointing=("reentrant" if a.reentrant else "non-reentrant"),
               optimizer=opt_name, init_s=init_s, deepspeed_initialize_s=ds_init_s,
               wall_s=time.perf_counter() - t_start,
               versions=dict(deepspeed=deepspeed.__version__, torch=torch.__version__,
                             transformers=transformers.__version__))
    print(f"{SYSTEM} {name}: {med:.3f} s a step, {tps:.0f} tokens/s, MFU {row['mfu'] * 100:.1f} %, "
          f"peak device {row['peak_device_gib'] or 0:.2f} GiB (driver), "
          f"{row['peak_device_torch_reserved_gib']:.2f} GiB reserved by torch, "
          f"host RSS {row['host_rss_gib']:.1f} GiB (estimate {est / GIB:.1f}), losses {losses}")
    write_row(a.out, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host-to-device copy rate of one decoder layer's masters by how they are cut
into copies (GPU machine, PyTorch and the driver API through ctypes).

    python3 scripts/copy-pieces.py [--json OUT]

The pool copies each host master of a layer with its own cuMemcpyHtoDAsync,
and a master whose buffer does not start and end on page boundaries is cut
into a page-locked middle and pageable head and tail pieces (only whole
pages are registered). This measures, for the 8B shapes' NF4 layer (seven
packed weights and two bf16 norms) and the bf16 layer, the median time of:

- `one`: the layer's bytes as one page-locked copy (the floor);
- `masters`: one page-locked copy per master, page-aligned;
- `masters+pageable`: as the pool copies today (a 4080-byte pageable head
  and a pageable tail around each page-locked middle);
- `image+pageable`: the seven packed weights as one buffer (one master) and
  the two norms, cut as the pool cuts them.
"""
import argparse, ctypes, json, statistics
import numpy as np
import torch

PAGE = 4096
cuda = ctypes.CDLL("libcuda.so.1")
cr = torch.cuda.cudart()
torch.cuda.init()


def nf4_bytes(rows, cols):
    n = rows * cols
    return n // 64 * 4 + n // 2


def layer(fmt, hidden=4096, kv=1024, inter=14336):
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (inter, hidden), (inter, hidden), (hidden, inter)]
    size = (lambda r, c: nf4_bytes(r, c)) if fmt == "nf4" else (lambda r, c: r * c * 2)
    return [size(r, c) for r, c in shapes], [hidden * 2, hidden * 2]


def pieces(weights, norms, how):
    """(offset into the host arena, bytes, pinned) of each copy."""
    out, at = [], PAGE  # the arena's first page stays pageable
    def master(n):
        nonlocal at
        if how == "masters":
            out.append((at, n, True))
            at += (n + PAGE - 1) // PAGE * PAGE + PAGE
            return
        start = at + 16  # a large malloc's data starts 16 bytes into a page
        head = PAGE - 16
        mid = (n - head) // PAGE * PAGE
        tail = n - head - mid
        out.append((start, head, False))
        out.append((start + head, mid, True))
        if tail:
            out.append((start + head + mid, tail, False))
        at += (n + 16 + PAGE - 1) // PAGE * PAGE + PAGE
    if how == "one":
        out.append((at, sum(weights) + sum(norms), True))
        return out
    if how == "image+pageable":
        master(sum((w + 255) // 256 * 256 for w in weights))
    else:
        for w in weights:
            master(w)
    for n in norms:
        master(n)
    return out


def time_copies(copies, iters=30):
    end = max(o + n for o, n, _ in copies) + PAGE
    host = np.ones(end + PAGE, np.uint8)
    base = host.ctypes.data
    pad = (-base) % PAGE
    regs = []
    for o, n, pinned in copies:
        if pinned:
            p = base + pad + o
            # Pinned pieces start on a page; the pages they end in hold
            # nothing else (the pieces are a page apart).
            lo, hi = p, (p + n + PAGE - 1) // PAGE * PAGE
            if cr.cudaHostRegister(lo, hi - lo, 0) != 0:
                raise SystemExit("cudaHostRegister failed")
            regs.append(lo)
    total = sum(n for _, n, _ in copies)
    dst = torch.empty(total + 256 * len(copies), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            d = dst.data_ptr()
            for o, n, _ in copies:
                r = cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(d), ctypes.c_void_p(base + pad + o),
                                              ctypes.c_size_t(n), ctypes.c_void_p(stream.cuda_stream))
                if r != 0:
                    raise SystemExit(f"cuMemcpyHtoDAsync: {r}")
                d += (n + 255) // 256 * 256
            b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    for p in regs:
        cr.cudaHostUnregister(p)
    s = statistics.median(times)
    return s, total / s / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for fmt in ["nf4", "bf16"]:
        w, n = layer(fmt)
        for how in ["one", "masters", "masters+pageable", "image+pageable"]:
            c = pieces(w, n, how)
            s, gbps = time_copies(c)
            rows.append(dict(format=fmt, how=how, copies=len(c), bytes=sum(x[1] for x in c),
                             ms=s * 1e3, gbps=gbps))
            print(f"{fmt:5} {how:18} {len(c):3} copies {sum(x[1] for x in c)/1e6:8.1f} MB "
                  f"{s*1e3:7.3f} ms {gbps:6.2f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


main()

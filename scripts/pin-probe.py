"""Page-locking and first-touch rates of host memory by size (GPU machine, PyTorch).

    python3 scripts/pin-probe.py

For each of 0.25, 1, 4 and 16 GiB: the rate of first-touching fresh pages, of
cudaHostRegister and of cudaHostUnregister (twice), then four threads
registering 4 GiB each. Measured on the H200 (benches/results/pin-probe-h200.txt)
to find what a streamed attention call's setup costs.
"""
import time, threading, torch, numpy as np
cr = torch.cuda.cudart()
torch.cuda.init()
def pin(a):
    t = time.perf_counter(); r = cr.cudaHostRegister(a.ctypes.data, a.nbytes, 0); t1 = time.perf_counter()
    cr.cudaHostUnregister(a.ctypes.data); t2 = time.perf_counter()
    return int(r), t1 - t, t2 - t1
for gib in [0.25, 1, 4, 16]:
    n = int(gib * (1 << 30))
    t = time.perf_counter(); a = np.empty(n, np.uint8); a.fill(1); ft = time.perf_counter() - t
    r, reg, unreg = pin(a)
    r2, reg2, unreg2 = pin(a)
    print(f"{gib:6.2f} GiB: first touch {n/ft/1e9:6.2f} GB/s | register {n/reg/1e9:6.2f} GB/s unregister {n/unreg/1e9:6.2f} GB/s | again {n/reg2/1e9:6.2f} / {n/unreg2/1e9:6.2f} (rc {r},{r2})", flush=True)
    del a
# Four threads registering 4 GiB each.
arrs = [np.ones(4 << 30, np.uint8) for _ in range(4)]
res = [None] * 4
def work(i): res[i] = pin(arrs[i])
t = time.perf_counter(); th = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[x.start() for x in th]; [x.join() for x in th]; tt = time.perf_counter() - t
print(f"4 threads x 4 GiB: {16 * (1 << 30) / tt / 1e9:6.2f} GB/s overall (register+unregister), each {[round(r[1], 2) for r in res]} s", flush=True)

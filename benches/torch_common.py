"""Timing shared by the PyTorch peer benches (benches/*_torch.py): warm-up,
CUDA-event or host-clock timings of a call, and their median."""
import time

import torch


def warm_up(fn, warmup, reset_peak=True):
    """Calls `fn` `warmup` times and synchronizes the device; with
    `reset_peak`, the peak-memory statistics then count the timed calls only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()


def event_times_ms(fn, reps):
    """`reps` calls of `fn`, each timed by CUDA events around it, in ms."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def wall_times_s(fn, reps):
    """`reps` calls of `fn`, each timed by the host clock to the end of a
    device synchronize, in seconds."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def median(times):
    """The middle of `times` (the upper one of an even count)."""
    times = sorted(times)
    return times[len(times) // 2]

#!/usr/bin/env python3
"""Where the steps of a pool timeline went (a Chrome trace that
StreamedSequential::write_timeline wrote, e.g. the lora bench's
LORA_BENCH_TIMELINE): per step, the wall time, the GPU's compute busy (union of
block compute spans), the largest gaps between compute spans and the blocks
around them, and the copy engines' busy time; then the steps' median and
spread, and how many were compute-bound (a long job's steps should all take
about their copies' time: a run of compute-bound steps among copy-bound ones
is a burst of prompts); last, each named host phase's median and 90th
percentile (a decode step's parts, the trainer's phases); and the copies'
idle time and where its largest stretches fall.

    python3 scripts/timeline-summary.py TRACE.json [gaps per step, default 6]

A step starts at each host span "<first block> forward issued"."""
import json
import sys


def union(spans):
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main():
    trace = json.load(open(sys.argv[1]))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    issued = sorted(e["ts"] for e in ev if e["cat"] == "host" and e["name"].endswith("forward issued"))
    first = [e for e in ev if e["cat"] == "host" and e["name"].endswith("forward issued")]
    name0 = min(first, key=lambda e: e["ts"])["name"] if first else None
    starts = sorted(e["ts"] for e in first if e["name"] == name0)
    if not starts:
        sys.exit("no '... forward issued' host spans: not a training timeline")
    end_all = max(e["ts"] + e["dur"] for e in ev)
    bounds = list(zip(starts, starts[1:] + [end_all]))
    print(f"{len(bounds)} steps ({len(issued)} forward spans); times in ms")
    stats = []
    for k, (a, b) in enumerate(bounds):
        inside = [e for e in ev if a <= e["ts"] < b]
        comp = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in inside if e["cat"] == "compute")
        busy = {c: union([(e["ts"], e["ts"] + e["dur"]) for e in inside if e["cat"] == c])
                for c in ("compute", "h2d", "d2h", "host", "stall")}
        gaps = []
        for (s0, e0, n0), (s1, e1, n1) in zip(comp, comp[1:]):
            if s1 > e0:
                gaps.append((s1 - e0, n0, n1, e0, s1))
        if comp:
            gaps.append((comp[0][0] - a, "step start", comp[0][2], a, comp[0][0]))
            gaps.append((b - comp[-1][1], comp[-1][2], "next step", comp[-1][1], b))
        gaps.sort(reverse=True)
        wall = b - a
        stats.append((wall, busy["compute"], busy["h2d"]))
        print(f"step {k}: {wall / 1e3:.1f}  compute busy {busy['compute'] / 1e3:.1f} "
              f"({100 * busy['compute'] / wall:.0f} %), {len(comp)} spans; h2d {busy['h2d'] / 1e3:.1f}, "
              f"d2h {busy['d2h'] / 1e3:.1f}, stalls {busy['stall'] / 1e3:.1f}, "
              f"gaps {sum(g[0] for g in gaps) / 1e3:.1f}")
        host = [e for e in ev if e["cat"] == "host" and "issued" not in e["name"]]
        for g, n0, n1, g0, g1 in gaps[:top]:
            print(f"    gap {g / 1e3:8.2f}  after {n0} before {n1}")
            # The host's named phases that overlap the gap (the trainer's own,
            # the pool's waits): what the GPU sat idle behind.
            for e in sorted(host, key=lambda e: e["ts"]):
                s0, s1 = e["ts"], e["ts"] + e["dur"]
                if s1 > g0 and s0 < g1 and e["dur"] >= 1e3:
                    print(f"        host {e['name']}: {e['dur'] / 1e3:.1f}")
    spread(stats)
    copy_idle(ev, bounds[0][0], end_all, top)
    host_phases(ev)


def copy_idle(ev, start, end, top):
    """The host-to-device copies' idle time over the whole trace (a streamed
    run at its PCIe floor keeps them busy from its first copy to its end) and
    its largest stretches, with the copies around them."""
    h2d = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e["cat"] == "h2d")
    if not h2d:
        return
    idle, end_prev, name_prev = [], start, "trace start"
    for s, e, n in h2d:
        if s > end_prev:
            idle.append((s - end_prev, name_prev, n))
        if e > end_prev:
            end_prev, name_prev = e, n
    if end > end_prev:
        idle.append((end - end_prev, name_prev, "trace end"))
    print(f"h2d idle {sum(g for g, _, _ in idle) / 1e3:.1f} of {(end - start) / 1e3:.1f}; largest:")
    for g, n0, n1 in sorted(idle, reverse=True)[:top]:
        print(f"    idle {g / 1e3:8.2f}  after copy {n0} before copy {n1}")


def host_phases(ev):
    """The median and 90th percentile of each named host phase that is not
    one layer's (a decode step's admit, embedding, sampling...)."""
    by = {}
    for e in ev:
        if e["cat"] == "host" and not e["name"].startswith("model."):
            by.setdefault(e["name"], []).append(e["dur"] / 1e3)
    for name, xs in sorted(by.items()):
        xs.sort()
        print(f"host {name}: {len(xs)} spans, median {xs[len(xs) // 2]:.2f}, "
              f"p90 {xs[min(len(xs) - 1, int(0.9 * len(xs)))]:.2f}")


def spread(stats):
    """The steps' median, 10th and 90th percentiles (wall, compute busy, h2d
    busy) and the count whose compute outlasted their copies."""
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3
    for i, what in enumerate(("wall", "compute busy", "h2d busy")):
        xs = [t[i] for t in stats]
        print(f"all steps, {what}: median {pct(xs, 0.5):.1f}, "
              f"p10 {pct(xs, 0.1):.1f}, p90 {pct(xs, 0.9):.1f}")
    bound = sum(1 for _, c, h in stats if c > h)
    print(f"compute-bound steps (compute busy above h2d busy): {bound} of {len(stats)}")


if __name__ == "__main__":
    main()

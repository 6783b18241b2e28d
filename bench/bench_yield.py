"""What one busy background thread costs a training loop that keeps every core busy, by its CPU
priority (normal, SCHED_IDLE) and its kind of work (Python that holds the GIL, xxh3 over 1 MiB
buffers, which releases it). The reason for `background_yield_s` (checkpointing/save/yielding.py).

A torch MLP trains with as many intra-op threads as the machine has cores; one background thread
per priority waits, and in each phase at most one of them works without pause. Phases of
`--phase-s` seconds are interleaved over `--rounds` rounds (so that the machine's drift hits every
phase alike); the table gives each phase's median step time and its ratio to the phase with no
background work.

    python bench/bench_yield.py [--rounds 4] [--phase-s 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch
import xxhash

PHASES = ("none", "python_idle", "xxh3_idle", "python_normal", "xxh3_normal")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--phase-s", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="intra-op threads (default: every core)")
    p.add_argument("--json", default=None)
    P = p.parse_args(argv)
    if not hasattr(os, "SCHED_IDLE"):
        sys.exit("needs Linux (SCHED_IDLE)")
    torch.set_num_threads(P.threads)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x = torch.randn(256, 1024)
    buf = bytearray(1 << 20)
    phase = {"now": "none"}
    stop = threading.Event()

    def step() -> None:
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()

    def background(suffix: str, idle: bool) -> None:
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while not stop.is_set():
            now = phase["now"]
            if now == "python" + suffix:
                s = 0
                for i in range(2000):  # holds the GIL
                    s += i * i
            elif now == "xxh3" + suffix:
                xxhash.xxh3_128_digest(buf)  # releases the GIL while it hashes
            else:
                time.sleep(0.002)

    workers = [threading.Thread(target=background, args=("_idle", True), daemon=True),
               threading.Thread(target=background, args=("_normal", False), daemon=True)]
    for w in workers:
        w.start()
    for _ in range(3):
        step()
    steps: dict[str, list[float]] = {ph: [] for ph in PHASES}
    for _ in range(P.rounds):
        for ph in PHASES:
            phase["now"] = ph
            time.sleep(0.05)
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < P.phase_s:
                step()
                n += 1
            steps[ph].append((time.perf_counter() - t0) / n)
    stop.set()
    base = statistics.median(steps["none"])
    print(f"{P.threads} intra-op threads on {os.cpu_count()} CPUs, torch {torch.__version__}, {P.rounds} rounds of {P.phase_s} s per phase\n")
    print("| background thread | step (median) | x no background | per round |")
    print("|---|---:|---:|---|")
    rows = {}
    for ph in PHASES:
        med = statistics.median(steps[ph])
        rows[ph] = {"step_s": med, "ratio": med / base, "rounds": steps[ph]}
        print(f"| {ph} | {med * 1e3:.1f} ms | {med / base:.2f} | {', '.join(f'{v * 1e3:.0f}' for v in steps[ph])} |")
    if P.json:
        with open(P.json, "w") as fh:
            json.dump({"threads": P.threads, "cpus": os.cpu_count(), "torch": torch.__version__, "phases": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

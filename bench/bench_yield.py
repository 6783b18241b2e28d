"""What one busy background thread costs a training loop that keeps every core busy, by its CPU
priority (normal, SCHED_IDLE) and its kind of work (Python that holds the GIL, xxh3 over 1 MiB
buffers, which releases it). The reason for `background_yield_s` (checkpointing/save/yielding.py).

A torch MLP trains with as many intra-op threads as the machine has cores; one background thread
per priority waits, and in each phase at most one of them works without pause. Phases of
`--phase-s` seconds are interleaved over `--rounds` rounds (so that the machine's drift hits every
phase alike); the table gives each phase's median step time and its ratio to the phase with no
background work.

    python bench/bench_yield.py [--rounds 4] [--phase-s 3] [--json out.json]
    python bench/bench_yield.py --model transformer --phase-s 5 --rounds 3   # the 0.7 GB transformer + AdamW of bench_core.py

`--model transformer` trains bench_core.py's transformer instead (a step of about a second that
dispatches thousands of small ops, each taking the GIL back), adds idle-priority phases that copy
64 MiB with memmove and write 32 MiB O_DIRECT blocks, and reports the loop thread's time asleep
per step (wall time less its CPU and run-queue time, from /proc/thread-self/schedstat; on a
virtual machine stolen time counts as asleep).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import threading
import time

import torch
import xxhash

PHASES = ("none", "python_idle", "xxh3_idle", "python_normal", "xxh3_normal")
PHASES_TRANSFORMER = ("none", "python_idle", "xxh3_idle", "memmove_idle", "write_idle")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--phase-s", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="intra-op threads (default: every core)")
    p.add_argument("--json", default=None)
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"), help="for the write phase")
    P = p.parse_args(argv)
    if not hasattr(os, "SCHED_IDLE"):
        sys.exit("needs Linux (SCHED_IDLE)")
    torch.set_num_threads(P.threads)
    torch.manual_seed(0)
    phases = PHASES if P.model == "mlp" else PHASES_TRANSFORMER
    buf = bytearray(1 << 20)
    phase = {"now": "none"}
    stop = threading.Event()
    if P.model == "mlp":
        net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        x = torch.randn(256, 1024)

        def step() -> None:
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_core

        trainer, count = bench_core.Trainer(0.7, 4, 64, None, seed=0), [0]

        def step() -> None:
            count[0] += 1
            trainer.step(count[0], None)
    big = mmap.mmap(-1, 64 << 20)
    src = mmap.mmap(-1, 64 << 20)
    big.write(os.urandom(1 << 20) * 64)
    src.write(os.urandom(1 << 20) * 64)
    big_at, src_at = (ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in (big, src))
    out = None
    if P.model == "transformer":
        os.makedirs(P.dir, exist_ok=True)
        out = os.open(os.path.join(P.dir, "yield-write.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    pos = [0]

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
            elif now == "memmove" + suffix:
                ctypes.memmove(big_at, src_at, 64 << 20)  # releases the GIL
            elif now == "write" + suffix and out is not None:
                os.pwrite(out, memoryview(big)[: 32 << 20], pos[0])
                pos[0] = (pos[0] + (32 << 20)) % (512 << 20)
            else:
                time.sleep(0.002)

    workers = [threading.Thread(target=background, args=("_idle", True), daemon=True),
               threading.Thread(target=background, args=("_normal", False), daemon=True)]
    for w in workers:
        w.start()
    for _ in range(3 if P.model == "mlp" else 2):
        step()
    steps: dict[str, list[float]] = {ph: [] for ph in phases}
    asleep: dict[str, list[float]] = {ph: [] for ph in phases}
    for _ in range(P.rounds):
        for ph in phases:
            phase["now"] = ph
            time.sleep(0.05)
            t0, n, cpu0 = time.perf_counter(), 0, _schedstat()
            while time.perf_counter() - t0 < P.phase_s:
                step()
                n += 1
            wall, cpu1 = time.perf_counter() - t0, _schedstat()
            steps[ph].append(wall / n)
            asleep[ph].append((wall - (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / n)
    stop.set()
    if out is not None:
        os.close(out)
        os.unlink(os.path.join(P.dir, "yield-write.bin"))
    base = statistics.median(steps["none"])
    print(f"{P.model}: {P.threads} intra-op threads on {os.cpu_count()} CPUs, torch {torch.__version__}, {P.rounds} rounds of {P.phase_s} s per phase\n")
    print("| background thread | step (median) | x no background | loop thread asleep per step (median) | per round |")
    print("|---|---:|---:|---:|---|")
    rows = {}
    for ph in phases:
        med = statistics.median(steps[ph])
        rows[ph] = {"step_s": med, "ratio": med / base, "rounds": steps[ph], "asleep_s": statistics.median(asleep[ph])}
        print(f"| {ph} | {med * 1e3:.1f} ms | {med / base:.2f} | {statistics.median(asleep[ph]) * 1e3:.0f} ms | "
              f"{', '.join(f'{v * 1e3:.0f}' for v in steps[ph])} |")
    if P.json:
        with open(P.json, "w") as fh:
            json.dump({"threads": P.threads, "cpus": os.cpu_count(), "torch": torch.__version__, "phases": rows}, fh, indent=1)
    return 0


def _schedstat() -> tuple[float, float]:
    """This thread's time on a CPU and waiting for one, in seconds."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run) / 1e9, int(wait) / 1e9


if __name__ == "__main__":
    sys.exit(main())

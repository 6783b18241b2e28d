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
    python bench/bench_yield.py --model transformer --phases python_idle,pythonyield_idle,merge_idle,mergeheld_idle --merge 64x256
    python bench/bench_yield.py --model probe --phases python_idle,pythonyield_idle,merge_idle,mergeheld_idle

`--model transformer` trains bench_core.py's transformer instead (a step of about a second that
dispatches thousands of small ops, each taking the GIL back), adds idle-priority phases that copy
64 MiB with memmove and write 32 MiB O_DIRECT blocks, and reports the loop thread's time asleep
per step (wall time less its CPU and run-queue time, from /proc/thread-self/schedstat; on a
virtual machine stolen time counts as asleep). Its Python phases: `python_idle` holds the GIL until
CPython's switch interval takes it away, `pythonyield_idle` hands it over every millisecond
(checkpointing/format/handoff.py), `merge_idle` runs rank 0's commit work of `--merge` ranks x
DTensors (bench_dist.py's synthetic reports: parse, merge, encode, decode) again and again, and
`mergeheld_idle` the same with handoff() never releasing (the GIL held as before handoff.py).

`--model probe` trains nothing: the loop thread sleeps 0.5 ms again and again and records how
late it runs again, which is how long it waited for the GIL (it needs almost no CPU, so a
busy core or a stolen one hardly delays it); the table then gives that delay's median and 99th
percentile per phase. Its phase `save` has CheckpointManager save a `--save-gb` transformer + AdamW
(bench_core.py) again and again, each as soon as the last is durable: how long a save's own threads
keep the GIL from a thread that wants it. `--blame MS` notes, at every wake later than MS ms, where
each checkpoint thread not asleep on a lock or queue is (the innermost frames of its stack): the
Python that held the GIL ended there (a call that releases it, handoff(), or the switch interval).
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
PHASES_TRANSFORMER = ("none", "python_idle", "pythonyield_idle", "merge_idle", "xxh3_idle", "memmove_idle", "write_idle")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--phase-s", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="intra-op threads (default: every core)")
    p.add_argument("--json", default=None)
    p.add_argument("--model", choices=("mlp", "transformer", "probe"), default="mlp")
    p.add_argument("--phases", default=None, help="comma-separated subset of the phases (default: all of the model's)")
    p.add_argument("--merge", default="64x256", help="merge phase: rank 0's merge of RANKSxDTENSORS synthetic reports, again and again")
    p.add_argument("--save-gb", type=float, default=0.7, help="probe's save phase: a model + AdamW of this size, saved by CheckpointManager")
    p.add_argument("--blame", type=float, default=None, metavar="MS",
                   help="probe: when a wake is later than MS ms, note where the save's threads were (the Python that held the GIL ended there)")
    p.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"), help="for the write phase")
    P = p.parse_args(argv)
    if not hasattr(os, "SCHED_IDLE"):
        sys.exit("needs Linux (SCHED_IDLE)")
    torch.set_num_threads(P.threads)
    torch.manual_seed(0)
    phases = PHASES if P.model != "transformer" else PHASES_TRANSFORMER
    if P.phases:
        phases = tuple(["none"] + [ph for ph in P.phases.split(",") if ph != "none"])
    merge = _merge_work(*map(int, P.merge.split("x"))) if any(ph.startswith("merge") for ph in phases) else None
    buf = bytearray(1 << 20)
    phase = {"now": "none"}
    stop = threading.Event()
    late: dict[str, list[float]] = {}
    full_gcs: dict[str, list[float]] = {}
    blamed: dict[tuple, list[float]] = {}
    late_wakes: list[float] = []
    if P.model == "probe":
        saver = _saver(P.save_gb, P.dir) if "save" in phases else None
        import gc

        gc_start: dict[int, float] = {}

        def on_gc(stage: str, info: dict) -> None:  # full collections, by the phase they fell in: each holds the GIL throughout
            if info["generation"] == 2:
                if stage == "start":
                    gc_start[threading.get_ident()] = time.perf_counter()
                else:
                    full_gcs.setdefault(phase["now"], []).append(time.perf_counter() - gc_start.pop(threading.get_ident(), time.perf_counter()))

        gc.callbacks.append(on_gc)

        def step() -> None:
            if phase["now"] == "save" and saver is not None:
                saver()  # a save of its own whenever the last one is durable; its threads work while this one probes
            mine = late.setdefault(phase["now"], [])
            for _ in range(100):
                t0 = time.perf_counter()
                time.sleep(0.0005)
                mine.append(time.perf_counter() - t0 - 0.0005)
                if P.blame is not None and mine[-1] * 1e3 > P.blame:
                    late_wakes.append(mine[-1])
                    _blame(blamed, mine[-1])
    elif P.model == "mlp":
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
            elif now == "pythonyield" + suffix:  # the same, handing the GIL over every millisecond (gil.py)
                s, t_end = 0, time.perf_counter() + 0.001
                while time.perf_counter() < t_end:
                    for i in range(100):
                        s += i * i
                time.sleep(0)
            elif now == "merge" + suffix and merge is not None:  # rank 0's commit work (parse, merge, encode, decode)
                merge(True)
            elif now == "mergeheld" + suffix and merge is not None:
                merge(False)
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
    if late:
        print("\n| background thread | loop thread's wait for the GIL after a 0.5 ms sleep: mean | median | 99th percentile | max | full collections (ms each) |")
        print("|---|---:|---:|---:|---:|---|")
        for ph in phases:
            xs = sorted(late[ph])
            rows[ph].update(late_median_s=xs[len(xs) // 2], late_p99_s=xs[int(len(xs) * 0.99)], late_max_s=xs[-1])
            gcs = ", ".join(f"{d * 1e3:.0f}" for d in full_gcs.get(ph, [])) or "none"
            print(f"| {ph} | {sum(xs) / len(xs) * 1e3:.3f} ms | {xs[len(xs) // 2] * 1e3:.3f} ms | {xs[int(len(xs) * 0.99)] * 1e3:.2f} ms | "
                  f"{xs[-1] * 1e3:.1f} ms | {gcs} |")
    if late_wakes:
        print(f"\nWakes later than {P.blame} ms: {len(late_wakes)}, {sum(late_wakes) * 1e3:.0f} ms late in all. Where the checkpoint threads "
              "not asleep on a lock or queue were then (innermost frame first; a wake may name several threads, or none), by the lateness:")
        for where, xs in sorted(blamed.items(), key=lambda kv: -sum(kv[1]))[:25]:
            print(f"  {sum(xs) * 1e3:7.1f} ms  {len(xs):5d} x  max {max(xs) * 1e3:5.1f}  {' < '.join(where)}")
    if P.json:
        with open(P.json, "w") as fh:
            json.dump({"threads": P.threads, "cpus": os.cpu_count(), "torch": torch.__version__, "phases": rows}, fh, indent=1)
    return 0


_WAITING = ("threading.py", "queue.py")


def _blame(blamed: dict[tuple, list[float]], late_s: float) -> None:
    """Where each checkpoint thread is now that the probe has the GIL back: the innermost frames of
    its stack (the GIL was released there: a C call that drops it, handoff(), or the switch interval)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, "")
        if not name.startswith("ckpt") or os.path.basename(frame.f_code.co_filename) in _WAITING:
            continue  # not a checkpoint thread, or one asleep on a lock, an event or a queue (it held no GIL)
        where, f = [name], frame
        while f is not None and len(where) < 5:
            where.append(f"{f.f_code.co_name}@{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}")
            f = f.f_back
        blamed.setdefault(tuple(where), []).append(late_s)


def _saver(size_gb: float, root: str):
    """The probe's `save` phase: bench_core's transformer + AdamW state, saved by a CheckpointManager
    with its defaults (its threads at SCHED_IDLE for background_yield_s), a new save as soon as
    the last one is durable."""
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_core

    from checkpointing import CheckpointManager

    trainer = bench_core.Trainer(size_gb, 1, 16, None, seed=0)
    os.makedirs(root, exist_ok=True)
    import atexit
    import shutil

    ckdir = tempfile.mkdtemp(prefix="yield-save-", dir=root)
    manager = CheckpointManager(ckdir, keep_local=2)
    atexit.register(shutil.rmtree, ckdir, True)  # runs after the close below: atexit is last-in, first-out
    atexit.register(manager.close)
    state = {"model": trainer.model, "optim": trainer.opt}
    last: list = [None, 0]

    def save() -> None:
        if last[0] is None or last[0].done():
            last[1] += 1
            last[0] = manager.save(last[1], state)

    return save


def _merge_work(world: int, tensors: int):
    """Rank 0's part of a commit of `world` ranks' reports of `tensors` DTensors each, as the
    coordinator runs it (dist/store_coordinator.py): parse every report, merge, encode, decode."""
    import json

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_dist import synthetic_parts

    from checkpointing.format import handoff
    from checkpointing.format.gcpause import gc_paused
    from checkpointing.format.rank_reports import merge_parts, part_from

    blobs = synthetic_parts(world, tensors)

    def once(hand_off: bool) -> None:
        handoff.INTERVAL_S = 0.001 if hand_off else float("inf")
        with gc_paused():
            parts = []
            for b in blobs:
                handoff.handoff()  # as the coordinator parses the reports
                parts.append(part_from(json.loads(b)))
            merge_parts(1, parts, ("t",) * world)

    return once


def _schedstat() -> tuple[float, float]:
    """This thread's time on a CPU and waiting for one, in seconds."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run) / 1e9, int(wait) / 1e9


if __name__ == "__main__":
    sys.exit(main())

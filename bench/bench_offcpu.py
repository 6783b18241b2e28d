"""Where the training threads sleep while a save runs: an off-CPU profile from outside the process.

A child process trains the 0.7 GB transformer + AdamW of bench_core.py (2 intra-op threads) and
saves every `--cycle` steps with our CheckpointManager (defaults, or `--no-yield`); it writes the
start and end of every step and whether a save's background work was in flight. This process
samples, every `--interval-ms`, the state of the child's training threads (/proc/<pid>/task/<tid>/stat)
and, for a sleeping one, the innermost kernel frames of /proc/<pid>/task/<tid>/stack (root only).
Each sample is attributed to its step; the tables give the time in each state and, per kernel wait
site, the sleeping time per step in save windows against steps with nothing in flight. No GIL of
the child is touched, but the sampler takes CPU itself (printed): on a machine with few cores it
competes with the threads it watches, and with a yielding save's threads for the idle moments.

    python bench/bench_offcpu.py [--steps 60] [--cycle 6] [--no-yield]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, os, sys, time, threading
sys.path.insert(0, sys.argv[1])
import torch
import bench_core as B
from checkpointing import CheckpointManager
torch.set_num_threads(2)
steps, cycle, out, ckdir, no_yield = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6] == "1"
tr = B.Trainer(0.7, 4, 64, None, seed=0)
for i in range(2):
    tr.step(i, None)
mgr = CheckpointManager(ckdir, background_yield_s=None if no_yield else 30.0)
mgr.save(0, {"model": tr.model, "optim": tr.opt}).wait()
others = [t.native_id for t in threading.enumerate() if t is not threading.main_thread()]  # ours, not torch's
print("READY", threading.get_native_id(), *others, flush=True)
sys.stdin.readline()
log, handle = [], None
for s in range(1, steps + 1):
    busy = handle is not None and not handle.done()
    t0 = time.time()
    if s % cycle == 0:
        handle = mgr.save(s, {"model": tr.model, "optim": tr.opt})
        busy = True
    tr.step(s, None)
    log.append({"step": s, "t0": t0, "t1": time.time(), "busy": busy or (handle is not None and not handle.done())})
mgr.close()
json.dump(log, open(out, "w"))
"""


def sample(pid: int, tids: list[int], until: callable, interval: float) -> list[tuple[float, int, str, str]]:
    out = []
    while not until():
        t = time.time()
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
                if state in ("S", "D"):
                    with open(f"/proc/{pid}/task/{tid}/stack") as fh:
                        frames = [ln.split("]", 1)[1].strip().split("+")[0] for ln in fh.read().splitlines() if "]" in ln]
                    site = " < ".join(frames[:3]) if frames else "?"
                else:
                    site = ""
                out.append((t, tid, state, site))
            except OSError:
                pass
        time.sleep(interval)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--cycle", type=int, default=6)
    p.add_argument("--interval-ms", type=float, default=2.0)
    p.add_argument("--no-yield", action="store_true")
    p.add_argument("--top", type=int, default=12)
    P = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="offcpu-")
    out = os.path.join(work, "steps.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", CHILD, HERE, str(P.steps), str(P.cycle), out, os.path.join(work, "ck"),
                              "1" if P.no_yield else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline().split()
    assert line and line[0] == "READY", line
    main_tid, python_threads = int(line[1]), {int(t) for t in line[2:]}
    # the training threads: the main thread and torch's intra-op threads (every task that is not a Python thread)
    tids = [main_tid] + [int(t) for t in os.listdir(f"/proc/{child.pid}/task") if int(t) != main_tid and int(t) not in python_threads]
    child.stdin.write("go\n")
    child.stdin.flush()
    t_start, cpu_start = time.time(), time.process_time()
    samples = sample(child.pid, tids, lambda: child.poll() is not None, P.interval_ms / 1000)
    sampler_load = (time.process_time() - cpu_start) / max(1e-9, time.time() - t_start)
    child.wait()
    with open(out) as f:
        steps = json.load(f)
    shutil.rmtree(work, ignore_errors=True)
    kind = {}
    for st in steps:
        kind[st["step"]] = "save" if st["busy"] else "quiet"
    n_steps = collections.Counter(kind.values())
    sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_state: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t, tid, state, site in samples:
        st = next((s for s in steps if s["t0"] <= t < s["t1"]), None)
        if st is None:
            continue
        k = kind[st["step"]]
        who = "loop" if tid == main_tid else "intra-op"
        per_state[(who, state)][k] += 1
        if site:
            sites[(who, site)][k] += 1
    ms = P.interval_ms
    print(f"{'no-yield' if P.no_yield else 'yield'}: {n_steps['save']} steps with a save in flight, {n_steps['quiet']} without; "
          f"{len(tids)} training threads; a sample every {ms} ms (+ the reads) per thread; this sampler used {sampler_load:.2f} CPUs\n")
    print("| thread | state | ms per save step | ms per quiet step | extra |\n|---|---|---:|---:|---:|")
    for (who, state), c in sorted(per_state.items()):
        a, b = c["save"] * ms / max(1, n_steps["save"]), c["quiet"] * ms / max(1, n_steps["quiet"])
        print(f"| {who} | {state} | {a:.0f} | {b:.0f} | {a - b:+.0f} |")
    print("\n| thread | where it sleeps (innermost kernel frames) | ms per save step | ms per quiet step | extra |\n|---|---|---:|---:|---:|")
    rows = []
    for (who, site), c in sites.items():
        a, b = c["save"] * ms / max(1, n_steps["save"]), c["quiet"] * ms / max(1, n_steps["quiet"])
        rows.append((a - b, who, site, a, b))
    for extra, who, site, a, b in sorted(rows, reverse=True)[: P.top]:
        print(f"| {who} | {site} | {a:.0f} | {b:.0f} | {extra:+.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

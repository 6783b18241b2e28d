#!/usr/bin/env python
"""Save -> durable against the disk's floor, at several sizes (issue 21, item 3).

    python bench/bench_durable.py                      # 0.5, 2 and 8 GB, 3 repetitions (~4 min on 2 cores)
    python bench/bench_durable.py --sizes 0.5 --reps 2 # smoke run

For each size, a module of fp32 parameters (64 MiB, 16 MiB and a few odd-sized small ones, so chunks
also lie off page boundaries) is saved by a CheckpointManager (one rank, defaults but keep_local=1)
and timed from save() to the handle's wait() returning: staged, digested, written with O_DIRECT,
fsynced, committed. Every save changes every byte first (outside the timing), so each is a full
write of the state, as in dense training. The floor, measured in the same run and interleaved
with ours (floor, ours, floor, ours, ...): an O_DIRECT write + fsync of the same number of bytes
in 64 MiB blocks from a page-aligned, pre-faulted buffer to a fresh file on the same disk
(bench/_common.py write_file), the best of two per repetition; and, since a save writes over a
retired step's pack file (a spare: docs/format.md), the same write over the blocks of an existing
file of that size (no truncation), once per repetition: a file of its own, written over in every
repetition, so that it is as old as the spare our save writes over (a file written over right after
it was written is faster on this disk: the host still holds it). Reported: median seconds of each,
and ours / floor.
The first save of each size (which allocates the staging pool) is reported apart.

Results: a markdown table on stdout and in bench/out/durable.md, JSON in bench/out/durable.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

from checkpointing import CheckpointManager  # noqa: E402

MiB = 1 << 20


def make_state(nbytes: int) -> torch.nn.Module:
    """A module of fp32 parameters adding up to about `nbytes`: 64 MiB ones, then 16 MiB ones, then
    small odd ones. Passed as a module, its tensors take the default deferred copy (after save()
    returns, on the I/O thread), as a model and optimizer in a training loop do."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    left, n = nbytes, 0
    for size in (64 * MiB, 16 * MiB):
        while left >= size:
            state[f"t{n:04d}"] = torch.rand(size // 4, generator=g)
            left -= size
            n += 1
    for numel in (997, 4093, 12289, 65521):  # off page boundaries
        if left >= numel * 4:
            state[f"t{n:04d}"] = torch.rand(numel, generator=g)
            left -= numel * 4
            n += 1
    module = torch.nn.Module()
    for key, t in state.items():
        module.register_parameter(key, torch.nn.Parameter(t))
    return module


def _settle(ckdir: str) -> None:
    """Wait until keep_local=1 removed the previous step's files (after the save's waiters were
    released), so that the next floor measurement has the disk to itself."""
    deadline = time.time() + 30
    while time.time() < deadline and len([n for n in os.listdir(ckdir) if n.startswith("step-")]) > 1:
        time.sleep(0.01)


def huge_share(address: int, length: int) -> float | None:
    """The share of [address, address + length) backed by transparent huge pages (/proc/self/smaps)."""
    huge = size = 0
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < address + length and address < hi
                    if inside:
                        size += min(hi, address + length) - max(lo, address)
                elif inside and head == "AnonHugePages:":
                    huge += int(line.split()[1]) * 1024
    except OSError:
        return None
    return huge / size if size else None


def run(size_gb: float, reps: int, out: str, log, pool_floor: bool = False) -> dict:
    nbytes = int(size_gb * 1e9)
    model = make_state(nbytes)
    state = {"model": model}
    total = sum(t.numel() * 4 for t in model.parameters())
    buf = C.aligned_buffer(64 * MiB)  # write_file writes 64 MiB blocks from it, over and over
    ckdir = os.path.join(out, f"ck-{size_gb}")
    shutil.rmtree(ckdir, ignore_errors=True)
    floors, over, ours, stalls, pool_floors, phases = [], [], [], [], [], []
    with CheckpointManager(ckdir, keep_local=1) as mgr:
        t0 = time.perf_counter()
        first = mgr.save(0, state).wait()
        first_s = time.perf_counter() - t0
        _settle(ckdir)
        C.write_file(os.path.join(out, "floor-over.bin"), total, buf, direct=True)  # written over in every repetition
        for r in range(reps):
            floor = min(C.write_file(os.path.join(out, "floor.bin"), total, buf, direct=True) for _ in range(2))
            os.unlink(os.path.join(out, "floor.bin"))
            over.append(C.write_file(os.path.join(out, "floor-over.bin"), total, buf, direct=True, fresh=False))
            with torch.no_grad():
                for t in model.parameters():
                    t.add_(1.0)  # every byte changes: a full write
            gc.collect()
            t0 = time.perf_counter()
            stats = mgr.save(r + 1, state).wait()
            took = time.perf_counter() - t0
            _settle(ckdir)
            floors.append(floor)
            ours.append(took)
            stalls.append(stats.stall_s)
            phases.append({"snapshot_s": stats.snapshot_s, "write_s": stats.write_s, "commit_s": stats.commit_s})
            extra = ""
            if pool_floor:
                # the same O_DIRECT write, from the staging pool's own pages (the image of the save
                # just made) instead of one hot 64 MiB buffer: the disk and the pool's page backing
                n = total // C.PAGE * C.PAGE
                path = os.path.join(out, "floor-pool.bin")
                pool_floors.append(C.write_from(path, mgr._pool.view[:n], direct=True))
                os.unlink(path)
                extra = f", floor from the pool {pool_floors[-1]:.3f} s"
            log(f"  {size_gb} GB rep {r}: floor {floor:.3f} s (over a file {over[-1]:.3f} s), ours {took:.3f} s ({took / floor:.2f}x), "
                f"stall {stats.stall_s:.3f} s, written {stats.bytes_written / 1e9:.3f} GB; snapshot "
                f"{stats.snapshot_s:.3f} write {stats.write_s:.3f} commit {stats.commit_s:.3f}{extra}")
        pool_huge = huge_share(mgr._pool.address, mgr._pool.capacity)
    del buf
    os.unlink(os.path.join(out, "floor-over.bin"))
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"size_gb": size_gb, "bytes": total, "floor_s": floors, "over_s": over, "ours_s": ours, "stall_s": stalls,
            "first_save_s": first_s, "first_stall_s": first.stall_s, "phases": phases,
            "pool_floor_s": pool_floors, "pool_huge_share": pool_huge,
            "ratio": C.median(ours) / C.median(floors), "ratio_over": C.median(ours) / C.median(over)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.0, 8.0], help="state sizes in GB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "out", "durable-run"), help="scratch dir (on the disk to measure)")
    p.add_argument("--pool-floor", action="store_true",
                   help="also time the O_DIRECT write from the staging pool's pages (after each save), and report their huge-page share")
    p.add_argument("--label", default="", help="a name for this run in the table (e.g. the code's version)")
    p.add_argument("--md", default=os.path.join(HERE, "out", "durable.md"))
    p.add_argument("--json", default=os.path.join(HERE, "out", "durable.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for size in args.sizes:
        rows.append(run(size, args.reps, args.out, print, args.pool_floor))
        gc.collect()
    machine = C.machine_description()
    lines = [f"### save -> durable vs an O_DIRECT write of the same bytes ({datetime.date.today().isoformat()}"
             f"{', ' + args.label if args.label else ''})", "",
             f"{C.machine_line(args.out)}; medians of {args.reps} interleaved repetitions", "",
             "| state | O_DIRECT write + fsync, new file | the same over an existing file | ours save() -> durable | ratio | ratio to over a file | each repetition | stall | first save -> durable |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        each = ", ".join(f"{o / f:.2f}" for o, f in zip(r["ours_s"], r["floor_s"]))
        lines.append(f"| {r['bytes'] / 1e9:.2f} GB | {C.median(r['floor_s']):.3f} s | {C.median(r['over_s']):.3f} s | "
                     f"{C.median(r['ours_s']):.3f} s | **{r['ratio']:.2f}** | {r['ratio_over']:.2f} | {each} | "
                     f"{C.median(r['stall_s']):.3f} s | {r['first_save_s']:.3f} s |")
    if args.pool_floor:
        lines += ["", "The same O_DIRECT write from the staging pool's own pages, right after each save:", ""]
        for r in rows:
            share = r["pool_huge_share"]
            lines.append(f"- {r['bytes'] / 1e9:.2f} GB: {C.median(r['pool_floor_s']):.3f} s (ours / it "
                         f"{C.median(r['ours_s']) / C.median(r['pool_floor_s']):.2f}); pool in huge pages: "
                         f"{'?' if share is None else f'{share:.0%}'}")
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(os.path.dirname(args.md), exist_ok=True)
    with open(args.md, "a") as f:
        f.write(md + "\n")
    with open(args.json, "a") as f:
        f.write(json.dumps({"label": args.label, "machine": machine, "rows": rows}) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()

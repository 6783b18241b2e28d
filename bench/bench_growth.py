#!/usr/bin/env python
"""Does anything grow over many saves? (issue 21, item 5)

    python bench/bench_growth.py                       # 1 GB state, 100 saves (~3 min on 2 cores)
    python bench/bench_growth.py --size-gb 0.2 --saves 30

One CheckpointManager (one rank, keep_local=2, defaults otherwise) saves the module of
bench_durable.py `--saves` times; before every save every tensor changes (outside the timing), so
each save is a full write, as in dense training. After each save is durable the bench records:
the process's RSS, the staging pool (mgr.staging_bytes, against the state's bytes), open file
descriptors, threads, Python heap (tracemalloc), the bytes and step directories on disk, the call's
stall and save -> durable. Reported: the first ten saves after the first against the last ten
(medians), the per-save slope of a least-squares line over saves 11..N, and the lines of code
whose Python allocations grew most between save 10 and the last (tracemalloc; it slows Python
allocation, so --no-tracemalloc for timings).

Results: a markdown table on stdout and in bench/out/growth.md, JSON in bench/out/growth.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import statistics
import sys
import threading
import tracemalloc

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402
from bench_durable import make_state  # noqa: E402

from checkpointing import CheckpointManager  # noqa: E402


def disk_usage(path: str) -> tuple[int, int]:
    """(bytes of the files under path, step directories in it)."""
    total = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except FileNotFoundError:
                pass
    steps = sum(1 for n in os.listdir(path) if n.startswith("step-"))
    return total, steps


def sample(mgr: CheckpointManager, ckdir: str, traced: bool) -> dict:
    used, steps = disk_usage(ckdir)
    return {
        "rss": C.rss_bytes(),
        "staging": mgr.staging_bytes,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "py_heap": tracemalloc.get_traced_memory()[0] if traced else None,
        "disk": used,
        "step_dirs": steps,
        "python_threads": threading.active_count(),
    }


def slope(ys: list) -> float:
    xs = list(range(len(ys)))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def run(P) -> dict:
    module = make_state(int(P.size_gb * 1e9))
    params = list(module.parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in params)
    ckdir = os.path.join(P.out, "ck")
    shutil.rmtree(ckdir, ignore_errors=True)
    if P.tracemalloc:
        tracemalloc.start(8)
    rows, snap10 = [], None
    with CheckpointManager(ckdir, keep_local=2) as mgr:
        for i in range(1, P.saves + 1):
            with torch.no_grad():
                for p in params:
                    p.add_(1.0)
            gc.collect()
            t0 = C.now()
            h = mgr.save(i, {"model": module})
            call = C.now() - t0
            h.wait()
            mgr.wait()  # the retired step's files unlinked too, so the disk column is the steady state
            row = {"save": i, "call_s": call, "durable_s": C.now() - t0}
            row.update(sample(mgr, ckdir, P.tracemalloc))
            rows.append(row)
            if i == 10 and P.tracemalloc:
                snap10 = tracemalloc.take_snapshot()
            if i % 10 == 0:
                print(f"  save {i}: RSS {row['rss'] / 1e6:.0f} MB, fds {row['fds']}, threads {row['threads']}, "
                      f"durable {row['durable_s']:.3f} s", file=sys.stderr, flush=True)
        growth = []
        if snap10 is not None:
            last = tracemalloc.take_snapshot()
            flt = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
            for st in last.filter_traces(flt).compare_to(snap10.filter_traces(flt), "lineno")[:8]:
                if st.size_diff > 0:
                    frame = st.traceback[0]
                    growth.append({"where": f"{os.path.relpath(frame.filename, os.path.dirname(HERE))}:{frame.lineno}",
                                   "bytes": st.size_diff, "blocks": st.count_diff})
        n_stats = len(mgr.stats())
    if P.tracemalloc:
        tracemalloc.stop()
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"size_gb": P.size_gb, "state_bytes": state_bytes, "saves": P.saves, "rows": rows, "py_growth": growth,
            "stats_kept": n_stats}


FIELDS = (("rss", "process RSS", 1e6, "MB"), ("staging", "staging pool", 1e6, "MB"), ("fds", "open file descriptors", 1, ""),
          ("threads", "threads", 1, ""), ("py_heap", "Python heap (tracemalloc)", 1e3, "kB"), ("disk", "bytes on disk", 1e6, "MB"),
          ("step_dirs", "step directories", 1, ""), ("call_s", "save() call", 1e-3, "ms"), ("durable_s", "save -> durable", 1, "s"))


def report(res: dict, P) -> str:
    rows = res["rows"]
    first, last = rows[1:11], rows[-10:]
    steady = rows[10:]
    L = [f"## Growth over {res['saves']} saves ({P.date})", "",
         f"Machine: {C.machine_line(P.out)}. State {res['state_bytes'] / 1e9:.2f} GB (a module of fp32 tensors), every byte "
         f"changed before each save, keep_local=2, tracemalloc {'on' if P.tracemalloc else 'off'}.", "",
         f"| what | saves 2-11 (median) | saves {len(rows) - 9}-{len(rows)} (median) | slope per save over saves 11-{len(rows)} |",
         "|---|---:|---:|---:|"]
    for key, label, scale, unit in FIELDS:
        if rows[0].get(key) is None:
            continue
        a = statistics.median(r[key] for r in first) / scale
        b = statistics.median(r[key] for r in last) / scale
        s = slope([r[key] for r in steady]) / scale
        L.append(f"| {label} | {a:,.3f} {unit} | {b:,.3f} {unit} | {s:+,.4f} {unit} |")
    L.append("")
    L.append(f"Staging pool / state bytes after every save: {sorted({r['staging'] / res['state_bytes'] for r in rows[1:]})}; "
             f"mgr.stats() holds {res['stats_kept']} records.")
    if res["py_growth"]:
        L.append("")
        L.append("Python allocations that grew most between save 10 and the last (tracemalloc, by line):")
        L.append("")
        L.append("| where | bytes | blocks |")
        L.append("|---|---:|---:|")
        for g in res["py_growth"]:
            L.append(f"| {g['where']} | {g['bytes']:+,} | {g['blocks']:+,} |")
    return "\n".join(L) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--saves", type=int, default=100)
    p.add_argument("--no-tracemalloc", dest="tracemalloc", action="store_false")
    p.add_argument("--out", default=os.path.join(HERE, "out", "growth-run"))
    p.add_argument("--json", default=os.path.join(HERE, "out", "growth.json"))
    p.add_argument("--md", default=os.path.join(HERE, "out", "growth.md"))
    p.add_argument("--date", default=datetime.date.today().isoformat())
    P = p.parse_args()
    if P.saves < 21:
        p.error("--saves must be at least 21 (the first ten are compared with the last ten)")
    os.makedirs(P.out, exist_ok=True)
    res = run(P)
    C.write_results({"date": P.date, "machine": C.machine_description(), **res}, report(res, P), P.json, P.md)
    shutil.rmtree(P.out, ignore_errors=True)


if __name__ == "__main__":
    main()

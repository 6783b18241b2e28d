#!/usr/bin/env python
"""Cold restore against the disk's read floor, at several sizes (issue 21, item 4).

    python bench/bench_restore.py                      # 0.5, 2 and 8 GB, 3 repetitions
    python bench/bench_restore.py --sizes 0.5 --reps 2 # smoke run

For each size, the module of bench_durable.py (fp32 parameters of 64 MiB, 16 MiB and a few odd
sizes) is saved once by a CheckpointManager (one rank, keep_local=1); the manager is closed, so its
staging pool is gone, and a fresh one (as a resumed job opens) restores the step into the live
module: preallocated targets, zeroed before each restore. Timed: restore(), cold (the step's files
evicted from the page cache with POSIX_FADV_DONTNEED first), every chunk verified.

The floor, interleaved with ours (floor, ours, floor, ours, ...): a cold O_DIRECT read of the very
files the restore reads, in 64 MiB blocks, with as many threads as the restore reads with
(READ_THREADS), each into its own page-aligned buffer: the device's speed at the same parallelism,
with no verification and no destination. Also reported: a single-stream cold O_DIRECT read and a
cold buffered read of the same files, for reference.

In place, no extra copy: the bench records each target's data_ptr before and after the restore
(all must be unchanged), and samples the process's RSS every 5 ms during the restore: the peak
growth over the RSS before it (a restore that staged the state in a buffer, then copied it into
the targets, would grow by about the state's size). The first restore is checked bit-exact (xxh3
of every tensor against the saved one's).

Results: a markdown table on stdout and in bench/out/restore.md, JSON in bench/out/restore.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import queue
import shutil
import sys
import threading

import torch
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402
from bench_durable import make_state  # noqa: E402

from checkpointing import CheckpointManager  # noqa: E402
from checkpointing.format.naming import step_dir  # noqa: E402
from checkpointing.restore.reading import READ_THREADS  # noqa: E402
from checkpointing.state.views import tensor_view  # noqa: E402

MiB = 1 << 20
BLOCK = 64 * MiB


def step_files(ckdir: str, step: int) -> list[str]:
    """The step's files the restore reads: its data files (the manifest and COMMIT are not counted)."""
    d = os.path.join(ckdir, step_dir(step))
    return sorted(f for f in C._files_under(d) if os.path.getsize(f) >= MiB)


def parallel_read(files: list[str], threads: int, *, direct: bool) -> tuple[float, int]:
    """Read every file whole, in BLOCK pieces spread over `threads` threads; (seconds, bytes)."""
    work: queue.Queue = queue.Queue()
    for f in files:
        size = os.path.getsize(f)
        for off in range(0, size, BLOCK):
            work.put((f, off))
    total = [0] * threads
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        buf = C.aligned_buffer(BLOCK, fill=None)
        mv = memoryview(buf)
        fds: dict[str, int] = {}
        try:
            while True:
                try:
                    f, off = work.get_nowait()
                except queue.Empty:
                    return
                fd = fds.get(f)
                if fd is None:
                    fd = fds[f] = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
                total[i] += os.preadv(fd, [mv], off)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            for fd in fds.values():
                os.close(fd)
            mv.release()
            buf.close()

    ts = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    t0 = C.now()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = C.now() - t0
    if errors:
        raise errors[0]
    return dt, sum(total)


def digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """xxh3-128 of each tensor's bytes (a bit-exact check that needs no second copy of the state)."""
    return [xxhash.xxh3_128(tensor_view(t.detach())).digest() for t in tensors]


class RssPeak:
    """Sample this process's RSS every 5 ms on a thread; .growth = peak - RSS at start."""

    def __enter__(self) -> "RssPeak":
        self.start = C.rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, C.rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, C.rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def run(size_gb: float, reps: int, out: str, log) -> dict:
    nbytes = int(size_gb * 1e9)
    module = make_state(nbytes)
    params = list(module.parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in params)
    ckdir = os.path.join(out, f"ck-{size_gb:g}")
    shutil.rmtree(ckdir, ignore_errors=True)
    with CheckpointManager(ckdir, keep_local=1) as mgr:
        mgr.save(1, {"model": module}).wait()
    gc.collect()
    ref = digests(params)
    files = step_files(ckdir, 1)
    file_bytes = sum(os.path.getsize(f) for f in files)

    res: dict = {"size_gb": size_gb, "state_bytes": state_bytes, "file_bytes": file_bytes, "files": len(files),
                 "threads": READ_THREADS, "ours_s": [], "floor_s": [], "rss_growth": [], "in_place": True}
    single, buffered = [], []
    mgr = CheckpointManager(ckdir, keep_local=1)
    try:
        for i in range(reps):
            C.evict(ckdir)
            res["floor_s"].append(parallel_read(files, READ_THREADS, direct=True)[0])
            with torch.no_grad():
                for p in params:
                    p.zero_()
            ptrs = [p.data_ptr() for p in params]
            C.evict(ckdir)
            resident = C.resident_bytes(ckdir)
            with RssPeak() as rss:
                t0 = C.now()
                got = mgr.restore({"model": module})
                res["ours_s"].append(C.now() - t0)
            res["rss_growth"].append(rss.growth)
            res["in_place"] &= ptrs == [p.data_ptr() for p in params]
            if i == 0:
                res["resident_before"] = resident
                res["bit_exact"] = got == 1 and digests(params) == ref
            log(f"  {size_gb:g} GB rep {i}: floor {res['floor_s'][-1]:.3f} s, ours {res['ours_s'][-1]:.3f} s, "
                f"RSS +{rss.growth / 1e6:.1f} MB")
        for _ in range(max(1, reps // 2)):
            C.evict(ckdir)
            single.append(parallel_read(files, 1, direct=True)[0])
            C.evict(ckdir)
            buffered.append(parallel_read(files, READ_THREADS, direct=False)[0])
    finally:
        mgr.close()
    shutil.rmtree(ckdir, ignore_errors=True)
    res["ours_median_s"] = C.median(res["ours_s"])
    res["floor_median_s"] = C.median(res["floor_s"])
    res["single_odirect_s"] = min(single)
    res["buffered_threads_s"] = min(buffered)
    res["ratio"] = res["floor_median_s"] / res["ours_median_s"]  # throughput, ours / floor
    return res


def report(results: list[dict], args) -> str:
    L = [f"## Cold restore vs the cold O_DIRECT read floor ({args.date})", "",
         f"Machine: {C.machine_line(args.out)}. {args.reps} repetitions per size, interleaved; medians.", "",
         f"| state | ours: cold restore | floor: O_DIRECT read, {READ_THREADS} threads | ours / floor (throughput) "
         "| 1 stream O_DIRECT | buffered, same threads | RSS growth during restore (max) | targets in place | bit-exact |",
         "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        gb = r["file_bytes"] / 1e9
        L.append(
            f"| {r['state_bytes'] / 1e9:.2f} GB | {r['ours_median_s']:.3f} s ({gb / r['ours_median_s']:.2f} GB/s) "
            f"| {r['floor_median_s']:.3f} s ({gb / r['floor_median_s']:.2f} GB/s) | **{r['ratio']:.2f}** "
            f"| {r['single_odirect_s']:.3f} s | {r['buffered_threads_s']:.3f} s "
            f"| {max(r['rss_growth']) / 1e6:.1f} MB | {'yes' if r['in_place'] else 'NO'} | {'yes' if r['bit_exact'] else 'NO'} |")
    return "\n".join(L) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5,2,8", help="state sizes in GB, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "out", "restore-run"))
    p.add_argument("--json", default=os.path.join(HERE, "out", "restore.json"))
    p.add_argument("--md", default=os.path.join(HERE, "out", "restore.md"))
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    results = []
    for s in args.sizes.split(","):
        log(f"size {s} GB")
        results.append(run(float(s), args.reps, args.out, log))
        gc.collect()
    C.write_results({"date": args.date, "machine": C.machine_description(), "results": results}, report(results, args),
                    args.json, args.md)
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()

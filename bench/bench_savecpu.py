"""Where a save's CPU goes: the checkpoint threads' CPU time per save, split by what they do,
beside the floors of the same bytes (memmove, xxh3, the O_DIRECT write's CPU: bench_cost.py's),
measured in the same run.

bench_core.py's transformer + AdamW trains one step between saves (every byte of the state
changes: dense training), and a CheckpointManager saves after each step and waits for it. The
functions of each phase are wrapped, in this process only, with a timer of the calling thread's
CPU time (time.thread_time; about a microsecond per call, 787 calls per save for the per-chunk
phases); each phase's time is exclusive (a phase nested in another is subtracted from it), and
"other" is what no named phase covers. Threads: ckpt-io (staging, digests, the commit, retention)
and ckpt-write (the write-behind of the pack, a thread per save); the table after it checks the
phases against the kernel's count for the threads that live on. `background_yield_s=None`: the
threads are not lowered, so that wall time and CPU time agree (the CPU a save costs does not depend
on its priority).

    python bench/bench_savecpu.py [--size-gb 0.7] [--saves 8] [--dir DIR] [--no-incremental]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_core  # noqa: E402
import bench_cost  # noqa: E402

from checkpointing import CheckpointManager  # noqa: E402
from checkpointing.dist import coordinator  # noqa: E402
from checkpointing.format import rank_reports  # noqa: E402
from checkpointing.save import behind, pack_writer, scrub, staging, worker, writer  # noqa: E402

# (object, attribute, phase): wrapped in this order; a phase that runs inside another is subtracted from it
PHASES = [
    (worker.SaveWorker, "_run", "other (the save's bookkeeping)"),
    (staging.StagingPool, "ensure", "staging pool: allocate / check"),
    (pack_writer.PackWriter, "stage", "staging: per-chunk Python around the copies"),
    (staging.Copier, "copy", "staging: the copy (memmove; memcmp where compared)"),
    (pack_writer.PackWriter, "_written", "staging: scan for written pages"),
    (pack_writer.PackWriter, "digest_upto", "digests: the pass after staging (its Python)"),
    (pack_writer.PackWriter, "_digest", "digests: xxh3-128 per chunk"),
    (pack_writer.PackWriter, "write_chunks", "writes on ckpt-io (the last spans, O_DIRECT)"),
    (pack_writer.PackWriter, "close", "writes on ckpt-io (the last spans, O_DIRECT)"),
    (writer, "_part", "the rank's report"),
    (coordinator.LocalCoordinator, "commit", "commit: manifest, COMMIT, fsyncs"),
    (coordinator, "merge_parts", "commit: merge (validate the reports)"),
    (rank_reports, "encode_manifest", "commit: encode the manifest"),
    (rank_reports, "decode_manifest", "commit: decode it (the reader's checks)"),
    (worker.LocalRetention, "after_commit", "retention"),
    (worker.LocalRetention, "collect", "retention"),
    (scrub.Reverifier, "after_commit", "re-verification of borrowed chunks"),
    (behind.WriteBehind, "_write", "the pack's writes behind the copy (O_DIRECT)"),
]


class Meter:
    """Exclusive CPU time per phase, per thread: a stack of the phases the thread is in."""

    def __init__(self) -> None:
        self.cpu: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.calls: dict[tuple[str, str], int] = collections.Counter()
        self._local = threading.local()
        self.on = False

    def wrap(self, owner: object, name: str, phase: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:  # an older version of the package (A/B runs)
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            stack = self._local.__dict__.setdefault("stack", [])
            thread = threading.current_thread().name
            t0 = time.thread_time()
            stack.append(0.0)  # CPU of phases nested in this call
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                nested = stack.pop()
                self.cpu[thread, phase] += spent - nested
                self.calls[thread, phase] += 1
                if stack:
                    stack[-1] += spent

        setattr(owner, name, timed)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's Python threads by name (/proc/self/task/<native id>/stat)."""
    out: dict[str, float] = collections.defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[thread.name] += (int(fields[11]) + int(fields[12])) / tick
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=0.7)
    p.add_argument("--saves", type=int, default=8, help="measured saves (after two unmeasured ones)")
    p.add_argument("--dir", default=os.path.join(HERE, "out"))
    p.add_argument("--no-incremental", action="store_true", help="incremental=False: every chunk copied and written, none compared")
    P = p.parse_args(argv)
    meter = Meter()
    for owner, name, phase in PHASES:
        meter.wrap(owner, name, phase)
    trainer = bench_core.Trainer(P.size_gb, 1, 16, None, seed=0)
    os.makedirs(P.dir, exist_ok=True)
    ckdir = tempfile.mkdtemp(prefix="savecpu-", dir=P.dir)  # removed below: each run writes ~1.4 GB
    manager = CheckpointManager(ckdir, keep_local=2, background_yield_s=None,
                                incremental=not P.no_incremental)
    state = {"model": trainer.model, "optim": trainer.opt}
    before: dict[str, float] = {}
    stats = []
    for s in range(P.saves + 2):
        trainer.step(s + 1, None)
        if s == 2:
            meter.on, before = True, _thread_cpu()
        st = manager.save(s + 1, state).wait()
        if meter.on:
            stats.append(st)
    after = _thread_cpu()
    meter.on = False
    manager.close()
    shutil.rmtree(ckdir, ignore_errors=True)
    nbytes = trainer.state_bytes()
    floors = bench_cost.measure_floors(trainer, argparse.Namespace(out=P.dir, write_block_mib=32, floor_reps=3))
    n = P.saves
    print(f"State {nbytes / 1e9:.3f} GB (bench_core transformer + AdamW), {n} saves measured, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| thread | phase | CPU ms per save | calls per save |")
    print("|---|---|---:|---:|")
    for (thread, phase), cpu in sorted(meter.cpu.items(), key=lambda kv: (kv[0][0], -kv[1])):
        print(f"| {thread} | {phase} | {cpu / n * 1e3:.1f} | {meter.calls[thread, phase] / n:.0f} |")
    named = collections.defaultdict(float)
    for (thread, _), cpu in meter.cpu.items():
        named[thread] += cpu
    print("\n| thread | CPU ms per save (/proc) | of which in the phases above |")
    print("|---|---:|---:|")
    for name in sorted(k for k in after if k.startswith("ckpt")):
        print(f"| {name} | {(after[name] - before.get(name, 0.0)) / n * 1e3:.1f} | {named.get(name, 0.0) / n * 1e3:.1f} |")
    print("\n| wall time, median over the saves | ms |")
    print("|---|---:|")
    for field in ("snapshot_s", "write_s", "commit_s", "total_s"):
        print(f"| {field} | {statistics.median(getattr(st, field) for st in stats) * 1e3:.1f} |")
    print("\n| floor, the same bytes, one thread (bench_cost.py's) | CPU ms |")
    print("|---|---:|")
    labels = {"memcpy": "memmove, one call per tensor", "xxh3": "xxh3-128, 1 MiB chunks", "write_odirect": "O_DIRECT write + fsync, 32 MiB"}
    for key, label in labels.items():
        print(f"| {label} | {floors[key]['cpu_s'] * 1e3:.1f} |")
    print(f"| **floor core-seconds** (the three) | **{floors['core_s'] * 1e3:.1f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

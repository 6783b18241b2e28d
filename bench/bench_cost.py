#!/usr/bin/env python
"""Cost harness: what one save costs the training loop, and who pays it (issue 21, item 1).

    python bench/bench_cost.py                  # full run (0.7 GB state, ~7 min on 2 cores)
    python bench/bench_cost.py --quick          # smoke test (0.2 GB, 3 saves per config, ~2 min)
    python bench/bench_cost.py --knobs          # also ours with other options (attribution runs)
    python bench/bench_cost.py --only ours_async,dcp_thread --saves 12
    python bench/bench_cost.py --ranks 4         # 4 gloo ranks on 127.0.0.1, each 1/4 of the state

One training loop per config (each in a fresh child process, so that no config inherits another's
threads, registered memory or allocator state), the model and trainer of bench_core.py. Saves come
at steps = 0 mod --cycle; every step is timed, and after every step the harness samples, from
/proc, every thread of the process and of its child processes: on-CPU time and run-queue wait
(schedstat, ns), user/system time, minor/major faults, voluntary/involuntary context switches and
bytes written. A save's *window* is the step that called save() and the steps after it until its
background work is done (plus --tail steps); the other steps are the loop's own no-save steps,
interleaved with the saves (so a slow drift of the machine cancels).

Per save: loop overhead = sum of the window's step times - window steps x the mean no-save step,
with a bootstrap 95% confidence interval of its mean over saves (saves and no-save steps
resampled); the same difference for every counter, per thread category (training thread, torch
intra-op threads, checkpoint threads (every thread that appeared with the saver), child processes)
and per named thread. Floors of the same bytes, measured in the same run: a single-thread memmove
of the state, xxh3-128 over it on one core (1 MiB chunks), and the CPU of an O_DIRECT write + fsync
of it; their CPU-seconds summed are the floor the issue's target is set against. "floor_thread" is
that physics as a saver (a 40-line thread: memmove, xxh3, O_DIRECT write) in the same loop: what the
minimal work costs the loop here.

Results: bench/out/cost.md (markdown) and bench/out/cost.json (every step's counters), or --md/--json.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _common as C  # noqa: E402
from _common import now  # noqa: E402

GB = 1e9
MiB = 1 << 20


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# configs: key -> (what it is, how it is built); the savers come from bench_core.py
# ---------------------------------------------------------------------------------------------

DEFAULT = ["none", "floor_thread", "ours_async", "ours_state_dict", "ours_eager", "dcp_thread", "dcp_process"]

# ours with other options, for attributing the cost (--knobs): key -> (manager options, extras)
KNOBS = {
    "ours_compare": ({"change_detection": "compare"}, {}),
    "ours_full": ({"incremental": False}, {}),
    "ours_chunk16m": ({"chunk_bytes": 16 * MiB}, {}),
    "ours_block8m": ({"write_block_bytes": 8 * MiB}, {}),
    "ours_block128m": ({"write_block_bytes": 128 * MiB}, {}),
    "ours_buffered": ({"direct_io": False}, {}),
    "ours_budget64m": ({"staging_budget_bytes": 64 * MiB}, {}),
    "ours_idle": ({}, {"io_policy": "idle"}),
    "ours_noyield": ({"background_yield_s": None}, {}),
    "ours_keepall": ({"keep_local": None}, {}),  # no retention: no file is deleted (DCP's runs delete none either)
    "ours_nospares": ({}, {"spares": False}),  # retired pack files deleted, never written over (the code before spares)
    "ours_lowcopy": ({}, {"lowcopy": True}),
    # a remote tier: moto on 127.0.0.1 in a process of its own (its CPU is "foreign"), keep_remote=1
    "ours_remote": ({"keep_remote": 1}, {"remote": True}),
    "ours_remote_upnoyield": ({"keep_remote": 1}, {"remote": True, "upload_yield": False}),  # uploads at normal priority (the code before)  # the copy itself at SCHED_IDLE once save() returned; the guard hurries it
    "ours_threads1": ({}, {"threads": 1}),
    "floor_idle": (None, {"io_policy": "idle"}),
}


def describe(key: str) -> str:
    names = {
        "none": "no saves (the loop alone)",
        "floor_thread": "floor as a saver: 1 thread, memmove + xxh3 + O_DIRECT write (no framework)",
        "ours_async": "ours, snapshot=async, model + optimizer objects",
        "ours_state_dict": "ours, snapshot=async, model.state_dict() + optimizer.state_dict()",
        "ours_eager": "ours, snapshot=eager, objects",
        "dcp_thread": "DCP async_save THREAD, reused DefaultStager, async staging (no shm)",
        "dcp_process": "DCP async_save PROCESS, reused DefaultStager, shm, async staging",
    }
    if key in names or key not in KNOBS:
        return names.get(key, key)
    opts, extra = KNOBS[key]
    bits = [f"{k}={v}" for k, v in (opts or {}).items()] + [f"{k}={v}" for k, v in extra.items()]
    return ("floor_thread" if key.startswith("floor") else "ours async objects") + ", " + ", ".join(bits)


def make_saver(key: str, tr, root: str, P):
    import bench_core as B

    class OursCost(B.Ours):
        """bench_core's Ours with manager options, keeping the handle to see when the save is done."""

        def __init__(self, snapshot, form, options):
            super().__init__(tr, root, snapshot, form)
            self.options, self.handle = options, None

        def setup(self):
            from checkpointing import CheckpointManager
            self.mgr = CheckpointManager(self.root, **{"keep_local": 2, "snapshot": self.snapshot, **REMOTE, **self.options})

        def save(self, step):
            t0 = now()
            self.handle = self.mgr.save(step, self._state(step))
            rec = {"step": step, "call_s": now() - t0}
            self.recs.append(rec)
            return rec

        def busy(self):
            return self.handle is not None and not self.handle.done()

        def finish(self):
            super().finish()
            import dataclasses
            stats = {s.step: s for s in self.mgr.stats()}
            for rec in self.recs:
                s = stats.get(rec["step"])
                if s is not None:
                    rec["stats"] = {k: v for k, v in dataclasses.asdict(s).items() if isinstance(v, (int, float))}

    class DcpCost(B.DcpAsync):
        def busy(self):
            return self.pending_staging is not None or (self.prev_upload is not None and not self.prev_upload.done())

    if key == "none":
        return None
    if key == "ours_async":
        return OursCost("async", "objects", {})
    if key == "ours_state_dict":
        return OursCost("async", "state_dict", {})
    if key == "ours_eager":
        return OursCost("eager", "objects", {})
    if key == "dcp_thread":
        return DcpCost(tr, root, "thread", dict(use_shared_memory=False, use_async_staging=True))
    if key == "dcp_process":
        return DcpCost(tr, root, "process", dict(use_shared_memory=True, use_async_staging=True))
    if key == "floor_thread" or key.startswith("floor_"):
        return FloorSaver(tr, root, P.write_block_mib * MiB)
    opts, _extra = KNOBS[key]
    return OursCost("async", "objects", opts)


class FloorSaver:
    """The physics of a save as a saver: a pool mapped once (huge pages, pre-faulted), then per save
    on one background thread: memmove of every tensor (the training thread waits for it before
    optimizer.step()), xxh3-128 per 1 MiB, O_DIRECT pwrite of the pool in blocks + fsync to a fresh
    file. No manifest, no commit, no framework."""

    name = "floor_thread"

    def __init__(self, tr, root: str, block: int):
        self.tr, self.root, self.block = tr, root, block
        self.recs: list = []
        self.q: list = []
        self.cv = threading.Condition()
        self.staged = threading.Event()
        self.done = threading.Event()
        self.staged.set()
        self.done.set()
        self.thread = None
        self.pool = None

    def setup(self):
        self.nbytes = C.round_up(self.tr.state_bytes(), C.PAGE)
        self.pool = C.aligned_buffer(self.nbytes, fill=None)
        self.pool.madvise(getattr(__import__("mmap"), "MADV_POPULATE_WRITE", 23))
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.pool))
        self.thread = threading.Thread(target=self._run, name="floor-saver", daemon=True)
        self.thread.start()

    def save(self, step):
        t0 = now()
        self.done.wait()
        self.staged.clear()
        self.done.clear()
        with self.cv:
            self.q.append(step)
            self.cv.notify()
        rec = {"step": step, "call_s": now() - t0, "t0": t0}
        self.recs.append(rec)
        return rec

    def pre_step(self):
        if not self.staged.is_set():
            t0 = now()
            self.staged.wait()
            self.recs[-1]["guard_wait_s"] = self.recs[-1].get("guard_wait_s", 0.0) + now() - t0

    def busy(self):
        return not self.done.is_set()

    def _run(self):
        import xxhash
        while True:
            with self.cv:
                while not self.q:
                    self.cv.wait()
                step = self.q.pop(0)
            if step is None:
                return
            rec = self.recs[-1]
            off = 0
            for t in self.tr.tensors():
                n = t.numel() * t.element_size()
                ctypes.memmove(self.addr + off, t.data_ptr(), n)
                off += n
            rec["staged_t"] = now()
            self.staged.set()
            mv = memoryview(self.pool)
            rec["digests"] = len([xxhash.xxh3_128(mv[o:o + MiB]).digest() for o in range(0, self.nbytes, MiB)])
            path = os.path.join(self.root, f"step-{step}.bin")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                pos = 0
                while pos < self.nbytes:
                    pos += os.pwrite(fd, mv[pos:min(self.nbytes, pos + self.block)], pos)
                os.fsync(fd)
            finally:
                os.close(fd)
            mv.release()
            for name in os.listdir(self.root):
                if name != os.path.basename(path):
                    os.remove(os.path.join(self.root, name))
            rec["durable_s"] = now() - rec["t0"]
            self.done.set()

    def finish(self):
        self.done.wait()
        for r in self.recs:
            r["stall_s"] = r["call_s"] + r.get("guard_wait_s", 0.0)

    def extra(self):
        return {}

    def close(self):
        if self.thread is not None:
            with self.cv:
                self.q.append(None)
                self.cv.notify()
            self.thread.join()
            self.thread = None


# ---------------------------------------------------------------------------------------------
# the child: one config's loop, sampled per step
# ---------------------------------------------------------------------------------------------

class Labels:
    """Names and categories of this process's threads: 'train' (the thread running the loop),
    'intra' (threads that existed before the saver was set up: torch's intra-op pool), 'ckpt'
    (every thread that appeared with the saver: ckpt-io, ckpt-metrics, DCP's executors, ...)."""

    def __init__(self):
        self.main = threading.get_native_id()
        self.names: dict[int, str] = {}
        self.cats: dict[int, str] = {}
        self.before: set[int] = set()

    def freeze_baseline(self):
        self.before = {int(t) for t in os.listdir("/proc/self/task")}

    def refresh(self, tids):
        py = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        for tid in tids:
            if tid in self.names:
                continue
            if tid == self.main:
                name, cat = "train", "train"
            elif tid in self.before and tid not in py:
                name, cat = f"intra-{C.task_comm(os.getpid(), tid)}-{tid}", "intra"
            elif tid in py:
                name, cat = py[tid], "ckpt"
                try:  # the OS thread name, for perf/top (Python 3.11 does not set it)
                    with open(f"/proc/self/task/{tid}/comm", "w") as f:
                        f.write(name[:15])
                except OSError:
                    pass
            else:
                name, cat = f"{C.task_comm(os.getpid(), tid)}-{tid}", "ckpt"
            self.names[tid], self.cats[tid] = name, cat


def sample_delta(labels: Labels, a: dict, b: dict) -> dict:
    """Per category and per named thread, the counters' deltas between samples a and b; plus the
    machine's busy and steal CPU-seconds and the share of 'busy' that was not this process tree."""
    labels.refresh(b["tasks"].keys())
    cats = {c: dict.fromkeys(C.TASK_FIELDS + ("blocked_s",), 0) for c in ("train", "intra", "ckpt", "child")}
    threads: dict[str, dict] = {}
    dt = b["t"] - a["t"]
    for tid, cur in b["tasks"].items():
        d = C.task_delta(a["tasks"].get(tid), cur)
        cat = labels.cats[tid]
        for k in C.TASK_FIELDS:
            cats[cat][k] += d[k]
        if cat == "train" or d["cpu_s"] > 0:  # asleep for the rest of the interval (idle threads left out)
            cats[cat]["blocked_s"] += max(0.0, dt - d["cpu_s"] - d["wait_s"])
        if cat != "intra" and (d["cpu_s"] > 0 or d["minflt"] > 0):
            threads[labels.names[tid]] = {k: round(d[k], 6) for k in ("cpu_s", "wait_s", "minflt", "majflt", "ivcsw", "wchar")}
    for pid, cur in b["children"].items():
        d = C.task_delta(a["children"].get(pid), cur)
        for k in C.TASK_FIELDS:
            cats["child"][k] += d[k]
        if d["cpu_s"] > 0:
            cats["child"]["blocked_s"] += max(0.0, dt - d["cpu_s"] - d["wait_s"])
        if d["cpu_s"] > 0:
            threads[f"child-{pid}"] = {k: round(d[k], 6) for k in ("cpu_s", "wait_s", "minflt", "majflt", "ivcsw", "wchar")}
    own = sum(c["cpu_s"] for c in cats.values())
    busy = b["machine"]["busy_s"] - a["machine"]["busy_s"]
    return {"cats": {c: {k: round(v, 6) for k, v in d.items()} for c, d in cats.items()}, "threads": threads,
            "n_intra": sum(1 for tid in b["tasks"] if labels.cats[tid] == "intra"),
            "machine_busy_s": round(busy, 3), "steal_s": round(b["machine"]["steal_s"] - a["machine"]["steal_s"], 3),
            "foreign_s": round(max(0.0, busy - own), 3)}


def set_io_policy(labels: Labels, policy: str) -> list:
    """Run the checkpoint threads at SCHED_IDLE (an attribution knob: does the loop pay for the
    background threads by waiting for a CPU?)."""
    done = []
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        labels.refresh([tid])
        if labels.cats.get(tid) == "ckpt":
            if policy == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            done.append(labels.names[tid])
    return done


def per_step_md(res: dict, upto: int = 7) -> list[str]:
    """Per config, the steps after each save() (+0 is the step that called it, at its end), means
    over the saves: step time, the loop and intra-op threads' time asleep (wall - CPU - run-queue
    wait), the loop thread's run-queue wait, the machine's steal and the checkpoint threads' CPU
    (with --ranks, every rank's: each rank accounts its own per step); then the same for the steps
    with no save in flight."""
    L = ["**Step by step after save()** (means over saves; s; asleep: loop / intra-op thread; steal: all vCPUs):\n",
         "| config | step | n | step s | asleep s | run-queue wait s | machine steal vCPU-s | checkpoint threads CPU-s (every rank's with --ranks) |",
         "|---|---|---:|---:|---:|---:|---:|---:|"]

    def cells(rows: list[dict]) -> str:
        def mean(get) -> float:
            return sum(get(r) for r in rows) / len(rows)
        return (f"{len(rows)} | {mean(lambda r: r['dt']):.3f} | {mean(lambda r: r['cats']['train']['blocked_s']):.3f} / "
                f"{mean(lambda r: r['cats']['intra']['blocked_s']):.3f} | {mean(lambda r: r['cats']['train']['wait_s']):.3f} | "
                f"{mean(lambda r: r.get('steal_s', 0.0)):.3f} | {mean(lambda r: r['cats']['ckpt']['cpu_s'] + r.get('ranks_ckpt_cpu_s', 0.0)):.3f} |")

    for key, raw in res.get("raw", {}).items():
        by: dict[int, list[dict]] = {}
        quiet: list[dict] = []
        for run in raw.get("runs", []):
            k = None
            for row in run.get("rows", []):
                k = 0 if row.get("save") else (k + 1 if k is not None else None)
                if k is not None and k <= upto:
                    by.setdefault(k, []).append(row)
                elif not row.get("busy"):
                    quiet.append(row)
        if not by:
            continue
        L.extend(f"| {key} | +{k} | " + cells(by[k]) for k in sorted(by))
        if quiet:
            L.append(f"| {key} | later, nothing in flight | " + cells(quiet))
    return L + [""]


REMOTE: dict = {}  # the remote tier's manager options (a config with "remote")


def _remote_tier(key: str):
    """Start moto on 127.0.0.1 in a process of its own and point REMOTE at a fresh bucket there."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from embedded_s3 import EmbeddedS3

    server = EmbeddedS3()
    server.start()
    REMOTE.update(remote=server.bucket(f"cost-{key.replace('_', '-')}") + "/ck", storage_options=server.storage_options)
    return server


def _low_copy() -> None:
    """Experiment: the save's threads at SCHED_IDLE from the moment save() may return (the copy too,
    not only what follows it); the guard before optimizer.step() puts them back at normal priority."""
    from checkpointing.save.job import SaveJob
    from checkpointing.save.pack_writer import PackWriter

    stage = PackWriter.stage

    def low_stage(self, opened=None):
        if opened is None or self.cpu is None:
            return stage(self, opened)
        def lowered():
            opened()
            self.cpu.lower()
        return stage(self, lowered)

    wait_staged = SaveJob.wait_staged

    def hurried(self, stall):
        if not self.staging.staged.is_set() and self.outcome.hurry is not None:
            self.outcome.hurry()
        return wait_staged(self, stall)

    PackWriter.stage, SaveJob.wait_staged = low_stage, hurried


def child_main(P) -> int:
    import torch
    import bench_core as B

    key = P.child
    extra = KNOBS.get(key, (None, {}))[1]
    rank, world = int(os.environ.get("BENCH_RANK", "0")), P.ranks if key != "floors" else 1
    torch.set_num_threads(extra.get("threads", max(1, P.threads // world)))
    if extra.get("spares") is False:  # attribution: retention deletes every retired pack file, as before spares
        from checkpointing.storage.local import LocalStorage
        LocalStorage.keep_spare = lambda self, path, limit: False
    if extra.get("lowcopy"):
        _low_copy()
    server = _remote_tier(key) if extra.get("remote") else None  # held to the end: moto exits when its stdin pipe is closed
    if extra.get("upload_yield") is False:  # attribution: uploads at normal priority, as before they yielded
        from checkpointing.save import uploader
        start = uploader.start_uploader
        uploader.start_uploader = lambda *a, **kw: start(*a, **{**kw, "yield_s": None})
        import checkpointing.manager as manager_module
        manager_module.start_uploader = uploader.start_uploader
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=rank, world_size=world)
    # with --ranks N every rank holds its 1/N of the state (as FSDP shards it: different data on every rank)
    # ... and the job's batch (that of one rank holding everything) is every rank's: each does 1/N of the work
    batch = P.batch if world == 1 or P.batch is not None else max(1, round(2.8 / P.size_gb))
    tr = B.Trainer(P.size_gb / world, batch, P.seq, P.step_time, seed=rank)
    if world > 1:
        tr.state = lambda step: {f"model_r{rank}": tr.model, f"optim_r{rank}": tr.opt, "step": step}
        tr.step = _lockstep(tr.step)
    res: dict = {"key": key, "name": describe(key), "threads": torch.get_num_threads(), "torch": torch.__version__, "batch": tr.batch,
                 "state_bytes": tr.state_bytes(), "n_params": tr.n_params, "blocks": tr.n_blocks, "vocab": tr.vocab}
    if key == "floors":
        res["floors"] = measure_floors(tr, P)
        return _dump(P, res)
    root = os.path.join(os.path.abspath(P.out), key)
    if world > 1 and key.startswith("floor"):
        root = os.path.join(root, f"rank{rank}")  # the floor saver owns its directory
    os.makedirs(root, exist_ok=True)
    if key.startswith("dcp"):
        B.init_gloo()
    saver = make_saver(key, tr, root, P)
    pre = saver.pre_step if saver is not None else None
    labels = Labels()
    for i in range(P.warmup):
        tr.step(i, pre)
    labels.freeze_baseline()
    if saver is not None:
        saver.setup()
        t0 = now()
        with B.redirect_fds(os.path.join(P.out, f"{key}.log")) if key == "dcp_process" else _null():
            rec = saver.save(0)  # untimed: first-save costs (pool, process spawn, plan)
            res["first_call_s"] = rec["call_s"]  # how long the first save() blocked the loop
            saver.finish()
        res["first_save_s"] = now() - t0
        saver.recs.clear()
        if extra.get("io_policy"):
            res["io_policy"] = {extra["io_policy"]: set_io_policy(labels, extra["io_policy"])}
    sampler = C.TaskSampler()
    sampler.refresh_children()
    if world > 1:  # the other ranks' processes are counted as this one's children
        import torch.distributed as dist
        pids: list = [None] * world
        dist.all_gather_object(pids, os.getpid())
        sampler.children += [p for p in pids if p != os.getpid()]
    res["children"] = list(sampler.children)
    n_steps = (P.saves + 1) * P.cycle
    rows = []
    gc.collect()
    gc.disable()
    try:
        prev = sampler.sample()
        labels.refresh(prev["tasks"].keys())
        for s in range(1, n_steps + 1):
            t0 = now()
            tr.step(s, pre)
            saved = saver is not None and s % P.cycle == 0 and s <= P.saves * P.cycle
            if saved:
                saver.save(s)
            t1 = now()
            busy = bool(saver is not None and saver.busy())
            cur = sampler.sample()
            row = sample_delta(labels, prev, cur)
            row.update(step=s, t=t1 - t0, save=saved, busy=busy, t0=t0, t_sampled=cur["t"], dt=cur["t"] - prev["t"])
            rows.append(row)
            prev = cur
    finally:
        gc.enable()
    if saver is not None:
        t0 = now()
        saver.finish()
        res["finish_wait_s"] = now() - t0
        res["saves"] = [{k: v for k, v in r.items() if k not in ("t0", "t1", "staged_t", "done_t")} for r in saver.recs]
        res.update(saver.extra())
        saver.close()
    late = set(C.descendants(os.getpid())) - set(res["children"])
    if late:
        res["children_late"] = sorted(late)  # processes that appeared during the loop: not sampled
    res["rows"] = rows
    res["thread_names"] = {str(t): n for t, n in labels.names.items()}
    if world > 1:
        res["ranks"] = world
        import torch.distributed as dist
        # every rank's own threads per step, by the same labels (the steps are in lockstep): rank 0 samples the
        # other ranks only as whole processes, which cannot tell their checkpoint threads from their training
        mine = [(r["cats"]["ckpt"]["cpu_s"], r["cats"]["train"]["cpu_s"] + r["cats"]["intra"]["cpu_s"]) for r in rows]
        every: list = [None] * world
        dist.all_gather_object(every, mine)  # nothing in flight any more: the saver has finished and closed
        for i, row in enumerate(rows):
            row["ranks_ckpt_cpu_s"] = round(sum(e[i][0] for e in every[1:]), 6)
            row["ranks_train_cpu_s"] = round(sum(e[i][1] for e in every[1:]), 6)
        dist.barrier()
    if key.startswith("dcp") or world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return 0  # rank 0 reports: every step is in lockstep, and it samples the other ranks' processes
    shutil.rmtree(root, ignore_errors=True)
    return _dump(P, res)


def _lockstep(step):
    """A training step followed by an all-reduce, as data-parallel training's gradient reduction:
    the ranks move in lockstep, so a save that slows one rank slows the job. On a group of its own:
    DCP's async_save runs collectives on the default group from its background thread, and two
    threads' collectives on one gloo group can pair up differently on different ranks (a hang)."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")

    def run(i, pre_step=None):
        loss = step(i, pre_step)
        dist.all_reduce(torch.zeros(1024), group=group)
        return loss
    return run


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _dump(P, res) -> int:
    with open(P.result, "w") as f:
        json.dump(res, f, default=str)
    return 0


def measure_floors(tr, P) -> dict:
    """The state's bytes through each piece of physics, on one thread, CPU-seconds and wall."""
    import xxhash
    nbytes = tr.state_bytes()
    size = C.round_up(nbytes, C.PAGE)
    buf = C.aligned_buffer(size, fill=0)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    tensors = tr.tensors()
    out: dict = {"bytes": nbytes}

    def best(fn, reps):
        runs = []
        for _ in range(reps):
            m0, c0, w0 = C.machine_cpu(), time.thread_time(), now()
            fn()
            w, c, m1 = now() - w0, time.thread_time() - c0, C.machine_cpu()
            runs.append((w, c, m1["busy_s"] - m0["busy_s"]))
        w = min(r[0] for r in runs)
        return {"wall_s": w, "cpu_s": min(r[1] for r in runs), "machine_busy_s": min(r[2] for r in runs),
                "GBps": C.gbps(nbytes, w)}

    def memcpy():
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(base + off, t.data_ptr(), n)
            off += n
    out["memcpy"] = best(memcpy, 3)
    mv = memoryview(buf)

    def digest():
        for o in range(0, nbytes, MiB):
            xxhash.xxh3_128(mv[o:min(nbytes, o + MiB)]).digest()
    out["xxh3"] = best(digest, 3)
    path = os.path.join(os.path.abspath(P.out), "floor.bin")
    block = P.write_block_mib * MiB

    def write(direct):
        def go():
            if os.path.exists(path):
                os.remove(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
            try:
                pos = 0
                while pos < size:
                    pos += os.pwrite(fd, mv[pos:min(size, pos + block)], pos)
                os.fsync(fd)
            finally:
                os.close(fd)
        return go
    out["write_odirect"] = best(write(True), P.floor_reps)
    out["write_buffered"] = best(write(False), 1)
    os.remove(path)
    mv.release()
    buf.close()
    out["core_s"] = out["memcpy"]["cpu_s"] + out["xxh3"]["cpu_s"] + out["write_odirect"]["cpu_s"]
    # the same with the write's CPU counted machine-wide (kernel threads, interrupts): an upper bound
    out["core_s_machine"] = out["memcpy"]["cpu_s"] + out["xxh3"]["cpu_s"] + out["write_odirect"]["machine_busy_s"]
    return out


# ---------------------------------------------------------------------------------------------
# analysis: windows, no-save steps, bootstrap
# ---------------------------------------------------------------------------------------------

def windows(rows: list, tail: int) -> tuple[list, list]:
    """Per save, the indices of its window (the save's step, then while its background work is not
    done, then `tail` more, never into the next save's step); and the indices of no-save steps."""
    saves = [i for i, r in enumerate(rows) if r["save"]]
    inside = [False] * len(rows)
    wins = []
    for j, i in enumerate(saves):
        limit = (saves[j + 1] - 1) if j + 1 < len(saves) else len(rows) - 1
        end = i
        while end < limit and rows[end]["busy"]:
            end += 1
        end = min(end + tail, limit)
        wins.append(list(range(i, end + 1)))
        for k in range(i, end + 1):
            inside[k] = True
    quiet = [i for i in range(len(rows)) if not inside[i]]
    return wins, quiet


def _val(row, field):
    """A row's value: 't' (step seconds), 'foreign_s', 'steal_s', or 'cat.field' / 'all.field', where
    'cat.blocked_s' is the sample interval less the category's on-CPU and run-queue time: time its
    threads slept (the GIL, an event, a futex in an OpenMP barrier, I/O)."""
    if "." not in field:
        return row.get(field, 0.0) if field.startswith("ranks_") else row[field]  # ranks_*: only in multi-rank runs
    if field.endswith(".blocked_s") and "blocked_s" not in row["cats"][field.split(".")[0]]:  # older records
        cat = field.split(".")[0]
        n = 1 if cat == "train" else row.get("n_" + cat, 1)
        return n * row.get("dt", row["t"]) - row["cats"][cat]["cpu_s"] - row["cats"][cat]["wait_s"]
    cat, k = field.split(".")
    if cat == "all":
        return sum(row["cats"][c][k] for c in row["cats"])
    return row["cats"][cat][k]


# A config's steps come in groups, one per run (round): each run's windows are measured against that
# run's own no-save steps (runs can differ in their step time), and the bootstrap resamples within runs.

def ckpt_cpu(a: dict) -> float:
    """Checkpoint CPU per save: this process's checkpoint threads, plus, with --ranks, every other
    rank's (each rank's own accounting), else this process's children (DCP's process workers)."""
    return a["ckpt_cpu_s"] + (a["ranks_ckpt_cpu_s"] if a.get("per_rank_cpu") else a["child_cpu_s"])


def per_save_extra(rows, groups, field) -> tuple[list, float]:
    """Per save: sum over its window of `field` - window length x its run's no-save steps' mean;
    and the no-save mean over all runs."""
    per, qall = [], []
    for wins, quiet in groups:
        q = [_val(rows[i], field) for i in quiet]
        mq = sum(q) / len(q) if q else 0.0
        qall += q
        per += [sum(_val(rows[i], field) for i in w) - len(w) * mq for w in wins]
    return per, (sum(qall) / len(qall) if qall else 0.0)


def bootstrap(rows, groups, field, n=2000, seed=0) -> list:
    """Bootstrap distribution of the mean per-save extra of `field` (each run's saves and no-save
    steps resampled independently)."""
    rng = random.Random(seed)
    data = [([(sum(_val(rows[i], field) for i in w), len(w)) for w in wins], [_val(rows[i], field) for i in quiet])
            for wins, quiet in groups]
    data = [(s, q) for s, q in data if s and q]
    if not data:
        return []
    nsaves = sum(len(s) for s, _ in data)
    out = []
    for _ in range(n):
        tot = 0.0
        for sums, q in data:
            mq = sum(q[rng.randrange(len(q))] for _ in q) / len(q)
            tot += sum(s - k * mq for s, k in (sums[rng.randrange(len(sums))] for _ in sums))
        out.append(tot / nsaves)
    return out


def _fit(xs: list, ys: list) -> tuple[float, float]:
    """Least squares y = a + b x (b = 0 when x does not vary)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    vx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / vx if vx > 1e-12 else 0.0
    return my - b * mx, b


def adjusted(rows, groups, n=2000, seed=0) -> dict:
    """Overhead per save with each run's no-save step time modelled as a + b x (other processes'
    CPU-s in that step): on a shared machine, a window that happened to meet a burst of foreign load
    is not charged for it. Returns the estimate, the mean b, and a bootstrap CI."""
    groups = [(w, q) for w, q in groups if w and len(q) >= 3]
    if not groups:
        return {}
    X = [r["foreign_s"] for r in rows]
    T = [r["t"] for r in rows]

    def est(picks):
        tot, k, slopes = 0.0, 0, []
        for (wins, _), (qidx, widx) in zip(groups, picks):
            a, b = _fit([X[i] for i in qidx], [T[i] for i in qidx])
            slopes.append(b)
            tot += sum(sum(T[i] - a - b * X[i] for i in wins[j]) for j in widx)
            k += len(widx)
        return tot / k, sum(slopes) / len(slopes)

    value, slope = est([(q, range(len(w))) for w, q in groups])
    rng = random.Random(seed)
    dist = [est([([q[rng.randrange(len(q))] for _ in q], [rng.randrange(len(w)) for _ in w]) for w, q in groups])[0]
            for _ in range(n)]
    return {"overhead_adj_s": value, "foreign_slope": slope, "overhead_adj_ci": ci(dist), "overhead_adj_dist": dist}


def ci(dist: list) -> tuple:
    if not dist:
        return (None, None)
    d = sorted(dist)
    return d[int(0.025 * len(d))], d[min(len(d) - 1, int(0.975 * len(d)))]


FIELDS = {  # per-save extras reported (name -> row field)
    "overhead_s": "t",
    "train_cpu_s": "train.cpu_s", "intra_cpu_s": "intra.cpu_s", "ckpt_cpu_s": "ckpt.cpu_s", "child_cpu_s": "child.cpu_s",
    "own_cpu_s": "all.cpu_s",
    "train_wait_s": "train.wait_s", "intra_wait_s": "intra.wait_s", "ckpt_wait_s": "ckpt.wait_s",
    "train_blocked_s": "train.blocked_s", "intra_blocked_s": "intra.blocked_s",
    "train_sys_s": "train.sys_s", "ckpt_sys_s": "ckpt.sys_s", "child_sys_s": "child.sys_s",
    "train_minflt": "train.minflt", "intra_minflt": "intra.minflt", "ckpt_minflt": "ckpt.minflt", "child_minflt": "child.minflt",
    "all_majflt": "all.majflt",
    "train_ivcsw": "train.ivcsw", "intra_ivcsw": "intra.ivcsw", "train_vcsw": "train.vcsw",
    "ckpt_wchar": "ckpt.wchar", "child_wchar": "child.wchar", "all_wbytes": "all.wbytes",
    "foreign_s": "foreign_s", "steal_s": "steal_s",
    "ranks_ckpt_cpu_s": "ranks_ckpt_cpu_s", "ranks_train_cpu_s": "ranks_train_cpu_s",  # --ranks: the other ranks' own threads
}


def pooled(run: dict, tail: int) -> tuple[list, list, list]:
    """A config's runs (rounds) as one list of steps; per run, its windows and no-save steps
    (indices into that list); and the saves of all runs."""
    runs = run["runs"] if "runs" in run else [run]
    rows, groups, saves = [], [], []
    for r in runs:
        w, q = windows(r["rows"], tail)
        off = len(rows)
        rows += r["rows"]
        groups.append(([[i + off for i in x] for x in w], [i + off for i in q]))
        saves += r.get("saves") or []
    return rows, groups, saves


def analyze(run: dict, P) -> dict:
    rows, groups, saves = pooled(run, P.tail)
    wins = [w for g in groups for w in g[0]]
    quiet = [i for g in groups for i in g[1]]
    a: dict = {"name": run["name"], "steps": len(rows), "n_saves": len(wins), "n_quiet": len(quiet),
               "window_steps_mean": (sum(len(w) for w in wins) / len(wins)) if wins else None,
               "per_rank_cpu": bool(rows) and "ranks_ckpt_cpu_s" in rows[0]}  # --ranks: each rank's own accounting (below)
    qt = [rows[i]["t"] for i in quiet]
    a["step_quiet_mean_s"] = sum(qt) / len(qt) if qt else None
    a["step_quiet_sd_s"] = (sum((x - a["step_quiet_mean_s"]) ** 2 for x in qt) / max(1, len(qt) - 1)) ** 0.5 if qt else None
    a["step_quiet_median_s"] = C.median(qt)
    a["foreign_per_step_s"] = sum(r["foreign_s"] for r in rows) / len(rows)
    a["foreign_load"] = sum(r["foreign_s"] for r in rows) / max(1e-9, sum(r["t"] for r in rows))
    a["steal_per_step_s"] = sum(r["steal_s"] for r in rows) / len(rows)
    if not wins:
        return a
    for name, field in FIELDS.items():
        per, mq = per_save_extra(rows, groups, field)
        a[name] = sum(per) / len(per)
        a[name + "_per_save"] = per
        a[name + "_quiet_mean"] = mq
    dist = bootstrap(rows, groups, "t", seed=P.seed)
    a["overhead_dist"] = dist
    a["overhead_ci"] = ci(dist)
    a["overhead_median_s"] = C.median(a["overhead_s_per_save"])
    a.update(adjusted(rows, groups, seed=P.seed))
    # only what other processes left alone: windows and no-save steps in which they used < --calm CPUs
    def calm(i):
        return rows[i]["foreign_s"] <= P.calm * rows[i]["t"]
    cg = [([w for w in ws if all(calm(i) for i in w)], [i for i in qs if calm(i)]) for ws, qs in groups]
    cg = [(w, q) for w, q in cg if w and len(q) >= 3]
    a["calm_saves"], a["calm_quiet"] = sum(len(w) for w, _ in cg), sum(len(q) for _, q in cg)
    if a["calm_saves"] >= 2:
        per, mq = per_save_extra(rows, cg, "t")
        a["overhead_calm_s"] = sum(per) / len(per)
        a["overhead_calm_dist"] = bootstrap(rows, cg, "t", seed=P.seed)
        a["overhead_calm_ci"] = ci(a["overhead_calm_dist"])
        a["step_calm_mean_s"] = mq
        a["calm"] = {"per_rank_cpu": a["per_rank_cpu"]}
        for name, field in FIELDS.items():
            per, _ = per_save_extra(rows, cg, field)
            a["calm"][name] = sum(per) / len(per)
    a["est"] = {name: {"value": a[f"overhead{sfx}_s"], "ci": a[f"overhead{sfx}_ci"], "dist": a.pop(f"overhead{sfx}_dist")}
                for name, sfx in (("all", ""), ("adjusted", "_adj"), ("calm", "_calm")) if f"overhead{sfx}_dist" in a}
    for name in ("ckpt_cpu_s", "own_cpu_s", "train_wait_s"):
        a[name + "_ci"] = ci(bootstrap(rows, groups, FIELDS[name], n=1000, seed=P.seed))
    # the per-step slowdown of the steps that overlap a save, against the no-save steps
    # the per-step slowdown of the steps that overlap a save, against their run's no-save steps
    wsteps, qres = [], []
    for ws, qs in groups:
        if not qs:
            continue
        mq = sum(rows[i]["t"] for i in qs) / len(qs)
        wsteps += [rows[i]["t"] - mq for w in ws for i in w]
        qres += [rows[i]["t"] - mq for i in qs]
    if wsteps and qres:
        rng = random.Random(P.seed + 1)
        d = []
        for _ in range(2000):
            ws = [wsteps[rng.randrange(len(wsteps))] for _ in wsteps]
            qs = [qres[rng.randrange(len(qres))] for _ in qres]
            d.append(sum(ws) / len(ws) - sum(qs) / len(qs))
        a["slowdown_per_step_s"] = sum(wsteps) / len(wsteps)
        a["slowdown_per_step_ci"] = ci(d)
        a["slowdown_pct"] = 100 * a["slowdown_per_step_s"] / a["step_quiet_mean_s"]
    # per named thread: CPU-s, run-queue wait and faults per save inside windows (absolute sums)
    per_thread: dict = {}
    for w in wins:
        for i in w:
            for n, d in rows[i]["threads"].items():
                acc = per_thread.setdefault(n, dict.fromkeys(("cpu_s", "wait_s", "minflt", "majflt", "ivcsw", "wchar"), 0))
                for k in acc:
                    acc[k] += d[k]
    a["threads_per_save"] = {n: {k: v / len(wins) for k, v in acc.items()} for n, acc in sorted(per_thread.items())}
    for k in ("call_s", "stall_s", "durable_s", "guard_wait_s", "wait_prev_s", "staging_wait_s"):
        v = [s.get(k) for s in saves if s.get(k) is not None]
        if v:
            a[k + "_median"] = C.median(v)
    st = [s["stats"] for s in saves if "stats" in s]
    if st:
        for k in ("snapshot_s", "write_s", "commit_s", "bytes_total", "bytes_written", "bytes_deferred", "bytes_unwritten",
                  "slowdown_s", "cost_s"):
            v = [s.get(k) for s in st if s.get(k) is not None]
            if v:
                a["stats_" + k] = C.median(v)
    return a


# ---------------------------------------------------------------------------------------------
# perf: what the extra CPU of the windows is spent on
# ---------------------------------------------------------------------------------------------

def _sym_group(sym: str, dso: str) -> str:
    """A sample's leaf frame, as a readable group."""
    d = os.path.basename(dso.strip("()"))
    if "kernel" in d:
        if any(x in sym for x in ("clear_page", "fault", "do_anonymous_page", "handle_mm", "uffd", "userfault")):
            return "kernel: page faults"
        if any(x in sym for x in ("unmap", "tlb", "zap_", "free_pages", "folio_put", "release_pages", "mmap_region")):
            return "kernel: unmap/TLB"
        if any(x in sym for x in ("ext4", "bio", "blk_", "iomap", "dio", "iov_iter", "gup_", "copy_folio", "nvme", "virtio")):
            return "kernel: file I/O"
        if any(x in sym for x in ("schedule", "switch", "pick_", "enqueue", "dequeue", "futex", "raw_spin", "try_to_wake")):
            return "kernel: scheduling/futex"
        if "pagemap" in sym:
            return "kernel: pagemap scan"
        return "kernel: other"
    if d.startswith("libgomp"):
        return "libgomp (OpenMP barriers/spin)"
    if "memmove" in sym or "memcpy" in sym:
        return "memmove/memcpy"
    if "memcmp" in sym:
        return "memcmp"
    if "xxhash" in d or "XXH" in sym:
        return "xxh3"
    if "sgemm" in sym or "mkl" in sym:
        return "torch: MKL GEMM"
    if d.startswith("libtorch") or d.startswith("libc10"):
        return "torch: other kernels"
    if d.startswith("libpython") or d.startswith("_"):
        return "python interpreter"
    return d or "?"


def perf_attribution(data: str, run: dict, P) -> dict:
    """Per thread category and leaf-frame group: samples (as CPU-s) per save inside the windows,
    less the windows' length x the mean of the no-save steps; absolute per save for the checkpoint
    threads. Needs the child to have run under `perf record -k CLOCK_MONOTONIC` (--perf)."""
    if not os.path.exists(data):
        return {}
    p = subprocess.run(["perf", "script", "-i", data, "--max-stack=1", "-F", "tid,time,ip,sym,dso"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows = run["rows"]
    wins, quiet = windows(rows, P.tail)
    calm_w = [w for w in wins if all(rows[i]["foreign_s"] <= P.calm * rows[i]["t"] for i in w)]
    calm_q = [i for i in quiet if rows[i]["foreign_s"] <= P.calm * rows[i]["t"]]
    if len(calm_w) >= 2 and len(calm_q) >= 3:  # other processes' load makes OpenMP spin too: leave it out
        wins, quiet = calm_w, calm_q
    starts = [r["t0"] for r in rows]
    ends = [r["t0"] + r["t"] for r in rows]
    names = {int(t): n for t, n in run.get("thread_names", {}).items()}
    cat = {t: ("train" if n == "train" else "intra" if n.startswith("intra-") else "ckpt") for t, n in names.items()}
    import bisect
    per_step: list[dict] = [dict() for _ in rows]
    tid = t = None
    for line in p.stdout.splitlines():
        if not line.strip():
            continue
        if not line.startswith((" ", "\t")):
            head = line.split()
            tid, t = int(head[0]), float(head[1].rstrip(":"))
            continue
        parts = line.split(None, 1)
        if len(parts) < 2 or tid is None:
            continue
        sym, _, dso = parts[1].rpartition(" (")
        k = bisect.bisect_right(starts, t) - 1
        if k < 0 or t > ends[k]:
            tid = None
            continue
        g = (cat.get(tid, "child" if tid not in names else "ckpt"), _sym_group(sym, "(" + dso))
        per_step[k][g] = per_step[k].get(g, 0) + 1
        tid = None
    hz = P.perf_hz
    groups = {g for d in per_step for g in d}
    out = {}
    for g in groups:
        q = [per_step[i].get(g, 0) / hz for i in quiet]
        mq = sum(q) / len(q) if q else 0.0
        extra = [sum(per_step[i].get(g, 0) / hz for i in w) - len(w) * mq for w in wins]
        out[f"{g[0]} | {g[1]}"] = {"extra_cpu_s": sum(extra) / len(extra) if extra else 0.0, "quiet_step_cpu_s": mq}
    return dict(sorted(out.items(), key=lambda kv: -abs(kv[1]["extra_cpu_s"])))


# ---------------------------------------------------------------------------------------------
# the orchestrator
# ---------------------------------------------------------------------------------------------

def run_child(key: str, P, argv: list, rnd: int = 0) -> dict:
    result = os.path.join(os.path.abspath(P.out), f"{key}-{rnd}.json")
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", key, "--result", result]
    if P.perf and key != "floors":
        cmd = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", str(P.perf_hz), "-g", "-o",
               os.path.join(os.path.abspath(P.out), f"perf-{key}-{rnd}.data"), "--", *cmd]
    if P.wait_quiet > 0:
        load = C.wait_quiet(P.wait_quiet, log=log)
        log(f"{key}: other processes use {load:.2f} CPUs")
    t0 = now()
    others = []
    if P.ranks > 1 and key != "floors":  # ranks 1.. as their own processes; rank 0 is `proc`
        port = _free_port()
        env = dict(os.environ, BENCH_PORT=str(port))
        for r in range(1, P.ranks):
            with open(os.path.join(os.path.abspath(P.out), f"{key}-{rnd}-rank{r}.log"), "w") as fh:
                others.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(env, BENCH_RANK=str(r))))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env, BENCH_RANK="0"))
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate()
        for o in others:
            o.wait(timeout=120)
    finally:
        for o in [proc, *others]:
            if o.poll() is None:  # interrupted: no child runs on alone
                o.kill()
                o.wait()
    p = subprocess.CompletedProcess(cmd, proc.returncode, stdout)
    if p.returncode != 0 or not os.path.exists(result):
        return {"key": key, "name": describe(key) if key != "floors" else key, "error": f"exit {p.returncode}",
                "output": p.stdout[-3000:]}
    with open(result) as f:
        res = json.load(f)
    res["wall_s"] = now() - t0
    return res


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ratio_dist(a: list, b: list, seed: int) -> tuple:
    """95% interval of mean_a / mean_b from two independent bootstrap distributions."""
    if not a or not b:
        return (None, None)
    rng = random.Random(seed)
    r = [a[rng.randrange(len(a))] / x for x in (b[rng.randrange(len(b))] for _ in range(2000)) if x > 0]
    return ci(r)


ESTIMATORS = {"all": "all steps", "adjusted": "foreign-adjusted", "calm": "undisturbed steps only"}


def verdict(ci_: tuple, target: float) -> str:
    """'yes' when the whole 95% interval is within the target, 'no' when all of it is beyond, else 'unresolved'."""
    lo, hi = ci_
    if lo is None:
        return "n/a"
    return "yes" if hi <= target else "no" if lo > target else "unresolved"


def finalize(res: dict, P) -> None:
    """Ratios to the floor and to DCP's best async config, per estimator, and the issue's targets.
    The primary estimator: all steps on a calm machine (other processes < 0.1 CPUs over the run),
    else the undisturbed steps where every config with saves has enough of them, else foreign-adjusted."""
    core = res.get("floors", {}).get("core_s")
    cfgs = {k: c for k, c in res["configs"].items() if c.get("est")}
    primary = "all"
    if res.get("foreign_load", 0) >= 0.1:
        primary = "calm" if all("calm" in c["est"] for c in cfgs.values()) else "adjusted"
    res["primary"] = primary
    res["targets"], res["dcp_best"] = {}, {}
    for name in ESTIMATORS:
        dcp = {k: c["est"][name] for k, c in cfgs.items() if k.startswith("dcp") and name in c["est"]}
        best = min(dcp, key=lambda k: dcp[k]["value"]) if dcp else None
        res["dcp_best"][name] = best
        for k, c in cfgs.items():
            e = c["est"].get(name)
            if e is None:
                continue
            if core:
                e["x_floor"] = e["value"] / core
                e["x_floor_ci"] = tuple(None if x is None else x / core for x in e["ci"])
            if best and dcp[best]["value"] > 0:
                e["x_dcp"] = e["value"] / dcp[best]["value"]
                e["x_dcp_ci"] = ratio_dist(e["dist"], dcp[best]["dist"], P.seed + 7)
        ours = cfgs.get("ours_async", {}).get("est", {}).get(name)
        if ours is None:
            continue
        if "x_floor" in ours:
            res["targets"][f"loop overhead <= 2 x floor core-s ({ESTIMATORS[name]})"] = {
                "value": ours["x_floor"], "ci": ours["x_floor_ci"], "met": verdict(ours["x_floor_ci"], 2.0), "primary": name == primary}
        if "x_dcp" in ours:
            res["targets"][f"loop overhead <= 0.3 x DCP best, {best} ({ESTIMATORS[name]})"] = {
                "value": ours["x_dcp"], "ci": ours["x_dcp_ci"], "met": verdict(ours["x_dcp_ci"], 0.3), "primary": name == primary}
    for c in cfgs.values():
        c["ckpt_cpu_x_floor"] = ckpt_cpu(c) / core if core else None


def f(x, nd=3):
    if x is None:
        return "n/a"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(f(v, nd) for v in x) + "]"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _ranks_text(a: dict) -> str:
    n = a.get("ranks", 1)
    if n <= 1:
        return ""
    return (f"**{n} ranks** (processes on gloo, 127.0.0.1), each holding 1/{n} of the state under its own keys, "
            f"{max(1, a['threads'] // n)} torch thread(s) and the batch above each (1/{n} of the model: the job's work split {n} ways), an all-reduce after every step (the ranks move in "
            "lockstep); rank 0's steps are timed, every rank's process is sampled (the other ranks as children), and "
            "each rank accounts its own threads per step (checkpoint or training, as rank 0 does): the checkpoint and "
            "training CPU columns are every rank's; the floors are those of the whole state on one thread. ")


def markdown(res: dict) -> str:
    a, m, st = res["args"], res["machine"], res.get("state", {})
    fl = res.get("floors", {})
    L = [f"### Cost harness ({res['date']})\n"]
    L.append(f"Machine: {m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('mem_total_gib')} GiB, {res['fs']}, "
             f"torch {res.get('torch')} CPU, {a['threads']} intra-op threads. {a.get('machine_note') or ''}\n")
    L.append(f"State: {st.get('bytes', 0) / GB:.3f} GB (fp32 model + AdamW, {st.get('blocks')} blocks, vocab {st.get('vocab')}); "
             f"batch {st.get('batch')}x{a['seq']}. " + _ranks_text(a) + f"Each config runs in a fresh process: {a['warmup']} warm-up steps, one "
             f"untimed save, then {(a['saves'] + 1) * a['cycle']} timed steps with a save at every step = 0 mod "
             f"{a['cycle']} ({a['saves']} saves). A save's window: its step, the steps until its background work is done, "
             f"+{a['tail']}; the other steps are the no-save steps. Overhead per save = window step time - window "
             f"steps x mean no-save step; [95% bootstrap CI]. Other processes on the machine used "
             f"**{res.get('foreign_load', 0):.2f} CPUs** on average during the run "
             f"({res.get('foreign_cpu_s', 0):.0f} CPU-s; steal {res.get('steal_s', 0):.1f} s).\n")
    if fl:
        L.append("**Floors** (the same bytes, one thread; CPU = the thread's CPU time; best of runs):\n")
        L.append("| floor | wall s | CPU s | machine busy s | GB/s |\n|---|---:|---:|---:|---:|")
        for k, label in (("memcpy", "memmove of the state into a pre-faulted huge-page buffer"),
                         ("xxh3", "xxh3-128 over it, 1 MiB chunks"),
                         ("write_odirect", f"O_DIRECT write {a['write_block_mib']} MiB pwrites + fsync"),
                         ("write_buffered", "buffered write + fsync (what DCP's writer does)")):
            x = fl[k]
            L.append(f"| {label} | {f(x['wall_s'])} | {f(x['cpu_s'])} | {f(x['machine_busy_s'], 2)} | {f(x['GBps'], 2)} |")
        L.append(f"\n**Floor core-seconds per save** (memcpy + xxh3 + O_DIRECT write CPU): **{f(fl['core_s'])} s** "
                 f"(with the write's machine-wide CPU: {f(fl['core_s_machine'])} s).\n")
    prim = res.get("primary", "all")
    L.append(f"**Per save** (means over saves; [95% bootstrap CI]). Loop overhead by three estimators: all steps; "
             f"foreign-adjusted (no-save step time modelled as a + b x other processes' CPU-s in the step); undisturbed "
             f"(only windows and no-save steps in which other processes used <= {a['calm']} CPUs; n = saves kept). "
             f"Ratios use the primary estimator, **{ESTIMATORS[prim]}**. CPU, run-queue waits and faults are extras "
             f"against the no-save steps, per save:\n")
    L.append("| config | loop overhead (primary) | all steps | foreign-adjusted | undisturbed (n) | x floor core-s | "
             "x DCP best | overlapping step slowdown | window steps | stall (median) | durable (median) | "
             "ckpt threads CPU-s (+ children; every rank's with --ranks) | training threads extra CPU-s | training threads extra run-queue wait s | "
             "foreign CPUs |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def est(c, name, bold=False):
        e = c["est"].get(name)
        if e is None:
            return "n/a"
        v = f"**{f(e['value'])}**" if bold else f(e["value"])
        return f"{v} [{f(e['ci'][0])}, {f(e['ci'][1])}]"

    for k, c in res["configs"].items():
        if "error" in c:
            L.append(f"| {c.get('name', k)} | ERROR {c['error']} |" + " |" * 14)
            continue
        if not c.get("est"):
            L.append(f"| {c['name']} | (no saves: step {f(c.get('step_quiet_mean_s'))} ± {f(c.get('step_quiet_sd_s'))} s) |"
                     + " |" * 12 + f" {f(c.get('foreign_load'), 2)} |")
            continue
        e = c["est"].get(prim, {})
        xf = f"{f(e.get('x_floor'), 1)} [{f((e.get('x_floor_ci') or (None, None))[0], 1)}, {f((e.get('x_floor_ci') or (None, None))[1], 1)}]"
        xd = f"{f(e.get('x_dcp'), 2)} [{f((e.get('x_dcp_ci') or (None, None))[0], 2)}, {f((e.get('x_dcp_ci') or (None, None))[1], 2)}]" \
            if e.get("x_dcp") is not None else "n/a"
        L.append(f"| {c['name']} | {est(c, prim, True)} | {est(c, 'all')} | {est(c, 'adjusted')} | "
                 f"{est(c, 'calm')} ({c.get('calm_saves')}) | {xf} | {xd} | "
                 f"{f(c.get('slowdown_per_step_s'))} s ({f(c.get('slowdown_pct'), 1)}%) | {f(c['window_steps_mean'], 1)} | "
                 f"{f(c.get('stall_s_median', c.get('call_s_median')))} | {f(c.get('durable_s_median'))} | "
                 f"{f(ckpt_cpu(c))} | {f(c['train_cpu_s'] + c['intra_cpu_s'] + c.get('ranks_train_cpu_s', 0.0))} | "
                 f"{f(c['train_wait_s'] + c['intra_wait_s'])} | {f(c.get('foreign_load'), 2)} |")
    L.append("\n**The first save** (not in the windows above: each loop starts with one untimed save): save() blocked "
             "the loop for " + "; ".join(f"{k} {f(c.get('first_call_s'))} s" for k, c in res["configs"].items()
                                         if c.get("first_call_s") is not None)
             + " (save() entry to durable: " + "; ".join(f"{k} {f(c.get('first_save_s'), 2)} s" for k, c in res["configs"].items()
                                                          if c.get("first_save_s") is not None)
             + "). A run of N saves pays that once: 1/N of it per save on top of the steady state above.\n")
    L.append("\n**The training threads' view** (extras per save against the no-save steps, seconds unless named): "
             "the loop thread's extra step time splits into its extra CPU time (its own work slower, page faults, "
             "OpenMP spinning), its extra run-queue wait (a CPU taken by another thread) and its extra blocked time "
             "(asleep: the GIL, the save call's and the guard's waits, a futex in an OpenMP barrier; and, on a "
             "virtual machine, time the hypervisor gave the thread's virtual CPU to other work: the kernel's "
             "clock leaves stolen time out of both CPU and run-queue time); the same for "
             "torch's intra-op threads; voluntary context switches of the loop thread count its sleeps; the "
             "machine's steal (all virtual CPUs, from /proc/stat) is the part of that the host took, e.g. to "
             "carry out the save's disk I/O. Over the "
             f"steps of the primary estimator ({ESTIMATORS[prim]}).\n")
    L.append("| config | loop thread: CPU | run-queue wait | blocked | sleeps (vcsw) | minor faults | intra-op: CPU | "
             "run-queue wait | blocked | machine steal (vCPU-s) | ckpt threads CPU-s (+ children; every rank's with --ranks) | their run-queue wait |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, c in res["configs"].items():
        if not c.get("est"):
            continue
        c = c["calm"] if prim == "calm" and c.get("calm") else c
        L.append(f"| {k} | {f(c['train_cpu_s'])} | {f(c['train_wait_s'])} | {f(c.get('train_blocked_s'))} | "
                 f"{c['train_vcsw']:.0f} | {c['train_minflt']:.0f} | {f(c['intra_cpu_s'])} | {f(c['intra_wait_s'])} | "
                 f"{f(c.get('intra_blocked_s'))} | {f(c.get('steal_s'))} | {f(ckpt_cpu(c))} | {f(c['ckpt_wait_s'])} |")
    L.append("\nNo-save step time per config (mean ± sd, the reference of its own overheads): " + "; ".join(
        f"{k} {f(c.get('step_quiet_mean_s'))} ± {f(c.get('step_quiet_sd_s'))} (n={c.get('n_quiet')})"
        for k, c in res["configs"].items() if "error" not in c) + ".\n")
    L.append("**Where the CPU went, per save** (named threads inside the windows, absolute; CPU-s / run-queue wait s / "
             "minor faults):\n")
    for k, c in res["configs"].items():
        th = c.get("threads_per_save")
        if not th:
            continue
        bits = [f"{n} {v['cpu_s']:.3f}/{v['wait_s']:.3f}/{v['minflt']:.0f}" for n, v in th.items() if v["cpu_s"] >= 0.001]
        L.append(f"- {k}: " + "; ".join(bits) + f" (quiet step: train {f(c.get('train_cpu_s_quiet_mean'))} CPU-s, "
                 f"intra-op {f(c.get('intra_cpu_s_quiet_mean'))} CPU-s, train wait {f(c.get('train_wait_s_quiet_mean'))} s)")
    L.append("")
    L.extend(per_step_md(res))
    perf = {k: c["perf"] for k, c in res["configs"].items() if c.get("perf")}
    if perf:
        L.append("**perf** (leaf frames sampled at %d Hz: extra CPU-s per save inside the windows against the no-save "
                 "steps, by thread category | code; the 8 largest):\n" % res["args"]["perf_hz"])
        for k, d in perf.items():
            top = list(d.items())[:8]
            L.append(f"- {k}: " + "; ".join(f"{g} {v['extra_cpu_s']:+.3f}" for g, v in top))
        L.append("")
    if res.get("targets"):
        L.append("**Targets** (issue 21; ours = ours_async; met = the whole 95% interval within the target, "
                 "unresolved = the interval spans it):\n")
        L.append("| target | value [95% CI] | met |\n|---|---:|---|")
        for k, t in res["targets"].items():
            mark = " (primary)" if t.get("primary") else ""
            L.append(f"| {k}{mark} | {f(t['value'], 2)} [{f(t['ci'][0], 2)}, {f(t['ci'][1], 2)}] | {t['met']} |")
        L.append("")
    if res.get("problems"):
        L.append("Problems: " + "; ".join(res["problems"]) + "\n")
    L.append(f"Total wall time {res.get('total_wall_s', 0):.0f} s. Command: `python bench/bench_cost.py "
             f"{' '.join(res.get('argv', []))}`.\n")
    return "\n".join(L)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None, help="model + AdamW state GB (default 0.7; --quick 0.2)")
    p.add_argument("--batch", type=int, default=None, help="batch (default round(2.8/size_gb), as bench_core)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--step-time", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (per rank: this / --ranks, at least 1)")
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks per config: real processes on gloo (127.0.0.1), each holding 1/ranks of the state under its own "
                        "keys, an all-reduce after every step; rank 0 reports and samples every rank's process")
    p.add_argument("--saves", type=int, default=None, help="timed saves per config (default 7; --quick 3)")
    p.add_argument("--cycle", type=int, default=None, help="a save every this many steps (default 7; --quick 5)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every config this many times, interleaved (configs then meet the same machine "
                        "conditions); the saves and no-save steps of all rounds are pooled")
    p.add_argument("--tail", type=int, default=1, help="steps after a save's background work still in its window")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--floor-reps", type=int, default=2)
    p.add_argument("--write-block-mib", type=int, default=32)
    p.add_argument("--only", default="", help="comma-separated config keys (default: " + ",".join(DEFAULT) + ")")
    p.add_argument("--knobs", action="store_true", help="also: " + ",".join(KNOBS))
    p.add_argument("--perf", action="store_true", help="run each config under perf record (out/perf-KEY.data)")
    p.add_argument("--perf-hz", type=int, default=499)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calm", type=float, default=0.15,
                   help="'undisturbed' steps: other processes used at most this many CPUs during the step")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each config, wait up to this many seconds for other processes to use < 0.3 CPUs")
    p.add_argument("--out", default=os.path.join(HERE, "out", "cost-run"), help="scratch dir (deleted and recreated)")
    p.add_argument("--json", default=os.path.join(HERE, "out", "cost.json"))
    p.add_argument("--md", default=os.path.join(HERE, "out", "cost.md"))
    p.add_argument("--quick", action="store_true", help="0.2 GB, 3 saves per config: a smoke test")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--machine-note", default="")
    p.add_argument("--reanalyze", default=None, metavar="JSON",
                   help="recompute the analysis and report of an earlier run's JSON (its raw steps) without running")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    P = p.parse_args(argv)
    if P.quick:
        P.size_gb = P.size_gb or 0.2
        P.saves = P.saves or 3
        P.cycle = P.cycle or 5
        P.warmup, P.floor_reps = 1, 1
    P.size_gb = P.size_gb or 0.7
    P.saves = P.saves or 7
    P.cycle = P.cycle or 7
    return P


def run_one(res: dict, key: str, P, child_argv: list, rnd: int) -> None:
    """One config's loop in a child process (round `rnd`); its raw steps kept in res["raw"][key]["runs"]."""
    r = run_child(key, P, child_argv, rnd)
    if "error" in r:
        res["problems"].append(f"{key} (round {rnd}): {r['error']}")
        log(f"{key}: ERROR {r['error']}\n{r.get('output', '')}")
        res["configs"].setdefault(key, r)
        return
    res.setdefault("torch", r.get("torch"))
    if r.get("children_late"):
        res["problems"].append(f"{key}: child processes appeared during the loop and were not sampled: {r['children_late']}")
    run = {k: r.get(k) for k in ("rows", "saves", "thread_names", "wall_s", "first_save_s", "first_call_s", "io_policy")}
    if P.perf:
        run["perf"] = perf_attribution(os.path.join(os.path.abspath(P.out), f"perf-{key}-{rnd}.data"), r, P)
    raw = res.setdefault("raw", {}).setdefault(key, {"name": r["name"], "runs": []})
    raw["runs"].append(run)
    a = analyze({"name": r["name"], "runs": [run]}, P)
    e = a.get("est", {})
    if e:
        log(f"{key:18s} overhead/save {e['all']['value']:.3f} s [{e['all']['ci'][0]:.3f}, {e['all']['ci'][1]:.3f}]"
            + (f" (undisturbed {e['calm']['value']:.3f}, n={a['calm_saves']})" if "calm" in e else "")
            + f"  ckpt CPU {ckpt_cpu(a):.3f} s  train wait +{a['train_wait_s'] + a['intra_wait_s']:.3f} s  "
            f"step {a['step_quiet_mean_s']:.3f} s  foreign {a['foreign_load']:.2f} CPUs  [{r['wall_s']:.0f} s]")
    else:
        log(f"{key:18s} step {a['step_quiet_mean_s']:.3f} ± {a['step_quiet_sd_s']:.3f} s  foreign {a['foreign_load']:.2f} CPUs")


def _merge_perf(runs: list) -> dict:
    """Per-run perf attributions averaged over runs, weighted by their saves."""
    out: dict = {}
    weights = [sum(1 for row in r["rows"] if row["save"]) for r in runs]
    total = sum(w for w, r in zip(weights, runs) if r.get("perf")) or 1
    for w, r in zip(weights, runs):
        for g, v in (r.get("perf") or {}).items():
            acc = out.setdefault(g, {"extra_cpu_s": 0.0, "quiet_step_cpu_s": 0.0})
            for k in acc:
                acc[k] += v[k] * w / total
    return dict(sorted(out.items(), key=lambda kv: -abs(kv[1]["extra_cpu_s"])))


def analyze_all(res: dict, P) -> None:
    """(Re)compute every config's analysis from the raw per-step records kept in `res`."""
    for key, raw in res.get("raw", {}).items():
        if "runs" not in raw:  # a run of one round, as the first version of this harness kept it
            raw = {"name": res["configs"].get(key, {}).get("name", describe(key)), "runs": [raw]}
        a = analyze({"name": raw.get("name", describe(key)), "runs": raw["runs"]}, P)
        runs = raw["runs"]
        a["rounds"] = len(runs)
        a["wall_s"] = sum(r.get("wall_s") or 0 for r in runs)
        a["first_save_s"] = C.median([r.get("first_save_s") for r in runs])
        a["first_call_s"] = C.median([r.get("first_call_s") for r in runs])
        a["io_policy"] = runs[0].get("io_policy")
        if any(r.get("perf") for r in runs):
            a["perf"] = _merge_perf(runs)
        res["configs"][key] = a


def report(res: dict, P) -> None:
    analyze_all(res, P)
    finalize(res, P)
    md = markdown(res)
    for c in res["configs"].values():  # the bootstrap distributions are long: kept out of the JSON
        for e in c.get("est", {}).values():
            e.pop("dist", None)
    C.write_results(res, md, P.json, P.md)
    log(f"JSON: {P.json}  markdown: {P.md}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    P = parse_args(argv)
    if P.child:
        return child_main(P)
    if P.reanalyze:
        with open(P.reanalyze) as fh:
            res = json.load(fh)
        res["args"].update(tail=P.tail, calm=P.calm, seed=P.seed)
        report(res, P)
        return 0
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the running child is killed too
    import platform
    out = os.path.abspath(P.out)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    keys = P.only.split(",") if P.only else list(DEFAULT) + (list(KNOBS) if P.knobs else [])
    unknown = [k for k in keys if k not in DEFAULT and k not in KNOBS]
    if unknown:
        sys.exit(f"unknown config(s) {unknown}; known: {DEFAULT + list(KNOBS)}")
    t_start = now()
    cpu0, m0 = C.cpu_snapshot(), C.machine_cpu()
    res: dict = {"date": P.date, "machine": C.machine_description(), "fs": C.fs_type(out), "python": platform.python_version(),
                 "args": {k: v for k, v in vars(P).items() if k not in ("child", "result")}, "argv": argv,
                 "configs": {}, "problems": []}
    child_argv = [a for a in argv if a not in ("--knobs", "--perf")]
    log("floors ...")
    fr = run_child("floors", P, child_argv)
    if "error" in fr:
        res["problems"].append(f"floors: {fr['error']}: {fr.get('output', '')[-500:]}")
    else:
        res["floors"] = fr["floors"]
        res["state"] = {"bytes": fr["state_bytes"], "params": fr["n_params"], "blocks": fr["blocks"], "vocab": fr["vocab"],
                        "batch": fr["batch"]}
        fl = fr["floors"]
        log(f"  memcpy {fl['memcpy']['cpu_s']:.3f} CPU-s, xxh3 {fl['xxh3']['cpu_s']:.3f}, O_DIRECT write "
            f"{fl['write_odirect']['cpu_s']:.3f} CPU-s ({fl['write_odirect']['wall_s']:.3f} s wall): core {fl['core_s']:.3f} s")
    for rnd in range(P.rounds):
        for key in keys:
            run_one(res, key, P, child_argv, rnd)
    res["total_wall_s"] = now() - t_start
    res["foreign_cpu_s"] = C.foreign_cpu_since(cpu0)
    res["foreign_load"] = res["foreign_cpu_s"] / res["total_wall_s"]
    res["steal_s"] = C.machine_cpu()["steal_s"] - m0["steal_s"]
    report(res, P)
    if not P.perf:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

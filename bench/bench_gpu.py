#!/usr/bin/env python
"""What a save costs a GPU training loop, against the physics and DCP, in one run (issue 21 on a GPU node).

    python bench/bench_gpu.py --gb 2 --budget-s 150   # what docs/benchmarks.md shows: ~4-5 min on one H200
    python bench/bench_gpu.py                     # 4 GB of state (fp32 weights + AdamW), 6 pairs per config
    python bench/bench_gpu.py --gb 1 --pairs 4    # quick
    python bench/bench_gpu.py --only floor,ours   # some configs

One process, one model on the GPU (bench_core.py's transformer, bf16 autocast, fp32 master weights
and AdamW state: 12 bytes per parameter), the same training loop for every config. The loop
synchronizes the device at the end of every step (as a loop that logs its loss each step does), so
a step's wall time is what the training pays.

Measurement: cycles of --cycle steps; per config, --pairs pairs of one cycle with a save at its
first step and one without, in random order within each pair (a drift of the machine cancels).
Loop overhead per save = the mean over pairs of (save cycle - no-save cycle), with a bootstrap 95%
confidence interval; the same difference of the process's CPU time (every thread, getrusage) is
the save's core-seconds. A save cycle ends when its save is durable: a save slower than the cycle
waits at the cycle's end, and the wait counts against it (the table says how often).

Configs:
  floor   physics as a saver: at save, the whole state copied device-to-host into one preallocated
          pinned buffer on a side stream (the compute stream waits for that copy before the next
          optimizer.step), then one thread digests it (xxh3-128) and writes it with O_DIRECT + fsync.
  ours    CheckpointManager.save(step, {"model", "optim", "step"}) (the default: async snapshot into
          pinned staging, incremental).
  ours_sd the same with model.state_dict() / optimizer.state_dict().
  ours_noyield  `ours` with background_yield_s=None: the save's threads keep normal priority (not in
          the default set: name it with --only; on a node whose CPUs wait for the GPU, yielding
          should cost nothing; this says whether it does).
  dcp     torch.distributed.checkpoint.async_save (thread), its default staging (a blocking copy to
          host memory inside the call).
  dcp_pinned  async_save with a reused DefaultStager: pinned memory, async staging, non-blocking
          copies; the next optimizer.step waits for staging (as torchtitan does). DCP's best.

Floors (same bytes, same run): device-to-host copy into pinned memory (the PCIe/DMA floor of the
stall), xxh3-128 on one core, O_DIRECT write + fsync from pinned memory, cold O_DIRECT read.
Restore: ours and dcp.load of the last step into the live model and optimizer, from cold files
(page cache dropped where the machine lets us), checked bit-exact.

Results: bench/out/gpu.md and bench/out/gpu.json (or --md/--json). Without CUDA the same code runs
on the CPU as a smoke test of the harness (numbers meaningless).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import random
import resource
import shutil
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as C  # noqa: E402
from _common import now  # noqa: E402
from bench_core import TinyLM, init_gloo, shape_for, stager_closed  # noqa: E402

GB = 1e9
MiB = 1 << 20
ALL = ["floor", "ours", "ours_sd", "dcp", "dcp_pinned"]
KNOWN = ALL + ["ours_noyield"]
OURS = ("ours", "ours_sd", "ours_noyield")  # the configs that save with a CheckpointManager


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sync_step(dev):
    """The end of a step as a loop that reads its loss sees it: the compute stream done (a save's
    copies on other streams may still run)."""
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------

class GpuTrainer:
    def __init__(self, gb: float, dev: torch.device, seq: int, target_step_s: float, batch: int):
        torch.manual_seed(0)
        self.dev, self.seq, self.d = dev, seq, 1024
        self.n_blocks, self.vocab = shape_for(gb, self.d)
        self.model = TinyLM(self.d, self.n_blocks, self.vocab).to(dev)
        kw = {"fused": True} if dev.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01, **kw)
        self.amp = dev.type == "cuda"
        self._data(batch or 1)
        self.step()  # AdamW state exists from here on
        self.batch = batch or self._calibrate(target_step_s)

    def _data(self, batch: int):
        g = torch.Generator(device=self.dev).manual_seed(1234)
        self.x = torch.randn(batch, self.seq, self.d, generator=g, device=self.dev)
        self.y = torch.randint(0, self.vocab, (batch, self.seq), generator=g, device=self.dev)

    def _calibrate(self, target: float) -> int:
        def timed(b):
            self._data(b)
            self.step()
            sync(self.dev)
            t0 = now()
            for _ in range(2):
                self.step()
            sync(self.dev)
            return (now() - t0) / 2
        t1, t2 = timed(1), timed(2)
        per = max(t2 - t1, 1e-4)
        b = max(1, min(256, int(round(1 + (target - t1) / per))))
        while True:  # the largest batch up to that which fits in the device's memory (a large model's
            try:     # activations outgrow it first: 8 GB of state at batch 256 did on a 141 GB H200)
                self._data(b)
                self.step()
                sync(self.dev)
                return b
            except torch.OutOfMemoryError:
                if b == 1:
                    raise
                self.x = self.y = None
                self.opt.zero_grad(set_to_none=True)
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()
                b = max(1, b * 2 // 3)

    def step(self, pre_step=None):
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp):
            out = self.model(self.x)
            loss = F.cross_entropy(out.float().view(-1, self.vocab), self.y.view(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if pre_step is not None:
            pre_step()
        self.opt.step()

    def state(self, step: int) -> dict:
        return {"model": self.model, "optim": self.opt, "step": step}

    def tensors(self) -> list:
        ts = [p.detach() for p in self.model.parameters()]
        for st in self.opt.state.values():
            ts.extend(v for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        return ts

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


# ---------------------------------------------------------------------------------------------
# savers: save(step) at a step's start; pre_step() before optimizer.step(); done() -> durable?
# ---------------------------------------------------------------------------------------------

class FloorSaver:
    """The minimum a save must do: DMA the state to pinned host memory, digest it, write it."""

    name = "floor: D2H into pinned + xxh3 + O_DIRECT write (one thread)"

    def __init__(self, tr: GpuTrainer, root: str):
        import xxhash
        self.xxhash = xxhash
        self.tr, self.root = tr, root
        os.makedirs(root, exist_ok=True)
        self.nbytes = C.round_up(tr.state_bytes(), C.PAGE)
        self.buf = C.aligned_buffer(self.nbytes, fill=0)
        self.host = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.pinned = tr.dev.type == "cuda"
        if self.pinned:
            err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), self.nbytes, 0)
            assert int(err) == 0, f"cudaHostRegister failed: {err}"
        self.stream = torch.cuda.Stream(tr.dev) if self.pinned else None
        self.thread = None
        self.event = None
        self.recs: list = []

    def save(self, step):
        t0 = now()
        if self.thread is not None:
            self.thread.join()
        t1 = now()
        rec = {"step": step, "wait_prev_s": t1 - t0}
        off = 0
        if self.pinned:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for t in self.tr.tensors():
                    n = t.numel() * t.element_size()
                    self.host[off:off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
                    off += n
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        else:
            for t in self.tr.tensors():
                n = t.numel() * t.element_size()
                ctypes.memmove(self.host.data_ptr() + off, t.data_ptr(), n)
                off += n
        rec["call_s"] = now() - t0
        self.thread = threading.Thread(target=self._write, args=(step, t0, rec, self.event), name="floor-writer")
        self.thread.start()
        self.recs.append(rec)

    def pre_step(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None

    def _write(self, step, t0, rec, event):
        if event is not None:
            event.synchronize()
        rec["staged_s"] = now() - t0
        h = self.xxhash.xxh3_128()
        mv = memoryview(self.buf)
        for off in range(0, self.nbytes, MiB):
            h.update(mv[off:off + MiB])
        path = os.path.join(self.root, f"floor-{step % 2}.bin")
        try:
            C.write_from(path, self.buf, direct=True)
        except OSError:
            C.write_from(path, self.buf, direct=False)
        rec["durable_s"] = now() - t0

    def done(self):
        return self.thread is None or not self.thread.is_alive()

    def wait(self):
        if self.thread is not None:
            self.thread.join()

    def finish(self):
        self.wait()
        for rec in self.recs:
            rec["stall_s"] = rec["call_s"] - rec["wait_prev_s"]

    def close(self):
        self.wait()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        del self.host
        try:
            self.buf.close()
        except BufferError:
            pass


class OursSaver:
    def __init__(self, tr, root, form: str, yielding: bool = True):
        from checkpointing import CheckpointManager
        self.tr, self.root, self.form = tr, root, form
        self.name = ("ours: CheckpointManager.save" + (" (state_dict()s)" if form == "state_dict" else " (model, optimizer)")
                     + ("" if yielding else ", background_yield_s=None"))
        self.mgr = CheckpointManager(root, keep_local=2, **({} if yielding else {"background_yield_s": None}))
        self.recs: list = []
        self.handle = None

    def _state(self, step):
        if self.form == "state_dict":
            return {"model": self.tr.model.state_dict(), "optim": self.tr.opt.state_dict(), "step": step}
        return self.tr.state(step)

    def save(self, step):
        t0 = now()
        self.handle = self.mgr.save(step, self._state(step))
        self.recs.append({"step": step, "call_s": now() - t0})

    def pre_step(self):
        pass  # the manager's optimizer pre-step hook orders optimizer.step() after the snapshot (state dicts too)

    def done(self):
        return self.handle is None or self.handle.done()

    def wait(self):
        self.mgr.wait()

    def finish(self):
        self.mgr.wait()
        stats = {s.step: s for s in self.mgr.stats()}
        for rec in self.recs:
            s = stats[rec["step"]]
            rec.update(wait_prev_s=s.wait_prev_s, stall_s=s.stall_s, guard_wait_s=s.guard_wait_s,
                       durable_s=s.total_s, snapshot_s=s.snapshot_s, write_s=s.write_s, commit_s=s.commit_s,
                       bytes_written=s.bytes_written, ok=s.ok)

    def restore(self):
        return self.mgr.restore(self.tr.state(0))

    def close(self):
        self.mgr.close()


class DcpSaver:
    def __init__(self, tr, root, pinned: bool):
        self.tr, self.root, self.pinned = tr, root, pinned
        self.stager = None
        self.stagers_made = 0
        if pinned:
            self.stager = self._new_stager()
            self.name = "DCP async_save (thread), reused DefaultStager: pinned, async staging, non-blocking copy"
        else:
            self.name = "DCP async_save (thread), default staging"
        self.recs: list = []
        self.upload = None
        self.staging = None
        self.last = None

    def _new_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        cuda = self.tr.dev.type == "cuda"
        self.stagers_made += 1
        return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=cuda))

    def state(self, step):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.tr.model, self.tr.opt)
        return {"model": msd, "optim": osd, "step": step}

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
        t0 = now()
        if self.upload is not None:
            self.upload.result()
        t1 = now()
        rec = {"step": step, "wait_prev_s": t1 - t0, "staging_wait_s": 0.0}
        if self.stager is not None and stager_closed(self.stager):
            self.stager = self._new_stager()  # counted in this save's call time, as it is in the loop
        self.last = os.path.join(self.root, f"step-{step}")
        r = dcp.async_save(self.state(step), checkpoint_id=self.last,
                           async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=self.stager)
        if isinstance(r, AsyncSaveResponse):
            self.upload, self.staging = r.upload_completion, r.staging_completion
        else:
            self.upload = r
        rec["call_s"] = now() - t0

        def finished(_f, rec=rec, t0=t0):
            rec["durable_s"] = now() - t0
        self.upload.add_done_callback(finished)
        self.recs.append(rec)

    def pre_step(self):
        if self.staging is not None:
            t0 = now()
            self.staging.result()
            self.recs[-1]["staging_wait_s"] += now() - t0
            self.staging = None

    def done(self):
        return self.upload is None or self.upload.done()

    def wait(self):
        self.pre_step()
        if self.upload is not None:
            self.upload.result()

    def finish(self):
        self.wait()
        for rec in self.recs:
            t_end = now() + 5
            while "durable_s" not in rec and now() < t_end:
                time.sleep(0.001)
            rec["stall_s"] = rec["call_s"] - rec["wait_prev_s"] + rec["staging_wait_s"]

    def restore(self):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        st = self.state(0)
        dcp.load(st, checkpoint_id=self.last)
        set_state_dict(self.tr.model, self.tr.opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
        return st["step"]

    def close(self):
        self.wait()
        if self.stager is not None:
            self.stager.close()


def make_saver(key, tr, root):
    if key == "floor":
        return FloorSaver(tr, root)
    if key == "ours":
        return OursSaver(tr, root, "objects")
    if key == "ours_sd":
        return OursSaver(tr, root, "state_dict")
    if key == "ours_noyield":
        return OursSaver(tr, root, "objects", yielding=False)
    if key == "dcp":
        return DcpSaver(tr, root, pinned=False)
    if key == "dcp_pinned":
        return DcpSaver(tr, root, pinned=True)
    raise SystemExit(f"unknown config {key!r}; known: {', '.join(KNOWN)}")


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------

def run_cycle(tr, saver, step0: int, n: int, save: bool) -> dict:
    sync(tr.dev)
    c0, t0 = cpu_s(), now()
    steps = []
    for i in range(n):
        ts = now()
        if save and i == 0:
            saver.save(step0)
        tr.step(saver.pre_step if saver is not None else None)
        sync_step(tr.dev)
        steps.append(now() - ts)
    late = 0.0
    if save and not saver.done():
        t = now()
        saver.wait()
        late = now() - t
    return {"t": now() - t0, "cpu": cpu_s() - c0, "steps": steps, "late_s": late}


def bootstrap_mean_ci(xs: list, n: int = 2000, seed: int = 0) -> list:
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(xs) for _ in xs) / len(xs) for _ in range(n))
    return [means[int(0.025 * n)], means[int(0.975 * n) - 1]]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def analyze(res: dict, seed: int) -> None:
    """A config's per-save numbers from its pairs of cycles and its saves' records. The save cycle's
    time, less its no-save partner's, is the loop overhead; the part of it spent at the cycle's end
    waiting for a save still not durable is given apart (`in_loop_s` is the rest): a loop that saves
    less often would not wait for it."""
    pairs, recs = res["pairs"], res["recs"]
    d_t = [p["save"]["t"] - p["none"]["t"] for p in pairs]
    d_in = [p["save"]["t"] - p["save"]["late_s"] - p["none"]["t"] for p in pairs]
    d_cpu = [p["save"]["cpu"] - p["none"]["cpu"] for p in pairs]
    res.update(
        overhead_s=_mean(d_t), overhead_ci=bootstrap_mean_ci(d_t, seed=seed),
        in_loop_s=_mean(d_in), in_loop_ci=bootstrap_mean_ci(d_in, seed=seed + 2),
        cpu_s=_mean(d_cpu), cpu_ci=bootstrap_mean_ci(d_cpu, seed=seed + 1),
        step_s=_mean([s for p in pairs for s in p["none"]["steps"]]),
        late=sum(1 for p in pairs if p["save"]["late_s"] > 0), late_s=_mean([p["save"]["late_s"] for p in pairs]),
        call_s=_mean([r.get("call_s") for r in recs]), stall_s=_mean([r.get("stall_s") for r in recs]),
        durable_s=_mean([r.get("durable_s") for r in recs]),
        save_step_extra_s=_mean([p["save"]["steps"][0] - _mean(p["none"]["steps"]) for p in pairs]),
    )


def run_config(key, tr, P, out) -> dict:
    root = os.path.join(out, key)
    shutil.rmtree(root, ignore_errors=True)
    t0 = now()
    saver = make_saver(key, tr, root)
    res = {"name": saver.name, "setup_s": now() - t0}
    step = 1
    # warm-up: the first saves allocate and register staging, open files, start threads
    for w in range(P.warm):
        t = now()
        run_cycle(tr, saver, step, P.cycle, True)
        saver.wait()
        res.setdefault("warm_cycle_s", []).append(now() - t)
        step += P.cycle
    saver.recs.clear()
    rng = random.Random(P.seed)
    pairs = []
    for _ in range(P.pairs):
        order = [True, False] if rng.random() < 0.5 else [False, True]
        got = {}
        for s in order:
            got[s] = run_cycle(tr, saver, step, P.cycle, s)
            step += P.cycle
        pairs.append(got)
    saver.finish()
    res.update(recs=saver.recs, pairs=[{"save": p[True], "none": p[False]} for p in pairs])
    analyze(res, P.seed)
    if key in OURS:
        res["guard_wait_s"] = _mean([r.get("guard_wait_s") for r in res["recs"]])
        res["staging_bytes"] = saver.mgr.staging_bytes
        res["ok"] = all(r.get("ok") for r in res["recs"])
    if key == "dcp_pinned":
        res["stagers_made"] = saver.stagers_made
    if P.restore and key in ("ours", "dcp_pinned"):
        res["restore"] = measure_restore(tr, saver, root)
    saver.close()
    shutil.rmtree(root, ignore_errors=True)
    return res


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def measure_restore(tr, saver, root) -> dict:
    """Restore the last saved step into the live model + optimizer (in place), from cold files where
    the page cache can be dropped; checked against the tensors as they were at that save."""
    saver.wait()
    # the state as of the last save: put it back first (training went on after it), by restoring
    ref_step = saver.recs[-1]["step"]
    out = {"step": ref_step}
    saver.restore()  # warm, also brings the live state to the saved one
    sync(tr.dev)
    ref = [t.clone() for t in tr.tensors()]
    with torch.no_grad():
        for t in tr.tensors():
            t.zero_()
    out["cold"] = drop_caches()
    t0 = now()
    saver.restore()
    sync(tr.dev)
    out["restore_s"] = now() - t0
    out["bytes_on_disk"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    out["bit_exact"] = all(torch.equal(a, b) for a, b in zip(tr.tensors(), ref))
    del ref
    return out


# ---------------------------------------------------------------------------------------------
# floors
# ---------------------------------------------------------------------------------------------

def measure_floors(tr, out, reps: int = 3) -> dict:
    import xxhash
    nbytes = C.round_up(tr.state_bytes(), C.PAGE)
    res = {"bytes": tr.state_bytes()}
    buf = C.aligned_buffer(nbytes, fill=0)
    host = torch.frombuffer(buf, dtype=torch.uint8)
    tensors = tr.tensors()
    if tr.dev.type == "cuda":
        torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
        best = []
        for _ in range(reps):
            sync(tr.dev)
            t0 = now()
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                host[off:off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
                off += n
            sync(tr.dev)
            best.append(now() - t0)
        res["d2h_pinned_s"] = min(best)
    mv = memoryview(buf)
    ts = []
    for _ in range(reps):
        c0 = time.thread_time()
        h = xxhash.xxh3_128()
        for off in range(0, nbytes, MiB):
            h.update(mv[off:off + MiB])
        ts.append(time.thread_time() - c0)
    res["xxh3_core_s"] = min(ts)
    del mv
    path = os.path.join(out, "floor.bin")
    ws, wcpu = [], []
    for _ in range(reps):
        if os.path.exists(path):
            os.remove(path)
        C.fsync_dir(out)
        c0 = time.thread_time()
        try:
            ws.append(C.write_from(path, buf, direct=True))
            res["write_direct"] = True
        except OSError:
            ws.append(C.write_from(path, buf, direct=False))
            res["write_direct"] = False
        wcpu.append(time.thread_time() - c0)
    res["write_odirect_s"], res["write_cpu_s"] = min(ws), min(wcpu)
    rs = []
    for _ in range(reps):
        C.evict(path)
        drop_caches()
        try:
            rs.append(C.read_file(path, buf, direct=True)[0])
        except OSError:
            rs.append(C.read_file(path, buf, direct=False)[0])
    res["read_odirect_cold_s"] = min(rs)
    os.remove(path)
    if tr.dev.type == "cuda":
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    del host
    try:
        buf.close()
    except BufferError:
        pass
    res["floor_core_s"] = res["xxh3_core_s"] + res["write_cpu_s"]
    return res


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def f3(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(res: dict) -> str:
    fl, cf = res["floors"], res["configs"]
    nb = fl["bytes"]
    L = [f"### GPU: {res['device']} — {nb / GB:.2f} GB of state, {res['date']}", "",
         f"Machine: {res['machine']}; torch {res['torch']}; model {res['model']}; batch {res['batch']} x "
         f"seq {res['seq']}, bf16 autocast, fused AdamW; a step (no save) {f3(res['step_s'])} s; cycles of "
         f"{res['cycle']} steps, {res['pairs']} save/no-save pairs per config. Command: `{res['command']}`.", "",
         "Floors of the same bytes: "
         + (f"device-to-host into pinned memory {f3(fl.get('d2h_pinned_s'))} s ({C.gbps(nb, fl['d2h_pinned_s']):.1f} GB/s), "
            if fl.get("d2h_pinned_s") else "")
         + f"xxh3-128 on one core {f3(fl['xxh3_core_s'])} s, "
         f"{'O_DIRECT' if fl.get('write_direct') else 'buffered'} write + fsync {f3(fl['write_odirect_s'])} s "
         f"({C.gbps(nb, fl['write_odirect_s']):.2f} GB/s, {f3(fl['write_cpu_s'])} CPU-s), cold O_DIRECT read "
         f"{f3(fl['read_odirect_cold_s'])} s; floor core-seconds (digest + write CPU) {f3(fl['floor_core_s'])}.", "",
         "Loop overhead per save: a save cycle's time less its no-save partner's; *waited at the end*: the part "
         "of it spent at the save cycle's end waiting for a save not yet durable (a loop saving less often would "
         "not wait); *in the loop*: the rest, which the ratios use.", "",
         "| config | loop overhead / save (s) [95% CI] | waited at the end (s) | in the loop (s) [95% CI] | / floor saver | "
         "/ DCP best | save() (s) | stall (s) | core-s / save | / floor core-s | save -> durable (s) | / O_DIRECT write |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fo = cf.get("floor", {}).get("in_loop_s")
    best = min((cf[k]["in_loop_s"] for k in ("dcp", "dcp_pinned") if "in_loop_s" in cf.get(k, {})), default=None)
    for key, r in cf.items():
        if "error" in r:
            L.append(f"| {key} | failed: {r['error']} | | | | | | | | | | |")
            continue
        ci, ci2 = r["overhead_ci"], r["in_loop_ci"]
        L.append(
            f"| {r['name']} | {f3(r['overhead_s'])} [{f3(ci[0])}, {f3(ci[1])}] | {f3(r['late_s'])} ({r['late']}/{len(r['pairs'])}) | "
            f"{f3(r['in_loop_s'])} [{f3(ci2[0])}, {f3(ci2[1])}] | "
            f"{f3(r['in_loop_s'] / fo, 2) if fo and fo > 0.001 and key != 'floor' else '–'} | "
            f"{f3(r['in_loop_s'] / best, 3) if best and best > 0.001 and key not in ('dcp', 'dcp_pinned') else '–'} | "
            f"{f3(r['call_s'])} | {f3(r['stall_s'])} | {f3(r['cpu_s'])} | {f3(r['cpu_s'] / fl['floor_core_s'], 1)} | "
            f"{f3(r['durable_s'])} | {f3(r['durable_s'] / fl['write_odirect_s'], 2) if r['durable_s'] else '–'} |")
    L.append("")
    rs = [(k, cf[k]["restore"]) for k in cf if "restore" in cf.get(k, {})]
    if rs:
        L.append("Restore of the last step into the live model and optimizer on the GPU ("
                 + ("page cache dropped" if all(r["cold"] for _, r in rs) else "page cache NOT dropped")
                 + f"): " + "; ".join(
                     f"{k} {f3(r['restore_s'])} s ({f3(r['restore_s'] / fl['read_odirect_cold_s'], 2)}x the cold O_DIRECT "
                     f"read, {r['bytes_on_disk'] / GB:.2f} GB in its directory, bit-exact: {r['bit_exact']})" for k, r in rs) + ".")
        L.append("")
    if cf.get("dcp_pinned", {}).get("stagers_made", 1) > 1:
        L.append(f"dcp_pinned: this torch closed the reused DefaultStager after each save (its table of copiers emptied), "
                 f"so the bench made a new one for each of {cf['dcp_pinned']['stagers_made']} saves: pinned buffers "
                 "were allocated per save.")
    for key in OURS:
        if key in cf and "staging_bytes" in cf[key]:
            L.append(f"{key}: staging {cf[key]['staging_bytes']:,} B = {cf[key]['staging_bytes'] / nb:.3f}x the state; "
                     f"guard wait {f3(cf[key].get('guard_wait_s'))} s per save; every save ok: {cf[key].get('ok')}.")
    return "\n".join(L) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0, help="state size (fp32 weights + AdamW), GB")
    ap.add_argument("--only", default=",".join(ALL))
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--cycle", type=int, default=0, help="steps per cycle (0: enough for a floor save to finish)")
    ap.add_argument("--step-s", type=float, default=0.25, help="target step time for the batch calibration")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="fit the measured cycles of all configs into about this many seconds (fewer pairs, at least 2)")
    ap.add_argument("--no-restore", dest="restore", action="store_false")
    ap.add_argument("--floor-reps", type=int, default=3, help="repetitions of each floor measurement (the best counts)")
    ap.add_argument("--reanalyze", default=None, metavar="JSON", help="print the tables of an earlier run's JSON")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "gpu"))
    ap.add_argument("--md", default=os.path.join(HERE, "out", "gpu.md"))
    ap.add_argument("--json", default=os.path.join(HERE, "out", "gpu.json"))
    return ap.parse_args(argv)


def main(argv=None):
    P = parse_args(argv)
    if P.reanalyze:
        with open(P.reanalyze) as f:
            res = json.load(f)
        for r in res["configs"].values():
            if "pairs" in r:
                for p in r["pairs"]:  # JSONs of the first runs keyed the cycles "True"/"False"
                    if "True" in p:
                        p["save"], p["none"] = p.pop("True"), p.pop("False")
                analyze(r, P.seed)
        print(markdown(res))
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        log("no CUDA device: running on the CPU as a smoke test of the harness (numbers meaningless)")
        P.seq = min(P.seq, 64)
    os.makedirs(P.out, exist_ok=True)
    init_gloo()
    t0 = now()
    tr = GpuTrainer(P.gb, dev, P.seq, P.step_s, P.batch)
    log(f"model: {tr.n_blocks} blocks, vocab {tr.vocab}, {tr.state_bytes() / GB:.2f} GB of state, batch {tr.batch} "
        f"({now() - t0:.1f} s)")
    floors = measure_floors(tr, P.out, P.floor_reps)
    log("floors:", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in floors.items()})
    base = [run_cycle(tr, None, 0, 4, False)["t"] / 4 for _ in range(2)]
    step_s = min(base)
    if not P.cycle:
        need = max(floors["write_odirect_s"] + floors.get("d2h_pinned_s", 0.0), step_s) * 1.5
        P.cycle = max(4, int(need / step_s) + 1)
    keys = [k for k in P.only.split(",") if k]
    if P.budget_s:
        cycle_s = P.cycle * step_s * 1.2
        fit = int(P.budget_s / len(keys) / cycle_s) - P.warm
        P.pairs = max(2, min(P.pairs, fit // 2))
    log(f"step {step_s:.3f} s, cycle {P.cycle} steps, {P.pairs} pairs per config")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke)",
           "machine": C.machine_line(P.out), "torch": torch.__version__, "python": platform.python_version(),
           "model": f"{tr.n_blocks} blocks d={tr.d} vocab={tr.vocab}", "batch": tr.batch, "seq": P.seq,
           "cycle": P.cycle, "pairs": P.pairs, "step_s": step_s, "floors": floors, "configs": {},
           "command": "python bench/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for key in keys:
        log(f"--- {key}")
        t = now()
        try:
            res["configs"][key] = run_config(key, tr, P, P.out)
        except Exception as e:  # one failing config must not lose the others' numbers
            import traceback
            traceback.print_exc()
            res["configs"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        r = res["configs"][key]
        log(f"{key}: {now() - t:.0f} s; overhead {f3(r.get('overhead_s'))} cpu {f3(r.get('cpu_s'))} "
            f"durable {f3(r.get('durable_s'))} late {r.get('late')}")
        res["pairs"] = P.pairs
        C.write_results(res, markdown(res), P.json, P.md)  # after every config: a run cut short keeps what it measured
    shutil.rmtree(P.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

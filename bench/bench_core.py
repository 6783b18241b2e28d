#!/usr/bin/env python
"""Checkpoint benchmark: physical floors, peers (torch.save, DCP save/async_save) and ours, all on
the same training state, the same disk and the same training loop, in one run.

    python bench/bench_core.py                 # full run (~0.7 GB state, under ~10 min on 2 cores)
    python bench/bench_core.py --quick         # smoke test (0.2 GB, fewer steps)
    python bench/bench_core.py --writer-experiment   # thread vs process background writer (~2 min)

Results: a markdown table + ratios on stdout, JSON under bench/out/ (--json), markdown (--md).

What "loop overhead per save" means: every config runs the same N training steps and saves every
k steps (the last save has k steps left to finish in the background); overhead per save =
(loop time with saves - loop time of the same N steps without saves) / number of saves. It
counts the stall inside save(), waits before optimizer.step(), and the slowdown of forward/backward
while background copies/writes compete for the 2 cores and memory bandwidth.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import logging
import os
import platform
import shutil
import socket
import sys
import threading
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as C  # noqa: E402
from _common import now  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("torch.distributed").setLevel(logging.ERROR)

GB = 1e9


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# training state
# ---------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Pre-LN transformer blocks + an output head; inputs are given as embeddings (data)."""

    def __init__(self, d: int, n_blocks: int, vocab: int, heads: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def shape_for(size_gb: float, d: int = 1024):
    """Blocks and vocab so that params * 12 bytes (fp32 weights + AdamW exp_avg + exp_avg_sq)
    is about size_gb."""
    params = size_gb * GB / 12
    per_block = 12 * d * d + 13 * d
    n_blocks = max(1, int((params - 8192 * d) // per_block))
    vocab = int(max(1024, (params - n_blocks * per_block - 2 * d) / (d + 1)) // 256 * 256)
    return n_blocks, vocab


class Trainer:
    def __init__(self, size_gb: float, batch: int | None, seq: int, target_step_s: float, seed: int = 0):
        torch.manual_seed(seed)
        self.d = 1024
        self.n_blocks, self.vocab = shape_for(size_gb, self.d)
        self.model = TinyLM(self.d, self.n_blocks, self.vocab)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.seq = seq
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if batch == 0:
            batch = self._calibrate(target_step_s)
        else:
            if batch is None:
                # deterministic default: ~0.6-0.9 s/step on 2 recent x86 cores at 0.7 GB
                batch = max(1, round(2.8 / size_gb))
            self._make_data(batch)
            self.step(0)  # creates the AdamW state
        self.batch = batch

    def _make_data(self, batch: int):
        g = torch.Generator().manual_seed(1234)
        self.data = [(torch.randn(batch, self.seq, self.d, generator=g),
                      torch.randint(0, self.vocab, (batch, self.seq), generator=g)) for _ in range(4)]

    def _calibrate(self, target: float) -> int:
        self._make_data(2)
        self.step(0)
        self.step(1)
        t0 = now(); self.step(2); t2 = now() - t0
        self._make_data(4)
        self.step(0)
        t0 = now(); self.step(1); t4 = now() - t0
        per = max((t4 - t2) / 2, 1e-3)
        fixed = max(t2 - 2 * per, 0.0)
        b = int(round((target - fixed) / per))
        b = max(1, min(64, b))
        self._make_data(b)
        self.step(0)
        return b

    def step(self, i: int, pre_step=None):
        x, y = self.data[i % len(self.data)]
        out = self.model(x)
        loss = F.cross_entropy(out.view(-1, self.vocab), y.view(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if pre_step is not None:
            pre_step()
        self.opt.step()
        return loss

    # the state every saver saves / restores
    def state(self, step: int) -> dict:
        return {"model": self.model, "optim": self.opt, "step": step}

    def tensors(self) -> list:
        ts = [p.detach() for p in self.model.parameters()]
        for st in self.opt.state.values():
            ts.extend(v for v in st.values() if torch.is_tensor(v))
        return ts

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def snapshot(self) -> list:
        return [t.clone() for t in self.tensors()]

    @torch.no_grad()
    def perturb(self):
        for t in self.tensors():
            t.zero_()

    def equal(self, ref: list) -> bool:
        cur = self.tensors()
        return len(cur) == len(ref) and all(torch.equal(a, b) for a, b in zip(cur, ref))


# ---------------------------------------------------------------------------------------------
# floors
# ---------------------------------------------------------------------------------------------

def measure_floors(tr: Trainer, out: str, reps: int) -> dict:
    nbytes = tr.state_bytes()
    res: dict = {"bytes": nbytes}
    tensors = tr.tensors()

    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)
    best = []
    for _ in range(max(3, reps)):
        t0 = now()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            dst[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        best.append(now() - t0)
    res["memcpy_torch_s"] = min(best)
    best = []
    base = dst.data_ptr()
    for _ in range(max(3, reps)):
        t0 = now()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(base + off, t.data_ptr(), n)
            off += n
        best.append(now() - t0)
    res["memcpy_memmove_s"] = min(best)
    del dst

    buf = C.aligned_buffer(C.BLOCK)
    for direct, key in ((True, "write_odirect_s"), (False, "write_buffered_s")):
        path, res[key] = C.best_write(out, nbytes, buf, reps, direct=direct)
    # reads of the (buffered-written) file
    cold_b, cold_d, warm = [], [], []
    for _ in range(reps):
        C.evict(path)
        cold_b.append(C.read_file(path, buf, direct=False)[0])
        warm.append(C.read_file(path, buf, direct=False)[0])
        C.evict(path)
        cold_d.append(C.read_file(path, buf, direct=True)[0])
    res["read_cold_buffered_s"] = min(cold_b)
    res["read_cold_odirect_s"] = min(cold_d)
    res["read_warm_s"] = min(warm)
    os.remove(path)
    buf.close()
    for k in list(res):
        if k.endswith("_s"):
            res[k[:-2] + "_GBps"] = C.gbps(nbytes, res[k])
    res["read_cold_best_s"] = min(res["read_cold_buffered_s"], res["read_cold_odirect_s"])
    return res


# ---------------------------------------------------------------------------------------------
# savers: one per config, all driven by the same loop
# ---------------------------------------------------------------------------------------------

class Saver:
    name = "?"
    restorable = False

    def __init__(self, tr: Trainer, root: str):
        self.tr, self.root = tr, root
        self.recs: list = []  # per timed save

    def setup(self):
        pass

    def save(self, step: int) -> dict:
        raise NotImplementedError

    def pre_step(self) -> None:  # called right before optimizer.step()
        pass

    def finish(self) -> None:  # every save durable
        pass

    def close(self) -> None:
        pass

    def extra(self) -> dict:
        return {}


def fsync_file(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TorchSave(Saver):
    name = "torch.save (sync, +fsync)"
    restorable = True

    def path(self, step):
        return os.path.join(self.root, f"step-{step}.pt")

    def save(self, step):
        t0 = now()
        p = self.path(step)
        torch.save({"model": self.tr.model.state_dict(), "optim": self.tr.opt.state_dict(), "step": step}, p + ".tmp")
        fsync_file(p + ".tmp")
        os.replace(p + ".tmp", p)
        C.fsync_dir(self.root)
        dt = now() - t0
        rec = {"step": step, "call_s": dt, "wait_prev_s": 0.0, "stall_s": dt, "durable_s": dt}
        self.recs.append(rec)
        self.last = p
        return rec

    def restore(self, state):
        sd = torch.load(self.last, map_location="cpu", weights_only=True)
        self.tr.model.load_state_dict(sd["model"])
        self.tr.opt.load_state_dict(sd["optim"])
        state["step"] = sd["step"]
        return sd["step"]

    def restore_path(self):
        return self.last


class DcpSync(Saver):
    name = "DCP save (sync)"
    restorable = True

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        t0 = now()
        p = os.path.join(self.root, f"step-{step}")
        dcp.save(self.tr.state(step), checkpoint_id=p)
        dt = now() - t0
        rec = {"step": step, "call_s": dt, "wait_prev_s": 0.0, "stall_s": dt, "durable_s": dt}
        self.recs.append(rec)
        self.last = p
        return rec

    def restore(self, state):
        import torch.distributed.checkpoint as dcp
        dcp.load(state, checkpoint_id=self.last)
        return state["step"]

    def restore_path(self):
        return self.last


def stager_closed(stager) -> bool:
    """Some torch releases (2.11 seen) close a DefaultStager passed to async_save once the save is
    done (its table of copiers emptied: the next stage() fails with KeyError: <class 'type'>); such
    a stager cannot be reused."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    return table is not None and not table


class DcpAsync(Saver):
    """dcp.async_save. stager: None = async_save's own per-call DefaultStager (sync staging, fresh
    buffers each save); otherwise a reused DefaultStager with these StagingOptions. With async
    staging, the staging future is waited for before the next optimizer.step() (as torchtitan)."""

    def __init__(self, tr, root, ctype: str, stager_opts: dict | None):
        super().__init__(tr, root)
        self.ctype, self.stager_opts = ctype, stager_opts
        self.stager = None
        self.prev_upload = None
        self.pending_staging = None
        self.pending_rec = None
        if stager_opts is None:
            so = "default stager (per call, sync staging)"
        else:
            bits = ["reused DefaultStager"]
            bits.append("shm" if stager_opts["use_shared_memory"] else "no shm")
            bits.append("async staging" if stager_opts["use_async_staging"] else "sync staging")
            so = ", ".join(bits)
        self.name = f"DCP async_save {ctype.upper()}, {so}"

    def setup(self):
        if self.stager_opts is not None:
            self.stager = self._new_stager()

    def _new_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        return DefaultStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False, **self.stager_opts))


    def save(self, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
        t0 = now()
        if self.prev_upload is not None:
            self.prev_upload.result()
        t1 = now()
        ctype = AsyncCheckpointerType.PROCESS if self.ctype == "process" else AsyncCheckpointerType.THREAD
        rec = {"step": step, "wait_prev_s": t1 - t0, "staging_wait_s": 0.0}
        if self.stager is not None and stager_closed(self.stager):
            self.stager = self._new_stager()  # such a torch cannot reuse it: a new one, inside the timed call
        r = dcp.async_save(self.tr.state(step), checkpoint_id=os.path.join(self.root, f"step-{step}"),
                           async_checkpointer_type=ctype, async_stager=self.stager)
        if isinstance(r, AsyncSaveResponse):
            upload, self.pending_staging = r.upload_completion, r.staging_completion
        else:
            upload = r
        t2 = now()
        rec["call_s"] = t2 - t0
        rec["t1"] = t1

        def done(_f, rec=rec):
            rec["done_t"] = now()
        upload.add_done_callback(done)
        self.prev_upload = upload
        self.pending_rec = rec
        self.recs.append(rec)
        return rec

    def pre_step(self):
        if self.pending_staging is not None:
            t0 = now()
            self.pending_staging.result()
            self.pending_rec["staging_wait_s"] += now() - t0
            self.pending_staging = None

    def finish(self):
        if self.pending_staging is not None:
            self.pending_staging.result()
            self.pending_staging = None
        if self.prev_upload is not None:
            self.prev_upload.result()
            self.prev_upload = None
        for rec in self.recs:
            # Future.result() can return a moment before the done-callbacks have run
            t_end = now() + 5.0
            while "done_t" not in rec and now() < t_end:
                time.sleep(0.001)
            rec["stall_s"] = rec["call_s"] - rec["wait_prev_s"] + rec["staging_wait_s"]
            rec["durable_s"] = rec["done_t"] - rec.pop("t1")

    def close(self):
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class Ours(Saver):
    restorable = True

    FORMS = {"objects": "model and optimizer objects", "state_dict": "model.state_dict() + optimizer.state_dict()",
             "dcp": "DCP get_state_dict(model, optim) output"}

    def __init__(self, tr, root, snapshot: str, form: str = "objects"):
        super().__init__(tr, root)
        self.snapshot, self.form = snapshot, form
        self.name = f"ours CheckpointManager snapshot={snapshot}" + ("" if form == "objects" else f", {self.FORMS[form]}")
        self.mgr = None

    def setup(self):
        from checkpointing import CheckpointManager
        self.mgr = CheckpointManager(self.root, keep_local=2, snapshot=self.snapshot)

    def _state(self, step):
        if self.form == "state_dict":
            return {"model": self.tr.model.state_dict(), "optim": self.tr.opt.state_dict(), "step": step}
        if self.form == "dcp":
            from torch.distributed.checkpoint.state_dict import get_state_dict
            msd, osd = get_state_dict(self.tr.model, self.tr.opt)
            return {"model": msd, "optim": osd, "step": step}
        return self.tr.state(step)

    def save(self, step):
        t0 = now()
        self.mgr.save(step, self._state(step))
        rec = {"step": step, "call_s": now() - t0}
        self.recs.append(rec)
        return rec

    def finish(self):
        self.mgr.wait()
        stats = {s.step: s for s in self.mgr.stats()}
        for rec in self.recs:
            s = stats.get(rec["step"])
            if s is None:
                rec["error"] = "no SaveStats for this step"
                continue
            rec.update(wait_prev_s=s.wait_prev_s, stall_s=s.stall_s, guard_wait_s=s.guard_wait_s,
                       durable_s=s.total_s, snapshot_s=s.snapshot_s, write_s=s.write_s, commit_s=s.commit_s,
                       bytes_written=s.bytes_written, bytes_reused=s.bytes_reused,
                       bytes_total=s.bytes_total, bytes_deferred=s.bytes_deferred, ok=s.ok)

    def extra(self):
        return {"staging_bytes": self.mgr.staging_bytes if self.mgr else None}

    def restore(self, state):
        from checkpointing import CheckpointManager
        mgr = CheckpointManager(self.root, keep_local=2, snapshot=self.snapshot)
        try:
            return mgr.restore(state)
        finally:
            mgr.close()

    def restore_path(self):
        return self.root

    def close(self):
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None


def ours_available() -> tuple[bool, str]:
    try:
        import checkpointing
        checkpointing.CheckpointManager  # noqa: B018
        return True, ""
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def redirect_fds(path: str):
    """Send fd 1/2 to a file (so a child spawned now, e.g. DCP's checkpoint process, logs there)."""
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1); os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])


def run_config(tr: Trainer, saver: Saver | None, P: argparse.Namespace, out: str, verify_restore: bool,
               warmup: int) -> dict:
    n_steps = (P.saves + 1) * P.every
    res: dict = {"name": saver.name if saver else "baseline (no saves)"}
    pre = saver.pre_step if saver else None
    for i in range(warmup):
        tr.step(i, pre)
    if saver is not None:
        saver.setup()
        # one untimed warm-up save (first-save costs: process spawn, buffer allocation)
        t0 = now()
        ctx = redirect_fds(os.path.join(out, "dcp_process.log")) if getattr(saver, "ctype", "") == "process" \
            else contextlib.nullcontext()
        with ctx:
            saver.save(0)
            saver.finish()
        res["first_save_durable_s"] = now() - t0
        saver.recs.clear()
    step_times = []
    gc.collect()
    gc.disable()
    try:
        t_loop = now()
        for s in range(1, n_steps + 1):
            ts = now()
            tr.step(s, pre)
            if saver is not None and s % P.every == 0 and s <= P.saves * P.every:
                saver.save(s)
            step_times.append(now() - ts)
        res["loop_s"] = now() - t_loop
    finally:
        gc.enable()
    res["steps"] = n_steps
    res["step_median_s"] = C.median(step_times)
    res["step_s"] = step_times
    if saver is None:
        return res
    t0 = now()
    saver.finish()
    res["tail_wait_s"] = now() - t0
    res["saves"] = [dict(r) for r in saver.recs]
    res["n_saves"] = len(saver.recs)
    for key in ("call_s", "stall_s", "wait_prev_s", "durable_s", "guard_wait_s", "staging_wait_s", "write_s",
                "snapshot_s"):
        vals = [r.get(key) for r in saver.recs if r.get(key) is not None]
        if vals:
            res[key + "_median"] = C.median(vals)
    res.update(saver.extra())
    if verify_restore and saver.restorable:
        res["restore"] = measure_restore(tr, saver, P, n_steps)
    return res


def measure_restore(tr: Trainer, saver: Saver, P, step: int) -> dict:
    """Save the current state once more (untimed), then time restore cold (page cache of the
    checkpoint evicted) and warm, in place into the live model/optimizer; the first cold restore
    goes into a zeroed state and is checked bit-exact against the state that was saved."""
    out: dict = {}
    saver.recs.clear()
    saver.save(step)
    saver.finish()
    ref = tr.snapshot()
    tr.perturb()
    cold, warm = [], []
    path = saver.restore_path()
    for i in range(P.restore_reps):
        C.evict(path)
        out.setdefault("resident_after_evict", C.resident_bytes(path))
        st = tr.state(-1)
        t0 = now()
        got = saver.restore(st)
        cold.append(now() - t0)
        if i == 0:
            out["ok"] = bool(tr.equal(ref)) and st["step"] == step and got == step
            if not out["ok"]:
                out["problem"] = f"restored state differs from the saved one (returned {got!r}, step {st['step']!r})"
    for _ in range(P.restore_reps):
        st = tr.state(-1)
        t0 = now()
        saver.restore(st)
        warm.append(now() - t0)
    out["cold_s"] = C.median(cold)
    out["warm_s"] = C.median(warm)
    # The floor for these very bytes: a cold sequential read of the files the restore reads.
    # (On a virtual disk, files written with O_DIRECT can read back slower than files written
    # through the page cache, so the generic floor file is not the same physics.)
    if os.path.isdir(path):
        buf = C.aligned_buffer(C.BLOCK, fill=None)
        same = []
        for _ in range(P.restore_reps):
            C.evict(path)
            secs = 0.0
            for f in C._files_under(path):
                secs += C.read_file(f, buf, direct=False)[0]
            same.append(secs)
        out["same_files_read_cold_s"] = C.median(same)
        buf.close()
    out["cold_all_s"], out["warm_all_s"] = cold, warm
    out["ok"] = out.get("ok", False) and bool(tr.equal(ref))
    del ref
    return out


def init_gloo():
    import torch.distributed as dist
    if dist.is_initialized():
        return
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)


def make_configs(tr, out, P, have_ours):
    """(key, factory) in run order: every config sits between two no-save baseline loops
    (B c1 B c2 B ... cn B); a config's overhead is measured against the mean of its two neighbours,
    which cancels slow drifts of the machine (seen as +-10% over minutes on this VM)."""
    savers = []

    def add(key, fn):
        savers.append((key, fn))

    if have_ours:
        add("ours_async", lambda: Ours(tr, os.path.join(out, "ours_async"), "async"))
    add("dcp_async_thread_default", lambda: DcpAsync(tr, os.path.join(out, "dcp_t_def"), "thread", None))
    add("dcp_async_thread_stager", lambda: DcpAsync(
        tr, os.path.join(out, "dcp_t_st"), "thread", dict(use_shared_memory=False, use_async_staging=False)))
    add("dcp_async_thread_stager_async", lambda: DcpAsync(
        tr, os.path.join(out, "dcp_t_sta"), "thread", dict(use_shared_memory=False, use_async_staging=True)))
    add("torch_save", lambda: TorchSave(tr, os.path.join(out, "torch_save")))
    add("dcp_async_process_default", lambda: DcpAsync(tr, os.path.join(out, "dcp_p_def"), "process", None))
    add("dcp_async_process_shm", lambda: DcpAsync(
        tr, os.path.join(out, "dcp_p_shm"), "process", dict(use_shared_memory=True, use_async_staging=False)))
    add("dcp_async_process_shm_async", lambda: DcpAsync(
        tr, os.path.join(out, "dcp_p_shma"), "process", dict(use_shared_memory=True, use_async_staging=True)))
    if have_ours:
        add("ours_eager", lambda: Ours(tr, os.path.join(out, "ours_eager"), "eager"))
        # the same state passed as state dicts (what frameworks pass): the same deferred copy
        add("ours_state_dict", lambda: Ours(tr, os.path.join(out, "ours_sd"), "async", "state_dict"))
        add("ours_dcp_state_dict", lambda: Ours(tr, os.path.join(out, "ours_dcp_sd"), "async", "dcp"))
    add("dcp_sync", lambda: DcpSync(tr, os.path.join(out, "dcp_sync")))
    if P.only:
        keep = set(P.only.split(","))
        savers = [x for x in savers if x[0] in keep]
    # second pass of the key configs (ours vs the strongest DCP), at the end: their overhead is the
    # mean of both passes
    factories = dict(savers)
    for key in [k for k in P.repeat.split(",") if k and k in factories]:
        savers.append((key + "#2", _second_pass(factories[key])))
    cfgs = [("baseline_0", lambda: None)]
    for i, x in enumerate(savers):
        cfgs.append(x)
        cfgs.append((f"baseline_{i + 1}", lambda: None))
    return cfgs


def _second_pass(factory):
    def make():
        sv = factory()
        sv.root = sv.root + "-pass2"
        sv.name = sv.name + " (pass 2)"
        return sv
    return make


RESTORE_KEYS = {"torch_save", "dcp_sync", "ours_async"}


def run_core(P) -> dict:
    out = os.path.abspath(P.out)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    torch.set_num_threads(P.threads)
    t_start = now()
    have_ours, ours_err = ours_available()
    log(f"ours importable: {have_ours} {ours_err}")
    if P.wait_quiet > 0:
        log(f"other processes' CPU load before start: {C.wait_quiet(P.wait_quiet, log=log):.2f} CPUs")
    cpu_run = C.cpu_snapshot()
    tr = Trainer(P.size_gb, P.batch, P.seq, P.step_time)
    nbytes = tr.state_bytes()
    log(f"state: {tr.n_blocks} blocks d={tr.d} vocab={tr.vocab} params={tr.n_params/1e6:.1f}M "
        f"bytes={nbytes/GB:.3f} GB batch={tr.batch}x{tr.seq}")
    res: dict = {
        "date": P.date, "machine": C.machine_description(), "fs": C.fs_type(out), "torch": torch.__version__,
        "python": platform.python_version(), "threads": torch.get_num_threads(),
        "args": {k: v for k, v in vars(P).items()},
        "state": {"bytes": nbytes, "params": tr.n_params, "blocks": tr.n_blocks, "d": tr.d, "vocab": tr.vocab,
                  "batch": tr.batch, "seq": tr.seq},
        "ours_importable": have_ours, "ours_import_error": ours_err,
        "configs": {}, "problems": [],
    }
    log("floors ...")
    cpu0 = C.cpu_snapshot()
    res["floors"] = measure_floors(tr, out, P.floor_reps)
    res["floors"]["foreign_cpu_s"] = C.foreign_cpu_since(cpu0)
    log("  " + ", ".join(f"{k}={v:.2f}" for k, v in res["floors"].items() if k.endswith("GBps")))
    init_gloo()
    for key, factory in make_configs(tr, out, P, have_ours):
        saver = None
        t0 = now()
        cpu0 = C.cpu_snapshot()
        try:
            saver = factory()
            if saver is not None:
                os.makedirs(saver.root, exist_ok=True)
            r = run_config(tr, saver, P, out, verify_restore=key in RESTORE_KEYS,
                           warmup=P.warmup if (saver is not None or key == "baseline_0") else 0)
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc()
            r = {"name": saver.name if saver else key, "error": f"{type(e).__name__}: {e}", "traceback": tb}
            res["problems"].append(f"{key}: {type(e).__name__}: {e}")
            log(tb)
        finally:
            if saver is not None:
                try:
                    saver.close()
                except Exception as e:  # noqa: BLE001
                    res["problems"].append(f"{key} close: {type(e).__name__}: {e}")
                shutil.rmtree(saver.root, ignore_errors=True)
            gc.collect()
        r["wall_s"] = now() - t0
        r["foreign_cpu_s"] = C.foreign_cpu_since(cpu0)
        if isinstance(r.get("restore"), dict) and not r["restore"].get("ok", True):
            res["problems"].append(f"{key}: restore: {r['restore'].get('problem', 'mismatch')}")
        res["configs"][key] = r
        log(f"{key:32s} {r.get('loop_s', float('nan')):7.2f}s loop  "
            f"{summ(r)}  [{r['wall_s']:.0f}s, others used {r['foreign_cpu_s']:.1f} CPU-s]")
    finalize(res)
    res["total_wall_s"] = now() - t_start
    res["foreign_cpu_s"] = C.foreign_cpu_since(cpu_run)
    res["foreign_cpu_load"] = res["foreign_cpu_s"] / res["total_wall_s"]
    return res


def summ(r):
    bits = []
    for k in ("stall_s_median", "durable_s_median", "tail_wait_s"):
        if k in r:
            bits.append(f"{k}={r[k]:.3f}")
    if "restore" in r:
        bits.append(f"restore cold={r['restore'].get('cold_s', float('nan')):.2f} "
                    f"warm={r['restore'].get('warm_s', float('nan')):.2f} ok={r['restore'].get('ok')}")
    if "error" in r:
        bits.append("ERROR " + r["error"])
    return " ".join(bits)


def finalize(res: dict):
    cfgs = res["configs"]
    base = [c["loop_s"] for k, c in cfgs.items() if k.startswith("baseline") and "loop_s" in c]
    res["baseline_loop_s"] = sum(base) / len(base) if base else None
    res["baseline_spread_s"] = (max(base) - min(base)) if base else None
    keys = list(cfgs)
    nb_diffs = []
    for i, k in enumerate(keys):
        c = cfgs[k]
        if k.startswith("baseline") or "loop_s" not in c or not c.get("n_saves"):
            continue
        nbs = [cfgs[keys[j]]["loop_s"] for j in (i - 1, i + 1)
               if 0 <= j < len(keys) and keys[j].startswith("baseline") and "loop_s" in cfgs[keys[j]]]
        c["neighbour_baseline_s"] = sum(nbs) / len(nbs) if nbs else res["baseline_loop_s"]
        if len(nbs) == 2:
            nb_diffs.append(abs(nbs[0] - nbs[1]))
        c["overhead_per_save_s"] = (c["loop_s"] - c["neighbour_baseline_s"]) / c["n_saves"]
        c["overhead_per_save_global_s"] = (c["loop_s"] - res["baseline_loop_s"]) / c["n_saves"]
    # noise: half the median difference between two consecutive baselines, per save
    res["neighbour_noise_per_save_s"] = (C.median(nb_diffs) / 2 / max(res["args"]["saves"], 1)) if nb_diffs else None
    res["neighbour_noise_max_per_save_s"] = (max(nb_diffs) / 2 / max(res["args"]["saves"], 1)) if nb_diffs else None
    fl = res["floors"]
    nbytes = res["state"]["bytes"]
    ratios: dict = {}
    # configs run twice (key, key#2): overhead = mean of the passes
    agg: dict = {}
    for k, c in cfgs.items():
        if "overhead_per_save_s" in c:
            agg.setdefault(k.split("#")[0], []).append(c["overhead_per_save_s"])
    res["overhead_per_save_by_config"] = {k: sum(v) / len(v) for k, v in agg.items()}
    res["overhead_passes"] = agg
    dcp_async = {k: {"overhead_per_save_s": v} for k, v in res["overhead_per_save_by_config"].items()
                 if k.startswith("dcp_async")}
    if dcp_async:
        best_k = min(dcp_async, key=lambda k: dcp_async[k]["overhead_per_save_s"])
        ratios["dcp_best_async"] = best_k
    ours = dict(cfgs.get("ours_async", {}))
    if "ours_async" in res["overhead_per_save_by_config"]:
        ours["overhead_per_save_s"] = res["overhead_per_save_by_config"]["ours_async"]
    if "overhead_per_save_s" in ours and dcp_async:
        b = dcp_async[best_k]["overhead_per_save_s"]
        ratios["loop_overhead_ours_vs_dcp_best"] = ours["overhead_per_save_s"] / b if b > 0 else None
        ratios["loop_overhead_note"] = (f"ours {ours['overhead_per_save_s']:.3f} s vs {best_k} {b:.3f} s per save; "
                                        f"noise about ±{res['neighbour_noise_per_save_s'] or 0:.3f} s per save")
        if ours["overhead_per_save_s"] <= 0 < b:
            ratios["loop_overhead_note"] += "; ours is <= 0, i.e. not measurable above noise"
        if b <= 0:
            ratios["loop_overhead_ours_vs_dcp_best"] = None
            ratios["loop_overhead_note"] += "; the best DCP overhead is <= 0 (within noise): ratio undefined"
    if "durable_s_median" in ours:
        ratios["durable_vs_odirect_floor"] = ours["durable_s_median"] / fl["write_odirect_s"]
    rs = ours.get("restore", {})
    if "cold_s" in rs:
        ratios["cold_restore_tput_vs_generic_cold_read_floor"] = fl["read_cold_best_s"] / rs["cold_s"]
        if "same_files_read_cold_s" in rs:
            ratios["cold_restore_tput_vs_cold_read_floor"] = rs["same_files_read_cold_s"] / rs["cold_s"]
    if ours.get("staging_bytes") is not None:
        ratios["staging_bytes_vs_state_bytes"] = ours["staging_bytes"] / nbytes
    targets = {"loop_overhead_ours_vs_dcp_best": ("<=", 0.5), "durable_vs_odirect_floor": ("<=", 1.5),
               "cold_restore_tput_vs_cold_read_floor": (">=", 0.8), "staging_bytes_vs_state_bytes": ("<=", 1.0)}
    tol: dict = {}
    res["targets"] = {}
    for k, (op, tgt) in targets.items():
        v = ratios.get(k)
        res["targets"][k] = {"target": f"{op} {tgt}", "value": v,
                             "met": None if v is None else (v <= tgt + tol.get(k, 0) if op == "<=" else v >= tgt)}
    res["ratios"] = ratios


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def f3(x, nd=3):
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, (int, float)) else str(x))


def markdown(res: dict) -> str:
    st, fl = res["state"], res["floors"]
    m = res["machine"]
    a = res["args"]
    L = []
    L.append(f"### Core benchmark ({res['date']})\n")
    L.append(f"Machine: {m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('mem_total_gib')} GiB RAM, "
             f"{res['fs']}, torch {res['torch']} CPU, {res['threads']} intra-op threads, no GPU. "
             f"{a.get('machine_note') or ''}\n")
    L.append(f"State: {st['blocks']} transformer blocks (d={st['d']}) + head (vocab {st['vocab']}), "
             f"{st['params']/1e6:.1f} M params, fp32 + AdamW state = **{st['bytes']/GB:.3f} GB** "
             f"({st['bytes']} B). Batch {st['batch']}x{st['seq']} tokens; baseline step "
             f"{f3(res['configs'].get('baseline_0', {}).get('step_median_s'))} s.\n")
    L.append(f"Loop: {a['warmup']} warm-up steps + 1 untimed warm-up save, then {(a['saves'] + 1) * a['every']} timed "
             f"steps with a save every {a['every']} steps ({a['saves']} saves; the last one has {a['every']} steps "
             f"to finish). The no-save baseline loop runs before the first config, between every two configs and "
             f"after the last (B c1 B c2 ... B); **loop overhead / save** = (config loop - mean of the two "
             f"neighbouring baselines) / saves. All baselines: mean {f3(res['baseline_loop_s'], 2)} s, min..max "
             f"spread {f3(res['baseline_spread_s'], 2)} s; the median difference between neighbouring baselines "
             f"gives a noise of about ±{f3(res.get('neighbour_noise_per_save_s'), 3)} s per save (worst pair "
             f"±{f3(res.get('neighbour_noise_max_per_save_s'), 3)} s). The column "
             f"'vs all baselines' uses the mean of all baselines instead.\n")
    L.append("**Floors** (same bytes, same disk; best of "
             f"{a['floor_reps']} (memcpy: best of {max(3, a['floor_reps'])})):\n")
    L.append("| floor | s | GB/s |\n|---|---:|---:|")
    for k, label in (("memcpy_torch", "memcpy, torch copy_ into preallocated buffer"),
                     ("memcpy_memmove", "memcpy, ctypes.memmove (1 thread)"),
                     ("write_odirect", "sequential write O_DIRECT 64 MiB pwrite + fsync"),
                     ("write_buffered", "sequential write buffered 64 MiB pwrite + fsync"),
                     ("read_cold_buffered", "read cold (fadvise DONTNEED), buffered"),
                     ("read_cold_odirect", "read cold, O_DIRECT"),
                     ("read_warm", "read warm (page cache)")):
        L.append(f"| {label} | {f3(fl[k + '_s'])} | {f3(fl[k + '_GBps'], 2)} |")
    L.append("")
    L.append("**Configs** (medians over the timed saves; seconds):\n")
    L.append("| config | loop overhead / save | vs all baselines | stall (median) | save() call (median) | wait prev | "
             "save→durable (median) | first save→durable | restore cold | restore warm | other procs CPU-s |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, c in res["configs"].items():
        if k.startswith("baseline"):
            L.append(f"| {c['name']} #{k.split('_')[-1]} | loop {f3(c.get('loop_s'), 2)} s | | | | | | | | | "
                     f"{f3(c.get('foreign_cpu_s'), 1)} |")
            continue
        if "error" in c:
            L.append(f"| {c['name']} | ERROR: {c['error'][:120]} | | | | | | | | | |")
            continue
        rs = c.get("restore", {})
        rc = f3(rs.get("cold_s")) if rs else ""
        rw = f3(rs.get("warm_s")) if rs else ""
        if rs and not rs.get("ok", True):
            rc += " (WRONG)"
        L.append(f"| {c['name']} | **{f3(c.get('overhead_per_save_s'))}** | {f3(c.get('overhead_per_save_global_s'))} | "
                 f"{f3(c.get('stall_s_median'))} | "
                 f"{f3(c.get('call_s_median'))} | {f3(c.get('wait_prev_s_median'))} | "
                 f"{f3(c.get('durable_s_median'))} | {f3(c.get('first_save_durable_s'))} | {rc} | {rw} | "
                 f"{f3(c.get('foreign_cpu_s'), 1)} |")
    L.append("")
    L.append("Stall: time the training thread is blocked by the save, excluding waiting for the previous save: "
             "for ours `SaveStats.stall_s` (includes the guard wait before optimizer.step()); for DCP the "
             "async_save() call plus, with async staging, the wait on `staging_completion` before "
             "optimizer.step(); for sync savers the whole call. save→durable: ours `SaveStats.total_s`; DCP "
             "async from the async_save() call to the `upload_completion` future done-callback. torch.save "
             "writes to a temp file, fsyncs and renames (same durability as the others).\n")
    for k in ("ours_async", "ours_eager"):
        c = res["configs"].get(k)
        if c and "saves" in c:
            L.append(f"{c['name']} breakdown (median SaveStats): snapshot_s {f3(c.get('snapshot_s_median'))}, "
                     f"write_s {f3(c.get('write_s_median'))}, guard_wait_s {f3(c.get('guard_wait_s_median'))}, "
                     f"commit_s {f3(C.median([x.get('commit_s') for x in c['saves']]))}, total_s "
                     f"{f3(c.get('durable_s_median'))}; staging_bytes {c.get('staging_bytes')}.\n")
    L.append("All configs run in one process with a 1-rank gloo process group on 127.0.0.1 (DCP's PROCESS "
             "checkpointer needs one); DCP uses its default FileSystemWriter (sync_files=True, 1 thread).\n")
    multi = {k: v for k, v in res.get("overhead_passes", {}).items() if len(v) > 1}
    if multi:
        L.append("Configs run twice (loop overhead / save per pass → mean): " + "; ".join(
            f"{k}: {', '.join(f3(x) for x in v)} → **{f3(sum(v) / len(v))}**" for k, v in multi.items()) + ".\n")
    r = res["ratios"]
    L.append("**Ratios** (ours = `CheckpointManager(dir, keep_local=2)`, snapshot=\"async\"):\n")
    L.append("| ratio | value | target | met |\n|---|---:|---|---|")
    names = {"loop_overhead_ours_vs_dcp_best": f"loop overhead/save, ours vs best DCP async ({r.get('dcp_best_async', 'n/a')})",
             "durable_vs_odirect_floor": "save→durable vs O_DIRECT write floor (same bytes)",
             "cold_restore_tput_vs_cold_read_floor": "cold restore throughput vs a cold sequential read of the same files",
             "staging_bytes_vs_state_bytes": "staging memory (mgr.staging_bytes) vs state bytes"}
    for k, t in res["targets"].items():
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        nd = 5 if k == "staging_bytes_vs_state_bytes" else 2
        tg = t["target"]
        L.append(f"| {names[k]} | {f3(t['value'], nd)} | {tg} | {met} |")
    if r.get("cold_restore_tput_vs_generic_cold_read_floor") is not None:
        L.append(f"\nCold restore vs the generic floor file (written through the page cache, best of "
                 f"buffered/O_DIRECT reads): {f3(r['cold_restore_tput_vs_generic_cold_read_floor'], 2)}.")
    if r.get("loop_overhead_note"):
        L.append(f"\n({r['loop_overhead_note']})")
    if res.get("problems"):
        L.append("\nProblems seen in this run:\n")
        for p in res["problems"]:
            L.append(f"- {p}")
    if not res.get("ours_importable"):
        L.append(f"\n`checkpointing` was not importable: {res.get('ours_import_error')}")
    L.append(f"\nOther processes used {res.get('foreign_cpu_s', 0):.0f} CPU-s during the run "
             f"(mean load {res.get('foreign_cpu_load', 0):.2f} CPUs of {m.get('cpus')}); "
             "the 'other procs CPU-s' column shows it per config (0 = quiet machine).")
    L.append(f"\nTotal wall time of the run: {res.get('total_wall_s', 0):.0f} s. "
             f"Command: `python bench/bench_core.py {' '.join(sys.argv[1:])}`.\n")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------
# writer experiment: thread or process for the background writer?
# ---------------------------------------------------------------------------------------------

def run_writer_experiment(P) -> dict:
    from multiprocessing import shared_memory
    out = os.path.abspath(P.out)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    torch.set_num_threads(P.threads)
    if P.wait_quiet > 0:
        log(f"other processes' CPU load before start: {C.wait_quiet(P.wait_quiet, log=log):.2f} CPUs")
    tr = Trainer(P.size_gb, P.batch, P.seq, P.step_time)
    nbytes = C.round_up(tr.state_bytes(), C.PAGE)
    log(f"writer experiment: state {nbytes/GB:.3f} GB, batch {tr.batch}x{tr.seq}")
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        # stage the real state bytes into the shared buffer once (pages touched)
        dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
        off = 0
        for t in tr.tensors():
            n = t.numel() * t.element_size()
            dst[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        del dst
        child = C.WriterChild(f"/dev/shm/{shm.name.lstrip('/')}", nbytes)
        res: dict = {"date": P.date, "machine": C.machine_description(), "fs": C.fs_type(out),
                     "torch": torch.__version__, "bytes": nbytes, "batch": tr.batch, "steps_per_case": P.wx_steps,
                     "cases": {}}
        for i in range(P.warmup):
            tr.step(i)

        def run_case(mode: str, direct: bool | None):
            path = os.path.join(out, f"wx-{mode}.bin")
            times: list = []
            stop = threading.Event()
            th = None
            if mode == "thread":
                th = threading.Thread(target=C.writer_loop,
                                      args=(shm.buf, path, direct, stop.is_set, times), daemon=True)
                th.start()
            elif mode == "process":
                child.start(path, direct)
            steps = []
            cpu0 = C.cpu_snapshot()
            for s in range(P.wx_steps):
                t0 = now()
                tr.step(s)
                steps.append(now() - t0)
            stop.set()
            if th is not None:
                th.join()
            elif mode == "process":
                times = child.stop()
            foreign = C.foreign_cpu_since(cpu0)
            if os.path.exists(path):
                os.remove(path)
            return steps, times, foreign

        cases = [("none", None), ("thread", True), ("process", True), ("thread", False), ("process", False)]
        for rnd in range(P.wx_rounds):
            for mode, direct in cases:
                key = mode if direct is None else f"{mode}-{'odirect' if direct else 'buffered'}"
                steps, times, foreign = run_case(mode, direct)
                c = res["cases"].setdefault(key, {"step_s": [], "write_s": [], "foreign_cpu_s": 0.0})
                c["foreign_cpu_s"] += foreign
                c["step_s"].extend(steps)
                c["write_s"].extend(times)
                log(f"  round {rnd} {key:18s} step median {C.median(steps):.3f}s  writes {len(times)} "
                    f"median {f3(C.median(times))}s  others used {foreign:.1f} CPU-s")
        child.close()
    finally:
        shm.close()
        shm.unlink()
    base = C.median(res["cases"]["none"]["step_s"])
    for key, c in res["cases"].items():
        c["step_median_s"] = C.median(c["step_s"])
        c["step_mean_s"] = sum(c["step_s"]) / len(c["step_s"])
        c["slowdown_pct"] = (c["step_median_s"] / base - 1) * 100
        c["slowdown_mean_pct"] = (c["step_mean_s"] / (sum(res["cases"]["none"]["step_s"]) / len(res["cases"]["none"]["step_s"])) - 1) * 100
        if c["write_s"]:
            c["write_median_s"] = C.median(c["write_s"])
            c["write_GBps"] = C.gbps(nbytes, c["write_median_s"])
            c["writes"] = len(c["write_s"])
            # extra training time per full write of the state: (mean step slowdown * steps) / writes
            extra = (c["step_mean_s"] - sum(res["cases"]["none"]["step_s"]) / len(res["cases"]["none"]["step_s"])) * len(c["step_s"])
            c["train_cost_per_write_s"] = extra / len(c["write_s"])
    return res


def writer_markdown(res: dict) -> str:
    m = res["machine"]
    L = [f"### Writer experiment: thread or process? ({res['date']})\n",
         f"Machine: {m.get('cpus')} cores, {m.get('mem_total_gib')} GiB, {res['fs']}, torch {res['torch']} CPU. "
         f"The training loop runs {res['steps_per_case']} steps per case (rounds interleaved) while a writer "
         f"writes the same {res['bytes']/GB:.3f} GB staged buffer (a /dev/shm shared-memory buffer) to a fresh "
         f"file, 64 MiB pwrite blocks + fsync, back to back, from (a) a Python thread in the training process, "
         f"(b) a separate torch-free process mapping the same buffer.\n",
         "| writer | step median (s) | slowdown median | slowdown mean | write median (s) | write GB/s | "
         "writes | training cost per full write (s) | other procs CPU-s |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, c in res["cases"].items():
        L.append(f"| {k} | {f3(c['step_median_s'])} | {c['slowdown_pct']:+.1f}% | {c['slowdown_mean_pct']:+.1f}% | "
                 f"{f3(c.get('write_median_s'))} | {f3(c.get('write_GBps'), 2)} | {c.get('writes', 0)} | "
                 f"{f3(c.get('train_cost_per_write_s'))} | {c['foreign_cpu_s']:.1f} |")
    L.append("")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None, help="model+AdamW state GB (0.5 .. 2; default 0.7, --quick 0.2)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (default round(2.8/size_gb), deterministic; 0 = calibrate to --step-time)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--step-time", type=float, default=0.7, help="target step seconds for --batch 0")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before starting, wait up to this many seconds for other processes to go idle")
    p.add_argument("--every", type=int, default=5, help="save every k steps")
    p.add_argument("--saves", type=int, default=4, help="timed saves per config")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per config (no saves)")
    p.add_argument("--restore-reps", type=int, default=2)
    p.add_argument("--floor-reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=os.path.join(HERE, "out", "run"), help="scratch dir (deleted and recreated)")
    p.add_argument("--json", default=None, help="JSON results (default bench/out/bench_core[_writer].json)")
    p.add_argument("--md", default=None, help="also write the markdown section here")
    p.add_argument("--quick", action="store_true", help="0.2 GB, fewer steps: smoke test")
    p.add_argument("--only", default="", help="comma-separated config keys to run (default: all)")
    p.add_argument("--repeat", default="ours_async,dcp_async_process_shm_async",
                   help="config keys run a second time at the end (overhead = mean of both passes); '' = none")
    p.add_argument("--writer-experiment", action="store_true", help="thread vs process background writer")
    p.add_argument("--wx-steps", type=int, default=10, help="writer experiment: steps per case and round")
    p.add_argument("--wx-rounds", type=int, default=2)
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--machine-note", default="", help="free text added to the machine line")
    P = p.parse_args(argv)
    if P.quick:
        P.size_gb = P.size_gb or 0.2
        P.every, P.saves, P.warmup, P.restore_reps, P.floor_reps = 3, 2, 1, 1, 1
        P.wx_steps, P.wx_rounds = 5, 1
        P.repeat = ""
    P.size_gb = P.size_gb or 0.7
    if not 0.05 <= P.size_gb <= 4:
        p.error("--size-gb out of range")
    return P


def main(argv=None):
    P = parse_args(argv)
    if P.writer_experiment:
        res = run_writer_experiment(P)
        md = writer_markdown(res)
        default_json = os.path.join(HERE, "out", "bench_core_writer.json")
    else:
        res = run_core(P)
        md = markdown(res)
        default_json = os.path.join(HERE, "out", "bench_core.json")
    jpath = P.json or default_json
    C.write_results(res, md, jpath, P.md)
    log(f"JSON: {jpath}" + (f"  markdown: {P.md}" if P.md else ""))
    if not P.writer_experiment:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

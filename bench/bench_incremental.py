#!/usr/bin/env python
"""Incremental saves: `CheckpointManager(dir, incremental=True)` (write only the chunks whose bytes
changed since the previous committed save) against `incremental=False` (write everything), on the
same state, the same training loop and the same disk, in one run. Fine-tuning and dense training
also run `change_detection="compare"` (every byte compared with the previous save's, as where the
kernel cannot report written pages) to show what the kernel's write watching saves and costs.

    python bench/bench_incremental.py              # full run (~0.7 GB fine-tuning and dense states; a few minutes)
    python bench/bench_incremental.py --quick      # smoke test (~50 MB states, under a minute)
    python bench/bench_incremental.py --remote     # also: fine-tuning with a remote tier (embedded moto S3)
    python bench/bench_incremental.py --only finetune --reverify-cost --rounds 2
                                                   # what re-verifying borrowed chunks costs (reverify_every=10 vs None)

Scenarios (the modes run side by side: one training loop, one manager per mode, each in its own
fresh directory, taking turns to save, so every mode sees the same states, disk and machine load
at the same time; each round starts from the same seeded model/optimizer/data):

1. Floors: memcpy, memcmp (what an unchanged chunk costs), O_DIRECT + fsync write bandwidth, and
   that write from freshly mapped 4 KiB pages against huge pages (the staging pool's mapping), and
   what write watching costs (a scan, a peek, the faults of the first writes after a scan).
2. Fine-tuning: a frozen base (a stack of nn.Linear, ~90% of the checkpoint bytes) and a trained
   head with AdamW whose parameters + optimizer state are ~10% of the bytes. Targets: bytes
   written per save <= 0.12 x full, save -> durable time <= 0.2 x full.
3. Embedding table: nn.Embedding trained with sparse SGD on a few random rows per step (only those
   rows change) plus a small dense MLP (AdamW). chunk_bytes is swept (manifest size, bytes and time
   per save): the line "recommendation" names the chunk size with the lowest save time among those
   whose bytes per save are within 10% of the smallest.
4. Dense training: every parameter and AdamW state changes every step. Target: incremental within
   1.05 x full in both time and bytes (the cost of comparing before copying).
   Fine-tuning and dense also run with each save waited for before training goes on (the save's
   own cost, with no training step competing for the cores); their time targets are shown both ways.
5. (--remote) Fine-tuning with a remote tier on an embedded moto S3: bytes uploaded per save.

The loop: warm-up steps (the optimizer state exists), one untimed first save per mode (allocates
its staging pool; always writes everything), then a save every `--every` training steps, in blocks
of `--block` saves of one mode whose first save is not timed (it washes out what the previous
mode's saves left behind), the modes' blocks taking turns (each mode: `--saves` timed saves); the
training loop runs on while each save is written (snapshot="async", as in production). Per save:
SaveStats.total_s (save() entry -> committed on the local tier, what handle.wait() waits for),
stall_s, bytes_written (pack bytes incl. page padding), bytes_reused, chunks, bytes_unwritten (not
read at all: no write to their pages since the previous save); per mode the training thread's
time (the sum of the step times from each of its saves to the next save: save() calls, guard
waits, and the page faults of the first write to each watched page after a save). Medians are over
the timed saves of every round. Packs are written with O_DIRECT and nothing is read back (but one
restore check per scenario), so no page cache is dropped between modes. Results: markdown on
stdout, JSON (--json, default bench/out/bench_incremental.json), markdown (--md).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import glob
import logging
import mmap
import os
import platform
import random
import shutil
import sys
import tempfile
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as C  # noqa: E402
from _common import now  # noqa: E402
from checkpointing import CheckpointManager  # noqa: E402
from checkpointing.save import pagewrites  # noqa: E402
from checkpointing.save.staging import map_staging  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("checkpointing").setLevel(logging.WARNING)

GB = 1e9
KiB, MiB = 1 << 10, 1 << 20


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def f3(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


def mb(x):
    return "n/a" if x is None else f"{x / 1e6:.2f}"


def size_name(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB"


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


# ---------------------------------------------------------------------------------------------
# workloads: built from a seed, so every mode saves the same sequence of states
# ---------------------------------------------------------------------------------------------

class Workload:
    name = "?"
    model: nn.Module
    opts: list

    def state(self, step: int) -> dict:
        st = {"model": self.model, "step": step}
        for i, o in enumerate(self.opts):
            st[f"optim{i}"] = o
        return st

    def tensors(self) -> list:
        ts = [t.detach() for t in self.model.state_dict().values()]
        for o in self.opts:
            for s in o.state.values():
                ts.extend(v for v in s.values() if torch.is_tensor(v))
        return ts

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def step(self, i: int) -> None:
        raise NotImplementedError


def _linear_stack(d: int, n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n)])


class FineTune(Workload):
    """Frozen base (n x Linear(d, d)) + a trained head Linear(d, h) -> GELU -> Linear(h, classes)
    with AdamW; h is chosen so that head params + AdamW state are `share` of the checkpoint bytes."""

    name = "fine-tuning"

    def __init__(self, gb: float, share: float, d: int, batch: int, classes: int = 1000, seed: int = 0):
        torch.manual_seed(seed)
        per_layer = 4 * (d * d + d)
        n = max(1, round(gb * GB * (1 - share) / per_layer))
        base_bytes = n * per_layer
        # changed bytes = 12 * head params (fp32 weights, exp_avg, exp_avg_sq) + 4 step scalars
        head_params = share / (1 - share) * base_bytes / 12
        h = max(1, round((head_params - classes) / (d + 1 + classes)))
        self.base = _linear_stack(d, n).requires_grad_(False).eval()
        self.head = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, classes))
        self.model = nn.ModuleDict({"base": self.base, "head": self.head})
        self.opts = [torch.optim.AdamW(self.head.parameters(), lr=1e-4, weight_decay=0.01)]
        g = torch.Generator().manual_seed(seed + 1)
        self.data = [(torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g))
                      for _ in range(4)]
        self.shape = {"d": d, "base_layers": n, "head_hidden": h, "classes": classes, "batch": batch}
        self.step(0)  # creates the AdamW state
        self.changed_bytes = sum(t.numel() * t.element_size() for t in self.head.parameters()) + sum(
            v.numel() * v.element_size() for s in self.opts[0].state.values() for v in s.values() if torch.is_tensor(v))

    def step(self, i: int) -> None:
        x, y = self.data[i % len(self.data)]
        with torch.no_grad():
            x = self.base(x)
        loss = F.cross_entropy(self.head(x), y)
        self.opts[0].zero_grad(set_to_none=True)
        loss.backward()
        self.opts[0].step()


class Dense(Workload):
    """n x Linear(d, d) all trained with AdamW: every byte of the state changes every step."""

    name = "dense"

    def __init__(self, gb: float, d: int, batch: int, seed: int = 0):
        torch.manual_seed(seed)
        n = max(1, round(gb * GB / (12 * (d * d + d))))
        self.model = _linear_stack(d, n)
        self.opts = [torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)]
        g = torch.Generator().manual_seed(seed + 1)
        self.data = [(torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)) for _ in range(4)]
        self.shape = {"d": d, "layers": n, "batch": batch}
        self.step(0)
        self.changed_bytes = self.nbytes()

    def step(self, i: int) -> None:
        x, y = self.data[i % len(self.data)]
        loss = F.mse_loss(self.model(x), y)
        self.opts[0].zero_grad(set_to_none=True)
        loss.backward()
        self.opts[0].step()


class EmbeddingTable(Workload):
    """nn.Embedding(rows, dim, sparse=True) trained with SGD (or SparseAdam) on `touch` uniformly
    random rows per step, plus a small dense MLP head (AdamW, ~70 KB, changes every step)."""

    name = "embedding"

    def __init__(self, rows: int, dim: int, touch: int, optim: str = "sgd", seed: int = 0):
        torch.manual_seed(seed)
        self.emb = nn.Embedding(rows, dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 256), nn.GELU(), nn.Linear(256, 1))
        self.model = nn.ModuleDict({"emb": self.emb, "mlp": self.mlp})
        if optim == "sparseadam":
            emb_opt = torch.optim.SparseAdam(self.emb.parameters(), lr=1e-3)
        else:
            emb_opt = torch.optim.SGD(self.emb.parameters(), lr=0.05)
        self.opts = [emb_opt, torch.optim.AdamW(self.mlp.parameters(), lr=1e-3)]
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.rows, self.touch = rows, touch
        self.shape = {"rows": rows, "dim": dim, "rows_per_step": touch, "optim": optim}
        self.step(0)
        self.changed_bytes = None  # depends on the chunk size: see chunks_reused

    def step(self, i: int) -> None:
        idx = torch.randint(0, self.rows, (self.touch,), generator=self.gen)
        y = torch.randn(self.touch, generator=self.gen)
        loss = F.mse_loss(self.mlp(self.emb(idx)).squeeze(-1), y)
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in self.opts:
            o.step()


# ---------------------------------------------------------------------------------------------
# floors
# ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None)
_libc.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_libc.memcmp.restype = ctypes.c_int


def watch_floors(nbytes: int) -> dict | None:
    """What kernel write watching costs on `nbytes` of private anonymous memory (pagewrites.py): a
    scan that protects every page, a peek that protects nothing (both with every page written), and
    the training thread's side: writing every page once while protected (one minor fault each)
    against writing them unprotected. None where the kernel cannot watch."""
    w = pagewrites.watcher()
    if w is None:
        return None
    t = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    lo, hi = pagewrites.page_span(t.data_ptr(), t.data_ptr() + t.numel() * 4)
    res: dict = {"bytes": nbytes}
    w.scan(lo, hi)  # registers the range, protects every page
    t0 = now()
    t.add_(1.0)
    res["write_protected_s"] = now() - t0
    t0 = now()
    t.add_(1.0)
    res["write_unprotected_s"] = now() - t0
    t0 = now()
    w.peek(lo, hi)
    res["peek_s"] = now() - t0
    t0 = now()
    w.scan(lo, hi)
    res["scan_s"] = now() - t0
    res["fault_s"] = res["write_protected_s"] - res["write_unprotected_s"]
    del t
    return res


def pool_page_floors(nbytes: int, out: str, pools: int) -> dict:
    """An O_DIRECT write + fsync of `nbytes` from a freshly mapped buffer, `pools` times per kind, the
    kinds alternating: 4 KiB pages (MAP_POPULATE, huge pages refused) against the staging pool's own
    mapping (staging.map_staging: transparent huge pages). Each buffer is written twice; the median
    and the range over all writes of a kind."""
    path = os.path.join(out, "pool.bin")
    nbytes -= nbytes % C.PAGE  # O_DIRECT: whole pages
    got: dict = {"4k": [], "huge": []}
    for _ in range(pools):
        for kind in got:
            if kind == "huge":
                buf = map_staging(nbytes)
            else:
                buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
                buf.madvise(mmap.MADV_NOHUGEPAGE)
            for _ in range(2):
                if os.path.exists(path):
                    os.remove(path)
                got[kind].append(C.write_from(path, buf, direct=True))
            buf.close()
    os.remove(path)
    return {k: {"median_s": C.median(v), "min_s": min(v), "max_s": max(v), "writes": len(v)} for k, v in got.items()}


def measure_floors(nbytes: int, out: str, reps: int, block_sizes=()) -> dict:
    """Bandwidths on `nbytes` (the fine-tuning state's size): memcpy (torch copy_, and a 1-thread
    memmove as the staging copy does), memcmp of equal buffers (1 thread, in 8 MiB calls, as an
    incremental save compares an unchanged chunk), and a sequential O_DIRECT write + fsync."""
    res: dict = {"bytes": nbytes}
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)
    ts = []
    for _ in range(max(3, reps)):
        t0 = now()
        dst.copy_(src)
        ts.append(now() - t0)
    res["memcpy_torch_s"] = min(ts)
    step = 8 * MiB
    a, b = src.data_ptr(), dst.data_ptr()
    ts = []
    for _ in range(max(3, reps)):
        t0 = now()
        for off in range(0, nbytes, step):
            ctypes.memmove(b + off, a + off, min(step, nbytes - off))
        ts.append(now() - t0)
    res["memcpy_memmove_s"] = min(ts)
    ts = []
    for _ in range(max(3, reps)):
        t0 = now()
        for off in range(0, nbytes, step):
            if _libc.memcmp(a + off, b + off, min(step, nbytes - off)) != 0:
                raise AssertionError("memcmp floor: buffers differ")
        ts.append(now() - t0)
    res["memcmp_s"] = min(ts)
    del src, dst
    buf = C.aligned_buffer(C.BLOCK)
    path, res["write_odirect_s"] = C.best_write(out, nbytes, buf, reps, direct=True)
    os.remove(path)
    buf.close()
    for k in list(res):
        if k.endswith("_s"):
            res[k[:-2] + "_GBps"] = C.gbps(nbytes, res[k])
    # a small file written, fsynced and its directory fsynced: what a save pays (at least) for each
    # of its pin, manifest and COMMIT, whatever its size
    ts = []
    small_path = os.path.join(out, "small.json")
    for _ in range(max(3, reps)):
        t0 = now()
        fd = os.open(small_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"{}" * 2048)
        os.fsync(fd)
        os.close(fd)
        C.fsync_dir(out)
        ts.append(now() - t0)
        os.remove(small_path)
    res["small_put_fsync_s"] = C.median(ts)
    res["pool_pages"] = pool_page_floors(nbytes, out, pools=max(2, reps))
    res["watch"] = watch_floors(nbytes)
    # one synchronous O_DIRECT pwrite per block of `bs` (how a pack of scattered changed chunks is
    # written: one write per span), on up to 128 MiB
    res["write_odirect_blocks"] = {}
    small = min(nbytes, 128 * MiB)
    for bs in sorted(set(block_sizes)):
        if bs >= C.BLOCK:
            continue
        b = C.aligned_buffer(bs)
        ts = []
        for _ in range(reps):
            if os.path.exists(path):
                os.remove(path)
            ts.append(C.write_file(path, small, b, direct=True))
        os.remove(path)
        b.close()
        res["write_odirect_blocks"][bs] = {"bytes": small, "s": min(ts), "GBps": C.gbps(small, min(ts))}
    return res


# ---------------------------------------------------------------------------------------------
# one round: every mode on one workload, saving in turn
# ---------------------------------------------------------------------------------------------

def newest_manifest_bytes(d: str) -> int | None:
    steps = sorted(p for p in glob.glob(os.path.join(d, "step-*")) if os.path.exists(os.path.join(p, "COMMIT")))
    if not steps:
        return None
    ms = glob.glob(os.path.join(steps[-1], "manifest.*.json"))
    return os.path.getsize(ms[0]) if ms else None


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(f) for f in C._files_under(d) if os.path.isfile(f))


def tensors_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


MODES = {  # CheckpointManager options per mode
    "incremental": dict(incremental=True),  # the default: kernel write watching where available, else compare
    "compare": dict(incremental=True, change_detection="compare"),  # compare every byte with the previous save's
    "full": dict(incremental=False),
    "unverified": dict(incremental=True, reverify_every=None),  # --reverify-cost: no re-verification of borrowed chunks
}


def _per_save_stats(res: dict, stats: list) -> None:
    res["saves"] = [s.as_dict() for s in stats]
    for k in ("total_s", "stall_s", "guard_wait_s", "wait_prev_s", "snapshot_s", "write_s", "commit_s",
              "bytes_written", "bytes_reused", "chunks_reused", "upload_s", "bytes_uploaded", "bytes_upload_reused",
              "bytes_unwritten", "bytes_reverified", "chunks_reverified", "chunks_damaged"):
        vals = [s.get(k) for s in res["saves"] if s.get(k) is not None]
        if vals:
            res[k + "_median"] = C.median(vals)
            res[k + "_mean"] = sum(vals) / len(vals)
            res[k + "_max"] = max(vals)
    res["bytes_total"] = res["saves"][0]["bytes_total"] if res["saves"] else None
    res["chunks_total"] = res["saves"][0]["chunks_total"] if res["saves"] else None


def run_round(make, *, modes: tuple[str, ...], chunk_bytes: int, P, work: str, label: str,
              remote: dict | None = None, verify: tuple[str, ...] = (), overlap: bool = True) -> dict:
    """One workload, one training loop, one manager per mode (each in a fresh directory), saving in
    turn: a save every `P.every` steps, in blocks of `P.block` saves of one mode, the modes' blocks
    taking turns, until each mode made `P.saves` timed saves. The first save of a block is not
    timed: it washes out what the previous mode's saves left behind (a full save's 0.7 GB still
    being flushed by the host would otherwise slow the small save after it). Every mode thus sees
    the same states, disk and machine load within seconds of the others: slow drifts of disk and
    host speed fall on all modes alike instead of on whichever mode ran at that moment. The steps
    after a mode's save, up to the next save, are that mode's training-thread time (its save's
    writing runs during them, and so do the faults its write watching causes). Before a save, the
    other modes' work still in flight is waited for (outside the timed steps; reported as
    `bench_wait_s`), so that saves never overlap. With `overlap` False each save is waited for
    before training goes on (handle.wait(), not counted in the steps): the save's own cost, without
    the training step competing for the cores. Returns {mode: phase result}."""
    t_round = now()
    cpu0 = C.cpu_snapshot()
    w = make()
    build_s = now() - t_round
    dirs, mgrs, res = {}, {}, {}
    for mode in modes:
        d = dirs[mode] = tempfile.mkdtemp(prefix=f"{label}-{mode}-", dir=work)
        kw: dict = dict(keep_local=2, chunk_bytes=chunk_bytes, **MODES[mode])
        if remote is not None:
            kw.update(remote=f"{remote['url']}/{os.path.basename(d)}", storage_options=remote["options"], keep_remote=2)
        mgrs[mode] = CheckpointManager(d, **kw)
        res[mode] = {"label": label, "mode": mode, "chunk_bytes": chunk_bytes, "build_s": build_s, "bench_wait_s": 0.0}
    try:
        for i in range(P.warmup):
            w.step(i + 1)
        for mode in modes:  # untimed: allocates each staging pool and writes everything
            res[mode]["first"] = mgrs[mode].save(0, w.state(0)).wait().as_dict()
        handles: dict = {m: [] for m in modes}
        steps: dict = {m: [] for m in modes}
        timed = P.block - 1
        blocks = -(-P.saves // timed)
        turns = [(modes[b % len(modes)], k > 0) for b in range(blocks * len(modes)) for k in range(P.block)]
        owner = None  # the mode whose save came last: the steps that follow are its
        gc.disable()
        try:
            t_loop = now()
            for s in range(1, len(turns) * P.every + 1):
                t0 = now()
                w.step(s)
                if s % P.every == 0:
                    owner, counted = turns[s // P.every - 1]
                    t_wait = now()
                    for other in modes:
                        if other != owner:
                            mgrs[other].wait()
                    waited = now() - t_wait
                    res[owner]["bench_wait_s"] += waited
                    t0 += waited
                    h = mgrs[owner].save(s, w.state(s))
                    if not overlap:
                        t_wait = now()
                        h.wait()
                        t0 += now() - t_wait
                    if counted and len(handles[owner]) < P.saves:
                        handles[owner].append(h)
                if owner is not None:
                    steps[owner].append(now() - t0)
            stats = {m: [h.wait() for h in handles[m]] for m in modes}
            loop_s = now() - t_loop
        finally:
            gc.enable()
        for mode in modes:
            mgr, r = mgrs[mode], res[mode]
            mgr.wait()
            r["loop_s"] = loop_s
            r["step_median_s"] = C.median(steps[mode])
            r["step_mean_s"] = sum(steps[mode]) / len(steps[mode])
            r["train_s"] = sum(steps[mode])  # steps, save() calls, guard waits, first writes after a save
            r["manifest_bytes"] = newest_manifest_bytes(dirs[mode])
            r["dir_bytes_end"] = dir_bytes(dirs[mode])
            r["staging_bytes"] = mgr.staging_bytes
            _per_save_stats(r, stats[mode])
            r["ok"] = all(x["ok"] for x in r["saves"]) and r["first"]["ok"]
        last = len(turns) * P.every + 1
        for mode in verify:  # save the final state once more, restore it into a fresh (differently trained) workload
            mgrs[mode].save(last, w.state(last)).wait()
            w2 = make()
            w2.step(10_000)
            with CheckpointManager(dirs[mode], keep_local=None) as m2:
                got = m2.restore(w2.state(-1))
            res[mode]["restore_ok"] = bool(got == last and tensors_equal(w.tensors(), w2.tensors()))
            del w2
    finally:
        for mgr in mgrs.values():
            mgr.close()
    for mode in modes:
        shutil.rmtree(dirs[mode], ignore_errors=True)
    del w  # freed by reference counting (a full gc.collect() costs ~0.3 s here)
    foreign, wall = C.foreign_cpu_since(cpu0), now() - t_round
    for mode in modes:
        r = res[mode]
        r["foreign_cpu_s"], r["wall_s"] = foreign / len(modes), wall
        log(f"  {label:28s} {mode:11s} chunk {size_name(chunk_bytes):>7s}: "
            f"written {mb(r.get('bytes_written_median'))} MB (mean {mb(r.get('bytes_written_mean'))}) "
            f"total_s {f3(r.get('total_s_median'))} stall {f3(r.get('stall_s_median'))} "
            f"reused {r.get('chunks_reused_median')}/{r.get('chunks_total')} chunks, unwritten {mb(r.get('bytes_unwritten_median'))} MB "
            f"train {f3(r.get('train_s'))} s"
            + (f" uploaded {mb(r.get('bytes_uploaded_median'))} MB" if remote else "")
            + (f" restore_ok={r['restore_ok']}" if "restore_ok" in r else "")
            + f" [{wall:.1f}s, others {foreign:.1f} CPU-s]")
    return res


def run_pair(make, P, work: str, label: str, chunk_bytes: int, remote: dict | None = None, verify: bool = True,
             modes: tuple[str, ...] = ("incremental", "full"), overlap: bool = True) -> dict:
    """`P.rounds` interleaved rounds, each from a fresh workload; the modes' turn order rotates per round."""
    phases: dict = {m: [] for m in modes}
    for r in range(P.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        got = run_round(make, modes=order, chunk_bytes=chunk_bytes, P=P, work=work, label=f"{label}-r{r}",
                        remote=remote, verify=tuple(m for m in order if m != "full") if verify and r == 0 else (),
                        overlap=overlap)
        for m in modes:
            phases[m].append(got[m])
    return summarize(phases)


def median_ratio_interval(mine: list, full: list, key: str, boot: int = 2000) -> dict:
    """A 95% bootstrap interval (each mode's saves resampled on their own; seeded) of the ratio of
    the two modes' medians: the estimate the targets are judged on."""
    xs = [s[key] for ph in mine for s in ph["saves"] if s.get(key)]
    ys = [s[key] for ph in full for s in ph["saves"] if s.get(key)]
    if not xs or not ys:
        return {}
    rng = random.Random(0)
    boots = sorted(C.median(rng.choices(xs, k=len(xs))) / C.median(rng.choices(ys, k=len(ys))) for _ in range(boot))
    return {f"{key}_lo": boots[int(0.025 * boot)], f"{key}_hi": boots[int(0.975 * boot) - 1]}


def paired_ratio(mine: list, full: list, key: str, boot: int = 2000) -> dict:
    """The median of the ratios of the k-th timed save of a mode to the k-th of full (both in the same
    cycle of blocks, seconds apart), with a 95% bootstrap interval (the pairs resampled; seeded):
    shown beside the ratio of medians; it cancels drift within a round but doubles per-save noise."""
    xs = [a[key] / b[key] for pa, pb in zip(mine, full) for a, b in zip(pa["saves"], pb["saves"]) if a.get(key) and b.get(key)]
    if not xs:
        return {}
    rng = random.Random(0)
    boots = sorted(C.median(rng.choices(xs, k=len(xs))) for _ in range(boot))
    return {f"{key}_paired": C.median(xs), f"{key}_paired_lo": boots[int(0.025 * boot)],
            f"{key}_paired_hi": boots[int(0.975 * boot) - 1], f"{key}_pairs": len(xs)}


def summarize(phases: dict) -> dict:
    """Medians over every timed save of every round, per mode; ratios incremental / full."""
    out: dict = {"phases": phases}
    for mode, phs in phases.items():
        saves = [s for ph in phs for s in ph["saves"]]
        m: dict = {"n_saves": len(saves), "rounds": len(phs)}
        for k in ("total_s", "stall_s", "guard_wait_s", "wait_prev_s", "snapshot_s", "write_s", "commit_s",
                  "bytes_written", "bytes_reused", "chunks_reused", "upload_s", "bytes_uploaded", "bytes_upload_reused",
                  "bytes_unwritten", "bytes_reverified", "chunks_reverified", "chunks_damaged"):
            vals = [s.get(k) for s in saves if s.get(k) is not None]
            if vals:
                m[k] = C.median(vals)
                m[k + "_mean"] = sum(vals) / len(vals)
                m[k + "_max"] = max(vals)
        for k in ("bytes_total", "chunks_total", "manifest_bytes", "dir_bytes_end", "staging_bytes"):
            vals = [ph.get(k) for ph in phs if ph.get(k) is not None]
            m[k] = C.median(vals) if vals else None
        m["step_median_s"] = C.median([ph.get("step_median_s") for ph in phs])
        m["train_s"] = C.median([ph.get("train_s") for ph in phs])
        m["first_total_s"] = C.median([ph["first"]["total_s"] for ph in phs])
        m["foreign_cpu_s"] = sum(ph["foreign_cpu_s"] for ph in phs)
        m["bench_wait_s"] = sum(ph["bench_wait_s"] for ph in phs)  # waits for another mode's save (should be ~0)
        m["ok"] = all(ph["ok"] for ph in phs)
        ro = [ph["restore_ok"] for ph in phs if "restore_ok" in ph]
        if ro:
            m["restore_ok"] = all(ro)
        out[mode] = m
    full = out["full"]

    def ratios(mode):
        m = out[mode]
        r = {k: (m[k] / full[k] if m.get(k) is not None and full.get(k) else None)
             for k in ("bytes_written", "bytes_written_mean", "total_s", "stall_s", "bytes_uploaded", "upload_s",
                       "dir_bytes_end", "train_s")}
        r.update(median_ratio_interval(phases[mode], phases["full"], "total_s"))
        r.update(paired_ratio(phases[mode], phases["full"], "total_s"))
        return r

    out["ratios"] = ratios("incremental")
    if "compare" in out:
        out["ratios_compare"] = ratios("compare")
    if "unverified" in out:
        out["ratios_unverified"] = ratios("unverified")
    return out


# ---------------------------------------------------------------------------------------------
# scenarios
# ---------------------------------------------------------------------------------------------

def scenario_finetune(P, work, remote=None, gb=None) -> dict:
    gb = gb or P.ft_gb
    make = lambda: FineTune(gb, P.share, P.d, P.ft_batch)  # noqa: E731
    w = make()
    info = {"shape": w.shape, "bytes": w.nbytes(), "changed_bytes": w.changed_bytes,
            "changed_share": w.changed_bytes / w.nbytes()}
    del w
    log(f"fine-tuning{' (remote tier)' if remote else ''}: {info['shape']}, {info['bytes'] / GB:.3f} GB, "
        f"changed share {info['changed_share']:.4f}")
    modes = ("incremental", "unverified", "full") if P.reverify_cost else ("incremental", "compare", "full")
    res = run_pair(make, P, work, "ft-remote" if remote else "ft", P.chunk_bytes, remote=remote, verify=remote is None,
                   modes=("incremental", "full") if remote else modes)
    res.update(info)
    if remote is None and not P.reverify_cost:
        _waited_and_targets(res, make, P, work, "ft", bytes_limit=0.12, time_limit=0.2)
    return res


def _waited_and_targets(res: dict, make, P, work: str, label: str, *, bytes_limit: float, time_limit: float) -> None:
    """Run the scenario again with each save waited for, and judge the targets: bytes, and time both
    with training on and with saves waited for."""
    res["waited"] = run_pair(make, P, work, f"{label}-waited", P.chunk_bytes, verify=False,
                             modes=("incremental", "compare", "full"), overlap=False)
    r = res["ratios"]
    res["targets"] = {
        "bytes_written": {"value": r["bytes_written"], "target": f"<= {bytes_limit:g}", "met": _met(r["bytes_written"], bytes_limit)},
        "total_s": _time_target(r, time_limit),
        "total_s_waited": _time_target(res["waited"]["ratios"], time_limit),
    }


def scenario_dense(P, work) -> dict:
    make = lambda: Dense(P.dense_gb, P.d, P.dense_batch)  # noqa: E731
    w = make()
    info = {"shape": w.shape, "bytes": w.nbytes(), "changed_share": 1.0}
    del w
    log(f"dense: {info['shape']}, {info['bytes'] / GB:.3f} GB")
    res = run_pair(make, P, work, "dense", P.chunk_bytes, modes=("incremental", "compare", "full"))
    res.update(info)
    _waited_and_targets(res, make, P, work, "dense", bytes_limit=1.05, time_limit=1.05)
    return res


def scenario_embedding(P, work) -> dict:
    make = lambda: EmbeddingTable(P.emb_rows, P.emb_dim, P.emb_touch, P.emb_optim)  # noqa: E731
    w = make()
    info = {"shape": w.shape, "bytes": w.nbytes(), "row_bytes": P.emb_dim * 4}
    del w
    log(f"embedding: {info['shape']}, {info['bytes'] / GB:.3f} GB; chunk sizes "
        + ", ".join(size_name(c) for c in P.chunk_sizes))
    sweep = []
    for i, cb in enumerate(P.chunk_sizes):
        r = run_pair(make, P, work, f"emb-{size_name(cb).replace(' ', '')}", cb, verify=i == 0)
        r["chunk_bytes"] = cb
        sweep.append(r)
    res = {"sweep": sweep, **info}
    # the recommendation: per save bytes = pack bytes (mean over saves: includes the occasional
    # rewrite of a mostly-dead file, reuse.REWRITE_BELOW) + the manifest; among chunk sizes within
    # 10% of the smallest, the one with the lowest median save -> durable time
    rows = []
    for r in sweep:
        inc = r["incremental"]
        per_save = (inc.get("bytes_written_mean") or 0) + (inc.get("manifest_bytes") or 0)
        rows.append((r["chunk_bytes"], per_save, inc.get("total_s")))
    best_bytes = min(b for _, b, _ in rows)
    cands = [x for x in rows if x[1] <= 1.10 * best_bytes and x[2] is not None]
    pick = min(cands, key=lambda x: x[2]) if cands else None
    res["recommendation"] = None if pick is None else {
        "chunk_bytes": pick[0], "bytes_per_save": pick[1], "total_s": pick[2], "smallest_bytes_per_save": best_bytes,
        "rule": "lowest median incremental save->durable time among chunk sizes whose mean bytes per save "
                "(pack + manifest) are within 10% of the smallest"}
    return res


def _met(v, t):
    return None if v is None else bool(v <= t)


def _time_target(r: dict, limit: float) -> dict:
    """Time targets are judged on the ratio of the modes' median save -> durable times (the saves of
    all rounds), reported with its bootstrap interval (median_ratio_interval)."""
    v = r.get("total_s")
    return {"value": v, "lo": r.get("total_s_lo"), "hi": r.get("total_s_hi"), "target": f"<= {limit:g}", "met": _met(v, limit)}


def start_remote():
    from embedded_s3 import EmbeddedS3
    server = EmbeddedS3()
    server.start()
    return server, {"url": server.bucket("bench-incremental"), "options": server.storage_options}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _mode_rows(res: dict, remote: bool = False) -> list:
    L = []
    if remote:
        L.append("| mode | saves | bytes uploaded / save (median) | mean | bytes_upload_reused (median; whole earlier files) | "
                 "local commit -> remote durable (median, s) | bytes written / save | save -> durable local (median, s) |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for mode in [k for k in MODES if k in res]:
            m = res[mode]
            L.append(f"| {mode} | {m['n_saves']} | {mb(m.get('bytes_uploaded'))} MB | {mb(m.get('bytes_uploaded_mean'))} MB | "
                     f"{mb(m.get('bytes_upload_reused'))} MB | {f3(m.get('upload_s'))} | {mb(m.get('bytes_written'))} MB | "
                     f"{f3(m.get('total_s'))} |")
        return L
    L.append("| mode | saves | bytes written / save (median) | mean | max | reused (median) | chunks reused / total | "
             "save -> durable (median, s) | max | stall (median, s) | snapshot_s | write_s | commit_s | wait prev | "
             "first save (s) | disk at end | unwritten (median) | step (median, s) | training thread (s) | other procs CPU-s |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in [k for k in MODES if k in res]:
        m = res[mode]
        L.append(f"| {mode} | {m['n_saves']} | **{mb(m.get('bytes_written'))} MB** | {mb(m.get('bytes_written_mean'))} | "
                 f"{mb(m.get('bytes_written_max'))} | {mb(m.get('bytes_reused'))} MB | "
                 f"{m.get('chunks_reused', 0):.0f} / {m.get('chunks_total') or 0:.0f} | **{f3(m.get('total_s'))}** | "
                 f"{f3(m.get('total_s_max'))} | {f3(m.get('stall_s'), 4)} | {f3(m.get('snapshot_s'))} | {f3(m.get('write_s'))} | "
                 f"{f3(m.get('commit_s'))} | {f3(m.get('wait_prev_s'))} | {f3(m.get('first_total_s'))} | "
                 f"{mb(m.get('dir_bytes_end'))} MB | {mb(m.get('bytes_unwritten'))} MB | {f3(m.get('step_median_s'))} | "
                 f"{f3(m.get('train_s'))} | {m.get('foreign_cpu_s', 0):.1f} |")
    return L


def _waited_rows(res: dict) -> list:
    """The same scenario with each save waited for before training goes on (run_round overlap=False)."""
    wt = res.get("waited")
    if not wt:
        return []
    L = ["Each save waited for (`handle.wait()` right after `save()`): the save's own cost, with no training "
         "step competing for the cores:\n"]
    L += _mode_rows(wt) + [""]
    r, rc = wt["ratios"], wt.get("ratios_compare")
    L.append("| ratio to full, saves waited for | incremental (default) | compare every byte |\n|---|---:|---:|")
    for k, label in (("total_s", "save -> durable (ratio of the medians [95% interval])"),
                     ("total_s_paired", "save -> durable (median of the k-th saves' ratios [95% interval])")):
        L.append(f"| {label} | {_with_interval(r, k)} | {_with_interval(rc, k) if rc else ''} |")
    return L + [""]


def _reverify_rows(res: dict) -> list:
    """--reverify-cost: incremental (re-verifying borrowed chunks) against 'unverified' (reverify_every=None)."""
    on, off = res.get("incremental"), res.get("unverified")
    if not on or not off:
        return []
    L = ["Re-verification of borrowed chunks (default: each at least once in 10 saves, 200 MB/s) against none:\n",
         "| | re-verifying (default) | unverified | ratio |", "|---|---:|---:|---:|"]
    for k, label, nd in (("total_s", "save -> durable (median, s)", 3), ("wait_prev_s", "wait_prev (median, s)", 4),
                         ("stall_s", "stall (median, s)", 4), ("step_median_s", "step (median, s)", 4),
                         ("train_s", "training thread (s)", 3)):
        a, b = on.get(k), off.get(k)
        L.append(f"| {label} | {f3(a, nd)} | {f3(b, nd)} | {f3(a / b if a is not None and b else None)} |")
    L.append(f"| bytes re-verified / save (median) | {mb(on.get('bytes_reverified'))} MB | {mb(off.get('bytes_reverified'))} MB | |")
    L.append(f"| chunks re-verified / save (median) | {on.get('chunks_reverified', 0):.0f} | {off.get('chunks_reverified', 0):.0f} | |")
    return L + [""]


def _with_interval(r: dict, k: str) -> str:
    if r.get(k + "_lo") is None:
        return f3(r.get(k))
    return f"{f3(r[k])} [{f3(r[k + '_lo'])}, {f3(r[k + '_hi'])}]"


def _ratio_rows(res: dict) -> list:
    r, rc = res["ratios"], res.get("ratios_compare")
    L = ["| ratio to full | incremental (default) | target | met |" + (" compare every byte |" if rc else ""),
         "|---|---:|---|---|" + ("---:|" if rc else "")]
    names = {"bytes_written": "bytes written per save (median)", "bytes_written_mean": "bytes written per save (mean)",
             "total_s": "save -> durable (ratio of the medians [95% interval])",
             "total_s_paired": "save -> durable (median of the k-th saves' ratios [95% interval])", "stall_s": "stall (median)",
             "dir_bytes_end": "disk used at the end (keep_local=2)", "train_s": "training thread time (steps after its saves)"}
    tg = res.get("targets", {})
    for k, label in names.items():
        if r.get(k) is None:
            continue
        t = tg.get(k, {})
        met = {True: "yes", False: "**no**", None: ""}[t.get("met")]
        L.append(f"| {label} | {_with_interval(r, k)} | {t.get('target', '')} | {met} |" + (f" {_with_interval(rc, k)} |" if rc else ""))
    return L


def markdown(res: dict) -> str:
    mach = res["machine"]
    P = res["args"]
    L = [f"## Incremental saves (bench/bench_incremental.py), {res['date']}\n",
         f"Machine: {mach.get('cpus')} cores ({mach.get('cpu_model', '?')}), {mach.get('mem_total_gib')} GiB RAM, {res['fs']}, "
         f"torch {res['torch']} CPU, {res['threads']} intra-op threads. {P.get('machine_note') or ''}".rstrip() + "\n",
         f"Loop per round: the modes side by side on one training loop, one manager each in a fresh directory "
         f"(keep_local=2); {P['warmup']} warm-up step(s), one untimed first save per mode (full: allocates its staging "
         f"pool), then a save every {P['every']} training steps while training goes on (snapshot=\"async\"), in blocks "
         f"of {P['block']} saves of one mode whose first is not timed (a washout), the modes' blocks taking turns "
         f"({P['saves']} timed saves per mode and round); "
         f"{P['rounds']} round(s), each from the same seeded state, rotating the turn order. Training thread = the "
         f"steps from each of the mode's saves to the next save. Medians over all timed saves. save -> durable = "
         f"`SaveStats.total_s` (save() entry to committed locally); bytes written = the step's pack file "
         f"(changed chunks + page padding).\n"]
    fl = res.get("floors")
    if fl:
        L.append(f"**Floors** ({fl['bytes'] / GB:.3f} GB, the fine-tuning state's size; memcpy/memcmp best of "
                 f"{max(3, P['floor_reps'])}, writes best of {P['floor_reps']}):\n")
        L.append("| floor | s | GB/s |\n|---|---:|---:|")
        for k, label in (("memcpy_torch", "memcpy, torch copy_"), ("memcpy_memmove", "memcpy, 1-thread memmove in 8 MiB calls (as staging)"),
                         ("memcmp", "memcmp of equal buffers, 1 thread, 8 MiB calls (an unchanged chunk)"),
                         ("write_odirect", "sequential write O_DIRECT 64 MiB pwrite + fsync")):
            L.append(f"| {label} | {f3(fl[k + '_s'])} | {f3(fl[k + '_GBps'], 2)} |")
        L.append(f"| a 4 KiB file written + fsync + directory fsync (a save writes 3: pin, manifest, COMMIT; median) | "
                 f"{f3(fl['small_put_fsync_s'], 4)} | |")
        for kind, label in (("4k", "4 KiB pages"), ("huge", "transparent huge pages, as the staging pool")):
            v = (fl.get("pool_pages") or {}).get(kind)
            if v:
                L.append(f"| write O_DIRECT + fsync from a freshly mapped buffer of {label} (median of {v['writes']} writes, "
                         f"{v['writes'] // 2} buffers; range {f3(v['min_s'])}-{f3(v['max_s'])}) | {f3(v['median_s'])} | "
                         f"{f3(C.gbps(fl['bytes'], v['median_s']), 2)} |")
        wf = fl.get("watch")
        if wf:
            L.append(f"| write watching: a scan that protects every page, every page written (PAGEMAP_SCAN) | {f3(wf['scan_s'], 4)} | |")
            L.append(f"| write watching: a peek (protects nothing), every page written | {f3(wf['peek_s'], 4)} | |")
            L.append(f"| write watching: the training thread's first write to every page after a scan (one minor fault "
                     f"each): {f3(wf['write_protected_s'])} s against {f3(wf['write_unprotected_s'])} s unprotected | "
                     f"{f3(wf['fault_s'])} | |")
        for bs, v in (fl.get("write_odirect_blocks") or {}).items():
            L.append(f"| write O_DIRECT in {size_name(int(bs))} pwrites + fsync ({v['bytes'] / 1e6:.0f} MB) | {f3(v['s'])} | "
                     f"{f3(v['GBps'], 2)} |")
        L.append("")
    sc = res["scenarios"]
    ft = sc.get("finetune")
    if ft and "error" not in ft:
        sh = ft["shape"]
        L.append(f"### Fine-tuning, {100 * ft['changed_share']:.2f}% of the bytes change\n")
        L.append(f"Frozen base {sh['base_layers']} x Linear({sh['d']}, {sh['d']}) + head Linear({sh['d']}, {sh['head_hidden']}) -> "
                 f"Linear({sh['head_hidden']}, {sh['classes']}) trained with AdamW (batch {sh['batch']}); state "
                 f"{ft['bytes'] / GB:.3f} GB ({ft['bytes']} B), of which head params + AdamW state "
                 f"{ft['changed_bytes']} B = **{100 * ft['changed_share']:.2f}%**. chunk_bytes {size_name(P['chunk_bytes'])}.\n")
        L += _mode_rows(ft) + [""] + _ratio_rows(ft) + [""] + _waited_rows(ft) + _reverify_rows(ft)
        if fl:
            inc, full = ft["incremental"], ft["full"]
            share = ft["changed_share"]
            fixed = 3 * fl["small_put_fsync_s"]
            copy_changed = ft["bytes"] * share / (fl["memcpy_memmove_GBps"] * GB)
            write_inc = (inc.get("bytes_written") or 0) / (fl["write_odirect_GBps"] * GB)
            est = copy_changed + write_inc + fixed  # written pages watched: unchanged bytes are not read
            est_cmp = est + ft["bytes"] * (1 - share) / (fl["memcmp_GBps"] * GB)  # every unchanged byte compared
            est_full = (ft["bytes"] / (fl["memcpy_memmove_GBps"] * GB) + (full.get("bytes_written") or 0) / (fl["write_odirect_GBps"] * GB)
                        + fixed)
            ft["floor_estimate"] = {"incremental_s": est, "compare_s": est_cmp, "full_s": est_full, "ratio": est / est_full,
                                    "ratio_compare": est_cmp / est_full}
            cmp = ft.get("compare", {})
            L.append(f"Floor estimate of one save from the floors above (memmove of the changed bytes + O_DIRECT write of "
                     f"the bytes written + 3 small fsynced files; comparing every byte adds a memcmp of the unchanged "
                     f"ones): incremental {est:.3f} s, compare {est_cmp:.3f} s, full {est_full:.3f} s; ratios "
                     f"**{est / est_full:.2f}** and {est_cmp / est_full:.2f} (digests and CPU contention with training not "
                     f"counted). "
                     f"Measured: incremental snapshot_s {f3(inc.get('snapshot_s'))} + write_s {f3(inc.get('write_s'))} + "
                     f"commit_s {f3(inc.get('commit_s'))}; compare {f3(cmp.get('snapshot_s'))} + {f3(cmp.get('write_s'))} + "
                     f"{f3(cmp.get('commit_s'))}; full {f3(full.get('snapshot_s'))} + {f3(full.get('write_s'))} + "
                     f"{f3(full.get('commit_s'))}.\n")
        if "restore_ok" in ft["incremental"]:
            L.append(f"Restore check (last incremental step into a fresh model, bit-exact): {ft['incremental']['restore_ok']}.\n")
    elif ft:
        L.append(f"### Fine-tuning: ERROR {ft['error']}\n")
    emb = sc.get("embedding")
    if emb and "error" not in emb:
        sh = emb["shape"]
        L.append(f"### Embedding table, {sh['rows_per_step']} random rows change per step\n")
        L.append(f"nn.Embedding({sh['rows']}, {sh['dim']}, sparse=True) with {sh['optim']} + a small MLP head (AdamW); state "
                 f"{emb['bytes'] / GB:.3f} GB; a row is {emb['row_bytes']} B; up to {sh['rows_per_step'] * P['every']} rows "
                 f"change between two timed saves ({P['every']} steps). Per chunk size, both modes:\n")
        L.append("| chunk_bytes | mode | chunks | reused (median) | bytes written / save (median) | mean | max | "
                 "save -> durable (median, s) | snapshot_s | write_s | commit_s | stall (median, s) | manifest | disk at end | "
                 "bytes ratio (mean) | time ratio |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in emb["sweep"]:
            for mode in ("incremental", "full"):
                m = r[mode]
                rat = r["ratios"]
                L.append(f"| {size_name(r['chunk_bytes'])} | {mode} | {m.get('chunks_total') or 0:.0f} | {m.get('chunks_reused', 0):.0f} | "
                         f"{mb(m.get('bytes_written'))} MB | {mb(m.get('bytes_written_mean'))} | {mb(m.get('bytes_written_max'))} | "
                         f"**{f3(m.get('total_s'))}** | {f3(m.get('snapshot_s'))} | {f3(m.get('write_s'))} | {f3(m.get('commit_s'))} | "
                         f"{f3(m.get('stall_s'), 4)} | {(m.get('manifest_bytes') or 0) / 1e3:.1f} kB | {mb(m.get('dir_bytes_end'))} MB | "
                         + (f"{f3(rat['bytes_written_mean'])} | {f3(rat['total_s'])} |" if mode == "incremental" else " | |"))
        L.append("\nbytes ratio (mean) = incremental / full mean pack bytes per save (the mean includes the saves that "
                 "rewrite the chunks still taken from a file once they fall below reuse.REWRITE_BELOW of it); "
                 "time ratio = median save -> durable, incremental / full. write_s of scattered changed chunks is "
                 "one synchronous O_DIRECT pwrite per span: compare the chunk-sized pwrite floors above.")
        rec = emb.get("recommendation")
        if rec:
            L.append(f"\n**recommendation: chunk_bytes = {size_name(rec['chunk_bytes'])}** ({rec['rule']}: "
                     f"{rec['bytes_per_save'] / 1e6:.2f} MB per save vs the smallest {rec['smallest_bytes_per_save'] / 1e6:.2f} MB; "
                     f"{rec['total_s']:.3f} s).\n")
        if "restore_ok" in emb["sweep"][0]["incremental"]:
            L.append(f"Restore check ({size_name(emb['sweep'][0]['chunk_bytes'])} chunks, bit-exact): "
                     f"{emb['sweep'][0]['incremental']['restore_ok']}.\n")
    elif emb:
        L.append(f"### Embedding: ERROR {emb['error']}\n")
    de = sc.get("dense")
    if de and "error" not in de:
        sh = de["shape"]
        L.append("### Dense training, every byte changes\n")
        L.append(f"{sh['layers']} x Linear({sh['d']}, {sh['d']}) all trained with AdamW (batch {sh['batch']}); state "
                 f"{de['bytes'] / GB:.3f} GB. chunk_bytes {size_name(P['chunk_bytes'])}.\n")
        L += _mode_rows(de) + [""] + _ratio_rows(de) + [""] + _waited_rows(de)
        if "restore_ok" in de["incremental"]:
            L.append(f"Restore check: {de['incremental']['restore_ok']}.\n")
    elif de:
        L.append(f"### Dense: ERROR {de['error']}\n")
    rm = sc.get("remote")
    if rm and "error" not in rm:
        L.append(f"### Fine-tuning with a remote tier (moto S3 on 127.0.0.1), state {rm['bytes'] / GB:.3f} GB, "
                 f"{100 * rm['changed_share']:.2f}% changing\n")
        L += _mode_rows(rm, remote=True) + [""]
        r = rm["ratios"]
        L.append(f"Ratio incremental / full: bytes uploaded per save {f3(r.get('bytes_uploaded'))}, "
                 f"local commit -> remote durable {f3(r.get('upload_s'))}.\n")
    elif rm:
        L.append(f"### Remote: ERROR {rm['error']}\n")
    # summary of the targets
    with_targets = [(k, n) for k, n in (("finetune", "fine-tuning"), ("dense", "dense")) if "targets" in (sc.get(k) or {})]
    if with_targets:
        L.append("### Targets\n")
        L.append("| scenario | ratio incremental / full | value | target | met | floor estimate |\n|---|---|---:|---|---|---:|")
    for key, name in with_targets:
        s = sc[key]
        for k, t in s["targets"].items():
            met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            fe = s.get("floor_estimate", {}).get("ratio") if k in ("total_s", "total_s_waited") else None
            value = f3(t["value"]) if t.get("lo") is None else f"{f3(t['value'])} [{f3(t['lo'])}, {f3(t['hi'])}]"
            what = {"bytes_written": "bytes written / save", "total_s": "save -> durable, training on (ratio of medians)",
                    "total_s_waited": "save -> durable, save waited for (ratio of medians)"}[k]
            L.append(f"| {name} | {what} | "
                     f"{value} | {t['target']} | {met} | {f3(fe, 2) if fe is not None else ''} |")
    if res.get("problems"):
        L.append("\nProblems seen in this run:\n")
        L += [f"- {p}" for p in res["problems"]]
    L.append(f"\nOther processes used {res.get('foreign_cpu_s', 0):.0f} CPU-s during the run (mean load "
             f"{res.get('foreign_cpu_load', 0):.2f} CPUs of {mach.get('cpus')}; 0 = quiet machine). Total wall time "
             f"{res.get('total_wall_s', 0):.0f} s. Command: `python bench/bench_incremental.py {' '.join(sys.argv[1:])}`.\n")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~50 MB states, fewer saves: smoke test (under a minute)")
    p.add_argument("--only", default="finetune,embedding,dense", help="scenarios to run (comma-separated)")
    p.add_argument("--remote", action="store_true", help="also the fine-tuning scenario with a remote tier (embedded moto S3)")
    p.add_argument("--ft-gb", type=float, default=None, help="fine-tuning state GB (default 0.7; --quick 0.05)")
    p.add_argument("--dense-gb", type=float, default=None, help="dense state GB (default 0.7; --quick 0.05)")
    p.add_argument("--remote-gb", type=float, default=None, help="fine-tuning state GB with --remote (default 0.2; --quick 0.03)")
    p.add_argument("--share", type=float, default=0.10, help="fine-tuning: share of the bytes that change (head + AdamW)")
    p.add_argument("--d", type=int, default=None, help="width of the Linear stacks (default 2048; --quick 1024)")
    p.add_argument("--ft-batch", type=int, default=16)
    p.add_argument("--dense-batch", type=int, default=16)
    p.add_argument("--emb-rows", type=int, default=None, help="embedding rows (default 1M; --quick 200k)")
    p.add_argument("--emb-dim", type=int, default=64)
    p.add_argument("--emb-touch", type=int, default=32, help="embedding rows trained per step")
    p.add_argument("--emb-optim", choices=("sgd", "sparseadam"), default="sgd")
    p.add_argument("--chunk-sizes", default="256K,1M,4M,8M,16M", help="embedding sweep of chunk_bytes")
    p.add_argument("--chunk-bytes", default=None, help="chunk_bytes of the other scenarios (default: the library's)")
    p.add_argument("--every", type=int, default=5, help="save every k training steps")
    p.add_argument("--reverify-cost", action="store_true",
                   help="fine-tuning: run incremental (re-verifying borrowed chunks, the default) beside 'unverified' "
                        "(reverify_every=None) instead of 'compare', and skip the waited runs")
    p.add_argument("--saves", type=int, default=None, help="timed saves per mode and round (default 6; --quick 3)")
    p.add_argument("--block", type=int, default=3, help="saves of one mode in a row; the first of each is not timed")
    p.add_argument("--rounds", type=int, default=None, help="rounds, rotating the modes' turn order (default 4; --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up training steps before the first save")
    p.add_argument("--floor-reps", type=int, default=None, help="default 3; --quick 1")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before starting, wait up to this many seconds for other processes to go idle")
    p.add_argument("--out", default=os.path.join(HERE, "out"),
                   help="parent of the scratch directory (default bench/out, the disk bench_core uses); removed at the end")
    p.add_argument("--json", default=None, help="JSON results (default bench/out/bench_incremental.json)")
    p.add_argument("--md", default=None, help="also write the markdown section here")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--machine-note", default="", help="free text added to the machine line")
    P = p.parse_args(argv)
    q = P.quick
    P.ft_gb = P.ft_gb or (0.05 if q else 0.7)
    P.dense_gb = P.dense_gb or (0.05 if q else 0.7)
    P.remote_gb = P.remote_gb or (0.03 if q else 0.2)
    P.d = P.d or (1024 if q else 2048)
    P.emb_rows = P.emb_rows or (200_000 if q else 1_000_000)
    P.saves = P.saves or (3 if q else 6)
    if P.block < 2:
        raise SystemExit("--block must be at least 2 (the first save of a block is not timed)")
    P.rounds = P.rounds or (2 if q else 4)
    P.floor_reps = P.floor_reps or (1 if q else 3)
    if q:
        P.every = min(P.every, 3)
    P.chunk_sizes = [parse_size(s) for s in P.chunk_sizes.split(",") if s.strip()]
    if P.chunk_bytes is None:
        from checkpointing.options import DEFAULT_CHUNK_BYTES

        P.chunk_bytes = DEFAULT_CHUNK_BYTES
    else:
        P.chunk_bytes = parse_size(P.chunk_bytes)
    if not 0.0 < P.share < 0.5:
        p.error("--share must be in (0, 0.5)")
    return P


def main(argv=None):
    P = parse_args(argv)
    torch.set_num_threads(P.threads)
    os.makedirs(P.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-incremental-", dir=P.out)
    t_start = now()
    if P.wait_quiet > 0:
        log(f"other processes' CPU load before start: {C.wait_quiet(P.wait_quiet, log=log):.2f} CPUs")
    cpu_run = C.cpu_snapshot()
    args = {k: v for k, v in vars(P).items()}
    res: dict = {"date": P.date, "machine": C.machine_description(), "fs": C.fs_type(work), "torch": torch.__version__,
                 "python": platform.python_version(), "threads": torch.get_num_threads(), "args": args,
                 "scenarios": {}, "problems": []}
    only = {s.strip() for s in P.only.split(",") if s.strip()}
    server = None
    try:
        ft_bytes = FineTune(P.ft_gb, P.share, P.d, P.ft_batch).nbytes() if "finetune" in only else int(P.ft_gb * GB)
        log(f"floors on {ft_bytes / GB:.3f} GB in {work} ({res['fs']}) ...")
        cpu0 = C.cpu_snapshot()
        res["floors"] = measure_floors(ft_bytes, work, P.floor_reps, P.chunk_sizes if "embedding" in only else ())
        res["floors"]["foreign_cpu_s"] = C.foreign_cpu_since(cpu0)
        log("  " + ", ".join(f"{k}={v:.2f}" for k, v in res["floors"].items() if k.endswith("GBps")) + "; O_DIRECT in blocks: "
            + ", ".join(f"{size_name(b)} {v['GBps']:.2f}" for b, v in res["floors"]["write_odirect_blocks"].items()))
        plan = [("finetune", lambda: scenario_finetune(P, work)),
                ("embedding", lambda: scenario_embedding(P, work)),
                ("dense", lambda: scenario_dense(P, work))]
        plan = [x for x in plan if x[0] in only]
        if P.remote:
            def remote_scenario():
                nonlocal server
                server, remote = start_remote()
                return scenario_finetune(P, work, remote=remote, gb=P.remote_gb)
            plan.append(("remote", remote_scenario))
        for key, fn in plan:
            t0 = now()
            try:
                res["scenarios"][key] = fn()
            except Exception as e:  # noqa: BLE001
                res["scenarios"][key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                res["problems"].append(f"{key}: {type(e).__name__}: {e}")
                log(traceback.format_exc())
            res["scenarios"][key]["wall_s"] = now() - t0
        for key, s in res["scenarios"].items():
            for sub in ([s] if "sweep" not in s else s["sweep"]):
                for mode in MODES:
                    m = sub.get(mode, {})
                    if m and not m.get("ok", True):
                        res["problems"].append(f"{key} {mode}: a save failed")
                    if m.get("restore_ok") is False:
                        res["problems"].append(f"{key} {mode}: restore of the last step differs from the saved state")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    res["total_wall_s"] = now() - t_start
    res["foreign_cpu_s"] = C.foreign_cpu_since(cpu_run)
    res["foreign_cpu_load"] = res["foreign_cpu_s"] / res["total_wall_s"]
    md = markdown(res)
    jpath = P.json or os.path.join(HERE, "out", "bench_incremental.json")
    C.write_results(res, md, jpath, P.md)
    emb = res["scenarios"].get("embedding", {})
    if emb.get("recommendation"):
        rec = emb["recommendation"]
        print(f"recommendation: chunk_bytes={rec['chunk_bytes']} ({size_name(rec['chunk_bytes'])})")
    log(f"JSON: {jpath}" + (f"  markdown: {P.md}" if P.md else ""))
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())

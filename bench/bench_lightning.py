#!/usr/bin/env python
"""Lightning benchmark: loop overhead per save of LightningCheckpointIO vs Lightning's own TorchCheckpointIO
and AsyncCheckpointIO(TorchCheckpointIO), through a real lightning.pytorch.Trainer.

    python bench/bench_lightning.py             # ~0.2 GB model + AdamW state, 3 interleaved repetitions (~4 min on 2 cores)
    python bench/bench_lightning.py --quick     # smoke test

Every config runs the same Trainer.fit: the transformer of bench_core.py (TinyLM) wrapped in a
LightningModule, N training steps on fixed synthetic batches, and ModelCheckpoint(every_n_train_steps=k)
with its default save_top_k=1 (each save removes the previous checkpoint through remove_checkpoint).
N is not a multiple of k: the last save has a few steps to finish in the background, and teardown
waits for what is left. The baseline runs the same fit with enable_checkpointing=False.

**Loop overhead per save** = (fit time of the config - mean of the two neighbouring baseline fits) /
saves, in the order B c1 B c2 B c3 B per repetition; its median over the repetitions is reported,
with the ratios of ours to TorchCheckpointIO and to AsyncCheckpointIO. It counts the IO's
save_checkpoint calls, remove_checkpoint, teardown's wait for the last save, and the slowdown of the
training steps while background writes compete for the cores. Lightning's dump of the checkpoint
dict is paid alike by every config. TorchCheckpointIO writes without fsync; ours fsyncs every save.
Training runs on one torch thread by default (--threads): on this shared 2-core machine two OpenMP
threads on busy cores make step times swing tenfold; the other core is left to background work, as
on a GPU node whose CPUs are mostly idle.

Results: a markdown table on stdout and in bench/out/lightning.md, JSON in bench/out/lightning.json.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import platform
import shutil
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import _common as C  # noqa: E402
from _common import now  # noqa: E402
from bench_core import GB, TinyLM, shape_for  # noqa: E402

from checkpointing.integrations.lightning import LightningCheckpointIO  # noqa: E402

warnings.filterwarnings("ignore")
for _name in ("lightning", "lightning.pytorch", "lightning.fabric", "checkpointing"):
    logging.getLogger(_name).setLevel(logging.ERROR)

CONFIGS = {
    "torch": "TorchCheckpointIO (Lightning's default: torch.save, no fsync)",
    "async": "AsyncCheckpointIO(TorchCheckpointIO) (clone, then torch.save in a thread)",
    "ours": "LightningCheckpointIO (CheckpointManager, snapshot=async, fsync)",
    "ours_eager": "LightningCheckpointIO with its defaults (snapshot=eager, fsync)",
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class Batches(Dataset):
    """`length` samples cycling over 4 fixed ones: (embeddings (T, d), targets (T,))."""

    def __init__(self, length: int, seq: int, d: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.items = [(torch.randn(seq, d, generator=g), torch.randint(0, vocab, (seq,), generator=g)) for _ in range(4)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.items[i % len(self.items)]


class LM(pl.LightningModule):
    def __init__(self, d: int, n_blocks: int, vocab: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyLM(d, n_blocks, vocab)
        self.vocab = vocab

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).view(-1, self.vocab), y.view(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)


class Timed:
    """Wraps an IO instance's save_checkpoint/remove_checkpoint/teardown with timers (the bench's only patch)."""

    def __init__(self, io) -> None:
        self.calls: dict[str, list[float]] = {"save_checkpoint": [], "remove_checkpoint": [], "teardown": []}
        for name in self.calls:
            setattr(io, name, self._timed(name, getattr(io, name)))

    def _timed(self, name, fn):
        def call(*a, **k):
            t0 = now()
            try:
                return fn(*a, **k)
            finally:
                self.calls[name].append(now() - t0)
        return call


def make_io(key: str, store: str):
    if key == "torch":
        return None  # the strategy's default TorchCheckpointIO
    if key == "async":
        return AsyncCheckpointIO()  # the strategy fills in a TorchCheckpointIO
    if key == "ours_eager":
        return LightningCheckpointIO(store)  # the plugin's defaults: the state is copied before save_checkpoint returns
    return LightningCheckpointIO(store, snapshot="async")


def fit_once(key: str, P, shape, scratch: str) -> dict:
    """One Trainer.fit; key None is the baseline (no checkpointing)."""
    if os.path.exists(scratch):
        shutil.rmtree(scratch)
    os.makedirs(scratch)
    gc.collect()
    os.sync()
    pl.seed_everything(0, verbose=False)
    module = LM(P.d, *shape)
    data = DataLoader(Batches(P.steps * P.batch, P.seq, P.d, shape[1]), batch_size=P.batch, shuffle=False)
    plugins, callbacks, timed = [], [], None
    if key is not None:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(scratch, "ckpts"), every_n_train_steps=P.every))
        io = make_io(key, os.path.join(scratch, "store"))
        if io is not None:
            plugins.append(io)
    trainer = pl.Trainer(max_steps=P.steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=key is not None, plugins=plugins,
                         callbacks=callbacks, num_sanity_val_steps=0)
    if key is not None:
        timed = Timed(trainer.strategy.checkpoint_io)
    cpu0 = C.cpu_snapshot()
    t0 = now()
    trainer.fit(module, data)
    fit_s = now() - t0
    r = {"fit_s": fit_s, "foreign_cpu_s": C.foreign_cpu_since(cpu0), "global_step": trainer.global_step}
    if timed is not None:
        r.update({f"{k}_s": v for k, v in timed.calls.items()})
        r["saves"] = len(timed.calls["save_checkpoint"])
    del trainer, module
    shutil.rmtree(scratch, ignore_errors=True)
    return r


def quiet_fit(key: str | None, P, shape, scratch: str, deadline: float) -> dict:
    """fit_once() on a quiet machine where possible: wait for other processes to leave the CPUs first, and fit
    again when they used more than --max-foreign CPUs during the fit (until the --budget-s deadline)."""
    for attempt in range(P.retries + 1):
        if P.wait_quiet > 0 and now() < deadline:
            C.wait_quiet(min(P.wait_quiet, max(0.0, deadline - now())), threshold=P.max_foreign, window_s=2.0, log=log)
        r = fit_once(key, P, shape, scratch)
        r["attempts"] = attempt + 1
        load = r["foreign_cpu_s"] / r["fit_s"]
        if load <= P.max_foreign or now() >= deadline or attempt == P.retries:
            r["noisy"] = load > P.max_foreign
            return r
        log(f"  {key or 'baseline'}: other processes used {load:.2f} CPUs during the fit ({r['fit_s']:.1f} s); once more")
    raise AssertionError("unreachable")


def run(P) -> dict:
    torch.set_num_threads(P.threads)
    shape = shape_for(P.size_gb, P.d)
    probe = LM(P.d, *shape)
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    scratch = os.path.abspath(P.out)
    res = {"date": P.date, "machine": C.machine_description(), "fs": C.fs_type(os.path.dirname(scratch)),
           "torch": torch.__version__, "lightning": pl.__version__, "python": platform.python_version(),
           "threads": torch.get_num_threads(), "args": vars(P),
           "state": {"params": n_params, "bytes": n_params * 12, "blocks": shape[0], "vocab": shape[1], "d": P.d},
           "reps": []}
    log(f"model: {shape[0]} blocks d={P.d} vocab={shape[1]}: {n_params / 1e6:.1f} M params, "
        f"{n_params * 12 / GB:.3f} GB with AdamW state; {P.steps} steps, a save every {P.every}")
    t_start = now()
    log("warm-up fit (untimed) ...")
    fit_once("ours", argparse.Namespace(**{**vars(P), "steps": P.every + 1}), shape, scratch)
    order = list(CONFIGS)
    deadline = t_start + P.budget_s
    for rep in range(P.reps):
        keys = order[rep % len(order):] + order[:rep % len(order)]  # rotate the order between repetitions
        runs = {"baselines": []}
        runs["baselines"].append(quiet_fit(None, P, shape, scratch, deadline))
        for key in keys:
            runs[key] = quiet_fit(key, P, shape, scratch, deadline)
            runs["baselines"].append(quiet_fit(None, P, shape, scratch, deadline))
            runs[key]["neighbours"] = [runs["baselines"][-2]["fit_s"], runs["baselines"][-1]["fit_s"]]
            log(f"rep {rep} {key:6s} fit {runs[key]['fit_s']:6.2f}s  baselines {runs[key]['neighbours'][0]:.2f}/"
                f"{runs[key]['neighbours'][1]:.2f}s  saves {runs[key]['saves']}")
        res["reps"].append(runs)
    res["total_wall_s"] = now() - t_start
    finalize(res)
    return res


def finalize(res: dict) -> None:
    summary = {}
    for key in CONFIGS:
        overheads, calls, teardown, fits = [], [], [], []
        for runs in res["reps"]:
            r = runs[key]
            r["overhead_per_save_s"] = (r["fit_s"] - sum(r["neighbours"]) / 2) / r["saves"]
            overheads.append(r["overhead_per_save_s"])
            calls.extend(r["save_checkpoint_s"])
            teardown.extend(r["teardown_s"])
            fits.append(r["fit_s"])
        summary[key] = {"overhead_per_save_s": C.median(overheads), "overheads": overheads, "fit_s": C.median(fits),
                        "fit_min_s": min(fits), "save_call_s": C.median(calls), "teardown_s": C.median(teardown),
                        "saves": res["reps"][0][key]["saves"]}
    fits = [r for runs in res["reps"] for k, v in runs.items() for r in (v if k == "baselines" else [v])]
    res["foreign_cpu_load"] = sum(r["foreign_cpu_s"] for r in fits) / sum(r["fit_s"] for r in fits)
    res["noisy_fits"] = sum(1 for r in fits if r.get("noisy"))
    res["retried_fits"] = sum(r.get("attempts", 1) - 1 for r in fits)
    base = [b["fit_s"] for runs in res["reps"] for b in runs["baselines"]]
    pairs = [abs(a - b) for runs in res["reps"] for a, b in zip([x["fit_s"] for x in runs["baselines"]][:-1],
                                                                 [x["fit_s"] for x in runs["baselines"]][1:])]
    res["baseline"] = {"fit_s": C.median(base), "min": min(base), "max": max(base), "neighbour_diff_median_s": C.median(pairs)}
    for c in summary.values():  # noise only adds time: the fastest fits are the least disturbed ones
        c["overhead_min_based_s"] = (c["fit_min_s"] - res["baseline"]["min"]) / c["saves"]
    for est in ("overhead_per_save_s", "overhead_min_based_s"):
        ours = summary["ours"][est]
        for ref in ("torch", "async"):
            other = summary[ref][est]
            res.setdefault("ratios", {})[f"{est}: ours/{ref}"] = ours / other if other > 0 else None
    res["summary"] = summary


def f3(x) -> str:
    return "" if x is None else f"{x:.3f}"


def markdown(res: dict) -> str:
    st, s, b = res["state"], res["summary"], res["baseline"]
    m = res["machine"]
    saves = s["ours"]["saves"]
    L = [f"### Lightning benchmark ({res['date']})", "",
         f"Machine: {m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('mem_total_gib')} GiB RAM, {res['fs']}, "
         f"torch {res['torch']}, lightning {res['lightning']}, {res['threads']} intra-op threads, CPU only.", "",
         f"Model: bench_core's TinyLM, {st['blocks']} blocks d={st['d']}, vocab {st['vocab']}: {st['params'] / 1e6:.1f} M params, "
         f"fp32 + AdamW state = **{st['bytes'] / GB:.3f} GB**. Trainer.fit of {res['args']['steps']} steps "
         f"(batch {res['args']['batch']}x{res['args']['seq']}), ModelCheckpoint(every_n_train_steps={res['args']['every']}) "
         f"with save_top_k=1: {saves} saves per fit, each removing the previous checkpoint.", "",
         f"Order per repetition: B c1 B c2 B c3 B ({len(res['reps'])} repetitions, the configs' order rotated). "
         f"**Loop overhead / save** = (fit time - mean of the two neighbouring baseline fits) / saves, median over the "
         f"repetitions. Baseline fit (no checkpointing): median {b['fit_s']:.2f} s, {b['min']:.2f}..{b['max']:.2f} s; the "
         f"median difference of neighbouring baselines is {b['neighbour_diff_median_s']:.2f} s, i.e. a noise of about "
         f"±{b['neighbour_diff_median_s'] / saves:.3f} s per save. The machine is shared: each fit waits for other processes "
         f"to leave the CPUs and runs again (at most {res['args']['retries']} times) when they took more than "
         f"{res['args']['max_foreign']} CPUs during it; {res['retried_fits']} fits were run again, {res['noisy_fits']} kept "
         f"though busy; other processes used {res['foreign_cpu_load']:.2f} CPUs on average during the kept fits.", "",
         "The column 'from the fastest fits' is (fastest fit of the config - fastest baseline fit) / saves: other "
         "processes only add time, so it is the less disturbed estimate on a busy machine.", "",
         "| config | loop overhead / save (median) | per repetition | from the fastest fits | fit time (median) | "
         "save_checkpoint call (median) | teardown (median) |",
         "|---|---:|---|---:|---:|---:|---:|",
         f"| baseline (enable_checkpointing=False) | | | | {b['fit_s']:.2f} (fastest {b['min']:.2f}) | | |"]
    for key, name in CONFIGS.items():
        c = s[key]
        L.append(f"| {name} | **{f3(c['overhead_per_save_s'])}** | {', '.join(f3(x) for x in c['overheads'])} | "
                 f"{f3(c['overhead_min_based_s'])} | {c['fit_s']:.2f} (fastest {c['fit_min_s']:.2f}) | {f3(c['save_call_s'])} | "
                 f"{f3(c['teardown_s'])} |")
    L.append("")
    for est, label in (("overhead_per_save_s", "median of neighbour differences"), ("overhead_min_based_s", "from the fastest fits")):
        bits = []
        for ref, name in (("torch", "TorchCheckpointIO"), ("async", "AsyncCheckpointIO")):
            r = res["ratios"][f"{est}: ours/{ref}"]
            bits.append(f"ours / {name} **{r:.2f}**" if r is not None else f"ours / {name} undefined ({name}'s overhead <= 0: noise)")
        L.append(f"- loop overhead per save, {label}: " + "; ".join(bits))
    L.append("")
    L.append("save_checkpoint call: time inside the IO's save_checkpoint (Lightning's dump of the checkpoint dict comes "
             "before it); teardown: the IO's teardown at the end of fit (ours and Async wait there for the last save).")
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=0.2, help="model + AdamW state, GB")
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=28, help="training steps per fit (not a multiple of --every)")
    p.add_argument("--every", type=int, default=5, help="save every k steps")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: robust on a shared machine, see the docstring)")
    p.add_argument("--wait-quiet", type=float, default=20.0, help="before each fit, wait up to this many seconds "
                   "for other processes to leave the CPUs (0: do not wait)")
    p.add_argument("--max-foreign", type=float, default=0.25, help="CPUs other processes may use during a fit before it is run again")
    p.add_argument("--retries", type=int, default=2, help="fits run again at most this many times when the machine was busy")
    p.add_argument("--budget-s", type=float, default=420.0, help="after this many seconds, no more waiting or retries")
    p.add_argument("--out", default=os.path.join(HERE, "out", "lightning-run"), help="scratch dir (deleted after each fit)")
    p.add_argument("--json", default=os.path.join(HERE, "out", "lightning.json"))
    p.add_argument("--md", default=os.path.join(HERE, "out", "lightning.md"))
    p.add_argument("--quick", action="store_true", help="smoke test: 0.05 GB, 12 steps, 1 repetition")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    P = p.parse_args(argv)
    if P.quick:
        P.size_gb, P.steps, P.every, P.reps = 0.05, 12, 5, 1
    res = run(P)
    C.write_results(res, markdown(res), P.json, P.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LightningCheckpointIO with a real lightning.pytorch.Trainer on the CPU (checkpointing/integrations/lightning.py).

A tiny LightningModule (Linear + BatchNorm + Linear, AdamW, StepLR) trains on 32 fixed samples in
batches of 8 (4 steps per epoch, no shuffling), so every run is deterministic and a resumed run can
be compared bit for bit with an uninterrupted one. The ModelCheckpoint callbacks are Lightning's own.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import checkpointing  # noqa: E402
from checkpointing import CheckpointConfigError, CheckpointError, CheckpointManager, CheckpointNotFoundError, StateError  # noqa: E402
from checkpointing.format import naming  # noqa: E402
from checkpointing.integrations import _lightning_pointer as ptr  # noqa: E402
from checkpointing.integrations.lightning import LightningCheckpointIO  # noqa: E402
from checkpointing.storage import LocalStorage, RetryPolicy  # noqa: E402
from faults import Fault, HeldUploads, inject, waiting_for_upload  # noqa: E402
from s3_server import s3_bucket, s3_endpoint  # noqa: E402,F401 - fixtures
from test_yielding import _until  # noqa: E402

STEPS_PER_EPOCH = 4
EPOCHS = 4


@pytest.fixture(autouse=True)
def _quiet():
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class TinyModule(pl.LightningModule):
    def __init__(self, args: Any = None, lr: float = 0.01, scores: list[float] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.captured: list[dict] = []  # what each save_checkpoint received, in order
        self.steps_run = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.hparams.scores is not None:
            self.log("score", float(self.hparams.scores[self.current_epoch]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}

    def on_save_checkpoint(self, checkpoint: dict) -> None:  # the last hook before the CheckpointIO gets it
        self.captured.append(copy.deepcopy(checkpoint))


class PointersAreCommitted(Callback):
    """At every batch end (saves in flight): each pointer file in `folder` names a committed step."""

    def __init__(self, folder: Path, store: Path) -> None:
        self.folder, self.store, self.checked = folder, store, 0

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        for path, pointer in ptr.scan(str(self.folder)):
            assert (self.store / naming.commit_name(pointer.step)).exists(), f"{path} names step {pointer.step}, not committed"
            self.checked += 1


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def _fit(root: Path, *, max_epochs: int, ckpt_path: str | None = None, callbacks: list | None = None,
         module: TinyModule | None = None, io: LightningCheckpointIO | None = None) -> tuple[TinyModule, Any, LightningCheckpointIO]:
    pl.seed_everything(0, verbose=False)
    module = module or TinyModule(args=argparse.Namespace(width=16, kernel=(3, 3), name="tiny", path=Path("/data/x")))
    io = io or LightningCheckpointIO(root / "store")
    if callbacks is None:
        callbacks = [ModelCheckpoint(dirpath=root / "ckpts", save_last=True)]
    callbacks = [*callbacks, PointersAreCommitted(root / "ckpts", root / "store")]
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[io], callbacks=callbacks)
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return module, trainer, io


def _other_module() -> TinyModule:
    """A module to resume into, with other initial weights than the runs' (seed 0): only a restore makes it theirs."""
    torch.manual_seed(1)
    return TinyModule()


def _final_state(module: TinyModule, trainer: Any) -> dict:
    return {"model": {k: v.clone() for k, v in module.state_dict().items()},
            "optim": copy.deepcopy(trainer.optimizers[0].state_dict())}


def _steps(store: Path) -> list[int]:
    with CheckpointManager(store, read_only=True) as mgr:
        return mgr.steps()


def _pointers(folder: Path) -> dict[str, int]:
    return {os.path.basename(p): pointer.step for p, pointer in ptr.scan(str(folder))}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal values of the same kinds: tuples stay tuples, int keys stay ints, tensors keep dtype and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(kb for kb in b if kb == k)), f"{where}/{k}: key type"
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, argparse.Namespace):
        assert isinstance(b, argparse.Namespace), where
        assert_same(vars(a), vars(b), where)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """EPOCHS epochs without interruption: the final weights and optimizer state."""
    module, trainer, _ = _fit(tmp_path_factory.mktemp("reference"), max_epochs=EPOCHS)
    return _final_state(module, trainer)


def test_resume_from_last_is_bit_exact_and_every_path_loads_what_lightning_gave(tmp_path, reference):
    module, _, io = _fit(tmp_path, max_epochs=1)
    # teardown waited: the step is committed and its pointers written once fit() returns; the manager is closed
    assert io.manager is None
    assert _steps(tmp_path / "store") == [4]
    assert _pointers(tmp_path / "ckpts") == {"epoch=0-step=4.ckpt": 4, "last.ckpt": 4}
    # epoch=0-step=4.ckpt is the step's save; last.ckpt an alias of it, with the entries Lightning changed in between
    top, last = module.captured
    assert top["callbacks"] != last["callbacks"]  # last_model_path is set just before last.ckpt is saved
    assert_same(io.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=4.ckpt"), top)
    assert_same(io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt"), last)
    assert isinstance(last["optimizer_states"][0]["param_groups"][0]["betas"], tuple)

    resumed, trainer, _ = _fit(tmp_path, max_epochs=EPOCHS, ckpt_path="last", module=_other_module())
    assert resumed.steps_run == (EPOCHS - 1) * STEPS_PER_EPOCH
    assert_same(_final_state(resumed, trainer), reference)
    assert _steps(tmp_path / "store") == [16]  # save_top_k=1: step 4 went with its last pointer
    assert _pointers(tmp_path / "ckpts") == {"epoch=3-step=16.ckpt": 16, "last.ckpt": 16}
    assert_same(checkpointing.load(tmp_path / "store")["state_dict"], reference["model"])


def test_a_full_save_after_a_weights_only_one_at_the_same_step_resumes_bit_exact(tmp_path, reference):
    """Two ModelCheckpoints save at step 4: weights only (at the batch end) first, then in full (at the epoch end)."""
    weights = ModelCheckpoint(dirpath=tmp_path / "weights", save_weights_only=True, every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1)
    full = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    module, _, io = _fit(tmp_path, max_epochs=1, callbacks=[weights, full])
    assert _steps(tmp_path / "store") == [4]  # saved again with the optimizer state, not a second step
    slim, top, last = module.captured
    assert "optimizer_states" not in slim and "optimizer_states" in last
    assert_same(io.load_checkpoint(tmp_path / "weights" / "epoch=0-step=4.ckpt"), slim)  # its own entries, no more
    assert_same(io.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=4.ckpt"), top)
    assert_same(io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt"), last)

    resumed, trainer, _ = _fit(tmp_path, max_epochs=EPOCHS, ckpt_path="last", module=_other_module())
    assert_same(_final_state(resumed, trainer), reference)


def test_saves_at_one_step_with_other_values_each_load_what_they_were_given(tmp_path):
    """Called as Lightning calls it, all at global step 1: weights only, then in full (the step is saved again with
    the optimizer state), a fresh copy of the same weights (an alias), weights changed in place, a callback entry
    over 1 MiB that differs, and the plugin reused for a new run: one step holds them all, each path loads its own."""
    io = LightningCheckpointIO(tmp_path / "store")
    ckpts = tmp_path / "ckpts"
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    given: dict[str, dict] = {}

    def save(name: str, checkpoint: dict) -> None:
        given[name] = copy.deepcopy(checkpoint)
        io.save_checkpoint(checkpoint, ckpts / name)

    def full(**extra: Any) -> dict:
        return {"global_step": 1, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], **extra}

    save("slim.ckpt", {"global_step": 1, "state_dict": model.state_dict(), "epoch": 0})
    save("full.ckpt", full(epoch=1))  # the step lacked the optimizer state: saved again with it
    save("copy.ckpt", {"global_step": 1, "state_dict": {k: v.clone() for k, v in model.state_dict().items()}})  # an alias
    io.manager.wait()
    with torch.no_grad():
        model.weight.add_(1.0)  # changed without an optimizer step (an edit after fit, an averaged model)
    save("changed.ckpt", full(callbacks={"ema": torch.arange(1 << 19), "best": "b"}))
    save("changed-again.ckpt", full(callbacks={"ema": torch.arange(1 << 19), "best": "c"}))  # only a small value differs
    io.teardown()
    other = torch.nn.Linear(4, 2)  # the plugin reused for a new run that reaches the same global step
    save("new.ckpt", {"global_step": 1, "state_dict": other.state_dict()})
    io.teardown()
    assert _steps(tmp_path / "store") == [1]
    assert sorted(_pointers(ckpts)) == sorted(given)
    fresh = LightningCheckpointIO(tmp_path / "store")
    for name, checkpoint in given.items():
        assert_same(fresh.load_checkpoint(ckpts / name), checkpoint, name)


def test_a_failed_upload_is_logged_and_the_saves_go_on(tmp_path, s3_bucket, caplog):
    """An object store that fails (an outage) does not stop training: each step commits locally and gets its pointer."""
    url, options = s3_bucket
    io = LightningCheckpointIO(tmp_path / "store", remote=url, storage_options=options)
    weights = {"w": torch.zeros(4)}
    io.save_checkpoint({"global_step": 1, "state_dict": weights}, tmp_path / "ckpts" / "s1.ckpt")
    io.manager.wait()
    io.manager.remote_storage.retry = RetryPolicy(attempts=2, base_s=0.001, cap_s=0.002)
    inject(io.manager.remote_storage, Fault("*", "denied", times=-1))
    with caplog.at_level(logging.ERROR, logger="checkpointing"):
        for step in range(2, 6):
            weights["w"] += 1
            io.save_checkpoint({"global_step": step, "state_dict": weights}, tmp_path / "ckpts" / f"s{step}.ckpt")
            io._steps[step].settled.wait(60)  # its upload failed before the next save
        io.teardown()
    assert "upload" in caplog.text
    assert _pointers(tmp_path / "ckpts") == {f"s{s}.ckpt": s for s in range(1, 6)}
    assert torch.equal(io.load_checkpoint(tmp_path / "ckpts" / "s5.ckpt")["state_dict"]["w"], torch.full((4,), 4.0))


def test_an_outage_while_released_steps_are_deleted_does_not_stop_training(tmp_path, s3_bucket, caplog):
    """save_top_k=1 in an outage: deleting a released step needs the remote tier's listing, which fails. The step stays
    (listed as released, logged) and training goes on; teardown does not raise; the next run deletes it once the tier
    answers."""
    url, options = s3_bucket
    ckpts = tmp_path / "ckpts"
    io = LightningCheckpointIO(tmp_path / "store", remote=url, storage_options=options)
    weights = {"w": torch.zeros(4)}
    io.save_checkpoint({"global_step": 1, "state_dict": weights}, ckpts / "s1.ckpt")
    io.manager.wait()
    io.manager.remote_storage.retry = RetryPolicy(attempts=2, base_s=0.001, cap_s=0.002)
    proxy = inject(io.manager.remote_storage, Fault("*", "denied", times=-1))
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        for step in range(2, 6):  # as ModelCheckpoint(save_top_k=1): save the new file, remove the old one
            weights["w"] += 1
            io.save_checkpoint({"global_step": step, "state_dict": weights}, ckpts / f"s{step}.ckpt")
            io._steps[step].settled.wait(60)
            io.remove_checkpoint(ckpts / f"s{step - 1}.ckpt")
        io.teardown()
    assert "stays for now" in caplog.text
    assert _pointers(ckpts) == {"s5.ckpt": 5}
    proxy.faults.clear()
    with CheckpointManager(tmp_path / "store", read_only=True) as ro:
        kept = ro.steps()
    assert 5 in kept and len(kept) > 1  # the released steps are still there
    again = LightningCheckpointIO(tmp_path / "store", remote=url, storage_options=options)
    assert torch.equal(again.load_checkpoint(ckpts / "s5.ckpt")["state_dict"]["w"], torch.full((4,), 4.0))
    again.save_checkpoint({"global_step": 6, "state_dict": weights}, ckpts / "s6.ckpt")  # the next run: they go now
    again.teardown()
    with CheckpointManager(tmp_path / "store", read_only=True) as ro:
        assert 5 in ro.steps() and not set(kept) - {5} & set(ro.steps())


def test_a_save_as_a_scripts_last_line_writes_its_pointers(tmp_path):
    script = (f"import torch\nfrom checkpointing.integrations.lightning import LightningCheckpointIO\n"
              f"io = LightningCheckpointIO({str(tmp_path / 'store')!r})\nw = {{'w': torch.randn(1 << 20)}}\n"
              f"io.save_checkpoint({{'global_step': 4, 'state_dict': w}}, {str(tmp_path / 'slim.ckpt')!r})\n"
              f"io.save_checkpoint({{'global_step': 4, 'state_dict': w, 'optimizer_states': [{{'m': torch.ones(1 << 20)}}]}}, "
              f"{str(tmp_path / 'final.ckpt')!r})\ntorch.save(w, {str(tmp_path / 'w.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=240)
    io = LightningCheckpointIO(tmp_path / "store")
    w = torch.load(tmp_path / "w.pt")["w"]
    assert torch.equal(io.load_checkpoint(tmp_path / "slim.ckpt")["state_dict"]["w"], w)
    final = io.load_checkpoint(tmp_path / "final.ckpt")
    assert torch.equal(final["state_dict"]["w"], w) and torch.equal(final["optimizer_states"][0]["m"], torch.ones(1 << 20))


def test_weights_written_through_data_right_after_a_save_are_not_what_it_holds(tmp_path):
    """As WeightAveraging does at the end of fit (param.data.copy_, which no version counter sees): the
    plugin's snapshot is eager, so the save holds the weights Lightning gave."""
    io = LightningCheckpointIO(tmp_path / "store")
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):  # the plugin opens its manager after an optimizer step, as in fit, which then sees the next
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
    given = {k: v.clone() for k, v in model.state_dict().items()}
    io.save_checkpoint({"global_step": 1, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]},
                       tmp_path / "a.ckpt")
    for p in reversed(list(model.parameters())):
        p.data.zero_()
    io.teardown()
    assert_same(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"], given)


def test_an_earlier_pointer_loads_while_its_step_is_saved_again_and_a_fresh_plugin_removes_steps(tmp_path):
    io = LightningCheckpointIO(tmp_path / "store")
    w = torch.zeros(1 << 19)
    io.save_checkpoint({"global_step": 5, "state_dict": {"w": w}}, tmp_path / "a.ckpt")
    io.manager.wait()
    w += 1  # in place, without an optimizer step: the step is saved again holding both
    io.save_checkpoint({"global_step": 5, "state_dict": {"w": w}}, tmp_path / "b.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], torch.zeros(1 << 19))
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["w"], torch.ones(1 << 19))
    io.teardown()
    cleanup = LightningCheckpointIO(tmp_path / "store")  # a script that only removes
    cleanup.remove_checkpoint(tmp_path / "a.ckpt")
    cleanup.remove_checkpoint(tmp_path / "b.ckpt")
    cleanup.teardown()
    assert _steps(tmp_path / "store") == []


def test_a_pointer_without_keys_reads_as_one_naming_the_whole_step(tmp_path):
    io = LightningCheckpointIO(tmp_path / "store")
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(3)}, "epoch": 0}, tmp_path / "a.ckpt")
    io.teardown()
    body = json.loads((tmp_path / "a.ckpt").read_text())
    del body["keys"]  # as a pointer written before pointers had keys
    (tmp_path / "a.ckpt").write_text(json.dumps(body))
    assert list(io.load_checkpoint(tmp_path / "a.ckpt")) == ["global_step", "state_dict", "epoch"]


def test_save_top_k_by_a_monitored_metric_keeps_exactly_those_steps(tmp_path):
    scores = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0]  # the best two: epochs 3 and 4 (steps 16 and 20)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="score", mode="min", save_top_k=2, filename="{epoch}")
    _, _, io = _fit(tmp_path, max_epochs=len(scores), callbacks=[best], module=TinyModule(scores=scores))
    assert _steps(tmp_path / "store") == [16, 20]
    assert _pointers(tmp_path / "ckpts") == {"epoch=3.ckpt": 16, "epoch=4.ckpt": 20}
    assert io.load_checkpoint(best.best_model_path)["global_step"] == 16
    on_meta = io.load_checkpoint(best.best_model_path, map_location="meta")
    assert {t.device.type for t in on_meta["state_dict"].values()} == {"meta"}
    with pytest.raises(CheckpointNotFoundError):
        checkpointing.load(tmp_path / "store", step=12)


def test_every_n_train_steps_with_save_last(tmp_path):
    every = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1, save_last=True)
    _fit(tmp_path, max_epochs=3, callbacks=[every])  # 12 steps: saves at 3, 6, 9, 12 (+ last.ckpt each time)
    assert _steps(tmp_path / "store") == [3, 6, 9, 12]
    assert _pointers(tmp_path / "ckpts") == {"epoch=0-step=3.ckpt": 3, "epoch=1-step=6.ckpt": 6, "epoch=2-step=9.ckpt": 9,
                                             "epoch=2-step=12.ckpt": 12, "last.ckpt": 12}


def test_resume_from_an_explicit_older_checkpoint_replaces_the_newer_steps(tmp_path, reference):
    every_epoch = [ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, save_last=True)]
    _fit(tmp_path, max_epochs=EPOCHS, callbacks=every_epoch)
    assert _steps(tmp_path / "store") == [4, 8, 12, 16]
    old_last = ptr.read_pointer(str(tmp_path / "ckpts" / "last.ckpt"))

    every_epoch = [ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, save_last=True)]
    resumed, trainer, io = _fit(tmp_path, max_epochs=EPOCHS, ckpt_path=str(tmp_path / "ckpts" / "epoch=1-step=8.ckpt"),
                                callbacks=every_epoch, module=_other_module())
    assert resumed.steps_run == (EPOCHS - 2) * STEPS_PER_EPOCH
    assert_same(_final_state(resumed, trainer), reference)
    assert _steps(tmp_path / "store") == [4, 8, 12, 16]  # 12 and 16 saved again by the resumed run
    pointers = _pointers(tmp_path / "ckpts")
    assert pointers["last.ckpt"] == 16 and ptr.read_pointer(str(tmp_path / "ckpts" / "last.ckpt")).save_id != old_last.save_id
    for name, step in pointers.items():  # every pointer left names the step as it is now
        assert io.load_checkpoint(tmp_path / "ckpts" / name)["global_step"] == step
    assert sorted(pointers.values()) == [4, 8, 12, 16, 16]


def test_a_resumed_run_keeps_the_step_a_folder_it_has_not_touched_names(tmp_path):
    """Two ModelCheckpoints; the resumed run never writes into best/ (epoch 0 stays the best), so only the
    record of the folders earlier runs wrote pointers in keeps best/'s step when the other one moves on."""
    def callbacks() -> list:
        return [ModelCheckpoint(dirpath=tmp_path / "best", monitor="score", mode="min", save_top_k=1),
                ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, save_top_k=1)]

    scores = [0.0, 1.0, 2.0]
    _fit(tmp_path, max_epochs=1, callbacks=callbacks(), module=TinyModule(scores=scores))
    _, trainer, io = _fit(tmp_path, max_epochs=3, ckpt_path="last", callbacks=callbacks(), module=TinyModule(scores=scores))
    best = trainer.checkpoint_callbacks[0].best_model_path
    assert os.path.basename(best) == "epoch=0-step=4.ckpt" and _pointers(tmp_path / "best") == {"epoch=0-step=4.ckpt": 4}
    assert _steps(tmp_path / "store") == [4, 12]
    assert io.load_checkpoint(best)["global_step"] == 4


def test_a_class_as_a_hyper_parameter_is_refused_naming_the_key(tmp_path):
    with pytest.raises(StateError, match=r"hyper_parameters/args'\] is the class torch.nn.modules.activation.GELU, not a value"):
        _fit(tmp_path, max_epochs=1, module=TinyModule(args=torch.nn.GELU))


def test_aliases_and_removal_through_the_io_calls(tmp_path):
    """What ModelCheckpoint does, called directly: two paths for one step, then removals (deleted at teardown)."""
    io = LightningCheckpointIO(tmp_path / "store")
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    io.save_checkpoint({"global_step": 5, "state_dict": weights, "epoch": 0}, tmp_path / "ckpts" / "a.ckpt")
    io.save_checkpoint({"global_step": 5, "state_dict": weights, "epoch": 1}, tmp_path / "ckpts" / "b.ckpt")  # an alias
    io.save_checkpoint({"global_step": 7, "state_dict": weights, "epoch": 2}, tmp_path / "ckpts" / "c.ckpt")
    io.remove_checkpoint(tmp_path / "ckpts" / "a.ckpt")  # b still names step 5
    io.teardown()
    assert _steps(tmp_path / "store") == [5, 7] and _pointers(tmp_path / "ckpts") == {"b.ckpt": 5, "c.ckpt": 7}
    assert io.load_checkpoint(tmp_path / "ckpts" / "b.ckpt")["epoch"] == 1  # the alias's own entries
    io.save_checkpoint({"global_step": 9, "state_dict": weights, "epoch": 3}, tmp_path / "ckpts" / "c.ckpt")  # c moves on
    io.remove_checkpoint(tmp_path / "ckpts" / "b.ckpt")
    io.teardown()
    assert _steps(tmp_path / "store") == [9] and _pointers(tmp_path / "ckpts") == {"c.ckpt": 9}
    assert_same(checkpointing.load(tmp_path / "store", 9, exclude="_lightning_checkpoint_io")["state_dict"], weights)


_RELEASE_THEN_DIE = r"""
import sys, time, torch
from checkpointing.integrations.lightning import LightningCheckpointIO
store, ckpts, remote = sys.argv[1:4]
io = LightningCheckpointIO(store, remote=remote, upload_bytes_per_s=200e3)
io.save_checkpoint({"global_step": 5, "state_dict": {"w": torch.zeros(8)}}, ckpts + "/a.ckpt")
io.manager.wait()
while not io._steps[5].settled.is_set():
    time.sleep(0.01)  # its pointer is written
big = {"w": torch.randn(1 << 19, generator=torch.Generator().manual_seed(1))}  # 2 MB: ~10 s of upload at 200 kB/s
io.save_checkpoint({"global_step": 7, "state_dict": big}, ckpts + "/b.ckpt")
io.remove_checkpoint(ckpts + "/a.ckpt")  # save_top_k moves on while step 7 is in flight: a.ckpt goes at 7's commit
print("removed", flush=True)
sys.stdin.readline()
io._steps[7].settled.wait()  # 7's pointer is written, then a.ckpt removed and step 5 released
print("released", flush=True)
time.sleep(120)
"""


def test_a_removal_while_a_save_is_in_flight_waits_for_its_commit_and_a_released_step_goes_after_a_crash(tmp_path):
    store, ckpts, remote = tmp_path / "store", tmp_path / "ckpts", (tmp_path / "remote").as_uri()
    child = subprocess.Popen([sys.executable, "-c", _RELEASE_THEN_DIE, str(store), str(ckpts), remote], stdout=subprocess.PIPE,
                             stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    try:
        assert child.stdout.readline().strip() == "removed"
        # step 7 in flight (its upload): the old pointer is still in place, nothing is released
        assert _pointers(ckpts) == {"a.ckpt": 5} and not (store / ptr.RELEASED_NAME).exists()
        child.stdin.write("go on\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
    finally:
        child.kill()  # SIGKILL: no teardown
        child.wait()
    assert 5 in _steps(store) and _pointers(ckpts) == {"b.ckpt": 7}  # no pointer names 5; only the record does
    assert ptr.read_released(LocalStorage(store, direct=False, create=False)) == {5}
    io = LightningCheckpointIO(store, remote=remote)  # the next run
    io.save_checkpoint({"global_step": 9, "state_dict": {"w": torch.ones(8)}}, ckpts / "c.ckpt")
    io.teardown()
    assert 5 not in _steps(store) and 9 in _steps(store) and _pointers(ckpts) == {"b.ckpt": 7, "c.ckpt": 9}
    assert not (store / ptr.RELEASED_NAME).exists()


_MOVE_THEN_DIE = r"""
import sys, time, torch
from checkpointing.integrations.lightning import LightningCheckpointIO
store, ckpts = sys.argv[1:3]
io = LightningCheckpointIO(store)
for step in (5, 7):  # save_last: last.ckpt moves from step 5 to step 7 in 7's done callback
    io.save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((8,), float(step))}}, ckpts + "/last.ckpt")
    io.manager.wait()
    while not io._steps[step].settled.is_set():
        time.sleep(0.01)
print("moved", flush=True)
time.sleep(120)
"""


def test_a_step_a_pointer_moved_off_is_deleted_by_the_next_run_after_a_crash(tmp_path):
    store, ckpts = tmp_path / "store", tmp_path / "ckpts"
    child = subprocess.Popen([sys.executable, "-c", _MOVE_THEN_DIE, str(store), str(ckpts)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    try:
        assert child.stdout.readline().strip() == "moved"
    finally:
        child.kill()  # SIGKILL after the pointer moved, before any later call could delete step 5
        child.wait()
    assert _steps(store) == [5, 7] and _pointers(ckpts) == {"last.ckpt": 7}
    assert ptr.read_released(LocalStorage(store, direct=False, create=False)) == {5}
    io = LightningCheckpointIO(store)  # the next run
    io.save_checkpoint({"global_step": 9, "state_dict": {"w": torch.ones(8)}}, ckpts / "last.ckpt")
    io.teardown()
    assert _steps(store) == [9] and _pointers(ckpts) == {"last.ckpt": 9}


_DDP_FIT = r"""
import sys, torch, torch.nn as nn
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from checkpointing.integrations.lightning import LightningCheckpointIO

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    root, steps, resume, strategy = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume", sys.argv[4]
    torch.manual_seed(0)
    model = M()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[LightningCheckpointIO(root + "/store")],
                         callbacks=[ModelCheckpoint(dirpath=root + "/ckpts", every_n_train_steps=2, save_last=True)])
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4), ckpt_path="last" if resume else None)
    print("global_step", trainer.global_step, flush=True)
    if trainer.global_rank == 0:  # the weights this process holds now (spawn/fork: handed back by the workers) are the last save's
        saved = LightningCheckpointIO(root + "/store").load_checkpoint(root + "/ckpts/last.ckpt")["state_dict"]
        print("weights match", all(torch.equal(v, saved[k]) for k, v in model.state_dict().items()), flush=True)
"""


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_ddp_saves_from_rank_zero_without_a_process_group_of_the_users_own(tmp_path, strategy):
    """Lightning's own launchers: the plugin makes rank 0's group itself; ddp_spawn pickles the plugin into its workers and
    hands the trained weights back to the main process through it (a file that is no step of ours)."""
    script = tmp_path / "fit.py"
    script.write_text(_DDP_FIT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "MASTER_ADDR": "127.0.0.1"}
    for steps, how in ((4, "fresh"), (6, "resume")):
        r = subprocess.run([sys.executable, str(script), str(tmp_path), str(steps), how, strategy], env=env, capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
        ran = f"global_step {steps}" in r.stdout or strategy == "ddp_spawn"  # spawn: the main process's trainer keeps 0
        assert r.returncode == 0 and ran and "weights match True" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
        assert _pointers(tmp_path / "ckpts")["last.ckpt"] == steps and steps in _steps(tmp_path / "store")


def test_the_plugin_travels_to_spawned_workers_as_its_configuration_and_hands_weights_back(tmp_path):
    import pickle

    io = LightningCheckpointIO(tmp_path / "store", keep_local=3)
    copy = pickle.loads(pickle.dumps(io))
    assert copy.directory == io.directory and copy._options == io._options and copy._options["keep_local"] == 3 and copy.manager is None
    weights = {"net.weight": torch.randn(2, 3), "net.bias": torch.zeros(2)}  # a bare state_dict: no global_step
    copy.save_checkpoint(weights, tmp_path / "tmp" / ".temp.ckpt")
    loaded = io.load_checkpoint(tmp_path / "tmp" / ".temp.ckpt")
    assert sorted(loaded) == sorted(weights) and all(torch.equal(loaded[k], v) for k, v in weights.items())
    assert copy.manager is None and not (tmp_path / "store").exists()  # no step, no manager
    io.remove_checkpoint(tmp_path / "tmp" / ".temp.ckpt")
    assert not (tmp_path / "tmp" / ".temp.ckpt").exists()
    torch.save({"state_dict": weights}, tmp_path / "plain.ckpt")  # a torch.save file of someone else's is still refused
    torch.save({"hyper_parameters": argparse.Namespace(lr=0.1)}, tmp_path / "objects.ckpt")  # one weights_only cannot read
    for other in ("plain.ckpt", "objects.ckpt"):
        with pytest.raises(CheckpointError, match="not a LightningCheckpointIO pointer file"):
            io.load_checkpoint(tmp_path / other)
    io.save_checkpoint({"global_step": 1, "state_dict": weights}, tmp_path / "ckpts" / "last.ckpt")
    with pytest.raises(CheckpointConfigError, match="cannot be sent to another process"):
        pickle.dumps(io)
    io.teardown()


def test_a_copied_run_loads_from_its_own_store(tmp_path):
    import shutil

    io = LightningCheckpointIO(tmp_path / "run" / "store")
    io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.arange(4.0)}}, tmp_path / "run" / "ckpts" / "last.ckpt")
    io.teardown()
    shutil.copytree(tmp_path / "run", tmp_path / "copy")  # the pointer still names the original store
    with CheckpointManager(tmp_path / "run" / "store") as original:
        original.delete(4, allow_latest=True)  # the original moves on: its step 4 is gone
    copy = LightningCheckpointIO(tmp_path / "copy" / "store")
    loaded = copy.load_checkpoint(tmp_path / "copy" / "ckpts" / "last.ckpt")  # the copy's own step 4, same save
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))
    copy.teardown()


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


class OpaqueCodec:
    name = "test.Opaque"
    types = (Opaque,)

    def encode(self, obj: Opaque) -> Any:
        return {"value": obj.value}

    def decode(self, data: Any) -> Opaque:
        return Opaque(data["value"])


def test_a_hyper_parameter_the_json_tree_cannot_hold(tmp_path):
    with pytest.raises(StateError, match=r"hyper_parameters/args.*codecs=\[codec\]"):
        _fit(tmp_path / "a", max_epochs=1, module=TinyModule(args=Opaque(3)))
    with pytest.raises(StateError, match=r"argparse.Namespace at 'hyper_parameters/args'"):
        _fit(tmp_path / "b", max_epochs=1, module=TinyModule(args=argparse.Namespace(fn=Opaque(3))))

    io = LightningCheckpointIO(tmp_path / "c" / "store", codecs=[OpaqueCodec()])
    _fit(tmp_path / "c", max_epochs=1, module=TinyModule(args=argparse.Namespace(fn=Opaque(3))), io=io)
    loaded = io.load_checkpoint(tmp_path / "c" / "ckpts" / "last.ckpt")
    assert isinstance(loaded["hyper_parameters"]["args"].fn, Opaque) and loaded["hyper_parameters"]["args"].fn.value == 3


def test_load_refuses_files_it_did_not_write(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "torch.ckpt")
    io = LightningCheckpointIO(tmp_path / "store")
    with pytest.raises(checkpointing.CheckpointError, match="not a LightningCheckpointIO pointer file"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    with pytest.raises(CheckpointNotFoundError, match="not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")


def test_a_module_for_inference_from_a_pointer_file(tmp_path):
    """Lightning's load_from_checkpoint reads the pointer with torch.load and fails; io.load_module builds
    the module through it from the step the pointer names: hyper-parameters and weights bit-exact."""
    module, trainer, io = _fit(tmp_path, max_epochs=2)
    last = tmp_path / "ckpts" / "last.ckpt"
    with pytest.raises(Exception):
        TinyModule.load_from_checkpoint(last)  # what a user tries first: the file is our JSON pointer
    fresh = LightningCheckpointIO(tmp_path / "store")  # another process's view: a new object on the same store
    loaded = fresh.load_module(TinyModule, last, map_location="cpu")
    assert isinstance(loaded, TinyModule)
    assert loaded.hparams.lr == module.hparams.lr and loaded.hparams.args == module.hparams.args
    assert_same(dict(loaded.state_dict()), dict(module.state_dict()))
    with pytest.raises(TypeError, match="LightningModule"):
        fresh.load_module(object(), last)


_FIT_THEN_DIE = r"""
import os, sys, torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from checkpointing.integrations.lightning import LightningCheckpointIO

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.big = torch.nn.Parameter(torch.zeros(1 << 18))  # 1 MB: its upload at 200 kB/s holds the save in flight ~5 s
    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean() + self.big[:1].sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Die(Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 3:
            trainer.strategy.checkpoint_io.manager.wait()  # step 2 committed, its pointers written
            trainer.strategy.checkpoint_io._steps[2].settled.wait()
        if trainer.global_step == 4:
            os._exit(0)  # the step-4 save was issued (and ModelCheckpoint moved on); its upload is in flight

root, save_last = sys.argv[1], {"link": "link", "none": None}[sys.argv[2]]
torch.manual_seed(0)
io = LightningCheckpointIO(root + "/store", remote=sys.argv[3], upload_bytes_per_s=200e3)
trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     plugins=[io], callbacks=[ModelCheckpoint(dirpath=root + "/ckpts", every_n_train_steps=2, save_last=save_last), Die()])
trainer.fit(M(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
"""


def _fit_then_die(tmp_path: Path, save_last: str) -> tuple[Path, Path, str]:
    """A Trainer in a child process (ModelCheckpoint every 2 steps, default save_top_k=1) killed right after its step-4
    save was issued, while that save is in flight (its upload)."""
    script, remote = tmp_path / "fit.py", (tmp_path / "remote").as_uri()
    script.write_text(_FIT_THEN_DIE)
    r = subprocess.run([sys.executable, str(script), str(tmp_path), save_last, remote], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return tmp_path / "store", tmp_path / "ckpts", remote


class _Batches(Callback):
    def __init__(self) -> None:
        self.steps_run = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps_run += 1


def _resume_child_module(root: Path, remote: str, ckpt_path: str, save_last: Any) -> tuple[Any, _Batches]:
    """The child's module, resumed here to step 6 from `ckpt_path`; returns (trainer, the count of batches run)."""
    namespace: dict[str, Any] = {"__name__": "child_module"}
    exec(_FIT_THEN_DIE.split("class Die")[0], namespace)  # the child's imports and module class
    batches = _Batches()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[LightningCheckpointIO(root / "store", remote=remote)],
                         callbacks=[ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2, save_last=save_last), batches])
    trainer.fit(namespace["M"](), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4), ckpt_path=ckpt_path)
    return trainer, batches


def test_a_crash_while_a_save_is_in_flight_keeps_the_previous_checkpoint_with_save_top_k_1(tmp_path):
    """ModelCheckpoint removes the previous file right after save_checkpoint() returns: that pointer stays until the new
    step commits, so the crash leaves the previous checkpoint, which the next run neither deletes nor fails to resume."""
    store, ckpts, remote = _fit_then_die(tmp_path, "none")
    assert 2 in _steps(store) and _pointers(ckpts) == {"epoch=0-step=2.ckpt": 2}
    assert 2 not in ptr.read_released(LocalStorage(store, direct=False, create=False))
    trainer, module = _resume_child_module(tmp_path, remote, str(ckpts / "epoch=0-step=2.ckpt"), None)
    assert trainer.global_step == 6 and module.steps_run == 4  # resumed at step 2
    assert _pointers(ckpts)["epoch=0-step=6.ckpt"] == 6 and _steps(store)[-1] == 6


def test_save_last_link_from_a_fresh_dirpath_and_a_crash_before_the_commit_resumes_from_last(tmp_path):
    """save_last="link": Lightning links last.ckpt to the new file as soon as save_checkpoint() returns. The folder is
    made at the save (a fresh dirpath), and the new path holds a placeholder reading as the previous step until the
    commit, so that after a crash in between ckpt_path="last" resumes from the previous step, not from scratch."""
    store, ckpts, remote = _fit_then_die(tmp_path, "link")  # the child's first save linked into a dirpath it made
    assert os.path.islink(ckpts / "last.ckpt") and os.readlink(ckpts / "last.ckpt") == "epoch=0-step=4.ckpt"
    placeholder = ptr.read_pointer(str(ckpts / "last.ckpt"))
    assert placeholder.step == 2 and placeholder.pending is not None and placeholder.pending[0] == 4
    trainer, module = _resume_child_module(tmp_path, remote, "last", "link")
    assert trainer.global_step == 6 and module.steps_run == 4  # resumed at step 2, not from scratch
    # Lightning names the new link last-v1.ckpt (step 2's state has no last_model_path yet); the placeholder went
    assert _pointers(ckpts) == {"epoch=0-step=6.ckpt": 6, "last-v1.ckpt": 6} and 2 not in _steps(store)


class _ManagerOpened(Callback):
    """Whether the plugin opened its manager at the first optimizer step, before any save."""

    def __init__(self) -> None:
        self.opened: bool | None = None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.opened is None:
            self.opened = trainer.strategy.checkpoint_io.manager is not None


def test_a_plugin_kept_to_read_never_opens_a_manager_at_an_optimizer_step(tmp_path):
    """The README's inference recipe, then training a copy with a plain optimizer in the same process: the reader
    never opens a (writing) manager; a Trainer's plugin still opens it at its first optimizer step."""
    opened = _ManagerOpened()
    _fit(tmp_path, max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True), opened])
    assert opened.opened is True
    reader = LightningCheckpointIO(tmp_path / "store")
    module = reader.load_module(TinyModule, tmp_path / "ckpts" / "last.ckpt", map_location="cpu")
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    module.net(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert reader.manager is None
    with CheckpointManager(tmp_path / "store") as mgr:  # the training job reopens its directory
        assert mgr.steps() == [4]


def test_an_upload_failing_while_teardown_waits_is_logged_not_raised(tmp_path, s3_bucket, caplog):
    """The end of fit with the last save's upload in flight, then failing (an outage): teardown logs it (the step is
    committed locally, its pointer written) and does not raise. The upload is held until teardown waits for it."""
    url, options = s3_bucket
    io = LightningCheckpointIO(tmp_path / "store", remote=url, storage_options=options)
    weights = {"w": torch.zeros(4)}
    io.save_checkpoint({"global_step": 1, "state_dict": weights}, tmp_path / "ckpts" / "s1.ckpt")
    io.manager.wait()
    remote = io.manager.remote_storage
    remote.retry = RetryPolicy(attempts=2, base_s=0.001, cap_s=0.002)
    inject(remote, Fault("*", "denied", times=-1, path=f"*{naming.step_dir(2)}*"))
    held = remote.endpoint.fs = HeldUploads(remote.endpoint.fs, naming.step_dir(2))
    weights["w"] += 1
    io.save_checkpoint({"global_step": 2, "state_dict": weights}, tmp_path / "ckpts" / "s2.ckpt")
    main = threading.current_thread()
    opener = threading.Thread(target=lambda: (_until(lambda: held.waiting.is_set() and waiting_for_upload(main, 2), "teardown waits"),
                                              held.opened.set()), daemon=True)
    opener.start()
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        io.teardown()
    opener.join(120)
    assert "upload" in caplog.text and io.manager is None
    assert _pointers(tmp_path / "ckpts") == {"s1.ckpt": 1, "s2.ckpt": 2}
    assert torch.equal(io.load_checkpoint(tmp_path / "ckpts" / "s2.ckpt")["state_dict"]["w"], torch.ones(4))

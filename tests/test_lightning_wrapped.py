"""LightningCheckpointIO inside Lightning's AsyncCheckpointIO, and a path loaded while its save is in flight
(checkpointing/integrations/lightning.py, _lightning_lifecycle.py, _lightning_pending.py).

Lightning's AsyncCheckpointIO hands each save to our plugin from its own thread, after Lightning made it: a
removal ModelCheckpoint makes after a save can reach the plugin first, and its teardown does not call ours.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from checkpointing import CheckpointNotFoundError  # noqa: E402
from checkpointing.integrations.lightning import LightningCheckpointIO  # noqa: E402
from _models import child_env  # noqa: E402
from test_integration_lightning import EPOCHS, STEPS_PER_EPOCH, _final_state, _fit, _pointers, _quiet, _steps, assert_same  # noqa: E402,F401


def test_behind_async_checkpoint_io_top_k_holds_and_the_end_of_fit_leaves_every_pointer_written(tmp_path):
    io = LightningCheckpointIO(tmp_path / "store")
    wrapper = AsyncCheckpointIO(io)
    top = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=1)
    module, trainer, _ = _fit(tmp_path, max_epochs=EPOCHS, callbacks=[top], io=wrapper)
    last = EPOCHS * STEPS_PER_EPOCH
    assert io.manager is None  # the end of fit waited for the saves and closed the manager
    assert _pointers(tmp_path / "ckpts") == {os.path.basename(top.best_model_path): last}
    assert _steps(tmp_path / "store") == [last]  # every step Lightning released is deleted
    loaded = LightningCheckpointIO(tmp_path / "store").load_checkpoint(top.best_model_path)
    final = _final_state(module, trainer)
    assert loaded["global_step"] == last
    assert_same(final["model"], loaded["state_dict"])
    assert_same(final["optim"], loaded["optimizer_states"][0])


def _checkpoint(step: int, fill: float) -> dict:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4096, 2048), fill)}}  # 32 MiB: in flight a while


def test_a_path_loads_what_its_newest_save_gave_while_that_save_is_in_flight(tmp_path):
    io = LightningCheckpointIO(tmp_path / "store")
    path = tmp_path / "ckpts" / "x.ckpt"
    try:
        with pytest.raises(CheckpointNotFoundError):
            io.load_checkpoint(path)
        io.save_checkpoint(_checkpoint(3, 1.0), path)
        first = io.load_checkpoint(path)  # its save was in flight: no pointer there yet
        io.save_checkpoint(_checkpoint(7, 2.0), path)
        second = io.load_checkpoint(path)  # the pointer there still named step 3
    finally:
        io.teardown()
    assert first["global_step"] == 3 and torch.equal(first["state_dict"]["w"], torch.full((4096, 2048), 1.0))
    assert second["global_step"] == 7 and torch.equal(second["state_dict"]["w"], torch.full((4096, 2048), 2.0))


def test_behind_async_checkpoint_io_a_crash_while_a_removed_step_is_aliased_leaves_every_pointer_loadable(tmp_path):
    """ModelCheckpoint removes step=2.ckpt while the wrapper's thread saves last.ckpt at step 2 (an alias of that step):
    the step was deleted under the alias, so after a crash last.ckpt named a deleted step and fit(ckpt_path="last")
    failed. Collection now runs only on the thread that saves (the wrapper's), between its save calls."""
    script = Path(__file__).with_name("_lightning_wrapped_crash.py")
    env = {**child_env(), "CRASH": "1"}
    child = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    store = tmp_path / "store"
    for pointer in sorted((tmp_path / "ck").iterdir()):
        loaded = LightningCheckpointIO(store).load_checkpoint(pointer)
        assert loaded["global_step"] == json.loads(pointer.read_text())["step"]
    again = subprocess.run([sys.executable, str(script), str(tmp_path), "last"], env=child_env(), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]

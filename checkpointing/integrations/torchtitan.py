"""TieredCheckpointManager: torchtitan's checkpointer interface on a CheckpointManager (layer: integrations).

torchtitan (>= 0.3) builds its checkpointer from ``Trainer.Config.checkpoint``, any subclass of
``BaseCheckpointManager.Config``; its ``build()`` constructs the class that declares it. Select this
one in a config_registry function (examples/torchtitan/config_registry.py)::

    from checkpointing.integrations.torchtitan import TieredCheckpointManager

    config = llama3_debugmodel()
    config.checkpoint = TieredCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

How torchtitan's calls map onto the manager (CheckpointManager in ``<dump_folder>/<folder>``):

- ``save(step, last_step)``: at ``interval`` steps (and step 1 with ``enable_first_step_checkpoint``,
  and the last step), ``mgr.save(step, state)`` returns once the snapshot no longer needs the
  training loop; writing, fsync and commit go on in the background. ``async_mode="disabled"`` waits
  until the step is durable. The last step is always waited for (the process ends after it).
- ``maybe_wait_for_staging()``, which the trainer calls before ``optimizers.step()``: waits until the
  save in flight has copied the parameters and optimizer state (``mgr.wait_staged()``; the
  manager's optimizer-step guard would wait there anyway). The wait counts as the save's stall.
- Failures: a save (or its upload) that failed in the background is raised by the manager at the
  next save; it is logged there and training goes on (``strict=True``: it ends training). The last
  step's save and ``close()`` raise it either way; ``save_future.result()`` raises it too.
- ``keep_latest_k`` -> ``keep_local`` (0: keep all); ``keep_remote`` for the remote tier.
- ``load(step)`` (``load_step``; -1: the newest committed step) -> ``mgr.restore(state, step=...)``
  in place, ``exclude_from_loading`` -> ``restore(exclude=...)``. Step 0 (a seed checkpoint) loads
  the model only, as torchtitan does. An empty folder falls back to ``initial_load_path`` (one of our
  checkpoints: a directory or a tier URL; convert a DCP or Hugging Face one with ``checkpointing
  import``), then to a fresh start.
- ``last_save_model_only`` (torchtitan's default): the last step holds only the model, in
  ``export_dtype``. Such a step cannot be resumed from (it has no optimizer, data or train state):
  loading it names the newest full step to resume from instead.
- ``load_only`` opens the folder read-only: loads work, saves do nothing; a folder that does not
  exist loads ``initial_load_path`` (an evaluation run), and is not created.
- ``storage_options`` serve ``remote`` and an ``initial_load_path`` URL (either may be set alone).

State keys: ``model`` (``ModelWrapper``: the model parts' state dicts merged), ``optimizer`` (the
``OptimizersContainer``'s flat, FQN-keyed state), ``lr_scheduler``, ``dataloader``, the trainer's
``states`` (``train_state``), and ``torchtitan`` ({"model_only", "export_dtype"}: what the step
holds). The dataloader's state is bytes torchtitan pickles itself; we store them as bytes.

Resuming from an older step (``load_step=k`` with newer steps committed) abandons those newer steps:
the first save after such a load deletes them (every tier), as torchtitan's DCP checkpointer would
overwrite their folders, so that retention counts only the steps of the run going on. A step number
an earlier run saved and this one saves again (its step count restarted: ``exclude_from_loading=
["train_state"]``, a second seed checkpoint) replaces that step, with a warning, as torchtitan does.

Not supported (a CheckpointConfigError when the config is built, with what to use instead):
Hugging Face safetensors saves and loads (``last_save_in_hf``, ``initial_load_in_hf``: use
``checkpointing export DIR --format safetensors --only model`` and ``checkpointing import``), and a
remote ``folder`` (the folder is the node-local tier; give the URL as ``remote``).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.nn as nn
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP

from checkpointing.errors import CheckpointConfigError, CheckpointError, CheckpointNotFoundError, CheckpointSaveError
from checkpointing.integrations import _titan_load as loading
from checkpointing.manager import CheckpointManager, SaveHandle

__all__ = ["TieredCheckpointManager", "META"]

log = logging.getLogger("checkpointing")

_MAX_REPORTS = 8  # earlier failures one save may report (each is raised once) before the save itself goes ahead
META = loading.META  # every step's {"model_only": bool, "export_dtype": str | None}


class TieredCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer on a CheckpointManager (see the module docstring).

    Built by torchtitan's trainer: ``config.checkpoint.build(dataloader=..., model_parts=...,
    optimizers=..., lr_schedulers=..., states={"train_state": trainer}, sd_adapter=...,
    base_folder=config.dump_folder)`` on every rank (construction is collective with several ranks).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint policies, plus the tiers of a CheckpointManager."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
        """disabled: each save returns once durable. async (and async_with_pinned_mem, the same
        here: CUDA tensors are always staged through pinned memory): save returns after the
        snapshot, the write goes on in the background."""

        remote: str | None = None
        """Durable tier URL (s3://bucket/run1, any fsspec URL); each step is uploaded after its local commit."""

        storage_options: dict[str, str] = field(default_factory=dict)
        """fsspec options for `remote` (endpoint_url, ...). Keep credentials in the environment:
        torchtitan may log and save its config."""

        keep_remote: int = 0
        """Steps kept on the remote tier, or 0 to keep all."""

        incremental: bool = True
        """Write only the chunks that changed since an earlier retained step."""

        timeout_s: float = 600.0
        """Limit of every wait across ranks and of close()."""

        strict: bool = False
        """False: a failed save or upload is logged at the next save and training goes on (the
        steps committed before it stay restorable). True: it ends training there. The last step's
        save, and close(), raise either way."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise CheckpointConfigError(f"checkpoint.async_mode={self.async_mode!r}: use 'disabled' or 'async'")
            if self.last_save_in_hf:
                raise CheckpointConfigError(
                    "checkpoint.last_save_in_hf is not supported by TieredCheckpointManager: keep last_save_model_only=True "
                    "and export the last step after training: checkpointing export <folder> --format safetensors --only model --out DIR"
                )
            if self.initial_load_in_hf:
                raise CheckpointConfigError(
                    "checkpoint.initial_load_in_hf is not supported by TieredCheckpointManager: import the Hugging Face "
                    "weights once (checkpointing import HF_DIR DEST --step 0 --under model) and set "
                    "checkpoint.initial_load_path=DEST"
                )
            if "://" in self.folder:
                raise CheckpointConfigError(
                    f"checkpoint.folder={self.folder!r} is a URL: the folder is the node-local tier; set it to a local "
                    f"directory and checkpoint.remote={self.folder!r}"
                )
            if self.keep_remote < 0:
                raise CheckpointConfigError(f"checkpoint.keep_remote={self.keep_remote}: use 0 (keep all) or a positive count")
            if self.timeout_s <= 0:
                raise CheckpointConfigError(f"checkpoint.timeout_s={self.timeout_s}: use a positive number of seconds")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future | None = None
        self.config = config
        self.folder = os.path.join(base_folder, config.folder) if base_folder else config.folder
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        for key in (*self.states, *config.exclude_from_loading):
            if key == META:
                raise CheckpointConfigError(f"the state key {META!r} is TieredCheckpointManager's own: rename that state")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._abandon: list[int] = []  # newer steps of an abandoned run, deleted at the first save after the load
        keep = config.keep_latest_k or None
        # load_only on a folder that does not exist (an evaluation from initial_load_path): nothing to open, nothing is written
        self._mgr: CheckpointManager | None = None if config.load_only and not config.remote and not os.path.isdir(self.folder) else \
            CheckpointManager(self.folder, remote=config.remote, storage_options=(config.storage_options or None) if config.remote else None,
                              keep_local=keep, keep_remote=config.keep_remote or None, incremental=config.incremental,
                              timeout_s=config.timeout_s, read_only=config.load_only)
        # torchtitan's checkpointer overwrites a step it saves again (a run that restarts its step count): those of an earlier run
        self._existing = set() if config.load_only else set(_on_every_rank(self._mgr.steps()))
        log.info("checkpointing: torchtitan checkpoints in %s%s (keep_latest_k=%s, async_mode=%s)", self.folder,
                 f" and {config.remote}" if config.remote else "", config.keep_latest_k, config.async_mode)

    @property
    def manager(self) -> CheckpointManager:
        """The CheckpointManager underneath: stats(), summary(), steps(), tiers()."""
        if self._mgr is None:
            raise CheckpointConfigError(f"checkpoint.load_only=True and {self.folder} does not exist: no CheckpointManager is open there")
        return self._mgr

    def __del__(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
            log.error("checkpointing: closing the torchtitan checkpointer: %s", exc)

    # ------------------------------------------------------------------ BaseCheckpointManager hooks

    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        return (step == 1 and self.config.enable_first_step_checkpoint) or last_step or step % self.config.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self._drop_abandoned()
        if curr_step in self._existing:  # the same on every rank: a collective delete
            log.warning("checkpointing: step %d of an earlier run is in %s: replacing it, as torchtitan's checkpointer does", curr_step, self.folder)
            self._mgr.delete(curr_step, allow_latest=True, missing_ok=True)
            self._existing.discard(curr_step)
        model_only = last_step and self.config.last_save_model_only
        if model_only:
            model, exported = loading.export_model(self.states[MODEL], self.export_dtype)
            state: dict[str, Any] = {MODEL: model, META: {"model_only": True, "export_dtype": exported}}
        else:
            state = {k: v for k, v in self.states.items() if v is not None}
            state[META] = {"model_only": False, "export_dtype": None}
        handle = self._issue(curr_step, state)
        if last_step or self.config.async_mode == "disabled":
            handle.wait()  # durable (or its error) before the trainer goes on, or ends
            return True
        self.save_future = _SaveFuture(handle)
        return True

    def _maybe_wait_for_staging(self) -> None:
        if self._mgr is not None:
            self._mgr.wait_staged()

    def _wait_for_saving(self) -> None:
        self.save_future = None
        if self._mgr is not None:
            self._mgr.wait()

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if self._mgr is None:  # load_only, and the folder does not exist
            return self._initial_load()
        try:  # collective: the ranks agree on the step (the newest every rank can read, for -1)
            chosen, meta = loading.read_meta(self._mgr, None if step == -1 else step)
        except CheckpointNotFoundError as exc:
            if step == -1:
                raise
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: {exc}; set load_step to a committed step of {self.folder} "
                f"({self._mgr.steps()}), or to -1 for the newest"
            ) from None
        if chosen is None:
            return self._initial_load()
        if meta.model_only and chosen != 0:
            full = [s for s in self._mgr.steps() if 0 < s < chosen]
            raise CheckpointError(
                f"step {chosen} in {self.folder} holds only the model (the last save of a run with "
                "checkpoint.last_save_model_only=True): there is no optimizer, data or train state to resume from. "
                + (f"Resume from the newest full step with checkpoint.load_step={full[-1]}, or start" if full else "Start")
                + f" a new run from these weights: a new checkpoint.folder with checkpoint.initial_load_path={self._mgr.directory}"
            )
        if chosen == 0 or meta.model_only:  # a seed checkpoint: the model only, as torchtitan loads step 0
            loading.restore_model(self._mgr, chosen, self.states[MODEL], meta)
        else:  # -1: the newest step that reads clean (a damaged one is passed over, with a warning)
            chosen = self._restore_full(self._mgr, None if step == -1 else chosen)
        self._abandon = _on_every_rank([s for s in self._mgr.steps() if s > chosen])
        log.info("checkpointing: torchtitan state restored from step %d of %s", chosen, self.folder)
        return True

    def _close(self) -> None:
        mgr = getattr(self, "_mgr", None)
        if mgr is not None:
            self.save_future = None
            mgr.close()

    # ------------------------------------------------------------------ internals

    def _issue(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """mgr.save(); an earlier save's error, which it raises first (each once), ends training only when strict."""
        for _ in range(_MAX_REPORTS):
            try:
                return self._mgr.save(step, state)
            except CheckpointSaveError as exc:  # raised before this save was issued: an earlier save or upload failed
                if self.config.strict:
                    raise
                log.error("checkpointing: %s; training goes on (checkpoint.strict=True would end it here)", exc)
        return self._mgr.save(step, state)

    def _restore_full(self, mgr: CheckpointManager, step: int | None) -> int:
        """Restore every state of `step` (None: the newest that reads clean); the step restored."""
        target = {k: v for k, v in self.states.items() if v is not None}
        target[META] = {}
        exclude = list(self.config.exclude_from_loading)
        for key in exclude:
            if key not in self.states:
                raise CheckpointConfigError(f"checkpoint.exclude_from_loading names {key!r}, which is not a state (states: {sorted(self.states)})")
        chosen = mgr.restore(target, step=step, exclude=exclude or None)
        if chosen is None:
            raise CheckpointNotFoundError(f"{mgr.directory} holds no committed step")
        return chosen

    def _initial_load(self) -> bool:
        path = self.config.initial_load_path
        if not path:
            log.info("checkpointing: no checkpoint in %s and no initial_load_path: a fresh start", self.folder)
            return False
        source = loading.open_initial(path, self.config.storage_options)
        with source:
            step, meta = loading.read_meta(source, None)
            if step is None:
                raise CheckpointNotFoundError(f"checkpoint.initial_load_path={path!r} holds no committed step")
            if self.config.initial_load_model_only or meta.model_only or step == 0:
                loading.restore_model(source, step, self.states[MODEL], meta)
            else:
                step = self._restore_full(source, None)  # the newest that reads clean
        log.info("checkpointing: initial state from step %d of %s (%s)", step, path,
                 "model only" if self.config.initial_load_model_only or meta.model_only else "full")
        return True

    def _drop_abandoned(self) -> None:
        """After a load of an older step: its newer steps belong to the run that was abandoned."""
        if not self._abandon:
            return
        log.warning("checkpointing: training went on from an older step; deleting the newer steps %s of %s", self._abandon, self.folder)
        for s in sorted(self._abandon, reverse=True):  # every rank, each step: where a node lost it, the others delete it
            self._mgr.delete(s, allow_latest=True, missing_ok=True)
        self._existing -= set(self._abandon)
        self._abandon = []


def _on_every_rank(steps: list[int]) -> list[int]:
    """The steps any rank lists (the same list on every rank: the deletes after a load are collective)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_world_size() == 1:
        return steps
    lists: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(lists, steps)
    return sorted(set().union(*lists))


class _SaveFuture(Future):
    """`save_future`: the save's SaveHandle seen as a concurrent.futures.Future.

    Nothing is copied into it: reading its result or exception reports the save's error (as
    handle.result() does); if nobody reads it, the manager raises that error at the next save()
    (and at close), so a failed save is never lost."""

    def __init__(self, handle: SaveHandle) -> None:
        super().__init__()
        self._handle = handle

    def done(self) -> bool:
        return self._handle.done()

    def running(self) -> bool:
        return not self._handle.done()

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        return self._handle.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._handle.exception(timeout)

    def add_done_callback(self, fn: Callable[[Future], object]) -> None:
        self._handle.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        return f"<save_future of step {self._handle.step}: {'done' if self._handle.done() else 'running'}>"

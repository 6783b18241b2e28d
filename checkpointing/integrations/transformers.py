"""CheckpointingTrainer: the Hugging Face Trainer, checkpointing through a CheckpointManager (layer: integrations).

    from checkpointing.integrations import transformers as ckpt_hf

    trainer = ckpt_hf.CheckpointingTrainer(model=model, args=TrainingArguments(output_dir="out", save_steps=500, ...),
                                           train_dataset=ds, remote="s3://bucket/run1")   # checkpoint_dir=, CheckpointManager options
    trainer.train(resume_from_checkpoint=True)    # the newest committed checkpoint in out/, bit-exact

Each Trainer checkpoint is one step of a CheckpointManager in `checkpoint_dir` (default
`<output_dir>/checkpointing`), numbered by `global_step`: the model, the optimizer, the LR scheduler,
the gradient scaler (if any), the python/numpy/torch (and CUDA) generators, and the Trainer's
trainer_state.json text. The save returns after the snapshot; writing, fsync and commit go on in
the background while training continues (`train()` waits for them before it returns).

`output_dir/checkpoint-N` holds only `trainer_state.json` and `checkpointing.json` (a pointer to the
step), and appears only once step N is committed (_hf_markers.py, _hf_store.py). The Trainer's own
resume logic therefore works unchanged: `train(resume_from_checkpoint=True)` reads a folder, and
the load hooks below read the step it names.

What CheckpointingMixin overrides, and why (Trainer of transformers 5.x; the hooks are checked at import):
- `_save_checkpoint`: the Trainer writes model, optimizer, scheduler, scaler and RNG files
  synchronously with torch.save, then rotates folders; here one asynchronous save, with the
  eval metrics logged at that step passed as the step's metrics (retention by metric).
  `save_total_limit` (with the Trainer's best_model_checkpoint protected, recorded with each step) is
  the manager's retention (SaveTotalLimit); folders follow their steps.
- `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`, `_load_rng_state`,
  `_load_best_model`: read the step in place (never torch.load: nothing is unpickled).
- `train`: `resume_from_checkpoint=True` picks the newest folder whose step is committed (a folder
  a crash left pointing at an uncommitted step is skipped with a warning; the Trainer's
  get_last_checkpoint would take it); an explicit path is checked before training starts
  (CheckpointNotFoundError, or CheckpointError for a folder another Trainer wrote). At its end
  (also on an error) it waits for the saves and closes the manager, raising a failed save's error.
- `_finalize_training`: waits for the saves first, so that loading the best model and the
  Trainer's end-of-training folder cleanup see every folder; steps whose folder that cleanup
  removed are then deleted.

Limits: callbacks' `on_save` run before the folder exists (it appears at commit); checkpoint
folders hold no model files (`trainer.save_model()` still writes a regular model, and
`checkpointing export` writes safetensors); DeepSpeed is refused. Several processes (DDP under
torchrun): process 0 alone writes the folders, and `resume_from_checkpoint=True` resumes on every
process the one process 0 chose (tested on 2 CPU processes); FSDP and hyper-parameter search
(every trial would share one checkpoint directory) are untested.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import transformers
from accelerate.optimizer import AcceleratedOptimizer
from torch.optim import Optimizer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from checkpointing.errors import CheckpointConfigError, CheckpointMismatchError, CheckpointNotFoundError
from checkpointing.integrations import _hf_markers as markers
from checkpointing.integrations._hf_retention import BEST_STEP, SaveTotalLimit
from checkpointing.integrations._hf_store import TrainerCheckpoints
from checkpointing.manager import CheckpointManager
from checkpointing.options import ManagerOptions
from checkpointing.state.rng import RNGState

__all__ = ["CheckpointingMixin", "CheckpointingTrainer", "SaveTotalLimit"]

log = logging.getLogger("checkpointing")

_HOOKS = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state",
          "_load_best_model", "_get_output_dir", "store_flos")
_missing = [name for name in _HOOKS if not hasattr(transformers.Trainer, name)]
if _missing or TRAINER_STATE_NAME != markers.TRAINER_STATE_NAME or PREFIX_CHECKPOINT_DIR != markers.PREFIX:
    raise ImportError(f"checkpointing.integrations.transformers does not support transformers {transformers.__version__} "
                      f"(its Trainer lacks {', '.join(_missing) or 'the checkpoint folder names this module writes'}); "
                      "it is tested with transformers 5.23")

_MANAGER_OPTIONS = frozenset(inspect.signature(CheckpointManager.__init__).parameters) - {"self", "local_dir", "read_only"}


class CheckpointingMixin:
    """Trainer hooks that checkpoint through a CheckpointManager (see the module docstring).

    Put it before the Trainer class: ``class MyTrainer(CheckpointingMixin, SFTTrainer)``.
    Keyword arguments it takes (the rest go to the Trainer):
      checkpoint_dir: the CheckpointManager's local directory (default `<output_dir>/checkpointing`);
      remote: a durable tier (any fsspec URL); and any other CheckpointManager option
      (storage_options=, incremental=, keep_local=, ...). keep_local/keep_remote default to
      `save_total_limit` as a SaveTotalLimit policy (keep every step when it is None).
    The manager in use is `trainer.checkpoints.manager` during `train()`.
    """

    args: transformers.TrainingArguments
    state: transformers.TrainerState

    def __init__(self, *args: Any, checkpoint_dir: str | os.PathLike[str] | None = None, remote: str | None = None,
                 **kwargs: Any) -> None:
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in _MANAGER_OPTIONS}
        if "read_only" in kwargs:
            raise CheckpointConfigError("CheckpointingTrainer writes checkpoints: read_only is not an option here; "
                                        "checkpointing.load(dir) reads a step without writing")
        super().__init__(*args, **kwargs)
        if getattr(self, "is_deepspeed_enabled", False):
            raise CheckpointConfigError("CheckpointingTrainer does not support DeepSpeed (it checkpoints its engine itself); "
                                        "use transformers.Trainer, or train without DeepSpeed")
        if self.args.push_to_hub:
            log.warning("checkpointing: with CheckpointingTrainer the checkpoint-N folders hold pointers, not models: "
                        "push_to_hub uploads what trainer.save_model() writes, not the checkpoints")
        root = os.fspath(checkpoint_dir) if checkpoint_dir is not None else os.path.join(self.args.output_dir, "checkpointing")
        if "://" in root:
            raise CheckpointConfigError(f"checkpoint_dir={root!r}: pass a local directory; remote=... takes a URL (s3://...)")
        options["remote"] = remote
        policy = _retention(self.args)
        options.setdefault("keep_local", policy)
        if remote is not None:
            options.setdefault("keep_remote", policy)
        ManagerOptions(**{k: v for k, v in options.items() if k != "process_group"})  # invalid options fail here, not at the first save
        self.checkpoints = TrainerCheckpoints(root, options, markers=self.args.should_save)

    # ------------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train; resume_from_checkpoint=True takes the newest folder whose step is committed."""
        ok = False
        try:
            if resume_from_checkpoint is True:
                found = self.checkpoints.latest(self.args.output_dir)
                if found is None:
                    raise CheckpointNotFoundError(f"no committed checkpoint in {os.path.abspath(self.args.output_dir)} or in "
                                                  f"{self.checkpoints.root}: train without resume_from_checkpoint to start afresh")
                resume_from_checkpoint = found
            elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
                resume_from_checkpoint = self.checkpoints.resolve(resume_from_checkpoint).folder
            out = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
            ok = True
            return out
        finally:
            self.checkpoints.close(raise_errors=ok)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self.checkpoints.drain()  # every folder in place before the best model loads and the Trainer's cleanup runs
        out = super()._finalize_training(*args, **kwargs)  # type: ignore[misc]
        self.checkpoints.forget_removed()
        return out

    # ------------------------------------------------------------------ saving

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        step = self.state.global_step
        if getattr(self, "hp_search_backend", None) is None and trial is None:
            self.store_flos()  # type: ignore[attr-defined]
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        best = self.state.best_global_step
        if best:
            best_folder = os.path.join(run_dir, markers.folder_name(best))
            if best == step or os.path.isdir(best_folder):  # this step's folder appears once it is committed
                self.state.best_model_checkpoint = best_folder
        state: dict[str, Any] = {"model": self.model}  # type: ignore[attr-defined]
        if not self.args.save_only_model:
            state["optimizer"] = _torch_optimizer(self.optimizer)  # type: ignore[attr-defined]
            if self.lr_scheduler is not None:  # type: ignore[attr-defined]
                state["scheduler"] = self.lr_scheduler  # type: ignore[attr-defined]
            scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = RNGState()
        if self.args.should_save:
            self._export_callback_states()
        metrics = {BEST_STEP: float(_step_of(self.state.best_model_checkpoint)), **_logged_at(self.state, step)}  # first: always kept
        self.checkpoints.save(step, run_dir, state, metrics=metrics, write_state_json=self.state.save_to_json)

    def _export_callback_states(self) -> None:
        """The state of stateful callbacks (and of TrainerControl) into TrainerState, as the Trainer does before it saves."""
        for cb in [*self.callback_handler.callbacks, self.control]:  # type: ignore[attr-defined]
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()

    # ------------------------------------------------------------------ loading

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        source = self.checkpoints.resolve(resume_from_checkpoint)
        self.checkpoints.restore(source, {"model": self.model if model is None else model})  # type: ignore[attr-defined]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        source = self.checkpoints.resolve(checkpoint)
        parts: dict[str, Any] = {}
        if "optimizer" in source.contents:
            parts["optimizer"] = _torch_optimizer(self.optimizer)  # type: ignore[attr-defined]
        if "scheduler" in source.contents and self.lr_scheduler is not None:  # type: ignore[attr-defined]
            parts["scheduler"] = self.lr_scheduler  # type: ignore[attr-defined]
        if parts:
            try:
                self.checkpoints.restore(source, parts)
            except CheckpointMismatchError as exc:  # the Trainer has no way to leave the optimizer out
                raise CheckpointMismatchError(exc.step, exc.problems, fix=(
                    f"The Trainer resumes the optimizer and scheduler it saved in {checkpoint}: resume with the same optimizer "
                    "(class and parameter groups), or start a new run from these weights: "
                    f"model.load_state_dict(checkpointing.load({str(self.checkpoints.root)!r}, step={exc.step}, keys='model')['model']), "
                    "then train() without resume_from_checkpoint.")) from None

    def _load_scaler(self, checkpoint: str | None) -> None:
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if checkpoint is None or scaler is None:
            return
        source = self.checkpoints.resolve(checkpoint)
        if "scaler" in source.contents:
            self.checkpoints.restore(source, {"scaler": scaler})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        source = self.checkpoints.resolve(checkpoint)
        if "rng" in source.contents:
            self.checkpoints.restore(source, {"rng": RNGState()})
        else:
            log.info("checkpointing: %s holds no RNG state (save_only_model): reproducibility is not guaranteed", checkpoint)

    def _load_best_model(self) -> None:
        self.checkpoints.drain()
        folder = self.state.best_model_checkpoint
        try:
            source = self.checkpoints.resolve(folder)
        except CheckpointNotFoundError as exc:
            log.warning("checkpointing: cannot load the best model: %s", exc)
            return
        log.info("checkpointing: loading the best model from %s (score: %s)", folder, self.state.best_metric)
        self.checkpoints.restore(source, {"model": self.model})  # type: ignore[attr-defined]


class CheckpointingTrainer(CheckpointingMixin, transformers.Trainer):
    """transformers.Trainer with asynchronous, verified checkpoints (see the module docstring).

    ``CheckpointingTrainer(model=..., args=..., train_dataset=..., checkpoint_dir=None, remote=None, **manager_options)``
    """


def _retention(args: transformers.TrainingArguments) -> SaveTotalLimit | None:
    limit = args.save_total_limit
    if limit is None or limit <= 0:
        return None
    metric = args.metric_for_best_model
    if metric is not None and not metric.startswith("eval_"):
        metric = f"eval_{metric}"
    greater = bool(args.greater_is_better) if args.greater_is_better is not None else False
    return SaveTotalLimit(limit, metric, greater)


def _torch_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that steps (Accelerate's wrapper holds it): what the manager's step guard watches."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _step_of(folder: str | None) -> int:
    """The step of a checkpoint-<step> folder (the Trainer's best_model_checkpoint); -1 for none."""
    try:
        return int(os.path.basename(os.path.normpath(folder)).rsplit("-", 1)[1]) if folder else -1
    except (IndexError, ValueError):
        return -1


def _logged_at(state: transformers.TrainerState, step: int) -> dict[str, float]:
    """The numbers logged at `step` (loss, eval metrics, ...): the step's metrics."""
    out: dict[str, float] = {}
    for entry in reversed(state.log_history):
        if entry.get("step") != step:
            break
        for name, value in entry.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(name, float(value))
    return out

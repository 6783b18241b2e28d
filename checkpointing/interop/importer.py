"""Import a checkpoint of another format as one committed step of this library (layer: interop).

`import_checkpoint(src, dest, step)` reads SRC (readers.py: a DCP directory, a torch.save file, a
safetensors file, a Hugging Face directory) into one state and commits it with a CheckpointManager
on DEST (a directory, or a tier URL, then through a temporary local tier removed afterwards) as an
ordinary step: restore() and load() read it, `checkpointing verify` checks it, and the first save
of a run that restored it is incremental against it, chunk by chunk, where that run saves the same
keys: `under="model"` puts a flat state dict (a safetensors file, a model's torch.save) where a run
that saves {"model": model} keeps it.

Memory: the source's tensors are held once (DCP: allocated whole and filled by DCP's reader;
torch.save zip files and safetensors files: memory-mapped, their pages are the page cache's) and
written by one save through a staging ring of STAGING_BYTES, never copied whole a second time: the
peak is about the state plus the ring. A sharded Hugging Face directory is read file by file into
that one state and committed as one step: a step is all or nothing, and one save per file would
make steps that are neither restorable alone nor one checkpoint.

One process: call it outside torch.distributed, or in a world of one rank.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Iterable, Mapping

import torch

from checkpointing.format import naming
from checkpointing.errors import CheckpointConfigError, CheckpointError, StateError
from checkpointing.interop.readers import Loaded, detect, read, source_path
from checkpointing.interop.types import Conversion, ImportResult
from checkpointing.manager import CheckpointManager
from checkpointing.restore.selection import Selection, unmatched
from checkpointing.state.tree import flatten_state

STAGING_BYTES = 64 << 20  # the ring the step is written through


def import_checkpoint(
    src: str | os.PathLike,
    dest: str | os.PathLike,
    step: int,
    *,
    under: str | None = None,
    only: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    dtype: str | torch.dtype | None = None,
    tie: Mapping[str, str] | None = None,
    kind: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ImportResult:
    """Commit the checkpoint at `src` as step `step` of the checkpoint directory or tier URL `dest`.

    under: put the imported state under this top-level key ("model"). only / exclude: glob patterns
    over the source's "/"-joined keys ("model/*", "optim"). dtype: "bf16" / "fp16" / "fp32" casts
    the floating-point tensors. tie: {alias: name} of tied weights a file left out (Hugging Face
    drops "lm_head.weight" when it shares "transformer.wte.weight"): the alias is saved sharing the
    named tensor, as the model holds it (files written by export_safetensors say so themselves).
    kind: "dcp", "torch", "safetensors" or "hf" (default: told from `src`). storage_options: for a
    `dest` URL. Importing a DCP checkpoint unpickles its metadata: import only what you trust.
    """
    conv = Conversion.of(only, exclude, None, dtype)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= naming.MAX_STEP:  # before anything is created
        raise CheckpointConfigError(f"step={step!r}: pass the step number to commit the import as (an int in 0..{naming.MAX_STEP})")
    if under is not None and (not isinstance(under, str) or not under):
        raise CheckpointConfigError(f"under={under!r}: pass a top-level key such as 'model'")
    _check_one_process()
    path = source_path(src)
    select = Selection.of(True, conv.only or None, conv.exclude or None, take_all=True)
    loaded = read(path, kind or detect(path), select)
    bad = unmatched(select, loaded.keys)
    if bad:
        shown = ", ".join(repr(k) for k in sorted(k for k in loaded.keys if "/" not in k)[:12])
        raise CheckpointConfigError(f"{bad[0]!r} (in only=/exclude=) matches no key of {path}; its top-level keys are {shown}")
    state = _prepared(loaded, conv, dict(tie or {}))
    tensors, nbytes = _count(state)
    if not tensors and not state:
        raise CheckpointConfigError(f"nothing to import from {path} with only={list(conv.only)}, exclude={list(conv.exclude)}")
    _commit(dest, step, {under: state} if under else state, storage_options)
    return ImportResult(step, os.fspath(dest), loaded.kind, tensors, nbytes)


def _prepared(loaded: Loaded, conv: Conversion, tie: dict[str, str]) -> dict[str, Any]:
    """The state cast to `conv.dtype`, with tied names sharing their tensor (the file's ties, then `tie`)."""
    state = _cast(loaded.state, conv)
    for alias, name in {**loaded.tied, **tie}.items():
        if name not in state:
            if alias in tie:
                raise CheckpointConfigError(f"tie={{{alias!r}: {name!r}}}: {name!r} is not a name the source holds")
            continue
        if alias not in state:
            state[alias] = state[name]
    return state


def _cast(node: Any, conv: Conversion) -> Any:
    if isinstance(node, torch.Tensor):
        return conv.cast(node)
    if isinstance(node, dict):
        for k, v in node.items():
            node[k] = _cast(v, conv)  # one tensor at a time: the original goes as its cast arrives
        return node
    if isinstance(node, list):
        node[:] = [_cast(v, conv) for v in node]
        return node
    if isinstance(node, tuple):
        return tuple(_cast(v, conv) for v in node)
    return node


def _count(node: Any, seen: set[int] | None = None) -> tuple[int, int]:
    """Distinct tensors under `node` and their bytes."""
    seen = set() if seen is None else seen
    if isinstance(node, torch.Tensor):
        if id(node) in seen:
            return 0, 0
        seen.add(id(node))
        return 1, node.numel() * node.element_size()
    children = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
    counts = [_count(v, seen) for v in children]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def _commit(dest: str | os.PathLike, step: int, state: dict[str, Any], storage_options: Mapping[str, Any] | None) -> None:
    """One save of `state` as `step` on `dest`, durable on every tier when this returns."""
    url = os.fspath(dest)
    remote = url if "://" in url else None
    if remote is None and storage_options:
        raise CheckpointConfigError(f"storage_options apply to a URL destination (s3://bucket/prefix), not to the directory {url!r}")
    try:  # before anything is written to the destination (a manager opened on it writes its TIER and lock)
        flatten_state(state, eager=True)
    except StateError as exc:  # a value of the source that is neither a tensor nor JSON-like
        raise CheckpointConfigError(f"{exc}; or leave it out of the import: exclude=[KEY] (CLI: --exclude KEY)") from None
    local = tempfile.mkdtemp(prefix="ckpt-import-") if remote else url
    try:
        with CheckpointManager(local, remote=remote, storage_options=storage_options, keep_local=None, keep_remote=None,
                               staging_budget_bytes=STAGING_BYTES, snapshot="eager", process_group=None) as mgr:
            where = mgr.remote_storage.url if mgr.remote_storage is not None else url
            if remote and step in mgr.steps():  # (the local tier is a scratch directory: the error names the destination)
                raise CheckpointError(f"step {step} is already committed in {where}: import as another step, or delete that one "
                                      f"first (checkpointing rm {where} --step {step})")
            try:
                handle = mgr.save(step, state)
            except StateError as exc:  # a value of the source that is neither a tensor nor JSON-like
                raise CheckpointConfigError(f"{exc}; or leave it out of the import: exclude=[KEY] (CLI: --exclude KEY)") from None
            handle.wait()
            mgr.wait()  # the remote tier too
    finally:
        if remote:
            shutil.rmtree(local, ignore_errors=True)


def _check_one_process() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointConfigError("import_checkpoint runs in one process: call it outside torch.distributed (e.g. the CLI: "
                                    "checkpointing import SRC DEST --step N), not on every rank of a job")

"""Export a committed step as Hugging Face safetensors, streamed file by file (layer: interop).

The layout save_pretrained writes and from_pretrained reads: `model.safetensors`, or, when the
tensors exceed `max_shard_size`, `model-00001-of-0000N.safetensors` ... plus
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}).
Each file's header metadata holds {"format": "pt"} (from_pretrained requires it), the step, and,
when tied weights were written once, "checkpointing.tied": JSON of {alias: written name}.

Streamed: the selected tensors (naming.py) are grouped in order into files of at most
`max_shard_size` bytes (a larger tensor gets a file of its own, as Hugging Face does); each file's
tensors are read whole (sharded states merged, every chunk verified), cast, written with the
safetensors library, and dropped before the next file's are read. Peak memory is about the largest
file, not the step.

The output directory is created if missing; other files in it (config.json, a tokenizer) are left
alone. One that already holds an export (model.safetensors, the index, model-*-of-*.safetensors) is
refused unless `force`. Files are written under temporary names and renamed into place at the end,
the index last; then, with `force`, shards of the earlier export that the new one does not have are
removed. A failure before that removes the temporary files and leaves the directory as it was.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from checkpointing.errors import CheckpointConfigError
from checkpointing.format.dtypes import dtype_from_name, dtype_name
from checkpointing.interop.naming import Named, name_tensors
from checkpointing.interop.source import OpenStep, export_path, open_step
from checkpointing.interop.types import Conversion, ExportResult, parse_size
from checkpointing.restore.reading import READ_THREADS
from checkpointing.storage import Storage

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNSUPPORTED = frozenset({"complex128", "complex32"})  # dtypes the safetensors format has no name for


def export_safetensors(
    source: str | os.PathLike | Storage,
    out: str | os.PathLike,
    step: int | None = None,
    *,
    only: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write step `step` (default: the newest committed) of the checkpoint at `source` to the directory `out`.

    source: a checkpoint directory, a tier URL (s3://bucket/prefix, with `storage_options`), or an
    opened Storage. only / exclude: glob patterns over keys ("model"); names are the paths below
    what every `only` pattern spells out, joined with "." (see checkpointing.interop.naming).
    strip_prefix: removed from each name that starts with it. dtype: "bf16" / "fp16" / "fp32" casts
    the floating-point tensors. max_shard_size: bytes per file ("5GB", "500MB", an int). force:
    replace an earlier export in `out`. progress: called with 1 after each tensor.
    """
    conv = Conversion.of(only, exclude, strip_prefix, dtype)
    _need_safetensors()
    limit = parse_size(max_shard_size)
    opened = open_step(source, step, storage_options=storage_options)
    out_dir = export_path(out, opened.storage)
    _check_out(out_dir, force)
    named = name_tensors(opened.manifest, conv, "dotted")
    sizes = [_out_bytes(n, conv) for n in named]
    groups = plan_files(sizes, limit)
    files = [SINGLE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    tied = {alias: n.name for n in named for alias in n.aliases}
    meta = {"format": "pt", "checkpointing.step": str(opened.step)}
    if tied:
        meta["checkpointing.tied"] = json.dumps(tied, sort_keys=True)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointConfigError(f"cannot write {out_dir}: {exc.strerror or exc}; choose another --out (out_dir=)") from None
    layout = dict(zip(files, ([named[i] for i in g] for g in groups)))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": {n.name: f for f, ns in layout.items() for n in ns}}
    paths = _write_all(out_dir, layout, index if len(files) > 1 else None, lambda ns, tmp: _write_file(opened, ns, conv, tmp, meta, progress))
    return ExportResult(opened.step, tuple(map(str, paths)), len(named), sum(sizes), tied)


def _write_all(out_dir: Path, layout: dict[str, list[Named]], index: dict[str, Any] | None,
               write: Callable[[list[Named], Path], None]) -> list[Path]:
    """Each file under a temporary name, then every one renamed into place (the index last), then an earlier
    export's files the new one does not replace removed; on failure only the temporary files go."""
    token = secrets.token_hex(6)
    written: list[tuple[Path, Path]] = []  # (temporary, final)
    try:
        for name, group in layout.items():
            tmp = out_dir / f".{name}.{token}.tmp"
            write(group, tmp)
            os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its files 0600; a model is read by the account that serves it
            written.append((tmp, out_dir / name))
        if index is not None:
            tmp = out_dir / f".{INDEX}.{token}.tmp"
            tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append((tmp, out_dir / INDEX))
        keep = {final.name for _, final in written}
        stale = [p for p in _existing(out_dir) if p.name not in keep]
        for tmp, final in written:
            os.replace(tmp, final)
    except BaseException:
        for leftover in out_dir.glob(f".*.{token}.tmp"):
            leftover.unlink(missing_ok=True)
        raise
    for path in stale:  # only with force: _check_out refused a directory holding an export otherwise
        path.unlink(missing_ok=True)
    return [final for _, final in written]


def _umask() -> int:
    """This process's umask, read without changing it where the kernel says it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plan_files(sizes: list[int], limit: int) -> list[list[int]]:
    """Tensor indices grouped in order into files of at most `limit` bytes; a larger tensor alone in its own."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > limit:  # a tensor larger than the limit gets a file of its own
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current or not groups:
        groups.append(current)
    return groups


def _out_bytes(named: Named, conv: Conversion) -> int:
    entry = named.entry
    dtype = conv.out_dtype(dtype_from_name(entry.dtype))
    if dtype_name(dtype) in _UNSUPPORTED:
        raise CheckpointConfigError(f"{entry.key!r} is {dtype_name(dtype)}, which the safetensors format cannot hold: leave it out "
                                    "(exclude=) or export with format torch")
    n = 1
    for d in entry.shape:
        n *= d
    return n * dtype.itemsize


def _write_file(opened: OpenStep, named: list[Named], conv: Conversion, path: Path, meta: dict[str, str],
                progress: Callable[[int], None] | None) -> None:
    """Read `named` (in parallel, each verified), cast, and write them as one safetensors file."""
    from safetensors.torch import save_file  # present: export_safetensors checked it first

    def read(n: Named) -> torch.Tensor:
        t = conv.cast(opened.read(n.entry))
        if progress is not None:
            progress(1)
        return t

    with ThreadPoolExecutor(min(READ_THREADS, max(1, len(named))), thread_name_prefix="ckpt-export") as pool:
        tensors = dict(zip((n.name for n in named), pool.map(read, named)))
    save_file(tensors, str(path), metadata=meta)


def _need_safetensors() -> None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as exc:
        raise CheckpointConfigError(f"the safetensors export needs the safetensors package ({exc}): pip install safetensors") from None


def _existing(out_dir: Path) -> list[Path]:
    """The files of an earlier export in `out_dir`."""
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if p.name in (SINGLE, INDEX) or _SHARD.fullmatch(p.name))


def _check_out(out_dir: Path, force: bool) -> None:
    if out_dir.is_symlink() and not out_dir.exists():
        raise CheckpointConfigError(f"{out_dir} is a link to {os.readlink(out_dir)}, which does not exist: create that directory, "
                                    "or choose another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointConfigError(f"{out_dir} is a file: the safetensors export writes a directory (model.safetensors, ...)")
    found = _existing(out_dir)
    if found and not force:
        raise CheckpointConfigError(f"{out_dir} already holds an export ({found[0].name}{' and more' if len(found) > 1 else ''}): "
                                    "pass --force (force=True) to replace it, or choose another directory")

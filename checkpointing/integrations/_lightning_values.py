"""Values of LightningCheckpointIO that go through JSON, and the small helpers around them (layer: integrations).

- Codecs for what Lightning puts into hyper-parameters and is not JSON-like: `argparse.Namespace`
  (its attributes as a tree, which may use every other codec) and `pathlib` paths (a string).
  LightningCheckpointIO adds them to every manager it opens and to every load.
- An alias's overrides (lightning.py): a few small entries of a checkpoint encoded as a manifest's
  tree (checkpointing/state/tree.py node kinds) plus the bytes of their small tensors, and back.
- map_location as torch.load understands it, applied to a loaded (CPU) checkpoint.
- Where the argparse.Namespace values of a refused checkpoint are (a codec cannot know its key).
- Paths, tensor sizes, whether this process is the one Lightning saves from.

No Lightning import here except lightning_utilities' apply_to_collection.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import logging
import os
import pathlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection

from checkpointing.errors import CheckpointConfigError, CheckpointError, ManifestError, StateError
from checkpointing.format.decode import check_tree
from checkpointing.format.dtypes import dtype_from_name, dtype_name
from checkpointing.state.codecs import Codec
from checkpointing.state.tree import flatten_state

log = logging.getLogger("checkpointing")

BULK = frozenset({"state_dict", "optimizer_states"})  # never in an alias's overrides: equal at one global step
MAX_OVERRIDE_BYTES = 1 << 20
CODEC_HINT = ("LightningCheckpointIO never pickles: give it a codec for that type (LightningCheckpointIO(dir, codecs=[codec]), "
              "a checkpointing.Codec: name, types, encode(obj) -> JSON-like data, decode(data)), or keep the value out of "
              "the checkpoint (self.save_hyperparameters(ignore=[...]))")


# ---------------------------------------------------------------------------------------------- overrides

def encode_entries(entries: Mapping[str, Any], codecs: tuple[Codec, ...]) -> dict[str, Any]:
    """`entries` (small values: their tensors are copied into the JSON) as {"tree", "tensors"}."""
    flat = flatten_state(entries, codecs=codecs, eager=True)
    tensors = []
    for leaf in flat.leaves:
        t = leaf.tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        tensors.append({"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")})
    return {"tree": flat.tree, "tensors": tensors}


def decode_entries(data: Mapping[str, Any], codecs: Sequence[Codec], where: str) -> dict[str, Any]:
    """The entries encode_entries() encoded; CheckpointError naming `where` when the data are damaged."""
    try:
        tensors = [_tensor(t) for t in data["tensors"]]
        check_tree(data["tree"], len(tensors), where)
    except (ManifestError, KeyError, TypeError, ValueError, binascii.Error, RuntimeError) as exc:
        raise CheckpointError(f"{where}: damaged overrides ({exc}): delete that pointer file") from None
    return decode_tree(data["tree"], tensors, codecs, where)


def _tensor(entry: Mapping[str, Any]) -> torch.Tensor:
    dtype = dtype_from_name(entry["dtype"])
    shape = [int(n) for n in entry["shape"]]
    raw = base64.b64decode(entry["data"], validate=True)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def decode_tree(node: Mapping[str, Any], tensors: Sequence[torch.Tensor], codecs: Sequence[Codec], where: str) -> Any:
    """A value from a (validated) tree as flatten_state() builds it; tensors by their index."""
    if "dict" in node:
        return {k: decode_tree(v, tensors, codecs, where) for k, v in node["dict"]}
    if "list" in node:
        return [decode_tree(v, tensors, codecs, where) for v in node["list"]]
    if "tuple" in node:
        return tuple(decode_tree(v, tensors, codecs, where) for v in node["tuple"])
    if "value" in node:
        return node["value"]
    if "float" in node:
        return float(node["float"])
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "ndarray" in node:
        return np.array(tensors[node["ndarray"]].numpy())
    if "stateful" in node:  # as checkpointing.load(): an object saved through state_dict() comes back as that dict
        return decode_tree(node["stateful"], tensors, codecs, where)
    for codec in codecs:
        if codec.name == node["codec"]:
            return codec.decode(node["data"])
    raise CheckpointError(f"{where}: a value was saved with codec {node['codec']!r}; pass that codec: LightningCheckpointIO(..., codecs=[...])")


# ---------------------------------------------------------------------------------------------- codecs

class NamespaceCodec:
    """argparse.Namespace (`save_hyperparameters()` of an `args` parameter) as a tree of its attributes."""

    name = "argparse.Namespace"
    types: tuple[type, ...] = (argparse.Namespace,)

    def __init__(self) -> None:
        self.codecs: tuple[Codec, ...] = (self, PathCodec())  # for the attributes' values; with_codecs() sets every codec

    def encode(self, obj: Any) -> Any:
        try:
            flat = flatten_state(vars(obj), codecs=self.codecs)
        except StateError as exc:
            raise StateError(f"inside an argparse.Namespace: {exc}") from None
        if flat.leaves:
            raise StateError(f"an argparse.Namespace holds a tensor (attribute {flat.leaves[0].key!r}): keep tensors "
                             "out of the hyper-parameters, or convert it (t.tolist())")
        return {"tree": flat.tree}

    def decode(self, data: Any) -> Any:
        where = "an argparse.Namespace"
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: damaged data")
        try:
            check_tree(data.get("tree"), 0, where)
        except ManifestError as exc:
            raise CheckpointError(f"{where}: damaged data ({exc})") from None
        return argparse.Namespace(**decode_tree(data["tree"], [], self.codecs, where))


class PathCodec:
    """pathlib paths as their string (they come back as pathlib.Path)."""

    name = "pathlib.Path"
    types: tuple[type, ...] = (pathlib.PurePath,)

    def encode(self, obj: Any) -> Any:
        return str(obj)

    def decode(self, data: Any) -> Any:
        if not isinstance(data, str):
            raise CheckpointError("a pathlib.Path: damaged data")
        return pathlib.Path(data)


def with_codecs(codecs: Sequence[Codec]) -> tuple[Codec, ...]:
    """The user's codecs first (they may handle the same types differently), then ours for argparse.Namespace
    and pathlib paths unless the user's have those names; a Namespace's attributes may use any of them."""
    names = {c.name for c in codecs}
    namespace = NamespaceCodec()
    every = tuple(codecs) + tuple(c for c in (namespace, PathCodec()) if c.name not in names)
    namespace.codecs = every
    return every


# ---------------------------------------------------------------------------------------------- helpers

def local_path(path: Any) -> str:
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" in text:
        raise CheckpointConfigError(f"{text}: LightningCheckpointIO writes its pointer files on a local filesystem; give "
                                    "ModelCheckpoint a local dirpath (the data can go to remote=... of LightningCheckpointIO)")
    return os.path.abspath(os.path.expanduser(text))  # "~/ckpts": the home directory's, as Lightning's own IO reads it


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def namespaces_hint(exc: StateError, checkpoint: Mapping[str, Any]) -> str:
    """Where the Namespaces are, when the error comes from inside one (a codec cannot know its key)."""
    if "argparse.Namespace" not in str(exc):
        return ""
    found: list[str] = []

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, argparse.Namespace):
            found.append(key)
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, f"{key}/{k}" if key else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")

    walk(checkpoint, "")
    return f" (the argparse.Namespace at {', '.join(repr(k) for k in found[:5])})" if found else ""


def placed(tree: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Tensors moved as torch.load's map_location would (they load on the CPU)."""
    device = device_of(map_location)
    if device is None or device.type == "cpu":
        return tree
    return apply_to_collection(tree, torch.Tensor, lambda t: t.to(device))


def device_of(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, Mapping):
        where = map_location.get("cpu")
        return None if where is None else torch.device(where)
    if callable(map_location):  # fn(storage, location) -> storage, as torch.load calls it
        moved: Callable[..., Any] = map_location
        result = moved(torch.empty(1).untyped_storage(), "cpu")
        return getattr(result, "device", None)
    raise CheckpointConfigError(f"map_location={map_location!r}: pass a device, a str, a dict or a function (storage, location)")


def global_rank_zero() -> bool:
    """This process saves: torch.distributed is not initialised, or this is its rank 0 (Lightning saves there)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _on_default_group(options: Mapping[str, Any]) -> bool:
    """No process_group given, and torch.distributed runs several ranks: a manager would span them all."""
    import torch.distributed as dist

    return "process_group" not in options and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def add_rank_zero_group(options: dict[str, Any]) -> None:
    """Under DDP (several ranks, no process_group given): the process group of global rank 0 alone, which
    Lightning saves from, as the manager's. A collective: every rank calls this once, at its first optimizer step."""
    import torch.distributed as dist

    if _on_default_group(options):
        options["process_group"] = dist.new_group([0])


def carried(checkpoint: Mapping[str, Any]) -> list[str]:
    """The entries of a second save at one step that its pointer carries (lightning.py's module docstring)."""
    return [k for k, v in checkpoint.items() if k not in BULK and tensor_bytes(v) <= MAX_OVERRIDE_BYTES]


def overrides(checkpoint: Mapping[str, Any], target: str, codecs: tuple[Codec, ...]) -> dict | None:
    """The carried() entries of `checkpoint`, encoded (None: none)."""
    small = {k: checkpoint[k] for k in carried(checkpoint)}
    if not small:
        return None
    try:
        return encode_entries(small, codecs)
    except StateError as exc:
        raise StateError(f"{exc} (saving {target}){namespaces_hint(exc, checkpoint)}. {CODEC_HINT}") from exc


def repointed(own: Mapping[str, Any], reads: Mapping[str, str], keys: tuple[str, ...], old: Mapping[str, Any],
              moved: Mapping[str, str], codecs: tuple[Codec, ...]) -> tuple[dict | None, tuple[str, ...], dict[str, str] | None]:
    """(overrides, keys, renames) of a pointer whose step is saved again (_lightning_same_step.py): it keeps its
    own entries `own`, and reads each other key's value (`reads`: key -> stored entry) from the old step's small
    entries `old` (carried now), from the entry `moved` keeps it under, or from the new save (the same value)."""
    small = {k: old[stored] for k, stored in reads.items() if stored in old and stored not in moved}
    renames = {k: moved.get(stored, stored) for k, stored in reads.items() if k not in small and moved.get(stored, stored) != k}
    entries = {**small, **own}
    return (encode_entries(entries, codecs) if entries else None), keys, renames or None


def check_options(local_dir: Any, options: dict[str, Any], manager_signature: Any) -> None:
    """LightningCheckpointIO(local_dir, **options): refuse what cannot work; keep_local defaults to None."""
    if not isinstance(local_dir, (str, os.PathLike)) or not str(local_dir) or "://" in str(local_dir):
        raise CheckpointConfigError(f"local_dir={local_dir!r} is invalid: pass a local directory (remote=... takes a URL)")
    if "read_only" in options:
        raise CheckpointConfigError("LightningCheckpointIO writes checkpoints: read_only is not an option here; "
                                    "checkpointing.load(dir) reads a step without writing")
    try:
        manager_signature.bind(None, local_dir, **options)
    except TypeError as exc:
        raise CheckpointConfigError(f"LightningCheckpointIO(..., **manager_options): {exc}; see help(CheckpointManager)") from None
    options.setdefault("keep_local", None)
    options.setdefault("snapshot", "eager")  # Lightning's callbacks write weights outside the optimizer step (docs/design.md)
    if options["keep_local"] is not None:
        log.warning("checkpointing: LightningCheckpointIO with keep_local=%r may delete steps ModelCheckpoint still lists; "
                    "ModelCheckpoint(save_top_k=...) decides what is kept when keep_local=None", options["keep_local"])


def check_one_writer(options: Mapping[str, Any]) -> None:
    """Refuse a manager on the default process group of several ranks: Lightning saves from rank 0 only."""
    if _on_default_group(options):
        raise CheckpointConfigError(
            "LightningCheckpointIO: Lightning saves from global rank 0 only, and a CheckpointManager on the default "
            "process group would wait for every rank. It runs on a group of rank 0 alone, made on every rank at the first "
            "optimizer step: save after one, or pass process_group=torch.distributed.new_group([0]) (made on every rank) "
            "to LightningCheckpointIO(...)")

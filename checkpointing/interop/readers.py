"""Reading a checkpoint of another format into one nested state of CPU tensors and plain values (layer: interop).

What SRC is decides how it is read (`detect`):
- "dcp": a directory holding torch.distributed.checkpoint's `.metadata`. Read with DCP's own
  FileSystemReader: an empty state is built from its metadata (each tensor allocated whole, nested
  as it was saved, from the metadata's planner data), then `dcp.load(..., no_dist=True)` fills it,
  merging the saved shards. TRUST: DCP's `.metadata` is a pickle, and DCP unpickles its non-tensor
  values (torch.load(weights_only=False)); importing a DCP checkpoint can run code its author put
  there. Import only DCP checkpoints you trust.
- "torch": a torch.save file, read with torch.load(weights_only=True) (no arbitrary objects),
  memory-mapped when it is a zip file (what torch.save writes since 1.6). A file `export_torch`
  wrote ({"step", "world_size", "tensors": {"model/0.weight": ...}, "layout"}) comes back as the nested
  state its keys name ({"model": {"0.weight": ...}}), with the lists, tuples and int-keyed dicts its
  "layout" names: its tensors restore where they were saved from.
- "safetensors": a .safetensors file: {name: tensor}, memory-mapped.
- "hf": a Hugging Face directory: the files its `*.safetensors.index.json` weight map names, each for
  the tensors the map assigns to it (as from_pretrained reads them; one it assigns and the file lacks
  is refused), else its single `*.safetensors` file.
A directory of this library's checkpoints is refused (it needs no import).

`only` / `exclude` select by "/"-joined key of the state as read (dcp: "model/0.weight"; a
safetensors file: its names); what they leave out is not read where the format allows (dcp,
safetensors). Files written by export_safetensors name their tied weights in their metadata
("checkpointing.tied"); those names come back sharing one tensor (Loaded.tied).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from checkpointing.errors import CheckpointConfigError, CheckpointError, CheckpointNotFoundError
from checkpointing.restore.selection import Selection
from checkpointing.state.tree import join_key

KINDS = ("dcp", "torch", "safetensors", "hf")
_KINDS = ("list", "tuple", "int-keys")  # of containers, in an exported torch file's "layout"
_ZIP = b"PK\x03\x04"


@dataclasses.dataclass
class Loaded:
    kind: str
    state: dict[str, Any]
    tied: dict[str, str] = dataclasses.field(default_factory=dict)  # alias -> name, from export_safetensors' metadata
    keys: set[str] = dataclasses.field(default_factory=set)  # every key of the source (for patterns that match none)


def detect(src: Path) -> str:
    """The kind of checkpoint at `src` (see the module docstring)."""
    if src.is_dir():
        if (src / ".metadata").is_file():
            return "dcp"
        if (src / "TIER").exists() or any(p.name.startswith("step-") for p in src.iterdir()):
            raise CheckpointConfigError(f"{src} holds checkpoints of this library: no import needed (restore or load() it)")
        if list(src.glob("*.safetensors.index.json")) or list(src.glob("*.safetensors")):
            return "hf"
        raise CheckpointConfigError(f"{src} is neither a DCP checkpoint (no .metadata) nor a Hugging Face directory "
                                    "(no *.safetensors.index.json, no *.safetensors)")
    if not src.is_file():
        raise CheckpointNotFoundError(f"{src}: no such file or directory")
    with open(src, "rb") as f:
        head = f.read(9)
    if head[:4] == _ZIP:
        return "torch"
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < src.stat().st_size:
        return "safetensors"
    if head[:1] == b"\x80":  # a pickle's PROTO opcode: the legacy (pre-zip) torch.save format; torch.load says if it is not one
        return "torch"
    raise CheckpointConfigError(f"{src} is not a checkpoint import reads: neither a torch.save file (zip or legacy pickle), a "
                                ".safetensors file, a DCP checkpoint directory nor a Hugging Face directory")


def read(src: Path, kind: str, select: Selection) -> Loaded:
    """The state of the checkpoint at `src`, read as `kind`, restricted to `select`."""
    readers: dict[str, Callable[[Path, Selection], Loaded]] = {
        "dcp": _read_dcp, "torch": _read_torch, "safetensors": _read_safetensors, "hf": _read_hf,
    }
    if kind not in readers:
        raise CheckpointConfigError(f"kind={kind!r} is not one of {', '.join(KINDS)} (or None: told from the source)")
    try:
        return readers[kind](src, select)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - the readers are other libraries': their errors say what, this says where
        raise CheckpointConfigError(f"{src} cannot be read as a {kind} checkpoint ({type(exc).__name__}: {str(exc)[:300]})") from exc


def _read_dcp(src: Path, select: Selection) -> Loaded:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(src))
    meta = reader.read_metadata()  # a pickle: see TRUST in the module docstring
    planner_data = meta.planner_data or {}
    state: dict[str, Any] = {}
    keys: set[str] = set()
    for fqn, md in meta.state_dict_metadata.items():
        path = tuple(planner_data.get(fqn) or (fqn,))
        key = join_key(path)
        keys.update(_and_above(key))
        if not select.wants(key):
            continue
        value = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else md
        _set(state, path, value)
    if state:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load(state, storage_reader=reader, no_dist=True)
            except CheckpointException as exc:  # a BaseException: its failures per rank hold what went wrong
                causes = [f"{type(e).__name__}: {e}" for e, _ in getattr(exc, "failures", {}).values()] or [str(exc)]
                raise CheckpointConfigError(f"{src}: DCP could not read its data files ({' '.join(causes[0].split())[:300]}): is a .distcp file "
                                            "missing, or cut short? Copy the checkpoint whole and import it again") from None
    _optimizer_ids(state)
    return Loaded("dcp", state, keys=keys)


def _optimizer_ids(node: Any) -> None:
    """An optimizer's state_dict() keys its "state" by the int ids its "param_groups" list; DCP's flattening
    made them strings ("0"): made ints again, so Optimizer.load_state_dict finds them (it ignores str keys)."""
    if not isinstance(node, dict):
        return
    groups, state = node.get("param_groups"), node.get("state")
    if isinstance(groups, list) and isinstance(state, dict) and all(isinstance(g, dict) for g in groups):
        ids = {i for g in groups for i in (g.get("params") or []) if isinstance(i, int) and not isinstance(i, bool)}
        if ids and all(isinstance(k, str) and k.isdecimal() and int(k) in ids for k in state):
            node["state"] = {int(k): v for k, v in state.items()}
    for child in node.values():
        _optimizer_ids(child)


def _read_torch(src: Path, select: Selection) -> Loaded:
    try:
        with open(src, "rb") as f:
            zipped = f.read(4) == _ZIP
        obj = torch.load(src, map_location="cpu", weights_only=True, mmap=zipped)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, AttributeError, ImportError) as exc:
        raise CheckpointConfigError(_unreadable_torch_file(src, exc)) from None
    if not isinstance(obj, dict):
        obj = {"value": obj}  # import_checkpoint(..., under=KEY) names it
    elif _exported(obj):  # export_torch's file: its keys ("model/0.weight") name the nested state they came from
        state: dict[str, Any] = {}
        for key, tensor in obj["tensors"].items():
            _set(state, _segments(key), tensor)
        for prefix, kind in sorted(obj.get("layout", {}).items(), key=lambda item: -item[0].count("/")):  # the deepest first
            _rebuild(state, _segments(prefix), kind)
        obj = state
    keys: set[str] = set()
    return Loaded("torch", _select(obj, (), select, keys), keys=keys)


def _exported(obj: dict) -> bool:
    """The layout torch_export.py writes: {"step": int, "world_size": int, "tensors": {str: Tensor}, "layout": {str: str}}
    ("layout" since it was added: files written before have none)."""
    tensors, layout = obj.get("tensors"), obj.get("layout", {})
    return (set(obj) - {"layout"} == {"step", "world_size", "tensors"} and isinstance(obj["step"], int)
            and isinstance(obj["world_size"], int) and isinstance(tensors, dict)
            and all(isinstance(k, str) and k and isinstance(v, torch.Tensor) for k, v in tensors.items())
            and isinstance(layout, dict) and all(isinstance(k, str) and k and v in _KINDS for k, v in layout.items()))


def _segments(key: str) -> tuple[str, ...]:
    """A "/"-joined key's segments, unescaped ("%2F" is "/", "%25" is "%")."""
    return tuple(re.sub("%(25|2F)", lambda m: "%" if m.group(1) == "25" else "/", s) for s in key.split("/"))


def _rebuild(state: dict[str, Any], path: tuple[str, ...], kind: str) -> None:
    """The dict at `path` (str keys, as read) as the list, tuple or int-keyed dict it was saved as; left as it is when
    its keys are not those (a selection took some items of a list only: then an int-keyed dict)."""
    parent: Any = state
    for key in path[:-1]:
        parent = parent.get(key) if isinstance(parent, dict) else None
    node = parent.get(path[-1]) if isinstance(parent, dict) else None
    if not isinstance(node, dict) or not all(k.isdecimal() and str(int(k)) == k for k in node):
        return
    items = {int(k): v for k, v in node.items()}
    whole = sorted(items) == list(range(len(items)))
    if kind == "int-keys" or not whole:
        parent[path[-1]] = items
    else:
        parent[path[-1]] = [items[i] for i in range(len(items))] if kind == "list" else tuple(items[i] for i in range(len(items)))


def _read_safetensors(src: Path, select: Selection, loaded: Loaded | None = None, mapped: set[str] | None = None) -> Loaded:
    """The file's tensors (`mapped`: only those an index assigns to this file) into `loaded` (a new Loaded)."""
    from safetensors import safe_open

    out = loaded or Loaded("safetensors", {})
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata() or {}
        names = list(f.keys())
        for name in names if mapped is None else [n for n in names if n in mapped]:
            out.keys.update(_and_above(join_key((name,))))
            if select.wants(join_key((name,))):
                out.state[name] = f.get_tensor(name)  # memory-mapped: no copy until it is written
    if mapped is not None and (missing := sorted(mapped - set(names))):
        raise CheckpointConfigError(f"{src} lacks {len(missing)} tensor(s) the index assigns to it ({', '.join(missing[:4])}): "
                                    "the directory is incomplete or its index is stale; save it again or fix the index")
    try:
        tied = json.loads(meta.get("checkpointing.tied", "{}"))
    except ValueError:
        tied = None
    if isinstance(tied, dict) and all(isinstance(a, str) and a and isinstance(n, str) and n for a, n in tied.items()):
        out.tied.update(tied)  # else not ours, or damaged: ties are then restored by import_checkpoint(tie=...) only
    return out


def _read_hf(src: Path, select: Selection) -> Loaded:
    if not src.is_dir():
        raise CheckpointConfigError(f"{src} is a file: a Hugging Face checkpoint is the directory save_pretrained writes "
                                    "(for one .safetensors file use --format safetensors, or leave --format out)")
    indexes = sorted(src.glob("*.safetensors.index.json"))
    assigned: dict[str, set[str]] = {}  # file -> the names the index puts in it
    if indexes:
        index = src / "model.safetensors.index.json" if (src / "model.safetensors.index.json").is_file() else indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
            assigned = {f: {n for n, g in weight_map.items() if g == f} for f in files}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointConfigError(f"{index} is not a safetensors index ({exc})") from None
        bad = [f for f in files if not isinstance(f, str) or Path(f).name != f or f.startswith(".")]
        if bad:
            raise CheckpointConfigError(f"{index} names {bad[0]!r}: an index may name only files beside it")
    else:
        files = [p.name for p in sorted(src.glob("*.safetensors"))]
        if len(files) > 1 and "model.safetensors" not in files:
            raise CheckpointConfigError(f"{src} holds several .safetensors files and no index: import one of them ({', '.join(files[:4])})")
        files = ["model.safetensors"] if len(files) > 1 else files
    loaded = Loaded("hf", {})
    for name in files:
        if not (src / name).is_file():
            raise CheckpointNotFoundError(f"{src / name}: named by the index, missing")
        _read_safetensors(src / name, select, loaded, assigned.get(name))  # one after the other, into the one state
    return loaded


def _set(state: dict[str, Any], path: tuple, value: Any) -> None:
    """state[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int indices) on the way, as DCP does."""
    node: Any = state
    for key, nxt in zip(path, path[1:]):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            node[key] = empty if node[key] is None else node[key]
        else:
            node.setdefault(key, empty)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _select(node: dict, path: tuple, select: Selection, keys: set[str]) -> dict:
    """The dict `node` with only its selected keys (a list or tuple is kept whole when anything in it is selected)."""
    out = {}
    for k, v in node.items():
        p = path + (k,)
        key = join_key(p)
        keys.add(key)
        if isinstance(v, dict):
            sub = _select(v, p, select, keys)
            if select.wants(key) or sub:
                out[k] = v if select.wants(key) else sub
        elif isinstance(v, (list, tuple)):
            if _sequence_selected(v, p, select, keys):
                out[k] = v
        elif select.wants(key):
            out[k] = v
    return out


def _sequence_selected(node: list | tuple, path: tuple, select: Selection, keys: set[str]) -> bool:
    found = select.wants(join_key(path))
    for i, v in enumerate(node):
        p = path + (i,)
        keys.add(join_key(p))
        if isinstance(v, dict):
            found = bool(_select(v, p, select, keys)) or found
        elif isinstance(v, (list, tuple)):
            found = _sequence_selected(v, p, select, keys) or found
        else:
            found = found or select.wants(join_key(p))
    return found


def _and_above(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def source_path(src: str | os.PathLike) -> Path:
    if "://" in os.fspath(src):
        raise CheckpointConfigError(f"{src}: import reads a local file or directory (copy a remote one here first)")
    return Path(src)


def _unreadable_torch_file(src: Path, exc: BaseException) -> str:
    """Why torch.load(weights_only=True) refused `src`, and what to do (torch's own text names a
    remedy, weights_only=False, that import never takes: it would run the file's pickled code)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return (f"{src} holds objects of type {named.group(1)}, and import builds only tensors and plain containers (it never "
                "runs a file's pickled code). If you trust the file: load it yourself (torch.load(path, weights_only=False)), "
                "keep its tensors (a numpy array as torch.from_numpy(a)) in dicts and lists, torch.save that and import it")
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    return f"{src} cannot be read as a torch.save file ({type(exc).__name__}: {first}): is it one, and whole?"

"""Flatten a user state into a JSON tree plus a list of tensor leaves (pure: no I/O).

The tree keeps every non-tensor value and the exact container structure (dict keys may be str or
int, tuples stay tuples); each tensor is replaced by a reference into the leaf list. Tensors that
alias the same memory (tied weights) become one leaf referenced twice.

Node kinds (the manifest's `tree`, see docs/format.md):
    {"dict": [[key, node], ...]}   {"list": [node, ...]}   {"tuple": [node, ...]}
    {"value": None|bool|int|str|finite float}   {"float": "nan"|"inf"|"-inf"}   {"bytes": base64}
    {"tensor": index}   {"ndarray": index}
    {"stateful": node, "class": "module.Qualname"}   {"codec": name, "data": json-like}
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from checkpointing.state.codecs import Codec, find_codec
from checkpointing.errors import ManifestError, StateError
from checkpointing.format.decode import MAX_TREE_DEPTH, check_tree
from checkpointing.format.dtypes import NAME_OF
from checkpointing.state.sharding import ShardLayout, dtensor_layout, is_dtensor, local_tensor

NUMPY_KINDS = frozenset("biufc")
MAX_INT_BITS = 4096  # far below CPython's int <-> str conversion limit


@dataclasses.dataclass
class Leaf:
    """One tensor to checkpoint. `tensor` is live user memory until the snapshot copies it."""

    key: str
    tensor: torch.Tensor  # for a DTensor: its local shard
    deferred: bool  # True: copying may wait until the guard (only the optimizer step mutates it)
    layout: ShardLayout | None = None  # set for DTensor shards; None: a plain (per-rank) tensor
    version: int = -1  # deferred: the tensor's version counter at save() (an in-place write bumps it); else -1
    address: int = 0  # deferred: where its memory was at save() (freed and allocated again, it moves); else 0
    counted: tuple[torch.Tensor, ...] = ()  # deferred: other tensors whose version counters `version` adds up: a
    # DTensor and the parameter or optimizer state it was taken from (an in-place op on a DTensor moves its own counter,
    # a write through to_local() its shard's, and neither moves the counters of a state_dict()'s detached copy)

    def version_now(self) -> int:
        """The counters only grow: their sum moves when any does."""
        return self.tensor._version + sum(c._version for c in self.counted)


@dataclasses.dataclass
class FlatState:
    tree: dict[str, Any]
    leaves: list[Leaf]

    @property
    def nbytes(self) -> int:
        return sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in self.leaves)


def escape_segment(seg: str | int) -> str:
    return str(seg).replace("%", "%25").replace("/", "%2F")


def join_key(path: tuple[str | int, ...]) -> str:
    return "/".join(escape_segment(s) for s in path)


def is_stateful(obj: Any) -> bool:
    """An object with state_dict()/load_state_dict() (a class itself, torch.nn.GELU as a hyper-parameter, is not)."""
    return not isinstance(obj, type) and callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def class_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def encode_float(x: float) -> dict[str, Any]:
    if math.isfinite(x):
        return {"value": x}
    return {"float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


Owners = Mapping[int, Mapping[tuple, tuple[torch.Tensor, ...]]]  # storage address -> view -> the live tensors (owners())


def flatten_state(state: Mapping[str, Any], *, codecs: tuple[Codec, ...] = (), eager: bool = False,
                  watched: Owners | None = None) -> FlatState:
    """Walk `state`; raise StateError naming the key of anything that cannot be checkpointed.

    A tensor's copy may be deferred (Leaf.deferred) when it belongs to an optimizer object or to a
    module's parameters, or when its storage address is in `watched` (storages that only a guarded
    optimizer.step() mutates: a state_dict()'s tensors share them); never when `eager`.
    """
    if not isinstance(state, Mapping):
        raise StateError(f"state must be a dict of name -> value, such as {{'model': model, 'optim': optimizer}}; got {type(state).__name__}")
    walker = _Walker(codecs, eager, watched or {})
    tree = walker.visit_mapping(state, ())
    try:  # what save writes, restore must be able to read: the decoder's own checks, now
        check_tree(tree, len(walker.leaves), "state")
    except ManifestError as exc:
        raise StateError(f"{exc}: flatten that part of the state or encode it with a codec") from None
    return FlatState(tree, walker.leaves)


def _unsupported(t: torch.Tensor) -> str | None:
    """Why a (local) tensor cannot be saved as dense bytes, with what to do instead; None when it can."""
    if t.is_nested:
        return "is a nested tensor: save its components (t.unbind()) as a list of tensors"
    if t.is_quantized:
        return f"is a quantized tensor ({t.dtype}): save t.dequantize(), or t.int_repr() with its scale and zero point"
    if t.is_sparse or t.layout != torch.strided:
        return f"is a sparse tensor ({t.layout}): save t.to_dense(), or its indices and values as separate tensors"
    if t.device.type == "meta":
        return "is on the meta device and holds no data: materialize it (e.g. module.to_empty() and initialise) before saving"
    if t.dtype not in NAME_OF:
        return (f"has dtype {t.dtype}, which the format does not hold (it holds {', '.join(NAME_OF.values())}): save it viewed "
                "as one of those of the same size (t.view(torch.uint8)) and view it back after restore")
    return None


class _Walker:
    def __init__(self, codecs: tuple[Codec, ...], eager: bool, watched: Owners) -> None:
        self.codecs = codecs
        self.eager = eager
        self.watched = watched
        self.leaves: list[Leaf] = []
        self._alias: dict[tuple, int] = {}
        self._renormed: frozenset[int] = frozenset()  # weights a forward rewrites in place: never deferred

    def visit_mapping(self, obj: Mapping, path: tuple, deferred: Owners | bool = False) -> dict[str, Any]:
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise StateError(
                    f"state key {k!r} at {join_key(path) or '<root>'} is a {type(k).__name__}: "
                    "dict keys must be str or int"
                )
            if isinstance(k, int) and k.bit_length() > MAX_INT_BITS:
                raise StateError(f"state key at {join_key(path) or '<root>'} is an integer of {k.bit_length()} bits: use a smaller key")
            items.append([k, self.visit(v, path + (k,), deferred)])
        return {"dict": items}

    def visit(self, obj: Any, path: tuple, deferred: Owners | bool) -> dict[str, Any]:
        if isinstance(obj, torch.Tensor):
            return {"tensor": self.add_tensor(obj, path, deferred)}
        if isinstance(obj, np.ndarray):
            if type(obj) is not np.ndarray and (codec := find_codec(self.codecs, obj)) is not None:
                return self.visit_codec(codec, obj, path)
            return {"ndarray": self.add_ndarray(obj, path)}
        if len(path) > MAX_TREE_DEPTH:
            raise StateError(f"state[{join_key(path[:4])!r}...] nests deeper than {MAX_TREE_DEPTH} levels (does a dict or list hold "
                             "itself?): flatten that part of the state or encode it with a codec")
        if type(obj) not in _PLAIN and isinstance(obj, (int, str, float, Mapping, list, tuple)):  # a subclass (IntEnum, OrderedDict):
            codec = find_codec(self.codecs, obj)  # its codec, or its own state_dict(), before its base type
            if codec is not None:
                return self.visit_codec(codec, obj, path)
            if is_stateful(obj):
                return self.visit_stateful(obj, path)
        if obj is None or isinstance(obj, bool):
            return {"value": obj}
        if isinstance(obj, int):
            if obj.bit_length() > MAX_INT_BITS:
                raise StateError(f"state[{join_key(path)!r}] is an integer of {obj.bit_length()} bits: store it as a string or bytes")
            return {"value": int(obj)}
        if isinstance(obj, str):
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise StateError(f"state[{join_key(path)!r}] is a string that is not valid UTF-8 ({exc.reason}): store it as bytes") from None
            return {"value": obj}
        if isinstance(obj, float):
            return encode_float(obj)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
            return self.visit(obj.item(), path, deferred)
        if isinstance(obj, (bytes, bytearray)):
            return {"bytes": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, Mapping):
            return self.visit_mapping(obj, path, deferred)
        if isinstance(obj, list):
            return {"list": [self.visit(v, path + (i,), deferred) for i, v in enumerate(obj)]}
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return {"tuple": [self.visit(v, path + (i,), deferred) for i, v in enumerate(obj)]}
        codec = find_codec(self.codecs, obj)
        if codec is not None:
            return self.visit_codec(codec, obj, path)
        if is_stateful(obj):
            return self.visit_stateful(obj, path)
        if isinstance(obj, type):
            raise StateError(f"state[{join_key(path)!r}] is the class {obj.__module__}.{obj.__qualname__}, not a value: store its "
                             "name (a string) and look the class up after restore, or give CheckpointManager(codecs=[...]) a codec")
        raise StateError(
            f"state[{join_key(path)!r}] is a {class_name(obj)}, which is not checkpointable: pass "
            "tensors, numpy arrays, JSON-like values, or objects with state_dict()/load_state_dict(); "
            "for other objects give CheckpointManager(codecs=[...]) a codec (restore never unpickles by default)"
        )

    def visit_stateful(self, obj: Any, path: tuple) -> dict[str, Any]:
        deferred: Owners | bool = False
        if not self.eager:
            if isinstance(obj, torch.optim.Optimizer):
                # per-parameter state changes only inside optimizer.step(); param_groups (a tensor lr) in scheduler.step() too
                deferred = owners(v for st in obj.state.values() if isinstance(st, Mapping)
                                  for v in st.values() if isinstance(v, torch.Tensor))
            elif isinstance(obj, torch.nn.Module):
                # parameters change only in optimizer.step(); buffers (BatchNorm stats) and the weights a forward
                # renormalizes in place (nn.Embedding(max_norm=...)) change in forward
                renormed = frozenset(_storage(m.weight) for m in obj.modules() if _renorms(m))
                self._renormed |= renormed
                deferred = {address: held for address, held in owners(
                    p for p in obj.parameters() if not isinstance(p, torch.nn.parameter.UninitializedTensorMixin)).items()
                    if address not in renormed}
        try:
            sd = obj.state_dict()
        except Exception as exc:  # noqa: BLE001 - the user's object: say which
            raise StateError(f"state[{join_key(path)!r}].state_dict() ({class_name(obj)}) raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(sd, Mapping):
            raise StateError(f"state[{join_key(path)!r}].state_dict() returned a {type(sd).__name__}, not a dict")
        return {"stateful": self.visit_mapping(sd, path, deferred), "class": class_name(obj)}

    def visit_codec(self, codec: Codec, obj: Any, path: tuple) -> dict[str, Any]:
        try:
            data = codec.encode(obj)
        except Exception as exc:  # noqa: BLE001 - the user's codec: say which, and where
            raise StateError(f"codec {codec.name!r} failed to encode state[{join_key(path)!r}] ({class_name(obj)}): "
                             f"{type(exc).__name__}: {exc}") from exc
        try:
            json.dumps(data, allow_nan=False)
            _json_keys(data)
        except (TypeError, ValueError) as exc:
            raise StateError(f"codec {codec.name!r} returned non-JSON data for state[{join_key(path)!r}]: {exc} (JSON holds dicts "
                             "with str keys, lists, str, int, float, bool, None: encode bytes with base64)") from exc
        return {"codec": codec.name, "data": data}

    def add_tensor(self, t: torch.Tensor, path: tuple, deferred: Owners | bool) -> int:
        key = join_key(path)
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            raise StateError(f"state[{key!r}] is an uninitialized parameter or buffer (a lazy module, e.g. nn.LazyLinear): "
                             "run one forward pass to create it before saving")
        layout, counted = None, None
        if is_dtensor(t):
            counted = t
            t, layout = dtensor_layout(t, key)  # detached below: a DTensor's own detach() is a dispatched op (~30 us)
        elif t.is_nested:
            raise StateError(f"state[{key!r}] {_unsupported(t)}")
        elif type(t) is not torch.Tensor and not (isinstance(t, torch.nn.Parameter) and type(t.data) is torch.Tensor):  # a
            # Parameter of a subclass (nn.Parameter(TwoTensor), a quantized weight) passes isinstance(): its data tells
            raise StateError(f"state[{key!r}] is a {class_name(t)}: pass a plain tensor or a DTensor (tensor subclasses are not supported)")
        refusal = _unsupported(t)
        if refusal is not None:
            raise StateError(f"state[{key!r}] {refusal}")
        t = t.detach()
        if t.is_conj() or t.is_neg():  # a lazy view: its memory holds other values than it reads as
            t = t.resolve_conj().resolve_neg()  # the values, copied now (save() time): nothing left to defer
            deferred = False
        storage_ptr = t.untyped_storage().data_ptr()
        alias_key = (t.device, storage_ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, layout)
        if t.numel() and alias_key in self._alias:
            return self._alias[alias_key]
        held: tuple[torch.Tensor, ...] = ()
        if not isinstance(deferred, bool):
            held, deferred = deferred.get(storage_ptr, {}).get(_view(t), ()), storage_ptr in deferred
        deferred = (deferred or storage_ptr in self.watched) and storage_ptr not in self._renormed
        deferred = bool(deferred) and not self.eager
        watched = self.watched.get(storage_ptr, {}).get(_view(t), ()) if deferred else ()
        counted = _distinct((counted, *held, *watched), t) if deferred else ()
        version = t._version + sum(c._version for c in counted) if deferred else -1
        self.leaves.append(Leaf(key, t, deferred, layout, version, t.data_ptr() if deferred else 0, counted))
        self._alias[alias_key] = len(self.leaves) - 1
        return len(self.leaves) - 1

    def add_ndarray(self, a: np.ndarray, path: tuple) -> int:
        if type(a) is not np.ndarray and not isinstance(a, np.memmap):  # its own data (a mask, a matrix's rules) would be lost
            raise StateError(f"state[{join_key(path)!r}] is a {class_name(a)}, a subclass of numpy.ndarray whose own data would be "
                             "lost: save its parts as arrays (a masked array's a.data and a.mask) or np.asarray(a), or register a codec")
        if a.dtype.kind not in NUMPY_KINDS or a.dtype.byteorder == ">":
            raise StateError(f"state[{join_key(path)!r}] is a numpy array of dtype {a.dtype}: only native numeric/bool arrays can be checkpointed")
        try:  # ascontiguousarray() would make a 0-d array 1-d: only a strided one is copied
            t = torch.from_numpy(a if a.flags.c_contiguous else np.ascontiguousarray(a))
        except TypeError:  # float128, complex256: no torch dtype
            raise StateError(f"state[{join_key(path)!r}] is a numpy array of dtype {a.dtype}, which torch has no dtype for: "
                             "convert it (e.g. a.astype(np.float64)) before saving") from None
        self.leaves.append(Leaf(join_key(path), t, False))
        return len(self.leaves) - 1


_PLAIN = (int, str, float, dict, list, tuple, bool)


def _json_keys(data: Any) -> None:
    """ValueError for a dict key that is not a str anywhere in `data` (json.dumps would turn 1 into "1" silently)."""
    if isinstance(data, dict):
        for k, v in data.items():
            if not isinstance(k, str):
                raise ValueError(f"the dict key {k!r} ({type(k).__name__}) is not a str")
            _json_keys(v)
    elif isinstance(data, (list, tuple)):
        for v in data:
            _json_keys(v)


def _storage(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage().data_ptr()


def owners(tensors: Iterable[torch.Tensor]) -> dict[int, dict[tuple, tuple[torch.Tensor, ...]]]:
    """Per storage address (never 0: empty), per view of it (offset, shape), the tensors there as the user holds
    them: a DTensor with its local shard."""
    out: dict[int, dict[tuple, tuple[torch.Tensor, ...]]] = {}
    for t in tensors:
        local = local_tensor(t)
        try:
            address = local.untyped_storage().data_ptr()
        except RuntimeError:  # a wrapper subclass with no storage of its own: add_tensor refuses it by its key
            continue
        if address:
            out.setdefault(address, {}).setdefault(_view(local), _distinct((t, local), None))
    return out


def _view(t: torch.Tensor) -> tuple:
    return t.storage_offset(), tuple(t.shape)


def _distinct(tensors: Iterable[torch.Tensor | None], leaf: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The tensors, each once (by identity: == compares values), without None and `leaf`."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t is not None and t is not leaf:
            seen.setdefault(id(t), t)
    return tuple(seen.values())


def _renorms(module: torch.nn.Module) -> bool:
    """A module whose forward rewrites rows of its weight in place (embedding max_norm renormalization)."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.max_norm is not None

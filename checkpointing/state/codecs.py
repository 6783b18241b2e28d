"""Opt-in codecs for Python objects that are not JSON-like.

Restore never unpickles anything by default. A user who wants to checkpoint, say, a dataclass passes
a codec that turns it into JSON-like data and back; `PickleCodec` exists for users who trust their
checkpoint storage and explicitly allow pickle for a named set of types.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any, Protocol, runtime_checkable

from checkpointing.errors import CheckpointConfigError, CheckpointError, StateError


@runtime_checkable
class Codec(Protocol):
    """Turns objects of `types` into JSON-like data and back.

    name: stored in the manifest; restore looks the codec up by this name.
    types: the classes this codec handles (exact type match first, then isinstance).
    encode(obj) -> JSON-like data (None/bool/int/float/str, lists, dicts with str keys).
    decode(data) -> the object.
    """

    name: str
    types: tuple[type, ...]

    def encode(self, obj: Any) -> Any: ...

    def decode(self, data: Any) -> Any: ...


class PickleCodec:
    """Pickle for an explicit allowlist of types. Loading runs pickle: use it only with storage you trust.

    Even then, loading builds only the types it was given: a restricted unpickler refuses every
    other class or function a (tampered) pickle names, so a checkpoint cannot run code through
    this codec beyond those types' own constructors. A value whose pickle needs another type (a
    field holding an object of a class not listed) is refused at save(), naming that type.
    """

    name = "pickle"

    def __init__(self, *types: type) -> None:
        if not types:
            raise ValueError("PickleCodec needs the types it may pickle, e.g. PickleCodec(MyConfig)")
        self.types = tuple(types)
        self._allowed = frozenset((t.__module__, t.__qualname__) for t in types) | _SAFE_GLOBALS

    def encode(self, obj: Any) -> Any:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:  # what save writes, restore must be able to read: refuse now what loading would refuse
            self._load(data)
        except CheckpointError as exc:
            raise StateError(f"PickleCodec cannot save a {type(obj).__module__}.{type(obj).__qualname__}: {exc}") from None
        return base64.b64encode(data).decode("ascii")

    def decode(self, data: Any) -> Any:
        if not isinstance(data, str):
            raise CheckpointError(f"PickleCodec data must be a base64 string, found a {type(data).__name__}: the checkpoint is damaged")
        try:
            raw = base64.b64decode(data, validate=True)
        except binascii.Error as exc:
            raise CheckpointError(f"PickleCodec data is not valid base64 ({exc}): the checkpoint is damaged") from None
        return self._load(raw)

    def _load(self, data: bytes) -> Any:
        try:
            return _RestrictedUnpickler(io.BytesIO(data), self._allowed).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of a damaged pickle is one clear error
            raise CheckpointError(f"PickleCodec data cannot be loaded ({type(exc).__name__}: {exc}): the checkpoint is damaged") from None


# Harmless builtins a pickle of an allowed type may name (containers and numbers only; no callables
# that run code). Anything else must be among the codec's types.
_SAFE_GLOBALS = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "bytearray"),
    ("builtins", "slice"), ("builtins", "range"), ("collections", "OrderedDict"),
})


# modules a pickle names only to run code (os.system is posix.system in a pickle): never suggested for an allow-list
_RUNS_CODE = frozenset({"os", "posix", "nt", "subprocess", "builtins", "__builtin__", "sys", "shutil", "importlib", "runpy", "pty",
                        "socket", "code", "codeop", "ctypes", "pickle", "marshal", "types", "operator", "functools", "webbrowser"})


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the (module, qualified name) pairs it was given."""

    def __init__(self, file: io.BytesIO, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._allowed:
            if module.split(".")[0] in _RUNS_CODE:
                raise CheckpointError(f"the pickle names {module}.{name}: loading it would run code (a call into {module}); "
                                      "do not load this checkpoint, and do not add that name to a PickleCodec")
            raise CheckpointError(
                f"the pickle names {module}.{name}, which is not among the types this PickleCodec was given. If it is a "
                f"class you saved and you trust this checkpoint, add it: PickleCodec(..., {name.rsplit('.', 1)[-1]}); a "
                "function there (os.system, eval, a builtin) means the pickle would run code: do not load it"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("the pickle refers to a persistent id, which PickleCodec never writes: the checkpoint is damaged")


def find_codec(codecs: tuple[Codec, ...], obj: Any) -> Codec | None:
    for codec in codecs:
        if type(obj) in codec.types:
            return codec
    for codec in codecs:
        if isinstance(obj, codec.types):
            return codec
    return None


def codec_tuple(codecs: Any) -> tuple[Codec, ...]:
    """The `codecs=` a caller passed, checked: an iterable of codec objects (name, types, encode, decode)."""
    example = "e.g. codecs=[PickleCodec(MyConfig)]"
    if _is_codec(codecs) or isinstance(codecs, (str, bytes)):
        raise CheckpointConfigError(f"codecs={codecs!r} is invalid: pass a list of codec objects ({example})")
    try:
        out = tuple(codecs)
    except TypeError:
        raise CheckpointConfigError(f"codecs={codecs!r} is invalid: pass a list of codec objects ({example})") from None
    for c in out:
        if isinstance(c, type):
            raise CheckpointConfigError(f"codecs: {c.__name__} is a class; pass an instance of it ({example})")
        if not _is_codec(c):
            raise CheckpointConfigError(f"codecs: {c!r} is not a codec (an object with a str name, a tuple of types, encode() "
                                        f"and decode(); {example})")
    return out


def _is_codec(obj: Any) -> bool:
    return (not isinstance(obj, type) and isinstance(getattr(obj, "name", None), str) and isinstance(getattr(obj, "types", None), tuple)
            and callable(getattr(obj, "encode", None)) and callable(getattr(obj, "decode", None)))

"""Opt-in codecs for Python objects that are not JSON-like.

Restore never unpickles anything by default. A user who wants to checkpoint, say, a dataclass passes
a codec that turns it into JSON-like data and back; `PickleCodec` exists for users who trust their
checkpoint storage and explicitly allow pickle for a named set of types.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any, Protocol, runtime_checkable


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
    """Pickle for an explicit allowlist of types. Loading executes pickle: use only with trusted storage."""

    name = "pickle"

    def __init__(self, *types: type) -> None:
        if not types:
            raise ValueError("PickleCodec needs the types it may pickle, e.g. PickleCodec(MyConfig)")
        self.types = tuple(types)

    def encode(self, obj: Any) -> Any:
        return base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")

    def decode(self, data: Any) -> Any:
        return pickle.loads(base64.b64decode(data))  # noqa: S301 - explicit opt-in


def find_codec(codecs: tuple[Codec, ...], obj: Any) -> Codec | None:
    for codec in codecs:
        if type(obj) in codec.types:
            return codec
    for codec in codecs:
        if isinstance(obj, codec.types):
            return codec
    return None

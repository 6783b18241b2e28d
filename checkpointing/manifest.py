"""The manifest and commit marker: frozen dataclasses, canonical JSON, strict validation (pure).

`decode_*` never raises anything but ManifestError on bad input, whatever the bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from typing import Any

import xxhash

from .dtypes import BY_NAME, dtype_from_name, itemsize
from .errors import ManifestError
from .layout import check_relpath

FORMAT_VERSION = 1
CHUNK_DIGEST = "xxh3-128"
MAX_TREE_DEPTH = 64
_DIGEST = re.compile(r"^xxh3-128:[0-9a-f]{32}$")
_MANIFEST_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    file: str  # relative to the tier root
    offset: int
    length: int
    digest: str  # "xxh3-128:<hex>" of the chunk's bytes


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    offsets: tuple[int, ...]  # where this shard starts in the global tensor
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]  # the shard's row-major bytes, in order


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]  # global shape
    shards: tuple[ShardEntry, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(dtype_from_name(self.dtype))


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int
    tree: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    world_size: int = 1
    format_version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def files(self) -> set[str]:
        return {c.file for t in self.tensors for s in t.shards for c in s.chunks}


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    step: int
    manifest: str  # relative path of the manifest file
    manifest_digest: str  # "sha256:<hex>" of the manifest bytes
    format_version: int = FORMAT_VERSION


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def chunk_digest(data: memoryview | bytes) -> str:
    """The digest every chunk reference carries (xxh3-128 releases the GIL while it runs)."""
    return f"{CHUNK_DIGEST}:{xxhash.xxh3_128(data).hexdigest()}"


def manifest_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def encode_manifest(m: Manifest) -> bytes:
    return canonical_json(
        {
            "format_version": m.format_version,
            "step": m.step,
            "world_size": m.world_size,
            "chunk_digest": CHUNK_DIGEST,
            "tree": m.tree,
            "tensors": [
                {
                    "key": t.key,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "shards": [
                        {
                            "offsets": list(s.offsets),
                            "shape": list(s.shape),
                            "chunks": [[c.file, c.offset, c.length, c.digest] for c in s.chunks],
                        }
                        for s in t.shards
                    ],
                }
                for t in m.tensors
            ],
        }
    )


def encode_commit(c: CommitMarker) -> bytes:
    return canonical_json(
        {"format_version": c.format_version, "step": c.step, "manifest": c.manifest, "manifest_digest": c.manifest_digest}
    )


# ---------------------------------------------------------------- decoding with validation


def _load_json(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{where} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{where} must hold a JSON object, found {type(obj).__name__}")
    version = obj.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{where} has format_version {version!r}; this library reads version {FORMAT_VERSION} "
            "(upgrade checkpointing to read newer checkpoints)"
        )
    return obj


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def _int(obj: Any, what: str, where: str, lo: int = 0) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int) or obj < lo:
        raise ManifestError(f"{where}: {what} must be an integer >= {lo}, found {obj!r:.80}")
    return obj


def _ints(obj: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(obj, list) or len(obj) > 64:
        raise ManifestError(f"{where}: {what} must be a list of at most 64 integers, found {obj!r:.80}")
    return tuple(_int(x, what, where) for x in obj)


def _field(obj: dict, name: str, where: str) -> Any:
    if name not in obj:
        raise ManifestError(f"{where}: missing field {name!r}")
    return obj[name]


def decode_commit(data: bytes, where: str) -> CommitMarker:
    obj = _load_json(data, where)
    digest = _field(obj, "manifest_digest", where)
    if not isinstance(digest, str) or not _MANIFEST_DIGEST.fullmatch(digest):
        raise ManifestError(f"{where}: manifest_digest {digest!r:.80} is not 'sha256:<64 hex>'")
    return CommitMarker(
        step=_int(_field(obj, "step", where), "step", where),
        manifest=check_relpath(_field(obj, "manifest", where), what=f"{where}: manifest"),
        manifest_digest=digest,
    )


def check_tree(tree: Any, n_tensors: int, where: str) -> None:
    """Validate a tree exactly as decode_manifest will: what a save writes, a restore can read."""
    _check_node(tree, n_tensors, where, 0)
    if "dict" not in tree:
        raise ManifestError(f"{where}: the tree root must be a dict node")


def decode_manifest(data: bytes, where: str) -> Manifest:
    obj = _load_json(data, where)
    if obj.get("chunk_digest") != CHUNK_DIGEST:
        raise ManifestError(f"{where}: chunk_digest {obj.get('chunk_digest')!r} is not {CHUNK_DIGEST!r}")
    raw_tensors = _field(obj, "tensors", where)
    if not isinstance(raw_tensors, list):
        raise ManifestError(f"{where}: tensors must be a list")
    tensors = tuple(_decode_tensor(t, f"{where} tensors[{i}]") for i, t in enumerate(raw_tensors))
    tree = _field(obj, "tree", where)
    check_tree(tree, len(tensors), where + " tree")
    return Manifest(
        step=_int(_field(obj, "step", where), "step", where),
        tree=tree,
        tensors=tensors,
        world_size=_int(_field(obj, "world_size", where), "world_size", where, lo=1),
    )


def _decode_tensor(obj: Any, where: str) -> TensorEntry:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where} must be an object")
    key = _field(obj, "key", where)
    if not isinstance(key, str):
        raise ManifestError(f"{where}: key must be a string")
    where = f"{where} ({key!r:.120})"
    dtype = _field(obj, "dtype", where)
    if not isinstance(dtype, str) or dtype not in BY_NAME:
        raise ManifestError(f"{where}: unknown dtype {dtype!r:.40} (known: {', '.join(BY_NAME)})")
    size = itemsize(BY_NAME[dtype])
    shape = _ints(_field(obj, "shape", where), "shape", where)
    raw_shards = _field(obj, "shards", where)
    if not isinstance(raw_shards, list) or not raw_shards:
        raise ManifestError(f"{where}: shards must be a non-empty list")
    shards = []
    covered = 0
    for j, raw in enumerate(raw_shards):
        sw = f"{where} shard {j}"
        if not isinstance(raw, dict):
            raise ManifestError(f"{sw} must be an object")
        offsets = _ints(_field(raw, "offsets", sw), "offsets", sw)
        sshape = _ints(_field(raw, "shape", sw), "shape", sw)
        if len(offsets) != len(shape) or len(sshape) != len(shape):
            raise ManifestError(f"{sw}: offsets {offsets} / shape {sshape} do not match the tensor's rank {len(shape)}")
        if any(o + n > g for o, n, g in zip(offsets, sshape, shape)):
            raise ManifestError(f"{sw}: offsets {offsets} + shape {sshape} exceed the global shape {shape}")
        raw_chunks = _field(raw, "chunks", sw)
        if not isinstance(raw_chunks, list):
            raise ManifestError(f"{sw}: chunks must be a list")
        chunks = tuple(_decode_chunk(c, f"{sw} chunk {k}") for k, c in enumerate(raw_chunks))
        numel = math.prod(sshape)
        if sum(c.length for c in chunks) != numel * size:
            raise ManifestError(f"{sw}: chunk lengths add up to {sum(c.length for c in chunks)} bytes, the shard needs {numel * size}")
        covered += numel
        shards.append(ShardEntry(offsets, sshape, chunks))
    if covered != math.prod(shape):
        raise ManifestError(f"{where}: shards cover {covered} elements, the tensor has {math.prod(shape)}")
    return TensorEntry(key, dtype, shape, tuple(shards))


def _decode_chunk(obj: Any, where: str) -> ChunkRef:
    if not isinstance(obj, list) or len(obj) != 4:
        raise ManifestError(f"{where} must be [file, offset, length, digest]")
    file, offset, length, digest = obj
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ManifestError(f"{where}: digest {digest!r:.80} is not '{CHUNK_DIGEST}:<32 hex>'")
    return ChunkRef(
        check_relpath(file, what=f"{where}: file"),
        _int(offset, "offset", where),
        _int(length, "length", where, lo=1),
        digest,
    )


_LEAF_KEYS = {"value", "float", "bytes", "tensor", "ndarray"}


def _check_node(node: Any, n_tensors: int, where: str, depth: int) -> None:
    if depth > MAX_TREE_DEPTH:
        raise ManifestError(f"{where}: nesting deeper than {MAX_TREE_DEPTH}")
    if not isinstance(node, dict) or not node:
        raise ManifestError(f"{where}: tree node must be a non-empty object, found {node!r:.80}")
    if "dict" in node:
        items = node["dict"]
        if len(node) != 1 or not isinstance(items, list):
            raise ManifestError(f"{where}: malformed dict node")
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int)) and not isinstance(item[0], bool)):
                raise ManifestError(f"{where}: dict items must be [str|int key, node]")
            _check_node(item[1], n_tensors, f"{where}/{item[0]}", depth + 1)
    elif "list" in node or "tuple" in node:
        items = node.get("list", node.get("tuple"))
        if len(node) != 1 or not isinstance(items, list):
            raise ManifestError(f"{where}: malformed list/tuple node")
        for i, item in enumerate(items):
            _check_node(item, n_tensors, f"{where}/{i}", depth + 1)
    elif "stateful" in node:
        inner = node.get("stateful")
        if set(node) != {"stateful", "class"} or not isinstance(node["class"], str) or not isinstance(inner, dict) or "dict" not in inner:
            raise ManifestError(f"{where}: malformed stateful node")
        _check_node(node["stateful"], n_tensors, where, depth + 1)
    elif "codec" in node:
        if set(node) != {"codec", "data"} or not isinstance(node["codec"], str):
            raise ManifestError(f"{where}: malformed codec node")
    elif len(node) == 1 and next(iter(node)) in _LEAF_KEYS:
        kind, v = next(iter(node.items()))
        if kind in ("tensor", "ndarray"):
            _int(v, "tensor index", where)
            if v >= n_tensors:
                raise ManifestError(f"{where}: tensor index {v} out of range (manifest has {n_tensors} tensors)")
        elif kind == "value" and not (v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v))):
            raise ManifestError(f"{where}: value must be null, bool, integer, finite float or string")
        elif kind == "float" and v not in ("nan", "inf", "-inf"):
            raise ManifestError(f"{where}: float must be 'nan', 'inf' or '-inf'")
        elif kind == "bytes" and not isinstance(v, str):
            raise ManifestError(f"{where}: bytes must be a base64 string")
    else:
        raise ManifestError(f"{where}: unknown tree node {sorted(node)!r:.80}")

"""Reading a manifest or commit marker back: strict, total validation (layer: format, pure).

The bytes come from disk and may be damaged or hostile: `decode_*` returns a valid object or raises
ManifestError naming where the bad bytes came from, never anything else, whatever the input.
`check_tree` and `check_tiling` are the same checks for a save to run before it writes (what a
save writes, a restore can read).
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import re
from typing import Any

from checkpointing.errors import ManifestError
from checkpointing.format import json_pieces
from checkpointing.format.dtypes import BY_NAME, itemsize
from checkpointing.format.gcpause import gc_paused
from checkpointing.format.handoff import handoff
from checkpointing.format.manifest import (
    CHUNK_DIGEST,
    FORMAT_VERSION,
    ChunkRef,
    CommitMarker,
    CommittedStep,
    FileEntry,
    Manifest,
    ShardEntry,
    TensorEntry,
)
from checkpointing.format.naming import check_relpath
from checkpointing.format.tiling import check_tiling

READABLE_VERSIONS = (1, 2, 3)  # 1: one rank, one tree, no file table; 2: no references into other steps' files
MAX_TREE_DEPTH = 64
MAX_TENSOR_ELEMENTS = 1 << 48  # 256 T elements: far above any real tensor, far below what would overflow a size
_DIGEST = re.compile(r"^xxh3-128:[0-9a-f]{32}$")
_MANIFEST_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_TIER = re.compile(r"^[A-Za-z0-9_-]{0,64}$")  # "": the tier the manifest is read from (version 1)
MAX_METRICS = 64  # metrics per step (save(..., metrics=...)); they are copied into COMMIT, read with a 64 KiB cap
MAX_METRIC_NAME = 128



def _load_json(data: bytes, where: str, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> dict[str, Any]:
    try:
        obj = json_pieces.loads(data.decode("utf-8"), split="tensors", parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{where} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{where} must hold a JSON object, found {type(obj).__name__}")
    version = obj.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ManifestError(f"{where} is damaged: it has no valid format_version (found {version!r:.40}), which every "
                            "checkpointing file holds")
    if version not in versions:
        raise ManifestError(f"{where} has format_version {version}; this library reads version(s) {', '.join(map(str, versions))}"
                            + (" (upgrade checkpointing to read newer checkpoints)" if version > max(versions) else ""))
    return obj


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def _int(obj: Any, what: str, where: str, lo: int = 0) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int) or obj < lo:
        raise ManifestError(f"{where}: {what} must be an integer >= {lo}, found {obj!r:.80}")
    return obj


def _ints(obj: Any, what: str, where: str, limit: int = 64) -> tuple[int, ...]:
    if not isinstance(obj, list) or len(obj) > limit:
        raise ManifestError(f"{where}: {what} must be a list of at most {limit} integers, found {obj!r:.80}")
    return tuple(_int(x, what, where) for x in obj)


def _field(obj: dict, name: str, where: str) -> Any:
    if name not in obj:
        raise ManifestError(f"{where}: missing field {name!r}")
    return obj[name]


def _manifest_digest(obj: dict, where: str) -> str:
    digest = _field(obj, "manifest_digest", where)
    if not isinstance(digest, str) or not _MANIFEST_DIGEST.fullmatch(digest):
        raise ManifestError(f"{where}: manifest_digest {digest!r:.80} is not 'sha256:<64 hex>'")
    return digest


def decode_commit(data: bytes, where: str) -> CommitMarker:
    obj = _load_json(data, where, READABLE_VERSIONS)
    return CommitMarker(
        step=_int(_field(obj, "step", where), "step", where),
        manifest=check_relpath(_field(obj, "manifest", where), what=f"{where}: manifest"),
        manifest_digest=_manifest_digest(obj, where),
        metrics=check_metrics(obj.get("metrics", {}), where),
    )


def decode_committed_step(data: bytes, where: str) -> CommittedStep:
    """manifest.encode_committed_step's bytes back (this library's own version only: they never leave the job)."""
    obj = _load_json(data, where)
    world_size = _int(_field(obj, "world_size", where), "world_size", where, lo=1)
    return CommittedStep(step=_int(_field(obj, "step", where), "step", where), digest=_manifest_digest(obj, where), world_size=world_size,
                         files=_decode_files(_field(obj, "files", where), world_size, where))


def check_metrics(metrics: Any, where: str) -> dict[str, int | float]:
    """Validate a step's metrics (the optional `metrics` field of a manifest and its COMMIT), as a
    save does before it writes them: at most 64 names of 1-128 printable characters, each a finite
    number (an int within 64 bits, or a float). Returns them as a plain dict."""
    if not isinstance(metrics, dict):
        raise ManifestError(f"{where}: metrics must be an object of names to numbers, found {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS:
        raise ManifestError(f"{where}: {len(metrics)} metrics, at most {MAX_METRICS} are allowed")
    for name, value in metrics.items():
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_METRIC_NAME or not name.isprintable():
            raise ManifestError(f"{where}: metric name {name!r:.80} is not a string of 1-{MAX_METRIC_NAME} printable characters")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ManifestError(f"{where}: metric {name!r} is {type(value).__name__} {value!r:.40}, not a number")
        if isinstance(value, int) and not -(1 << 63) <= value < 1 << 63 or isinstance(value, float) and not math.isfinite(value):
            raise ManifestError(f"{where}: metric {name!r} is {value!r:.40}: a metric must be finite (an int within 64 bits, or a float)")
    return dict(metrics)


def check_tree(tree: Any, n_tensors: int, where: str) -> None:
    """Validate a tree exactly as decode_manifest will: what a save writes, a restore can read."""
    _check_node(tree, n_tensors, where, 0)
    if "dict" not in tree:
        raise ManifestError(f"{where}: the tree root must be a dict node")


def decode_manifest(data: bytes, where: str) -> Manifest:
    with gc_paused():  # a burst of objects that form no cycles (gcpause.py)
        return _decode_manifest(data, where)


def _decode_manifest(data: bytes, where: str) -> Manifest:
    obj = _load_json(data, where, READABLE_VERSIONS)
    if obj.get("chunk_digest") != CHUNK_DIGEST:
        raise ManifestError(f"{where}: chunk_digest {obj.get('chunk_digest')!r} is not {CHUNK_DIGEST!r}")
    raw_tensors = _field(obj, "tensors", where)
    if not isinstance(raw_tensors, list):
        raise ManifestError(f"{where}: tensors must be a list")
    tensors = tuple(_decode_tensor(t, f"{where} tensors[{i}]") for i, t in enumerate(raw_tensors))
    step = _int(_field(obj, "step", where), "step", where)
    world_size = _int(_field(obj, "world_size", where), "world_size", where, lo=1)
    if obj["format_version"] == 1:
        tree = _field(obj, "tree", where)
        check_tree(tree, len(tensors), where + " tree")
        if world_size != 1:
            raise ManifestError(f"{where}: a version 1 manifest has world_size 1, found {world_size}")
        return Manifest.single(step, tree, tensors)
    raw_trees = _field(obj, "trees", where)
    if not isinstance(raw_trees, list) or not raw_trees:
        raise ManifestError(f"{where}: trees must be a non-empty list")
    for i, tree in enumerate(raw_trees):
        check_tree(tree, len(tensors), f"{where} trees[{i}]")
    rank_trees = _ints(_field(obj, "rank_trees", where), "rank_trees", where, limit=1 << 20)
    if len(rank_trees) != world_size or any(i >= len(raw_trees) for i in rank_trees) or set(rank_trees) != set(range(len(raw_trees))):
        raise ManifestError(f"{where}: rank_trees must map each of the {world_size} ranks to one of the {len(raw_trees)} trees, using each")
    files = _decode_files(_field(obj, "files", where), world_size, where)
    sizes = {f.path: f.nbytes for f in files}
    for t in tensors:
        handoff()
        for s in t.shards:
            for copy in s.copies():
                for c in copy:
                    if c.file not in sizes:
                        raise ManifestError(f"{where}: tensor {t.key!r:.120} references {c.file!r}, which is not in the file table")
                    if c.offset + c.length > sizes[c.file]:
                        raise ManifestError(f"{where}: tensor {t.key!r:.120} references bytes past the end of {c.file!r}")
    return Manifest(step=step, trees=tuple(raw_trees), tensors=tensors, world_size=world_size, rank_trees=rank_trees, files=files,
                    metrics=check_metrics(obj.get("metrics", {}), where))


def _decode_files(raw: Any, world_size: int, where: str) -> tuple[FileEntry, ...]:
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: files must be a list")
    files = []
    for i, item in enumerate(raw):
        handoff()
        fw = f"{where} files[{i}]"
        if not isinstance(item, list) or len(item) != 5:
            raise ManifestError(f"{fw} must be [path, rank, tier, nbytes, primary_bytes]")
        path = check_relpath(item[0], what=f"{fw}: path")
        rank = _int(item[1], "rank", fw)
        tier = item[2]
        if not isinstance(tier, str) or not _TIER.fullmatch(tier):
            raise ManifestError(f"{fw}: tier {tier!r:.80} is not an id of 0-64 letters, digits, '-' or '_'")
        nbytes = _int(item[3], "nbytes", fw)
        primary = _int(item[4], "primary_bytes", fw)
        if rank >= world_size or primary > nbytes:
            raise ManifestError(f"{fw}: rank {rank} / primary_bytes {primary} out of range (world_size {world_size}, nbytes {nbytes})")
        files.append(FileEntry(path, rank, tier, nbytes, primary))
    if len({f.path for f in files}) != len(files):
        raise ManifestError(f"{where}: the file table lists a path twice")
    return tuple(files)


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
        handoff()
        shard = _shard_fast(raw, shape, size) or _decode_shard(raw, shape, size, f"{where} shard {j}")
        covered += math.prod(shard.shape)
        shards.append(shard)
    if math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise ManifestError(f"{where}: shape {list(shape)} has more than {MAX_TENSOR_ELEMENTS} elements (no real tensor has)")
    if covered != math.prod(shape):
        raise ManifestError(f"{where}: shards cover {covered} elements, the tensor has {math.prod(shape)}")
    check_tiling(shape, [(s.offsets, s.shape) for s in shards], where)
    return TensorEntry(key, dtype, shape, tuple(shards))


def _shard_fast(raw: Any, shape: tuple[int, ...], size: int) -> ShardEntry | None:
    """A shard as _decode_shard returns it when every check passes, else None (then _decode_shard
    says what is wrong): a manifest has a shard per rank per tensor, and naming each one in a
    message only in case it is bad cost a third of a decode."""
    if type(raw) is not dict:
        return None
    offsets, sshape, raw_chunks = raw.get("offsets"), raw.get("shape"), raw.get("chunks")
    if not (type(offsets) is list and type(sshape) is list and type(raw_chunks) is list and len(offsets) == len(shape) == len(sshape)):
        return None
    if not all(type(o) is int and type(n) is int and 0 <= o and 0 <= n and o + n <= g for o, n, g in zip(offsets, sshape, shape)):
        return None
    chunks = tuple(map(_chunk_fast, raw_chunks))
    if None in chunks or sum(c.length for c in chunks) != math.prod(sshape) * size:  # type: ignore[union-attr]
        return None
    replicas = _replicas_fast(raw.get("replicas", []), chunks)  # type: ignore[arg-type]
    if replicas is None:
        return None
    return ShardEntry(tuple(offsets), tuple(sshape), chunks, replicas)  # type: ignore[arg-type]


def _replicas_fast(raw: Any, primary: tuple[ChunkRef, ...]) -> tuple[tuple[ChunkRef, ...], ...] | None:
    """_decode_replicas when every copy is valid and matches the primary, else None."""
    if type(raw) is not list or len(raw) > 1 << 16:
        return None
    if not raw:
        return ()
    want = [(c.length, c.digest) for c in primary]
    out = []
    for copy in raw:
        if type(copy) is not list:
            return None
        chunks = tuple(map(_chunk_fast, copy))
        if None in chunks or [(c.length, c.digest) for c in chunks] != want:  # type: ignore[union-attr]
            return None
        out.append(chunks)
    return tuple(out)  # type: ignore[arg-type]


def _decode_shard(raw: Any, shape: tuple[int, ...], size: int, sw: str) -> ShardEntry:
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
    chunks = tuple(_decode_chunk(c, sw, k) for k, c in enumerate(raw_chunks))
    numel = math.prod(sshape)
    if sum(c.length for c in chunks) != numel * size:
        raise ManifestError(f"{sw}: chunk lengths add up to {sum(c.length for c in chunks)} bytes, the shard needs {numel * size}")
    return ShardEntry(offsets, sshape, chunks, _decode_replicas(raw.get("replicas", []), chunks, sw))


def _decode_replicas(raw: Any, primary: tuple[ChunkRef, ...], where: str) -> tuple[tuple[ChunkRef, ...], ...]:
    if not isinstance(raw, list) or len(raw) > 1 << 16:
        raise ManifestError(f"{where}: replicas must be a list of chunk lists")
    out = []
    for i, copy in enumerate(raw):
        if not isinstance(copy, list):
            raise ManifestError(f"{where} replica {i} must be a list of chunks")
        chunks = tuple(_decode_chunk(c, f"{where} replica {i}", k) for k, c in enumerate(copy))
        if [(c.length, c.digest) for c in chunks] != [(c.length, c.digest) for c in primary]:
            raise ManifestError(f"{where} replica {i}: its chunk lengths and digests differ from the primary copy")
        out.append(chunks)
    return tuple(out)


def _chunk_fast(obj: Any) -> ChunkRef | None:
    """A valid chunk reference [file, offset, length, digest] as a ChunkRef, else None."""
    if type(obj) is list and len(obj) == 4:
        file, offset, length, digest = obj
        if (type(offset) is int and offset >= 0 and type(length) is int and length >= 1 and type(digest) is str
                and _DIGEST.fullmatch(digest) and type(file) is str and _safe_path(file)):
            return ChunkRef(file, offset, length, digest)
    return None


def _decode_chunk(obj: Any, where: str, k: int) -> ChunkRef:
    """Chunk k of `where` (the message names it only on error: a manifest has thousands)."""
    ref = _chunk_fast(obj)
    if ref is not None:
        return ref
    where = f"{where} chunk {k}"
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


@functools.lru_cache(maxsize=4096)
def _safe_path(path: str) -> bool:
    """naming.check_relpath, remembered: chunks of one manifest name a few files thousands of times."""
    try:
        check_relpath(path)
    except ManifestError:
        return False
    return True


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
        if len({(type(k), k) for k, _ in items}) != len(items):
            raise ManifestError(f"{where}: a key appears twice in a dict node")
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
        elif kind == "bytes" and not _is_base64(v):
            raise ManifestError(f"{where}: bytes must be a base64 string, found {v!r:.80}")
    else:
        raise ManifestError(f"{where}: unknown tree node {sorted(node)!r:.80}")


def _is_base64(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True

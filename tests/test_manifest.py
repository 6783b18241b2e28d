"""The manifest format: golden bytes, round trips, and strict, total decoding.

decode_manifest / decode_commit read bytes from disk that may be damaged or hostile: whatever the
input, they must either return a valid object or raise ManifestError (a CheckpointError) whose
message names where the bad bytes came from -- never any other exception type.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import math
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from checkpointing.format import naming
from checkpointing.format.dtypes import BY_NAME, itemsize
from checkpointing.errors import CheckpointCorruptError, CheckpointError, ManifestError
from checkpointing.format.decode import MAX_TREE_DEPTH, decode_commit, decode_committed_step, decode_manifest
from checkpointing.format.manifest import (
    CHUNK_DIGEST,
    FORMAT_VERSION,
    ChunkRef,
    FileEntry,
    CommitMarker,
    CommittedStep,
    Manifest,
    ShardEntry,
    TensorEntry,
    canonical_json,
    encode_commit,
    encode_committed_step,
    encode_manifest,
    manifest_digest,
)
from checkpointing.format.manifest import chunk_digest

GOLDEN = Path(__file__).parent / "golden"
WHERE = "WHERE:/ckpt/step-0000000007/manifest.json"

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUNDTRIP = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- the fixed golden manifest

TOKEN = "0123456789ab"
PACK = naming.pack_name(7, 0, TOKEN)
PACK1 = naming.pack_name(7, 1, TOKEN)


def _chunk(offset: int, length: int, seed: int, file: str = PACK) -> ChunkRef:
    return ChunkRef(file, offset, length, chunk_digest(memoryview(bytes((seed + i) % 256 for i in range(length)))))


def golden_manifest_v1() -> Manifest:
    """What tests/golden/manifest_v1.json (written by version 1 of the format) decodes to."""
    tree = {
        "dict": [
            [
                "model",
                {
                    "stateful": {"dict": [["weight", {"tensor": 0}], ["bias", {"tensor": 1}]]},
                    "class": "torch.nn.modules.linear.Linear",
                },
            ],
            ["arr", {"ndarray": 2}],
            [
                "cfg",
                {
                    "dict": [
                        [1, {"value": "one"}],
                        ["lr", {"value": 0.001}],
                        ["nan", {"float": "nan"}],
                        ["ninf", {"float": "-inf"}],
                        ["flag", {"value": True}],
                        ["none", {"value": None}],
                        ["blob", {"bytes": base64.b64encode(b"\x00\x01\x02\xff").decode()}],
                        ["ünï/cødé", {"value": "ß→€ 😀"}],
                    ]
                },
            ],
            ["seq", {"list": [{"value": -3}, {"tuple": [{"value": 2.5}, {"value": "x"}]}, {"list": []}]}],
            ["obj", {"codec": "json-dataclass", "data": {"b": [1, 2], "a": "z"}}],
        ]
    }
    tensors = (
        # float32[2, 3] = 24 bytes as one shard of two chunks
        TensorEntry("model/weight", "float32", (2, 3), (ShardEntry((0, 0), (2, 3), (_chunk(0, 16, 1), _chunk(64, 8, 2))),)),
        TensorEntry("model/bias", "bfloat16", (3,), (ShardEntry((0,), (3,), (_chunk(128, 6, 3),)),)),
        TensorEntry("arr", "int64", (2,), (ShardEntry((0,), (2,), (_chunk(192, 16, 4),)),)),
    )
    return Manifest.single(7, tree, tensors)


def golden_manifest_v2() -> Manifest:
    """Two ranks: a sharded tensor (one shard per rank), a replicated one (written by rank 0, with a
    replica on rank 1's tier), per-rank values (two trees) and the file table."""
    v1 = golden_manifest_v1()
    tree1 = json.loads(json.dumps(v1.tree))
    tree1["dict"][2][1]["dict"][1][1] = {"value": 0.002}  # rank 1 saved another lr
    tensors = v1.tensors + (
        TensorEntry("emb", "float16", (4, 2), (
            ShardEntry((0, 0), (2, 2), (_chunk(256, 8, 5),)),
            ShardEntry((2, 0), (2, 2), (_chunk(0, 8, 6, PACK1),)),
        )),
        TensorEntry("step", "int64", (), (ShardEntry((), (), (_chunk(264, 8, 7),), ((_chunk(8, 8, 7, PACK1),),)),)),
    )
    files = (FileEntry(PACK, 0, "tier-a", 272, 272), FileEntry(PACK1, 1, "tier_b", 16, 8))
    return Manifest(step=7, trees=(v1.tree, tree1), tensors=tensors, world_size=2, rank_trees=(0, 1), files=files)


EARLIER = "step-0000000005/r00000.fedcba987654.pack"


def golden_manifest() -> Manifest:
    """Version 3: the version 2 manifest, saved incrementally: one tensor's chunk is taken from a
    file step 5 wrote (listed with the entry step 5's manifest gave it)."""
    v2 = golden_manifest_v2()
    tensors = v2.tensors + (TensorEntry("frozen", "float32", (4,), (ShardEntry((0,), (4,), (_chunk(4096, 16, 8, EARLIER),)),)),)
    tree = json.loads(json.dumps(v2.trees[0]))
    tree["dict"].append(["frozen", {"tensor": len(v2.tensors)}])
    tree1 = json.loads(json.dumps(v2.trees[1]))
    tree1["dict"].append(["frozen", {"tensor": len(v2.tensors)}])
    files = v2.files + (FileEntry(EARLIER, 0, "tier-a", 8192, 8192),)
    return dataclasses.replace(v2, trees=(tree, tree1), tensors=tensors, files=files)


def golden_commit() -> CommitMarker:
    data = encode_manifest(golden_manifest())
    return CommitMarker(7, naming.manifest_name(7, TOKEN), manifest_digest(data))


def _write_golden() -> None:  # run once by hand: UPDATE_GOLDEN=1 pytest tests/test_manifest.py
    GOLDEN.mkdir(exist_ok=True)
    (GOLDEN / "manifest_v3.json").write_bytes(encode_manifest(golden_manifest()))
    (GOLDEN / "commit_v3.json").write_bytes(encode_commit(golden_commit()))


if os.environ.get("UPDATE_GOLDEN") == "1":
    _write_golden()


def test_golden_manifest_bytes():
    expected = (GOLDEN / "manifest_v3.json").read_bytes()
    assert encode_manifest(golden_manifest()) == expected
    assert decode_manifest(expected, WHERE) == golden_manifest()


def test_version_2_manifests_still_read():
    """Checkpoints written by format version 2 (no references into earlier steps) still decode."""
    raw = (GOLDEN / "manifest_v2.json").read_bytes()
    assert json.loads(raw)["format_version"] == 2
    assert decode_manifest(raw, WHERE) == golden_manifest_v2()
    commit = decode_commit((GOLDEN / "commit_v2.json").read_bytes(), WHERE)
    assert commit.manifest_digest == manifest_digest(raw)


def test_version_1_manifests_still_read():
    """Checkpoints written by format version 1 (one rank) decode to the same one-rank manifest."""
    raw = (GOLDEN / "manifest_v1.json").read_bytes()
    assert json.loads(raw)["format_version"] == 1
    m = decode_manifest(raw, WHERE)
    assert m == golden_manifest_v1()
    assert m.world_size == 1 and m.rank_trees == (0,) and m.files[0].tier == ""
    commit = decode_commit((GOLDEN / "commit_v1.json").read_bytes(), WHERE)
    assert commit.manifest_digest == manifest_digest(raw)


def test_golden_commit_bytes():
    expected = (GOLDEN / "commit_v3.json").read_bytes()
    assert encode_commit(golden_commit()) == expected
    assert decode_commit(expected, WHERE) == golden_commit()
    # the commit names the manifest by its sha256: the golden manifest bytes are what it commits to
    assert golden_commit().manifest_digest == manifest_digest((GOLDEN / "manifest_v3.json").read_bytes())


def test_golden_bytes_are_canonical():
    for name in ("manifest_v3.json", "commit_v3.json", "manifest_v2.json", "commit_v2.json"):
        raw = (GOLDEN / name).read_bytes()
        text = raw.decode("utf-8")  # UTF-8, not \u escapes
        obj = json.loads(text)
        assert raw == json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        assert not raw.endswith(b"\n")
        assert b": " not in raw and b", " not in raw.replace("ß→€ 😀".encode(), b"")
    raw = (GOLDEN / "manifest_v3.json").read_bytes()
    assert "ünï/cødé".encode("utf-8") in raw and b"\\u" not in raw
    assert list(json.loads(raw)) == sorted(json.loads(raw))
    assert json.loads(raw)["format_version"] == FORMAT_VERSION == 3
    assert json.loads(raw)["chunk_digest"] == CHUNK_DIGEST


def test_roundtrip_golden_is_identity_on_bytes():
    data = encode_manifest(golden_manifest())
    assert encode_manifest(decode_manifest(data, WHERE)) == data


# ---------------------------------------------------------------- strategies for valid manifests

SEGMENT_CHARS = "abcXYZ019_.-"
segment = st.text(alphabet=SEGMENT_CHARS, min_size=1, max_size=12).filter(
    lambda s: s[0] not in ".-" and s not in (".", "..")
)
relpath = st.lists(segment, min_size=1, max_size=4).map("/".join)
chunk_digest_st = st.binary(min_size=16, max_size=16).map(lambda b: f"{CHUNK_DIGEST}:{b.hex()}")

json_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
dict_key = st.text(max_size=8) | st.integers(-(2**40), 2**40)


def _leaf_nodes(n_tensors: int):
    leaves = [
        st.builds(lambda v: {"value": v}, json_scalar),
        st.sampled_from(["nan", "inf", "-inf"]).map(lambda f: {"float": f}),
        st.binary(max_size=12).map(lambda b: {"bytes": base64.b64encode(b).decode()}),
        st.builds(lambda n, d: {"codec": n, "data": d}, st.text(min_size=1, max_size=8), json_value),
    ]
    if n_tensors:
        idx = st.integers(0, n_tensors - 1)
        leaves += [idx.map(lambda i: {"tensor": i}), idx.map(lambda i: {"ndarray": i})]
    return st.one_of(leaves)


def _dict_node(children):
    unique = st.lists(st.tuples(dict_key, children), max_size=4, unique_by=lambda kv: (type(kv[0]), kv[0]))  # a dict's keys
    return unique.map(lambda items: {"dict": [[k, v] for k, v in items]})


def tree_st(n_tensors: int):
    nodes = st.recursive(
        _leaf_nodes(n_tensors),
        lambda inner: st.one_of(
            _dict_node(inner),
            st.lists(inner, max_size=4).map(lambda xs: {"list": xs}),
            st.lists(inner, max_size=4).map(lambda xs: {"tuple": xs}),
            st.builds(lambda d, c: {"stateful": d, "class": c}, _dict_node(inner), st.text(min_size=1, max_size=20)),
        ),
        max_leaves=16,  # keeps the nesting well below MAX_TREE_DEPTH
    )
    return _dict_node(nodes)


@st.composite
def chunk_split(draw, nbytes: int) -> tuple[ChunkRef, ...]:
    if nbytes == 0:
        return ()
    cuts = sorted(draw(st.sets(st.integers(1, nbytes - 1), max_size=min(4, nbytes - 1))) if nbytes > 1 else set())
    bounds = [0, *cuts, nbytes]
    file = draw(relpath)
    base = draw(st.integers(0, 2**40))
    return tuple(
        ChunkRef(file, base + a, b - a, draw(chunk_digest_st)) for a, b in zip(bounds, bounds[1:])
    )


@st.composite
def tensor_entry(draw) -> TensorEntry:
    dtype = draw(st.sampled_from(sorted(BY_NAME)))
    size = itemsize(BY_NAME[dtype])
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=4)))
    # shards: the whole tensor, or slabs along dim 0
    if shape and shape[0] >= 2 and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, shape[0] - 1), min_size=1, max_size=shape[0] - 1)))
        bounds = [0, *cuts, shape[0]]
    else:
        bounds = None
    shards = []
    if bounds is None:
        shards.append(ShardEntry((0,) * len(shape), shape, draw(chunk_split(math.prod(shape) * size))))
    else:
        for a, b in zip(bounds, bounds[1:]):
            sshape = (b - a, *shape[1:])
            shards.append(ShardEntry((a,) + (0,) * (len(shape) - 1), sshape, draw(chunk_split(math.prod(sshape) * size))))
    key = draw(st.text(max_size=20))
    return TensorEntry(key, dtype, shape, tuple(shards))


@st.composite
def manifests(draw) -> Manifest:
    tensors = tuple(draw(st.lists(tensor_entry(), max_size=4)))
    trees = tuple(draw(st.lists(tree_st(len(tensors)), min_size=1, max_size=3)))
    world_size = draw(st.integers(len(trees), 1024))
    rank_trees = tuple(range(len(trees))) + tuple(draw(st.lists(st.integers(0, len(trees) - 1), min_size=world_size - len(trees), max_size=world_size - len(trees))))
    ends: dict[str, int] = {}
    for t in tensors:
        for sh in t.shards:
            for c in sh.chunks:
                ends[c.file] = max(ends.get(c.file, 0), c.offset + c.length)
    files = []
    for path, end in sorted(ends.items()):
        nbytes = end + draw(st.integers(0, 4096))
        tier = draw(st.text(alphabet="abcXYZ019_-", max_size=64))
        files.append(FileEntry(path, draw(st.integers(0, world_size - 1)), tier, nbytes, draw(st.integers(0, nbytes))))
    return Manifest(
        step=draw(st.integers(0, naming.MAX_STEP)),
        trees=trees,
        tensors=tensors,
        world_size=world_size,
        rank_trees=rank_trees,
        files=tuple(files),
    )


commits = st.builds(
    lambda step, path, h: CommitMarker(step, path, "sha256:" + h.hex()),
    st.integers(0, naming.MAX_STEP),
    relpath,
    st.binary(min_size=32, max_size=32),
)


@ROUNDTRIP
@given(manifests())
def test_roundtrip_random_manifests(m):
    data = encode_manifest(m)
    back = decode_manifest(data, WHERE)
    assert back == m
    assert encode_manifest(back) == data  # canonical: one encoding per manifest
    assert canonical_json(json.loads(data)) == data
    assert back.nbytes == sum(c.length for t in m.tensors for s in t.shards for c in s.chunks)


@ROUNDTRIP
@given(commits)
def test_roundtrip_random_commits(c):
    data = encode_commit(c)
    assert decode_commit(data, WHERE) == c
    assert encode_commit(decode_commit(data, WHERE)) == data


@ROUNDTRIP
@given(manifests())
def test_roundtrip_random_committed_steps(m):
    """What rank 0 tells the ranks that commit on no tier: the step, digest, world size and file table."""
    c = CommittedStep.of(m, manifest_digest(encode_manifest(m)))
    data = encode_committed_step(c)
    assert decode_committed_step(data, WHERE) == c
    assert (c.step, c.world_size, c.files) == (m.step, m.world_size, m.files)
    assert encode_committed_step(decode_committed_step(data, WHERE)) == data


def test_a_bad_tree_node_is_named_by_its_path():
    tree = {"dict": [["model", {"stateful": {"dict": [["layers", {"list": [{"value": 1}, {"value": [2]}]}]]}, "class": "M"}]]}
    with pytest.raises(ManifestError) as info:
        decode_manifest(encode_manifest(Manifest.single(1, tree, ())), WHERE)
    assert str(info.value) == f"{WHERE} trees[0]/model/layers/1: value must be null, bool, integer, finite float or string"
    for bad in (-1, True, 1.5, "0"):
        with pytest.raises(ManifestError, match=r"trees\[0\]/t: tensor index must be an integer >= 0"):
            decode_manifest(encode_manifest(Manifest.single(1, {"dict": [["t", {"tensor": bad}]]}, ())), WHERE)


def test_a_key_twice_in_one_dict_node_is_refused():
    twice = {"dict": [["w", {"value": 1}], ["x", {"dict": [["w", {"value": 2}], ["w", {"value": "second"}]]}]]}
    with pytest.raises(ManifestError, match=r"trees\[0\]/x: a key appears twice in a dict node"):
        decode_manifest(encode_manifest(Manifest.single(1, twice, ())), WHERE)
    int_and_str = {"dict": [[1, {"value": 1}], ["1", {"value": 2}]]}  # two keys: a dict may hold both
    assert decode_manifest(encode_manifest(Manifest.single(1, int_and_str, ())), WHERE).tree == int_and_str


def _chain(depth: int) -> dict:
    """A tree whose deepest node sits at nesting level `depth` (the root is level 0)."""
    node: dict = {"value": 1}
    for _ in range(depth):
        node = {"dict": [["k", node]]}
    return node


def test_tree_depth_limit_is_exact():
    ok = Manifest.single(1, _chain(MAX_TREE_DEPTH), ())
    assert decode_manifest(encode_manifest(ok), WHERE) == ok
    too_deep = Manifest.single(1, _chain(MAX_TREE_DEPTH + 1), ())
    with pytest.raises(ManifestError, match="nesting deeper"):
        decode_manifest(encode_manifest(too_deep), WHERE)


def test_manifest_error_is_a_checkpoint_error():
    assert issubclass(ManifestError, CheckpointCorruptError)
    assert issubclass(ManifestError, CheckpointError)


# ---------------------------------------------------------------- decoding never raises anything but ManifestError


def _expect_manifest_error(fn, data: bytes) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        fn(data, WHERE)
    msg = str(info.value)
    assert msg.strip(), "ManifestError with an empty message"
    assert WHERE in msg, f"message does not say where the bad bytes are: {msg[:300]!r}"
    return info.value


def _decode_or_manifest_error(fn, data: bytes):
    """Decoding may succeed (a mutation can yield a valid manifest) or raise ManifestError naming WHERE."""
    try:
        out = fn(data, WHERE)
    except ManifestError as exc:
        msg = str(exc)
        assert msg.strip()
        assert WHERE in msg, f"message does not say where the bad bytes are: {msg[:300]!r}"
        return None
    # anything accepted must be a well-formed object that encodes again to canonical bytes
    enc = {Manifest: encode_manifest, CommittedStep: encode_committed_step}.get(type(out), encode_commit)
    again = enc(out)
    assert fn(again, WHERE) == out
    return out


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_never_decode(data):
    _expect_manifest_error(decode_manifest, data)
    _expect_manifest_error(decode_commit, data)


@FUZZ
@given(json_value)
def test_random_json_values_are_rejected(value):
    data = json.dumps(value).encode()
    _expect_manifest_error(decode_manifest, data)
    _expect_manifest_error(decode_commit, data)


MANIFEST_FIELDS = ["format_version", "step", "world_size", "chunk_digest", "tree", "tensors"]
COMMIT_FIELDS = ["format_version", "step", "manifest", "manifest_digest"]


@FUZZ
@given(st.dictionaries(st.sampled_from(MANIFEST_FIELDS + COMMIT_FIELDS + ["x"]), json_value, max_size=10), st.booleans())
def test_random_objects_with_manifest_fields(obj, versioned):
    if versioned:
        obj["format_version"] = FORMAT_VERSION
    data = json.dumps(obj).encode()
    _decode_or_manifest_error(decode_manifest, data)
    _decode_or_manifest_error(decode_commit, data)


GOLDEN_BYTES = encode_manifest(golden_manifest())
GOLDEN_COMMIT_BYTES = encode_commit(golden_commit())


@st.composite
def byte_mutations(draw, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "replace"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "delete" and data:
            n = draw(st.integers(1, 8))
            del data[pos : pos + n]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4) | st.sampled_from([b"-", b"9", b"e9", b"[", b"{", b'"', b",", b"\\", b"..", b"/"]))
        elif data:
            data[pos] = draw(st.sampled_from(b'0123456789-[]{}",:.e/ '))
    return bytes(data)


@FUZZ
@given(byte_mutations(GOLDEN_BYTES))
def test_byte_mutations_of_a_manifest(data):
    _decode_or_manifest_error(decode_manifest, data)


@FUZZ
@given(byte_mutations(GOLDEN_COMMIT_BYTES))
def test_byte_mutations_of_a_commit(data):
    _decode_or_manifest_error(decode_commit, data)


@FUZZ
@given(byte_mutations(encode_committed_step(CommittedStep.of(golden_manifest(), manifest_digest(GOLDEN_BYTES)))))
def test_byte_mutations_of_a_committed_step(data):
    _decode_or_manifest_error(decode_committed_step, data)


BAD_VALUES = [
    None, True, False, -1, -(2**63), 2**64, 10**30, 1.5, -0.0, 1e300, "", "x", "../x", "/abs", "a//b", "a/./b",
    "float32", "sha256:" + "0" * 64, [], [1], [-1], [None], {}, {"dict": []}, {"value": 1}, [[[[[[[[[[[]]]]]]]]]]],
]


def _paths(obj, prefix=()):
    """Every (path, value) inside a parsed JSON object."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(obj, path, op, value):
    obj = copy.deepcopy(obj)
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "add" and isinstance(parent, dict):
        parent["unexpected"] = value
    elif op == "add":
        parent.append(value)
    return obj


GOLDEN_OBJ = json.loads(GOLDEN_BYTES)
GOLDEN_PATHS = [p for p, _ in _paths(GOLDEN_OBJ)]
COMMIT_OBJ = json.loads(GOLDEN_COMMIT_BYTES)
COMMIT_PATHS = [p for p, _ in _paths(COMMIT_OBJ)]


@FUZZ
@given(st.sampled_from(GOLDEN_PATHS), st.sampled_from(["replace", "replace", "delete", "add"]), st.sampled_from(BAD_VALUES))
def test_structural_mutations_of_a_manifest(path, op, value):
    data = json.dumps(_mutate(GOLDEN_OBJ, path, op, value), ensure_ascii=False).encode()
    _decode_or_manifest_error(decode_manifest, data)


@FUZZ
@given(st.sampled_from(COMMIT_PATHS), st.sampled_from(["replace", "delete", "add"]), st.sampled_from(BAD_VALUES))
def test_structural_mutations_of_a_commit(path, op, value):
    data = json.dumps(_mutate(COMMIT_OBJ, path, op, value), ensure_ascii=False).encode()
    _decode_or_manifest_error(decode_commit, data)


def test_every_field_replaced_by_every_bad_value():
    """The exhaustive version of the structural fuzz above (small: ~100 paths x ~30 values)."""
    failures: dict[tuple, str] = {}  # one example per (field, kind of failure)
    count = 0
    for path in GOLDEN_PATHS:
        for value in BAD_VALUES:
            data = json.dumps(_mutate(GOLDEN_OBJ, path, "replace", value), ensure_ascii=False).encode()
            try:
                _decode_or_manifest_error(decode_manifest, data)
            except Exception as exc:  # noqa: BLE001 - collected and reported together
                count += 1
                field = "/".join(str(p) for p in path)
                failures.setdefault((field, type(exc).__name__), f"{field} := {value!r:.40} -> {type(exc).__name__}: {str(exc)[:110]}")
    assert not failures, f"{count} inputs escaped as non-ManifestError or without 'where', e.g.:\n" + "\n".join(failures.values())


# ---------------------------------------------------------------- targeted invalid inputs (each must be rejected)


def _manifest_with(**edits) -> bytes:
    obj = copy.deepcopy(GOLDEN_OBJ)
    for dotted, value in edits.items():
        path = [int(p) if p.isdigit() else p for p in dotted.split("__")]
        target = obj
        for p in path[:-1]:
            target = target[p]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return json.dumps(obj, ensure_ascii=False).encode()


_DELETE = object()
CHUNK0 = "tensors__0__shards__0__chunks__0"

INVALID_MANIFESTS = {
    "format_version 4": _manifest_with(format_version=4),
    "format_version 0": _manifest_with(format_version=0),
    "format_version '1'": _manifest_with(format_version="1"),
    "format_version missing": _manifest_with(format_version=_DELETE),
    "chunk_digest sha1": _manifest_with(chunk_digest="sha1"),
    "step negative": _manifest_with(step=-1),
    "step float": _manifest_with(step=7.0),
    "step bool": _manifest_with(step=True),
    "step missing": _manifest_with(step=_DELETE),
    "world_size 0": _manifest_with(world_size=0),
    "tensors not a list": _manifest_with(tensors={}),
    "dtype unknown": _manifest_with(tensors__0__dtype="float128"),
    "dtype not a string": _manifest_with(tensors__0__dtype=7),
    "dtype a list": _manifest_with(tensors__0__dtype=["float32"]),
    "dtype an object": _manifest_with(tensors__0__dtype={"name": "float32"}),
    "shape negative": _manifest_with(tensors__0__shape=[-2, -3]),
    "shape huge": _manifest_with(tensors__0__shape=[2, 3 * 10**30]),
    "shape rank > 64": _manifest_with(tensors__0__shape=[1] * 65),
    "shards empty": _manifest_with(tensors__0__shards=[]),
    "shard rank mismatch": _manifest_with(tensors__0__shards__0__offsets=[0]),
    "shard outside tensor": _manifest_with(tensors__0__shards__0__offsets=[1, 0]),
    "chunk file ../x": _manifest_with(**{CHUNK0 + "__0": "../x"}),
    "chunk file /abs": _manifest_with(**{CHUNK0 + "__0": "/abs"}),
    "chunk file a//b": _manifest_with(**{CHUNK0 + "__0": "a//b"}),
    "chunk file empty": _manifest_with(**{CHUNK0 + "__0": ""}),
    "chunk file step/../../etc": _manifest_with(**{CHUNK0 + "__0": "step-0000000007/../../etc/passwd"}),
    "chunk file with NUL": _manifest_with(**{CHUNK0 + "__0": "a\x00b"}),
    "chunk file with backslash": _manifest_with(**{CHUNK0 + "__0": "..\\x"}),
    "chunk file with newline": _manifest_with(**{CHUNK0 + "__0": "step-0000000007/r.pack\n"}),
    "chunk offset negative": _manifest_with(**{CHUNK0 + "__1": -64}),
    "chunk length zero": _manifest_with(**{CHUNK0 + "__2": 0}),
    "chunk length negative": _manifest_with(**{CHUNK0 + "__2": -16}),
    "chunk length huge": _manifest_with(**{CHUNK0 + "__2": 2**70}),
    "chunk lengths do not add up": _manifest_with(**{CHUNK0 + "__2": 15}),
    "chunk digest wrong algo": _manifest_with(**{CHUNK0 + "__3": "sha256:" + "0" * 32}),
    "chunk digest short": _manifest_with(**{CHUNK0 + "__3": "xxh3-128:abc"}),
    "chunk digest uppercase": _manifest_with(**{CHUNK0 + "__3": "xxh3-128:" + "A" * 32}),
    "chunk digest trailing newline": _manifest_with(**{CHUNK0 + "__3": "xxh3-128:" + "a" * 32 + "\n"}),
    "chunk of 3 fields": _manifest_with(**{CHUNK0: ["a", 0, 16]}),
    "tree missing": _manifest_with(trees=_DELETE),
    "tree root a list node": _manifest_with(trees__0={"list": []}),
    "tree root stateful": _manifest_with(trees__0={"stateful": {"dict": []}, "class": "X"}),
    "tree tensor index out of range": _manifest_with(trees__0={"dict": [["a", {"tensor": 99}]]}),
    "tree tensor index negative": _manifest_with(trees__0={"dict": [["a", {"tensor": -1}]]}),
    "tree tensor index float": _manifest_with(trees__0={"dict": [["a", {"tensor": 0.0}]]}),
    "tree unknown node": _manifest_with(trees__0={"dict": [["a", {"pickle": "gASV"}]]}),
    "tree empty node": _manifest_with(trees__0={"dict": [["a", {}]]}),
    "tree bool key": _manifest_with(trees__0={"dict": [[True, {"value": 1}]]}),
    "tree float key": _manifest_with(trees__0={"dict": [[1.5, {"value": 1}]]}),
    "tree value a list": _manifest_with(trees__0={"dict": [["a", {"value": [1]}]]}),
    "tree value infinite (1e999)": _manifest_with(trees__0={"dict": [["a", {"value": 1e999}]]}).replace(b"Infinity", b"1e999"),
    "tree float bogus": _manifest_with(trees__0={"dict": [["a", {"float": "NaN"}]]}),
    "tree bytes not a string": _manifest_with(trees__0={"dict": [["a", {"bytes": [1, 2]}]]}),
    "tree stateful of an int": _manifest_with(trees__0={"dict": [["a", {"stateful": 5, "class": "X"}]]}),
    "tree stateful of null": _manifest_with(trees__0={"dict": [["a", {"stateful": None, "class": "X"}]]}),
    "tree stateful of a string": _manifest_with(trees__0={"dict": [["a", {"stateful": "dict", "class": "X"}]]}),
    "tree stateful without class": _manifest_with(trees__0={"dict": [["a", {"stateful": {"dict": []}}]]}),
    "tree codec without data": _manifest_with(trees__0={"dict": [["a", {"codec": "x"}]]}),
    "tree list and tuple": _manifest_with(trees__0={"dict": [["a", {"list": [], "tuple": []}]]}),
    "tree 65 levels": _manifest_with(trees__0=_chain(MAX_TREE_DEPTH + 1)),
    "trees empty": _manifest_with(trees=[]),
    "rank_trees too short": _manifest_with(rank_trees=[0]),
    "rank_trees index out of range": _manifest_with(rank_trees=[0, 2]),
    "rank_trees leaves a tree unused": _manifest_with(rank_trees=[0, 0]),
    "rank_trees missing": _manifest_with(rank_trees=_DELETE),
    "files missing": _manifest_with(files=_DELETE),
    "files lacks a chunk's file": _manifest_with(files=[["step-0000000007/r00000.0123456789ab.pack", 0, "a", 272, 272]]),
    "file listed twice": _manifest_with(files__1__0="step-0000000007/r00000.0123456789ab.pack"),
    "file path escapes": _manifest_with(files__0__0="../r.pack"),
    "file rank >= world_size": _manifest_with(files__1__1=2),
    "file tier with a slash": _manifest_with(files__0__2="a/b"),
    "file tier too long": _manifest_with(files__0__2="a" * 65),
    "file primary_bytes > nbytes": _manifest_with(files__1__4=17),
    "file of 4 fields": _manifest_with(files__0=["step-0000000007/r00000.0123456789ab.pack", 0, 272, 272]),
    "chunk past the end of its file": _manifest_with(files__1__3=15, files__1__4=8),
    "replica digest differs": _manifest_with(tensors__4__shards__0__replicas__0__0__3="xxh3-128:" + "0" * 32),
    "replica length differs": _manifest_with(tensors__4__shards__0__replicas__0__0__2=9),
    "replicas not a list": _manifest_with(tensors__4__shards__0__replicas={}),
    "overlapping shards": _manifest_with(tensors__3__shards__1__offsets=[1, 0], tensors__3__shards__0__shape=[2, 2]),
    "JSON NaN constant": GOLDEN_BYTES.replace(b'"step":7', b'"step":NaN'),
    "JSON Infinity constant": GOLDEN_BYTES.replace(b'"step":7', b'"step":Infinity'),
    "10000-level JSON nesting in the tree": GOLDEN_BYTES.replace(b'"trees":[{', b'"trees":[{"x":' + b"[" * 10000 + b"]" * 10000 + b",", 1),
    "10000 nested tree dicts": GOLDEN_BYTES.replace(b'"trees":[', b'"trees":[' + b'{"dict":[["k",' * 10000 + b'{"value":1}' + b"]]}" * 10000 + b",", 1),
    "int with 5000 digits": GOLDEN_BYTES.replace(b'"step":7', b'"step":' + b"9" * 5000),
    "UTF-16": GOLDEN_BYTES.decode().encode("utf-16"),
    "UTF-8 BOM": b"\xef\xbb\xbf" + GOLDEN_BYTES,
    "latin-1 byte": GOLDEN_BYTES.replace("ü".encode(), b"\xfc"),
    "truncated": GOLDEN_BYTES[:-1],
    "trailing garbage": GOLDEN_BYTES + b"x",
    "two objects": GOLDEN_BYTES + GOLDEN_BYTES,
    "empty": b"",
    "JSON list": b"[]",
    "JSON null": b"null",
}


@pytest.mark.parametrize("name", list(INVALID_MANIFESTS))
def test_invalid_manifest_is_rejected(name):
    _expect_manifest_error(decode_manifest, INVALID_MANIFESTS[name])


def _commit_with(**edits) -> bytes:
    obj = dict(COMMIT_OBJ)
    for k, v in edits.items():
        if v is _DELETE:
            del obj[k]
        else:
            obj[k] = v
    return json.dumps(obj).encode()


INVALID_COMMITS = {
    "format_version 4": _commit_with(format_version=4),
    "format_version missing": _commit_with(format_version=_DELETE),
    "step negative": _commit_with(step=-7),
    "step string": _commit_with(step="7"),
    "manifest ../x": _commit_with(manifest="../x"),
    "manifest /abs": _commit_with(manifest="/etc/passwd"),
    "manifest a//b": _commit_with(manifest="a//b"),
    "manifest empty": _commit_with(manifest=""),
    "manifest a list": _commit_with(manifest=["a"]),
    "manifest too long": _commit_with(manifest="/".join(["a" * 100] * 11)),
    "manifest missing": _commit_with(manifest=_DELETE),
    "digest missing": _commit_with(manifest_digest=_DELETE),
    "digest xxh3": _commit_with(manifest_digest="xxh3-128:" + "0" * 32),
    "digest short": _commit_with(manifest_digest="sha256:abc"),
    "digest a list": _commit_with(manifest_digest=["sha256:" + "0" * 64]),
    "digest trailing newline": _commit_with(manifest_digest="sha256:" + "0" * 64 + "\n"),
    "deep nesting": b'{"format_version":1,"step":' + b"[" * 10000 + b"]" * 10000 + b"}",
}


@pytest.mark.parametrize("name", list(INVALID_COMMITS))
def test_invalid_commit_is_rejected(name):
    _expect_manifest_error(decode_commit, INVALID_COMMITS[name])


def test_unknown_dtype_message_lists_known_dtypes_and_where():
    err = _expect_manifest_error(decode_manifest, INVALID_MANIFESTS["dtype unknown"])
    assert "float128" in str(err) and "float32" in str(err)


def test_newer_format_version_message_says_upgrade():
    err = _expect_manifest_error(decode_manifest, INVALID_MANIFESTS["format_version 4"])
    assert "upgrade" in str(err)


# ---------------------------------------------------------------- naming.check_relpath


def test_check_relpath_accepts_the_layout_names():
    for p in (naming.pack_name(0, 0, "abc"), naming.manifest_name(naming.MAX_STEP, naming.new_token()), naming.commit_name(3)):
        assert naming.check_relpath(p) == p


@pytest.mark.parametrize(
    "bad",
    ["", "/", "/abs", "..", ".", "../x", "a/../b", "a/..", "a//b", "a/", "./a", "a/./b", ".hidden", "-rf", "a b",
     "a\\b", "a\x00b", "ünï", "a\n", "x/y\n", "a" * 129, "/".join(["a" * 100] * 11), None, 3, b"abc", ["a"]],
)
def test_check_relpath_rejects(bad):
    with pytest.raises(ManifestError) as info:
        naming.check_relpath(bad, what="WHAT")
    assert "WHAT" in str(info.value)


path_alphabet = st.sampled_from(["a", "Z", "0", "_", "-", ".", "..", "/", "//", "\\", "\n", "\x00", " ", "é", "~"])


@settings(max_examples=300, deadline=None)
@given(st.lists(path_alphabet, max_size=12).map("".join) | st.text(max_size=40))
def test_check_relpath_never_accepts_escaping_paths(path):
    try:
        out = naming.check_relpath(path)
    except ManifestError as exc:
        assert str(exc).strip()
        return
    assert out == path
    assert not path.startswith("/")
    segments = path.split("/")
    assert ".." not in segments and "." not in segments and "" not in segments
    assert len(path) <= 1024
    # only plain characters: the result is safe to join under any root on any OS
    assert all(c.isascii() and (c.isalnum() or c in "._-/") for c in path), repr(path)


@settings(max_examples=200, deadline=None)
@given(st.lists(segment, min_size=1, max_size=6))
def test_check_relpath_accepts_plain_segments(segments):
    path = "/".join(segments)
    assume(len(path) <= 1024)
    assert naming.check_relpath(path) == path


@settings(max_examples=200, deadline=None)
@given(st.integers(0, naming.MAX_STEP))
def test_step_dir_roundtrip(step):
    name = naming.step_dir(step)
    assert naming.parse_step_dir(name) == step
    assert naming.check_relpath(naming.commit_name(step))


@pytest.mark.parametrize("step", [-1, naming.MAX_STEP + 1])
def test_step_dir_out_of_range(step):
    with pytest.raises(ValueError):
        naming.step_dir(step)


@pytest.mark.parametrize("name", ["step-1", "step-00000000001", "step-000000000a", "xstep-0000000001", "step-0000000001.tmp", "step-0000000001\n"])
def test_parse_step_dir_rejects(name):
    assert naming.parse_step_dir(name) is None


# ---------------------------------------------------------------- the decoder's fast paths agree with its checks


def test_a_shards_fast_path_accepts_exactly_what_its_checks_accept():
    """decode._shard_fast (no messages built) against _decode_shard (every check, named): for each
    shard of the golden manifest with each field replaced, deleted or extended by each bad value,
    the fast path returns what the checks return, or None (the checks then say what is wrong)."""
    from checkpointing.format.decode import _decode_shard, _shard_fast

    checked = 0
    for tensor in GOLDEN_OBJ["tensors"]:
        shape = tuple(tensor["shape"])
        size = itemsize(BY_NAME[tensor["dtype"]])
        for shard in tensor["shards"]:
            for path, _ in _paths(shard):
                for op in ("replace", "delete", "add"):
                    for value in BAD_VALUES:
                        raw = _mutate(shard, path, op, value)
                        try:
                            want = _decode_shard(raw, shape, size, WHERE)
                        except ManifestError:
                            want = None
                        got = _shard_fast(raw, shape, size)
                        assert got is None or got == want, (path, op, value)
                        checked += want is not None
    assert checked  # some mutations leave a valid shard: both paths accept them


@given(st.integers(1, 3), st.lists(st.tuples(st.integers(0, 12), st.integers(0, 5), st.sampled_from([(0, 4), (0, 2), (2, 2), (1, 0)])),
                                   min_size=1, max_size=12))
def test_tiling_of_shards_on_the_first_dimension_is_exact(ndim, spans):
    """Boxes with equal offsets in every dimension but the first are checked as intervals; the
    answer is the brute-force pairwise one whether they are or not."""
    from checkpointing.format.decode import check_tiling

    shape = (20,) + (4,) * (ndim - 1)
    boxes = [((o,) + (ro,) * (ndim - 1), (n,) + (rn,) * (ndim - 1)) for o, n, (ro, rn) in spans if o + n <= 20]
    assume(boxes)
    nonempty = [b for b in boxes if math.prod(b[1])]
    overlap = any(all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb))
                  for i, (oa, sa) in enumerate(nonempty) for ob, sb in nonempty[i + 1 :])
    if overlap:
        with pytest.raises(ManifestError, match="overlap"):
            check_tiling(shape, boxes, "t")
    else:
        check_tiling(shape, boxes, "t")


@given(manifests())
def test_each_ranks_account_of_a_step_holds_its_own_files(m):
    """CommittedStep.by_rank: one account per rank, each with the files that rank wrote and the
    step's digest; together they hold the file table; each round-trips."""
    whole = CommittedStep.of(m, manifest_digest(encode_manifest(m)))
    accounts = whole.by_rank()
    assert len(accounts) == m.world_size
    for rank, account in enumerate(accounts):
        assert (account.step, account.digest, account.world_size) == (whole.step, whole.digest, whole.world_size)
        assert all(f.rank == rank for f in account.files)
        assert decode_committed_step(encode_committed_step(account), WHERE) == account
    assert sorted(f.path for a in accounts for f in a.files) == sorted(f.path for f in whole.files)


@pytest.mark.parametrize("version, says", [
    (_DELETE, "damaged"), ("3", "damaged"), (None, "damaged"), (0, "damaged"), (4, "upgrade checkpointing"),
])
def test_a_format_version_is_called_newer_only_when_it_is(version, says):
    """A COMMIT or manifest whose format_version a flipped byte removed is damaged, not from a newer library: the error
    does not send the person on call to upgrade (only a larger version does)."""
    for decode, data in ((decode_manifest, _manifest_with(format_version=version)),
                         (decode_commit, _commit_with(version))):
        with pytest.raises(ManifestError) as info:
            decode(data, "step-0000000007/FILE")
        assert says in str(info.value) and ("upgrade" in str(info.value)) == (says != "damaged"), str(info.value)


def _commit_with(version) -> bytes:
    obj = json.loads(GOLDEN_COMMIT_BYTES)
    if version is _DELETE:
        del obj["format_version"]
    else:
        obj["format_version"] = version
    return json.dumps(obj).encode()

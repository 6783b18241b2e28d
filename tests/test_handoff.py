"""Long pure-Python work hands the GIL over (checkpointing/format/handoff.py): at most once per
interval per thread, and once per unit of work in rank 0's merge, the manifest's encoding and
every decode of it; the tensor-by-tensor encoding gives the bytes of a one-shot canonical_json."""

from __future__ import annotations

import json
import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.format import handoff as handoff_mod
from checkpointing.format import json_pieces
from checkpointing.format.decode import decode_manifest
from checkpointing.format.manifest import (CHUNK_DIGEST, ChunkRef, FileEntry, Manifest, ShardEntry, TensorEntry, _encode_shard,
                                           canonical_json, encode_files, encode_manifest)
from checkpointing.format.rank_reports import PartLeaf, RankPart, merge_parts

D = f"{CHUNK_DIGEST}:" + "0" * 32


@pytest.fixture
def releases(monkeypatch):
    """Counts the GIL releases of this thread's handoff() calls, every call past the first releasing."""
    count = [0]
    monkeypatch.setattr(handoff_mod, "INTERVAL_S", 0.0)
    monkeypatch.setattr(handoff_mod, "_release", lambda: count.__setitem__(0, count[0] + 1))
    handoff_mod.handoff()  # this thread's clock starts
    count[0] = 0
    return count


def _parts(world: int, tensors: int) -> list[RankPart]:
    mesh = tuple(range(world))
    parts = []
    for r in range(world):
        pack = f"step-0000000001/r{r:05d}.aaaaaaaaaaaa.pack"
        leaves = tuple(PartLeaf(f"w{t}", "float32", (2, 4), (2 * world, 4), (2 * r, 0), f"d{r}.{t}", 0, ((pack, 32 * t, 32, D),), mesh)
                       for t in range(tensors))
        parts.append(RankPart(r, pack, 32 * tensors, {"dict": [[f"w{t}", {"tensor": t}] for t in range(tensors)]}, leaves))
    return parts


def test_at_most_once_per_interval(monkeypatch):
    count = [0]
    monkeypatch.setattr(handoff_mod, "_release", lambda: count.__setitem__(0, count[0] + 1))
    monkeypatch.setattr(handoff_mod, "INTERVAL_S", 3600.0)
    for _ in range(1000):
        handoff_mod.handoff()
    assert count[0] == 0  # held for less than the interval: never released
    monkeypatch.setattr(handoff_mod, "INTERVAL_S", 0.0)
    handoff_mod.handoff()
    handoff_mod.handoff()
    assert count[0] == 2


def test_each_thread_keeps_its_own_clock(monkeypatch):
    """A thread that starts long work is not made to release by another thread's clock."""
    count = [0]
    monkeypatch.setattr(handoff_mod, "_release", lambda: count.__setitem__(0, count[0] + 1))
    monkeypatch.setattr(handoff_mod, "INTERVAL_S", 3600.0)
    handoff_mod.handoff()
    t = threading.Thread(target=lambda: [handoff_mod.handoff() for _ in range(100)])
    t.start()
    t.join()
    assert count[0] == 0


def test_merge_encode_and_decode_hand_over_per_unit_of_work(releases):
    world, tensors = 16, 8
    shards = world * tensors
    manifest, data, _ = merge_parts(1, _parts(world, tensors), ("t",) * world)  # merge, encode, decode
    assert releases[0] >= 3 * shards  # per leaf merged, per shard finished, per shard decoded
    releases[0] = 0
    assert encode_manifest(manifest) == data
    assert releases[0] >= tensors
    releases[0] = 0
    decode_manifest(data, "test")
    assert releases[0] >= shards


_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)  # keys: any text, escapes included
_metric_names = st.text(st.characters(whitelist_categories=("L", "N", "P", "S")), min_size=1, max_size=12)  # printable


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(_names, min_size=0, max_size=6, unique=True), metrics=st.dictionaries(_metric_names, st.integers(0, 10**12) | st.floats(0, 1e9),
                                                                                          max_size=3))
def test_tensor_by_tensor_encoding_is_the_one_shot_encoding(keys, metrics):
    files = (FileEntry("step-0000000001/r00000.aaaaaaaaaaaa.pack", 0, "t", 64 * max(1, len(keys)), 0),)
    tensors = tuple(TensorEntry(k, "float32", (4, 4), (ShardEntry((0, 0), (4, 4), (ChunkRef(files[0].path, 64 * i, 64, D),)),))
                    for i, k in enumerate(keys))
    tree = {"dict": [[k, {"tensor": i}] for i, k in enumerate(keys)]}
    m = Manifest(step=1, trees=(tree,), tensors=tensors, world_size=1, rank_trees=(0,), files=files, metrics=metrics)
    one_shot = canonical_json({
        **({"metrics": dict(m.metrics)} if m.metrics else {}), "format_version": m.format_version, "step": m.step, "world_size": m.world_size,
        "chunk_digest": CHUNK_DIGEST, "files": encode_files(m.files), "trees": list(m.trees), "rank_trees": list(m.rank_trees),
        "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "shards": [_encode_shard(s) for s in t.shards]} for t in m.tensors]})
    assert encode_manifest(m) == one_shot
    assert decode_manifest(one_shot, "test") == m


# ---------------------------------------------------------------- a document read a piece at a time

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


def _reject(name):
    raise ValueError(f"constant {name}")


@settings(max_examples=300, deadline=None)
@given(doc=st.dictionaries(st.sampled_from(["tensors", "files", "step", "x\\"]), _json_values, max_size=4),
       indent=st.sampled_from([None, 0, 2]), cut=st.integers(0, 400), junk=st.sampled_from(["", " ", "]", "}", ",", "x", "NaN", '"', "\ufeff"]))
def test_read_piece_by_piece_is_json_loads(doc, indent, cut, junk):
    """Every text, valid or cut short or with junk spliced in, reads as json.loads reads it, or
    fails with the same error."""
    text = json.dumps(doc, indent=indent)
    for t in (text, text[:cut] + junk + text[cut:], text[:cut], '{"tensors": [1, 2 , [3]] , "a":{}}', "[1]", ' {"tensors":[]} '):
        try:
            want = json.loads(t, parse_constant=_reject)
        except ValueError as exc:
            with pytest.raises(ValueError, match=re.escape(str(exc))):
                json_pieces.loads(t, split="tensors", parse_constant=_reject)
            continue
        assert json_pieces.loads(t, split="tensors", parse_constant=_reject) == want


def test_the_split_array_hands_over_per_element(releases):
    text = json.dumps({"step": 1, "tensors": [{"k": i} for i in range(50)], "files": list(range(50))})
    assert json_pieces.loads(text, split="tensors", parse_constant=_reject)["tensors"][49] == {"k": 49}
    assert releases[0] >= 50

"""Pure logic across ranks: who writes a replicated tensor (assign.py), and the merge of the
ranks' reports into one manifest (merge.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.plan.assign import OTHER, PRIMARY, TIER, UNIQUE, LeafInfo, assign_regions
from checkpointing.format.decode import decode_manifest
from checkpointing.format.manifest import encode_manifest
from checkpointing.format.rank_reports import MergeError, PartLeaf, RankPart, decode_part, encode_part, leaf_digest, merge_parts


@st.composite
def jobs(draw):
    world = draw(st.integers(2, 6))
    tiers = tuple(draw(st.lists(st.sampled_from("abc"), min_size=world, max_size=world)))
    keys = draw(st.lists(st.text("xyz", min_size=1, max_size=3), min_size=1, max_size=8, unique=True))
    sizes = {k: draw(st.integers(0, 1 << 20)) for k in keys}
    return world, tiers, keys, sizes


@settings(max_examples=200, deadline=None)
@given(jobs())
def test_each_replicated_tensor_has_one_primary_writer_and_one_writer_per_tier(job):
    world, tiers, keys, sizes = job
    regions = [assign_regions([LeafInfo(k, sizes[k], None) for k in keys], rank=r, tiers=tiers) for r in range(world)]
    for i, _ in enumerate(keys):
        column = [regions[r][i] for r in range(world)]
        assert column.count(PRIMARY) == 1
        for tier in set(tiers):
            writers = [r for r in range(world) if tiers[r] == tier and column[r] in (PRIMARY, TIER)]
            assert len(writers) == 1, (tier, column)
        assert UNIQUE not in column


def test_writing_is_spread_by_bytes():
    leaves = [LeafInfo(f"w{i}", 100, None) for i in range(8)]
    per_rank = [assign_regions(leaves, rank=r, tiers=("t",) * 4).count(PRIMARY) for r in range(4)]
    assert per_rank == [2, 2, 2, 2]


def test_sharded_replicas_and_per_rank_keys():
    leaves = [LeafInfo("shard", 10, (0,)), LeafInfo("rep", 10, (0, 1)), LeafInfo("rng", 10, None)]
    r0 = assign_regions(leaves, rank=0, tiers=("t", "t"), per_rank_keys=frozenset({"rng"}))
    r1 = assign_regions(leaves, rank=1, tiers=("t", "t"), per_rank_keys=frozenset({"rng"}))
    assert r0[0] == UNIQUE and r0[2] == UNIQUE and r1[2] == UNIQUE
    assert sorted([r0[1], r1[1]]) == [PRIMARY, OTHER]
    assert assign_regions(leaves, rank=0, tiers=("t",)) == [UNIQUE] * 3


def _leaf(key, shape, digest, chunks, *, offsets=None, global_shape=None, region=UNIQUE):
    return PartLeaf(key, "float32", shape, global_shape, offsets, digest, region, chunks)


def _part(rank, leaves, tree=None, borrowed=()):
    """A rank's report; chunks given as (offset, length, digest) are in its own new pack file."""
    tree = tree or {"dict": [[leaf.key, {"tensor": i}] for i, leaf in enumerate(leaves)]}
    file = f"step-0000000001/r{rank:05d}.aaaaaaaaaaaa.pack"
    leaves = [dataclasses.replace(l, chunks=None if l.chunks is None else tuple(c if len(c) == 4 else (file, *c) for c in l.chunks)) for l in leaves]
    own = sum(c[2] for l in leaves for c in (l.chunks or ()) if c[0] == file)
    return RankPart(rank, file, own, tree, tuple(leaves), tuple(borrowed))


D = "xxh3-128:" + "0" * 32
E = "xxh3-128:" + "1" * 32


def test_merge_sharded_replicated_and_per_rank():
    p0 = _part(0, [
        _leaf("w", (2, 3), "a", ((0, 24, D),), offsets=(0, 0), global_shape=(4, 3)),
        _leaf("step", (), "s", ((24, 4, D),), region=PRIMARY),
        _leaf("rng", (2,), "r0", ((28, 8, D),)),
    ])
    p1 = _part(1, [
        _leaf("w", (2, 3), "b", ((0, 24, E),), offsets=(2, 0), global_shape=(4, 3)),
        _leaf("step", (), "s", None, region=OTHER),
        _leaf("rng", (2,), "r1", ((24, 8, E),)),
    ])
    manifest, _, per_rank = merge_parts(1, [p0, p1], ("t", "t"))
    assert per_rank == {"rng"}
    keys = [t.key for t in manifest.tensors]
    assert keys == ["w", "step", "rng", "rng"]
    assert [s.offsets for s in manifest.tensors[0].shards] == [(0, 0), (2, 0)]
    assert manifest.rank_trees == (0, 1) and len(manifest.trees) == 2
    assert decode_manifest(encode_manifest(manifest), "x") == manifest
    assert decode_part(encode_part(p1)) == p1


def test_merge_replica_on_another_tier_and_primary_prefix():
    p0 = _part(0, [_leaf("step", (), "s", ((0, 4, D),), region=PRIMARY)])
    p1 = _part(1, [_leaf("step", (), "s", ((0, 4, D),), region=TIER)])
    manifest, _, _ = merge_parts(1, [p0, p1], ("a", "b"))
    [shard] = manifest.tensors[0].shards
    assert shard.chunks[0].file.endswith("r00000.aaaaaaaaaaaa.pack") and len(shard.replicas) == 1
    assert [(f.rank, f.tier, f.primary_bytes) for f in manifest.files] == [(0, "a", 4), (1, "b", 0)]


@pytest.mark.parametrize("problem", ["overlap", "hole", "replicas differ", "shape", "skipped"])
def test_merge_rejects_inconsistent_reports(problem):
    w0 = _leaf("w", (2, 3), "a", ((0, 24, D),), offsets=(0, 0), global_shape=(4, 3))
    w1 = {
        "overlap": _leaf("w", (2, 3), "b", ((0, 24, E),), offsets=(1, 0), global_shape=(4, 3)),
        "hole": _leaf("w", (1, 3), "b", ((0, 12, E),), offsets=(2, 0), global_shape=(4, 3)),
        "replicas differ": _leaf("w", (2, 3), "b", ((0, 24, E),), offsets=(0, 0), global_shape=(4, 3)),
        "shape": _leaf("w", (2, 3), "b", ((0, 24, E),), offsets=(2, 0), global_shape=(5, 3)),
        "skipped": _leaf("w", (2, 3), "b", None, offsets=(2, 0), global_shape=(4, 3), region=OTHER),
    }[problem]
    with pytest.raises(MergeError) as info:
        merge_parts(1, [_part(0, [w0]), _part(1, [w1])], ("t", "t"))
    assert "w" in str(info.value)


def test_leaf_digest_covers_dtype_shape_and_bytes():
    assert leaf_digest("float32", (2,), [D]) != leaf_digest("int32", (2,), [D])
    assert leaf_digest("float32", (2,), [D]) != leaf_digest("float32", (1, 2), [D])
    assert leaf_digest("float32", (2,), [D]) != leaf_digest("float32", (2,), [E])

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


def _sharded_part(rank, world, n_leaves, mesh_of=lambda t, world: tuple(range(world))):
    """`n_leaves` DTensors of 8 rows per rank, sharded on dim 0 over the mesh mesh_of(t, world)."""
    leaves = []
    for t in range(n_leaves):
        mesh = mesh_of(t, world)
        i = mesh.index(rank)
        leaves.append(PartLeaf(f"w{t}", "float32", (8, 4), (8 * len(mesh), 4), (8 * i, 0), f"d{rank}.{t}", UNIQUE,
                               ((f"step-0000000001/r{rank:05d}.aaaaaaaaaaaa.pack", 128 * t, 128, D),), mesh))
    return _part(rank, leaves)


def test_a_ranks_report_does_not_grow_with_the_job():
    """Every DTensor leaf lists its mesh's ranks: spelled per leaf, each rank's report grew with
    the number of ranks and rank 0 parsed N^2 of them. The report names each mesh and file once."""
    small = encode_part(_sharded_part(3, 8, 200))
    large = encode_part(_sharded_part(3, 4096, 200))
    one_mesh = len(",".join(map(str, range(4096))))
    assert len(large) - len(small) < one_mesh + 1024
    assert decode_part(large) == _sharded_part(3, 4096, 200)


def test_report_round_trip_with_several_meshes_and_files():
    """Leaves on different meshes (pipeline stages: one key on two meshes), equal meshes given as
    distinct tuples, chunks in this step's pack and in a borrowed file, a leaf a peer wrote."""
    part = _sharded_part(1, 4, 6, lambda t, world: tuple(range(world)) if t % 2 else (0, 1, 2, 3))  # equal meshes, distinct tuples
    other = "step-0000000000/r00001.bbbbbbbbbbbb.pack"
    leaves = list(part.leaves)
    leaves[2] = dataclasses.replace(leaves[2], chunks=((other, 0, 64, D), (leaves[2].chunks[0][0], 256, 64, E)))
    leaves[3] = dataclasses.replace(leaves[3], chunks=None, region=OTHER)
    leaves.append(PartLeaf("stage", "float32", (4,), (8,), (4,), "x", UNIQUE, ((other, 64, 16, E),), (1, 5)))
    part = dataclasses.replace(part, leaves=tuple(leaves))
    back = decode_part(encode_part(part))
    assert back == part
    assert back.leaves[0].mesh is back.leaves[1].mesh  # one tuple per mesh: the merge hashes each once


def test_merge_tells_meshes_apart_by_their_ranks_not_their_objects():
    """Two pipeline stages save a DTensor under one key on meshes {0, 1} and {2, 3}: two tensors.
    Ranks of one stage that hold equal meshes in different tuples: one tensor."""
    def part(rank):
        mesh = tuple([0, 1] if rank < 2 else [2, 3])  # a fresh tuple per rank
        i = mesh.index(rank)
        leaf = PartLeaf("w", "float32", (2, 3), (4, 3), (2 * i, 0), f"d{rank}", UNIQUE,
                        ((f"step-0000000001/r{rank:05d}.aaaaaaaaaaaa.pack", 0, 24, D),), mesh)
        return _part(rank, [leaf])

    parts = [decode_part(encode_part(part(r))) for r in range(4)]
    manifest, _, _ = merge_parts(1, parts, ("t",) * 4)
    assert [t.key for t in manifest.tensors] == ["w", "w"]
    assert [[s.offsets for s in t.shards] for t in manifest.tensors] == [[(0, 0), (2, 0)]] * 2
    assert manifest.rank_trees == (0, 0, 1, 1)

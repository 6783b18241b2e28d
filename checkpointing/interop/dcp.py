"""`CheckpointReader`: a torch.distributed.checkpoint StorageReader over our checkpoints (layer: interop).

    import torch.distributed.checkpoint as dcp
    from checkpointing.interop.dcp import CheckpointReader

    sd = {"model": model.state_dict()}
    dcp.load(sd, storage_reader=CheckpointReader("/ckpt/run1"))          # the newest committed step
    dcp.load(sd, storage_reader=CheckpointReader("s3://b/run1", step=20, storage_options={...}))

Tools that speak only DCP load our steps through DCP's own planner, which reshards: each rank
reads the boxes of the saved shards its targets overlap, whatever the saving and loading meshes.
The call order is DCP's (torch/distributed/checkpoint/storage.py): read_metadata, then
set_up_storage_reader, prepare_local_plan, prepare_global_plan (coordinator), read_data, on every
rank. Nothing here talks to other ranks: DCP does its own collectives.

- Names: DCP's "."-joined paths of the state dict, computed from the step's tree (_dcp_names.py).
- Tensors: `TensorStorageMetadata` with one chunk per saved shard box; read_data reads each
  requested box through restore/reading.py, every chunk verified against its digest before its
  bytes are used (a damaged chunk raises CheckpointCorruptError, never wrong values).
- Other values (ints, floats, strings, lists of them, tuples, numpy arrays): `BytesStorageMetadata`,
  served as `torch.save` bytes of the value rebuilt from the manifest's JSON tree (what DCP's
  planner `torch.load`s; we produce those bytes ourselves, nothing from disk is unpickled here).
- Per-rank values (the saving ranks held different ones): a rank gets its own when it loads with
  the saving world size, or the values of the rank named by `rank=`; otherwise they are refused by
  name when requested.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from checkpointing.errors import CheckpointConfigError, CheckpointError, CheckpointNotFoundError
from checkpointing.format.dtypes import dtype_from_name
from checkpointing.format.manifest import TensorEntry
from checkpointing.interop._dcp_names import DcpName, dcp_names
from checkpointing.interop._dcp_values import ValueBuilder
from checkpointing.interop.source import open_source
from checkpointing.restore.reading import READ_THREADS, ReadBox, Sources, read_box
from checkpointing.state.codecs import Codec
from checkpointing.tier import catalog
from checkpointing.tier.identity import tier_id_of

__all__ = ["CheckpointReader"]

_WINDOW = 4 * READ_THREADS  # tensor reads in flight at once (each into the planner's own target memory)


class CheckpointReader(StorageReader):
    """Read step `step` (default: the newest committed) of our checkpoint at `path_or_url` with DCP.

    path_or_url: a checkpoint directory (a local tier) or a tier URL (s3://, file://, ...);
    storage_options go to fsspec for URLs. Opened read-only: nothing is created, locked or deleted.
    param_names: {optimizer key: parameter names} for an optimizer saved through
    `optimizer.state_dict()` (keyed by parameter id) that a DCP tool loads in `get_state_dict`'s
    form (keyed by name): names in the optimizer's parameter order, usually
    `[n for n, _ in model.named_parameters()]`. The key is ours ("optim", or "app/optim").
    rank: whose per-rank values (values the saving ranks held differently) to read; by default a
    rank reads its own when it loads with the saving world size, and such values are refused by
    name otherwise. codecs: the Codec objects values were saved with.

    The step is chosen and its manifest read (digest checked) here, so a missing step fails at
    construction with CheckpointNotFoundError; `reset(checkpoint_id)` points the reader elsewhere.
    """

    def __init__(
        self,
        path_or_url: str | os.PathLike,
        step: int | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        param_names: Mapping[str, Sequence[str]] | None = None,
        rank: int | None = None,
        codecs: Iterable[Codec] = (),
    ) -> None:
        super().__init__()
        self._step_arg = step
        self._storage_options = dict(storage_options) if storage_options else None
        self._param_names = dict(param_names) if param_names else None
        self._rank_arg = rank
        self._codecs = tuple(codecs)
        self._open(path_or_url)

    # --------------------------------------------------------------------- DCP's StorageReader

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new read: at `checkpoint_id` when given; the newest committed step again when no step was named."""
        if checkpoint_id is not None or self._step_arg is None:
            self._open(self._target if checkpoint_id is None else checkpoint_id)

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        """DCP's view of the step: a tensor entry per saved tensor (its shard boxes), a bytes entry per other value."""
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, name in self._names.items():
            if name.is_tensor:
                entries[fqn] = _tensor_metadata(self._manifest.tensors[next(iter(name.nodes.values()))["tensor"]])
            else:
                entries[fqn] = BytesStorageMetadata()
        return Metadata(
            state_dict_metadata=entries,
            planner_data={fqn: name.path for fqn, name in self._names.items()},  # DCP's unflatten mapping
            storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Note which rank reads (DCP passes rank=): it decides whose per-rank values this rank gets."""
        self._tree = self._own_tree(kwargs.get("rank"))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every read item of `plan`: values rebuilt from the tree, tensor boxes read and verified.

        Problems known before reading (per-rank values this rank cannot have, shards it cannot
        reach, boxes outside the saved tensor) are raised together, before any target changes.
        """
        tensors, values = self._check(plan.items)
        for item, node in values:
            buf = io.BytesIO()
            torch.save(self._values.build(node, self._key(item)), buf)
            buf.seek(0)
            planner.load_bytes(item, buf)
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-dcp-read") as pool:
            for start in range(0, len(tensors), _WINDOW):
                self._read_window(pool, tensors[start : start + _WINDOW], planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether `checkpoint_id` (a directory or a URL, reachable without storage_options) holds a committed step of ours."""
        try:
            storage = open_source(os.fspath(checkpoint_id), None)
            return bool(catalog.list_steps(storage).committed)
        except Exception:  # noqa: BLE001 - any failure means "not ours" to DCP's storage detection
            return False

    # --------------------------------------------------------------------- ours

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's location (credentials never appear in it)."""
        return self._storage.url

    @property
    def step(self) -> int:
        """The step this reader reads."""
        return self._manifest.step

    @property
    def bytes_read(self) -> int:
        """Bytes of chunks this reader has read (each rank reads only what its targets overlap)."""
        return self._sources.bytes_read

    def _open(self, path_or_url: str | os.PathLike) -> None:
        self._target = os.fspath(path_or_url)
        storage = open_source(self._target, self._storage_options)
        committed = catalog.list_steps(storage).committed
        if not committed:
            raise CheckpointNotFoundError(f"{storage.url} holds no committed step of a checkpointing checkpoint")
        step = max(committed) if self._step_arg is None else self._step_arg
        if step not in committed:
            shown = ", ".join(map(str, committed[-10:])) + (f" and {len(committed) - 10} older" if len(committed) > 10 else "")
            raise CheckpointNotFoundError(f"step {step} is not committed in {storage.url} (committed: {shown}): pass one of those as step=")
        manifest = catalog.load_manifest(storage, step)
        if self._rank_arg is not None and not 0 <= self._rank_arg < manifest.world_size:
            raise CheckpointConfigError(f"rank={self._rank_arg}: step {step} was saved by {manifest.world_size} rank(s) (0..{manifest.world_size - 1})")
        here = tier_id_of(storage)
        if here is None:  # a remote tier (or a copy of one): every primary copy is here
            sources = Sources(manifest, None, "", remote=storage)
        else:
            sources = Sources(manifest, storage, here, where=f" (reading {storage.url}; its other shards are on other ranks' local tiers)")
        self._storage, self._manifest, self._sources = storage, manifest, sources
        self._names: dict[str, DcpName] = dcp_names(manifest, self._param_names)
        self._values = ValueBuilder(manifest, sources, self._codecs)
        self._tree = self._own_tree(None)

    def _own_tree(self, rank: int | None) -> int | None:
        """The tree whose per-rank values this rank reads, or None when it has none."""
        m = self._manifest
        if self._rank_arg is not None:
            return m.rank_trees[self._rank_arg]
        if m.world_size == 1:
            return m.rank_trees[0]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() == m.world_size:
            me = dist.get_rank()
            if rank is None or rank == me:  # DCP with no_dist=True passes rank 0 on every rank: not its own
                return m.rank_trees[me]
        return None

    def _key(self, item: ReadItem) -> str:
        return self._names[item.storage_index.fqn].key

    def _per_rank(self, name: DcpName) -> str:
        saved = self._manifest.world_size
        return (
            f"{name.key}: saved per rank (the {saved} saving ranks hold different values) and this rank has none of its "
            f"own here (it loads with another world size, or with no_dist=True); pass CheckpointReader(..., rank=r) "
            f"to read rank r's, or leave it out of the state dict"
        )

    def _check(self, items: list[ReadItem]) -> tuple[list[tuple[ReadItem, TensorEntry]], list[tuple[ReadItem, dict]]]:
        """Each item with what it reads (a tensor entry or a tree node); every problem raised at once."""
        problems: list[str] = []
        tensors: list[tuple[ReadItem, TensorEntry]] = []
        values: list[tuple[ReadItem, dict]] = []
        for item in items:
            name = self._names.get(item.storage_index.fqn)
            if name is None:
                problems.append(f"{item.storage_index.fqn}: not in step {self.step}")
                continue
            node = name.node_for(self._tree)
            if node is None:
                problems.append(self._per_rank(name))
            elif item.type == LoadItemType.BYTE_IO:
                values.append((item, node))
            elif "tensor" not in node:
                problems.append(f"{name.key}: this rank's value is not a tensor (the saving ranks held different kinds)")
            else:
                entry = self._manifest.tensors[node["tensor"]]
                problem = self._box_problem(item, entry, name.key)
                if problem:
                    problems.append(problem)
                else:
                    tensors.append((item, entry))
        if problems:
            raise CheckpointError(f"step {self.step} of {self.checkpoint_id} cannot serve this load: " + "; ".join(sorted(set(problems))))
        tensors.sort(key=lambda pair: _first_chunk(pair[1]))
        return tensors, values

    def _box_problem(self, item: ReadItem, entry: TensorEntry, key: str) -> str | None:
        offsets, shape = _box(item)
        if len(offsets) != len(entry.shape) or any(o < 0 or o + n > s for o, n, s in zip(offsets, shape, entry.shape)):
            return f"{key}: the box at {list(offsets)} of shape {list(shape)} lies outside the saved {entry.dtype}{list(entry.shape)}"
        unreachable = [s for s in entry.shards if s.chunks and self._sources.pick(s) is None and _overlaps(s.offsets, s.shape, offsets, shape)]
        if unreachable:
            f = unreachable[0].chunks[0].file
            return (f"{key}: the shard at {list(unreachable[0].offsets)} is in {f} (written by rank {self._sources.rank_of.get(f, '?')}), "
                    f"which is not in {self.checkpoint_id}: read from the remote tier, or a directory that holds every rank's files")
        return None

    def _read_window(self, pool: ThreadPoolExecutor, items: list[tuple[ReadItem, TensorEntry]], planner: LoadPlanner) -> None:
        """Resolve each item's target (this thread), read the boxes in parallel, then commit them in order."""
        jobs = []
        for item, entry in items:
            target = planner.resolve_tensor(item).detach()
            offsets, shape = _box(item)
            if tuple(target.shape) != shape:
                raise CheckpointError(
                    f"{self._key(item)}: DCP's planner gave a target of shape {list(target.shape)} for a box of shape {list(shape)}"
                )
            dtype = dtype_from_name(entry.dtype)
            dest = target if target.dtype == dtype else torch.empty(shape, dtype=dtype)  # converted on copy below
            jobs.append((item, target, dest, pool.submit(read_box, self._sources, self.step, ReadBox(entry, dest, offsets, shape))))
        wait([job[3] for job in jobs])
        for item, target, dest, fut in jobs:
            fut.result()  # the first failure (CheckpointCorruptError for a damaged chunk) is raised as is
            if dest is not target:
                target.copy_(dest)
            planner.commit_tensor(item, target)


def _box(item: ReadItem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The item's box of the global tensor: its saved chunk's offsets plus the offsets within it."""
    chunk = tuple(item.storage_index.offset or ())
    within = tuple(item.storage_offsets)
    return tuple(c + w for c, w in zip(chunk, within)) if chunk else within, tuple(item.lengths)


def _overlaps(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...], b_shape: tuple[int, ...]) -> bool:
    return all(a < b + m and b < a + n for a, n, b, m in zip(a_off, a_shape, b_off, b_shape))


def _tensor_metadata(entry: TensorEntry) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype_from_name(entry.dtype)),
        size=torch.Size(entry.shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.shape)) for s in entry.shards],
    )


def _first_chunk(entry: TensorEntry) -> tuple[str, int]:
    first = next((s.chunks[0] for s in entry.shards if s.chunks), None)
    return (first.file, first.offset) if first else ("", 0)

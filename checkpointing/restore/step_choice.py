"""Which step to restore, and where each rank reads it from (layer: restore; collective with several ranks).

Candidates are the steps committed on the local tier or on the remote tier, newest first. A step is
readable by a rank when every shard it needs is on its local tier (the step committed there, the
shard's file on this rank's tier), or when the remote tier holds the step (it holds every primary
copy): a replaced node with an empty local directory reads its part remotely, the others locally.
With peer copies, the replicas on this rank's node's disk (`replicas`: source tier id -> storage,
checkpointing/peer/) are candidates too, and a shard whose file lies on such a tier is read from
the replica when the step is committed there (before the remote tier).
With several ranks, the ranks then agree on the newest step every rank can read (the coordinator's
`agree_restore`, checkpointing/dist/types.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Mapping

from checkpointing.dist.types import Coordinator
from checkpointing.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, about_step
from checkpointing.format.manifest import Manifest
from checkpointing.restore.planner import RestorePlan, Sources, plan_restore
from checkpointing.restore.selection import Selection
from checkpointing.state.codecs import Codec
from checkpointing.storage import LocalStorage, Storage
from checkpointing.tier import catalog

log = logging.getLogger("checkpointing")


@dataclasses.dataclass
class _Readable:
    """What one rank found among the candidate steps: a plan per step it can read, why it cannot read
    the others, and the error that stopped the search (None: it looked at every candidate it needed)."""

    plans: dict[int, tuple[RestorePlan, Sources]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    error: BaseException | None = None


def choose_step(
    state: Mapping[str, Any],
    step: int | None,
    strict: bool | Selection,
    *,
    local: LocalStorage,
    remote: Storage | None,
    remote_steps: set[int],
    coord: Coordinator,
    codecs: tuple[Codec, ...],
    replicas: Mapping[str, Storage] | None = None,
    below: int | None = None,
) -> tuple[int | None, dict[int, tuple[RestorePlan, Sources]]]:
    """The step to restore (None: nothing committed) and, per readable step, its plan and sources.
    `below`: only steps older than it (a newer one's data turned out damaged on every copy)."""
    found = _readable_steps(state, step, strict, _Tiers(local, remote, frozenset(remote_steps), coord, codecs, dict(replicas or {})), below)
    plans, error = found.plans, found.error
    if coord.world_size == 1:
        if error is not None:
            raise error
        if step is not None and step not in plans:
            raise CheckpointNotFoundError(f"step {step} cannot be restored: {'; '.join(found.notes)}")
        return (max(plans) if plans else None), plans
    failure = None if error is None else f"{type(error).__name__}: {error}"
    try:
        chosen = coord.agree_restore(sorted(plans), "; ".join(found.notes) or "it can", step, error=failure)
    except CheckpointError:
        if error is not None:
            raise error from None
        raise
    if replicas and step is None and chosen is not None:
        _log_skipped(coord.rank, chosen, plans, found.notes)
    return chosen, plans


def _log_skipped(rank: int, chosen: int, plans: dict[int, Any], notes: list[str]) -> None:
    """With peer copies: say why newer committed steps are not restored (a step whose only copies were on a lost node)."""
    mine = [n for n in notes if _newer(n, chosen)]
    newer = sorted(s for s in plans if s > chosen)
    if mine:
        log.warning("checkpointing: rank %d restores step %d; newer steps are skipped: %s", rank, chosen, "; ".join(mine))
    elif newer:
        log.warning("checkpointing: rank %d restores step %d, not %s, which it could read: another rank cannot (see its log)",
                    rank, chosen, ", ".join(map(str, newer)))


def _newer(note: str, chosen: int) -> bool:
    """The note is about a step newer than `chosen` (it names "step N" first)."""
    words = note.replace(":", " ").split()
    return any(w == "step" and i + 1 < len(words) and words[i + 1].isdigit() and int(words[i + 1]) > chosen
               for i, w in enumerate(words))


@dataclasses.dataclass(frozen=True)
class _Tiers:
    """Where the candidates are: this rank's local tier, the remote tier and the steps committed there."""

    local: LocalStorage
    remote: Storage | None
    remote_steps: frozenset[int]
    coord: Coordinator
    codecs: tuple[Codec, ...]
    replicas: dict[str, Storage] = dataclasses.field(default_factory=dict)  # peer copies on this node's disk, by source tier


def _readable_steps(state: Mapping[str, Any], step: int | None, strict: bool | Selection, tiers: _Tiers, below: int | None = None) -> _Readable:
    """Plan the candidates, newest first (only `step` when given); with one rank and no `step`, stop at the first readable one."""
    local, remote, remote_steps, coord, codecs = tiers.local, tiers.remote, tiers.remote_steps, tiers.coord, tiers.codecs
    rank, world_size = coord.rank, coord.world_size
    local_steps = set(catalog.list_steps(local).committed)
    replica_steps = {t: set(catalog.list_steps(r).committed) for t, r in tiers.replicas.items()}
    committed = local_steps | remote_steps | set().union(*replica_steps.values())
    candidates = [step] if step is not None else sorted((s for s in committed if below is None or s < below), reverse=True)
    peers = " or a peer copy on its node" if tiers.replicas else ""
    where = f"its local tier {local.url}{peers}" + (f" or the remote tier {remote.url}" if remote is not None else "")
    found = _Readable(notes=[] if committed else [f"{where} holds no committed step"])
    damaged: list[int] = []
    for s in candidates:
        if s not in committed:
            found.notes.append(f"step {s} is not committed in {where}" + (f" (committed: {listing(committed)})" if committed else ""))
            continue
        copies = {t: r for t, r in tiers.replicas.items() if s in replica_steps[t]}  # peer copies holding step s
        try:
            manifest = _load_manifest(local if s in local_steps else None, remote if s in remote_steps else None, s, list(copies.values()))
            plan = plan_restore(state, manifest, rank=rank, world_size=world_size, codecs=codecs, select=strict)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:  # its COMMIT or manifest unreadable (listed, not readable)
            if step is not None:
                found.error = exc
                break
            found.notes.append(about_step(s, exc))
            damaged.append(s)
            log.warning("checkpointing: rank %d cannot use step %d, passed over for an older one: %s", rank, s, exc)
            continue
        except (CheckpointError, TypeError) as exc:
            found.error = exc
            break
        remote_note = "no remote tier is configured" if remote is None else f"the remote tier {remote.url} does not hold step {s}"
        sources = Sources(manifest, local if s in local_steps else None, coord.tiers[rank],
                          remote=remote if s in remote_steps else None, where=f" (its local tier is {local.url}; {remote_note})",
                          replicas=copies)
        missing = plan.missing(sources)
        if missing:
            if tiers.replicas:
                found.notes.append(f"for step {s} it needs {len(missing)} shard(s) that neither its local tier {local.url} nor a "
                                   f"committed peer copy on its node holds (their only copies are, or were, on another node), e.g. {missing[0]}")
            else:
                found.notes.append(f"for step {s} it needs {len(missing)} shard(s) its local tier {local.url} does not hold, e.g. {missing[0]}")
            continue
        found.plans[s] = (plan, sources)
        if world_size == 1 and step is None:
            break  # one rank: the newest readable step is the answer
    unreadable = candidates and not found.plans and (world_size == 1 or len(damaged) == len(candidates))
    if step is None and unreadable and found.error is None and not damaged:  # never a fresh start over committed steps
        found.error = CheckpointError(  # nothing is damaged: the shards lie on other nodes' disks
            f"no committed step in {where} can be read by this process: {'; '.join(found.notes)}. Their other shards are on the "
            "local tiers of the ranks that saved them (other nodes' directories): restore on those machines at that world size, "
            "configure a remote tier that holds every rank's data (remote=...), or read a directory that holds every rank's files")
    elif step is None and unreadable and found.error is None:
        found.error = CheckpointCorruptError(
            f"no committed step in {where} can be read: {'; '.join(found.notes)}. Nothing was restored; repair or remove "
            "the damaged steps' directories (checkpointing verify names what is damaged), or restore from another copy")
    return found


def _load_manifest(local: Storage | None, remote: Storage | None, step: int, copies: list[Storage] | None = None) -> Manifest:
    """The step's manifest from the local tier, else (or when the local copy is damaged) from a peer
    copy on this node's disk, else from the remote tier."""
    order = ([local] if local is not None else []) + list(copies or ()) + ([remote] if remote is not None else [])
    for i, storage in enumerate(order):
        try:
            return catalog.load_manifest(storage, step)
        except CheckpointCorruptError as exc:
            if i + 1 == len(order):
                raise
            nxt = order[i + 1]
            what = f"the remote tier {nxt.url}" if nxt is remote else f"the peer copy {nxt.url}"
            log.warning("checkpointing: %s; reading the manifest of step %d from %s instead", exc, step, what)
    raise CheckpointNotFoundError(f"step {step} is committed on no tier this rank reads")


def listing(steps: Iterable[int]) -> str:
    """Step numbers as an error lists them: the newest 10, and how many older ones."""
    ordered = sorted(steps)
    return ", ".join(map(str, ordered[-10:])) + (f" and {len(ordered) - 10} older" if len(ordered) > 10 else "")

"""Every key this package puts in the torch.distributed store, built in one place (layer: dist).

A manager's keys live under its namespace (`new_namespace`, a PrefixStore prefix), so two managers
of one job, or one job's restarts, never read each other's keys. Under it:

    init/tier/<rank>            the id of the rank's local tier (start-up)
    barrier/<name>/<rank>       the rank reached barrier <name>
    left/<rank>                 the rank is done with the store (close)
    restore/<n>/<rank>          the steps the rank can restore, for the manager's n-th restore
    gather/<name>/<rank>        the rank's value in gather <name> ("resume": the interrupted uploads it can
                                resume, at start-up; "passed-over/<n>": the newer steps it sees, n-th restore)
    save/<seq>/ws/<rank>        what replicated tensors the rank writes in save number seq
    save/<seq>/part/<rank>      its report (rank_reports.RankPart) or its error
    save/<seq>/silent/<rank>    the ranks it timed out waiting for in that save, and its error
    save/<seq>/manifest         rank 0's merged manifest (zlib, when several local tiers' leaders read it)
    save/<seq>/committed/<rank> the step's digest and that rank's files of it (CommittedStep.by_rank)
    save/<seq>/ack/<rank>       a local tier's leader committed there, or its error
    save/<seq>/status           rank 0's verdict on the save
    up/<seq>/<rank>             the rank's upload number seq is up, or its error
    up/<seq>/status             rank 0's verdict on that upload (remote commit)
    auto/<n>                    rank 0's save interval for period n (interval="auto")
    preempt/stop                the step the ranks agreed to stop after (preemption)
    preempt/done/<rank>         the rank finished its emergency save
    preempt/left/<rank>         the rank is leaving
    peer/secret                 rank 0's secret for the job's replica servers (peer copies)
    peer/addr/<rank>            a node leader's replica server, "host:port"
    peer/<seq>/<rank>           a node leader's peer copies of save number seq: ok, or the failures
    peer/<seq>/beat/<rank>      that leader is alive (a counter it bumps while it copies)
    peer/restore/<n>/<rank>     the replicas a node leader holds, for the manager's n-th restore
    peer/fetched/<n>/<rank>     that leader fetched back what its node lost (n-th restore)
    peer/fetch/<n>/beat/<rank>  that leader is alive while it fetches

Every rank of a job runs the same code, yet these formats stay fixed: they are what a reader of a
store dump sees. A key that names a rank ends with it (`rank_of`).
"""

from __future__ import annotations

import threading

_NAMESPACES: dict[str, int] = {}
_NAMESPACE_LOCK = threading.Lock()


def new_namespace(group_name: str) -> str:
    """A store prefix per manager: managers are created in the same order on every rank."""
    with _NAMESPACE_LOCK:
        n = _NAMESPACES.get(group_name, 0)
        _NAMESPACES[group_name] = n + 1
    return f"checkpointing/{group_name}/{n}/"


def give_back_namespace(group_name: str, namespace: str) -> None:
    """The manager that took `namespace` (the newest of `group_name`) never met the other ranks: the next one
    takes it again, as the other ranks' next manager will (deferred.py: a read-only manager whose meeting timed out)."""
    with _NAMESPACE_LOCK:
        n = _NAMESPACES.get(group_name, 0) - 1
        if n >= 0 and namespace == f"checkpointing/{group_name}/{n}/":
            _NAMESPACES[group_name] = n


def rank_of(key: str) -> int:
    """The rank a per-rank key names (its last part)."""
    return int(key.rsplit("/", 1)[1])


# ---------------------------------------------------------------- start-up, collectives, close


def init_tier(rank: int) -> str:
    return f"init/tier/{rank}"


def barrier(name: str, rank: int) -> str:
    return f"barrier/{name}/{rank}"


def left(rank: int) -> str:
    return f"left/{rank}"


def restore(n: int, rank: int) -> str:
    return f"restore/{n}/{rank}"


def gather(name: str, rank: int) -> str:
    return f"gather/{name}/{rank}"


# ---------------------------------------------------------------- one save (StoreCoordinator)


def save_written(seq: int, rank: int) -> str:
    return f"save/{seq}/ws/{rank}"


def save_part(seq: int, rank: int) -> str:
    return f"save/{seq}/part/{rank}"


def save_silent(seq: int, rank: int) -> str:
    return f"save/{seq}/silent/{rank}"


def save_ack(seq: int, rank: int) -> str:
    return f"save/{seq}/ack/{rank}"


def save_manifest(seq: int) -> str:
    return f"save/{seq}/manifest"


def save_committed(seq: int, rank: int) -> str:
    return f"save/{seq}/committed/{rank}"


def save_status(seq: int) -> str:
    return f"save/{seq}/status"


def save_all(seq: int, world_size: int) -> list[str]:
    """Every key of save number `seq` (to delete them once every rank is past it)."""
    per_rank = [fn(seq, r) for fn in (save_written, save_part, save_silent, save_ack, save_committed) for r in range(world_size)]
    return [save_manifest(seq), save_status(seq)] + per_rank


# ---------------------------------------------------------------- one upload (StoreTierCommitter)


def upload(seq: int, rank: int) -> str:
    return f"up/{seq}/{rank}"


def upload_status(seq: int) -> str:
    return f"up/{seq}/status"


def upload_all(seq: int, world_size: int) -> list[str]:
    """Every key of upload number `seq`."""
    return [upload_status(seq)] + [upload(seq, r) for r in range(world_size)]


# ---------------------------------------------------------------- the training loop


def auto_interval(n: int) -> str:
    return f"auto/{n}"


PREEMPT_STOP = "preempt/stop"


def preempt_done(rank: int) -> str:
    return f"preempt/done/{rank}"


def preempt_left(rank: int) -> str:
    return f"preempt/left/{rank}"


# ---------------------------------------------------------------- peer copies (checkpointing/peer/)


PEER_SECRET = "peer/secret"


def peer_addr(rank: int) -> str:
    return f"peer/addr/{rank}"


def peer_copied(seq: int, rank: int) -> str:
    return f"peer/{seq}/{rank}"


def peer_beat(seq: int, rank: int) -> str:
    return f"peer/{seq}/beat/{rank}"


def peer_restore(n: int, rank: int) -> str:
    return f"peer/restore/{n}/{rank}"


def peer_fetched(n: int, rank: int) -> str:
    return f"peer/fetched/{n}/{rank}"


def peer_fetch_beat(n: int, rank: int) -> str:
    return f"peer/fetch/{n}/beat/{rank}"

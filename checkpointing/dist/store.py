"""Talking to the torch.distributed store: a connection of our own, polling with a deadline, and its
errors translated once (layer: dist).

Every wait on other ranks in this package polls the store here (`poll`, `wait_set`, `wait_keys`):
with a deadline, backing off from 1 ms to 10 ms between round trips. Nothing here runs a collective
on a process group, so a background thread may wait without ever blocking training.
"""

from __future__ import annotations

import datetime
import functools
import json
import time
from typing import Any, Callable, Iterable, TypeVar

from checkpointing.dist.keys import rank_of
from checkpointing.dist.types import Store
from checkpointing.errors import CheckpointError, CoordinationLost, CoordinationTimeout, rank_ranges

_POLL_S = (0.001, 0.01)  # first and largest interval between polls of the store

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])


def poll(ready: Callable[[], _T], deadline: float) -> _T:
    """Call `ready` until it answers something true, and return that; past `deadline` (monotonic),
    return its last false answer instead."""
    delay = _POLL_S[0]
    while not (found := ready()):
        if time.monotonic() >= deadline:
            return found
        time.sleep(delay)
        delay = min(delay * 2, _POLL_S[1])
    return found


def delete_keys(store: Store, keys: Iterable[str]) -> None:
    """Delete keys no rank reads any more; one that cannot be deleted is left (a few bytes, nothing more)."""
    for key in keys:
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - a leftover key is harmless
            pass


def wait_set(store: Store, keys: list[str], deadline: float) -> bool:
    """Poll until every key is set (True), or until `deadline` passed (False)."""
    return not keys or poll(lambda: store.check(keys), deadline)


def wait_keys(store: Store, keys: list[str], deadline: float, what: str, *, timeout_s: float,
              keys_rank: Callable[[str], int] = rank_of) -> None:
    """Poll until every key is set; past `deadline`, CoordinationTimeout naming the ranks that did not answer."""
    if wait_set(store, keys, deadline):
        return
    missing = sorted(keys_rank(k) for k in keys if not store.check([k]))
    raise CoordinationTimeout(
        f"{what}: {rank_ranges(missing)} did not answer in time (timeout_s={timeout_s:g}; "
        "dead, hung, or much slower: raise timeout_s if they are only slow)",
        missing,
    )


def wait_reports(store: Store, parts: list[str], silent: list[str], deadline: float, what: str, *, timeout_s: float,
                 slice_s: float = 1.0) -> dict[int, str]:
    """wait_keys for the ranks' reports of one save (`parts`), where a rank that timed out waiting for
    others in that save names them at its `silent` key ({"ranks": [...], "error": ...}): once every
    report still missing is of a rank another one names, waiting on for it would only double what a
    dead rank costs the others. Returns those ranks, each with the error that named it ({}: all came).
    Past the first slice, each slice asks for the keys not seen yet (no report is fetched here)."""
    seen: set[int] = set()
    named: dict[int, str] = {}
    while not wait_set(store, parts, min(deadline, time.monotonic() + slice_s)):
        seen.update(i for i, k in enumerate(parts) if i not in seen and store.check([k]))
        said = [k for k in silent if store.check([k])]
        for raw in store.multi_get(said) if said else []:
            msg = json.loads(raw)
            named.update({int(r): str(msg.get("error")) for r in msg.get("ranks", [])})
        missing = [i for i in range(len(parts)) if i not in seen]
        if missing and all(i in named for i in missing):
            return {i: named[i] for i in missing}
        if time.monotonic() >= deadline:
            wait_keys(store, parts, deadline, what, timeout_s=timeout_s)  # raises CoordinationTimeout naming them
    return {}


def store_errors(fn: _F) -> _F:
    """For methods of an object with a `rank`: store failures (a DistError from the C++ client)
    become one clear CheckpointError."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except CheckpointError:
            raise
        except RuntimeError as exc:  # torch.distributed.DistError and its subclasses
            raise CoordinationLost(
                f"rank {self.rank} lost the torch.distributed store ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                "its host (rank 0 with a tcp:// init method, or the torchrun agent) has probably exited"
            ) from None

    return wrapper  # type: ignore[return-value]


def connect(namespace: str, timeout_s: float) -> Store:
    """A store connection of our own, in the job's key space (which is fresh for each launch)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    clone = getattr(store, "clone", None)  # a separate connection, safe to use from our thread
    if clone is not None:
        store = clone()
    store.set_timeout(datetime.timedelta(seconds=max(timeout_s, 1)))
    return dist.PrefixStore(namespace, store)


def store_host() -> str:
    """The address this host uses to reach the job's store (a node's replica server binds it): the
    local end of a route to the store's host, so 127.0.0.1 for a store on loopback; 127.0.0.1 when
    the store has no host (a FileStore, or no process group)."""
    import os
    import socket

    import torch.distributed as dist

    host = None
    try:
        store = dist.distributed_c10d._get_default_store()
        host = getattr(getattr(store, "_underlying_non_prefix_store", store), "host", None)
    except (RuntimeError, ValueError, AttributeError):
        pass
    host = host or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))  # no packet is sent: this only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"

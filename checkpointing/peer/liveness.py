"""Waiting through the store for node leaders that work for a long time, and keeping them heard (layer: peer).

A leader copying a step (or fetching replicas back) may take far longer than timeout_s, so the
ranks waiting for its outcome do not use a fixed deadline: the leader bumps a beat key while it
works (`Beating`), and a waiter gives up on a leader only when its beat has not changed for
timeout_s (`wait_alive`). A dead or hung leader is named; a slow one is waited for.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from checkpointing.dist.types import Store

BEAT_S = 1.0  # a working leader bumps its beat this often
_POLL_S = (0.002, 0.05)


def wait_alive(store: Store, waited: dict[int, str], beat_key: Callable[[int], str], timeout_s: float) -> list[int]:
    """Poll until every key of `waited` (leader rank -> key) is set; return the leaders whose beat
    stood still for `timeout_s` first (empty: every key is set)."""
    beats: dict[int, tuple[bytes | None, float]] = {leader: (None, time.monotonic()) for leader in waited}
    delay = _POLL_S[0]
    while True:
        missing = [leader for leader, key in waited.items() if not store.check([key])]
        if not missing:
            return []
        now = time.monotonic()
        for leader in missing:
            key = beat_key(leader)
            value = store.get(key) if store.check([key]) else None
            if value != beats[leader][0]:
                beats[leader] = (value, now)
        silent = [leader for leader in missing if now - beats[leader][1] > timeout_s]
        if silent:
            return silent
        time.sleep(delay)
        delay = min(2 * delay, _POLL_S[1])


def beating(store: Store, key: str, threads: list[threading.Thread]) -> None:
    """Start `threads` and bump `key` every BEAT_S until all of them ended (on the calling thread,
    which owns `store`)."""
    for t in threads:
        t.start()
    beat = 0
    while any(t.is_alive() for t in threads):
        beat += 1
        store.set(key, str(beat))
        for t in threads:
            t.join(BEAT_S / max(1, len(threads)))

"""Typed, validated options. Errors say which option is wrong and how to fix it."""

from __future__ import annotations

import dataclasses
import math
import signal
from typing import Any, Callable, Literal, Mapping

from checkpointing.plan.retention import RetentionPolicy, as_policy
from checkpointing.plan.scrub import DEFAULT_BYTES_PER_S as DEFAULT_REVERIFY_BYTES_PER_S
from checkpointing.plan.scrub import DEFAULT_EVERY as DEFAULT_REVERIFY_EVERY
from checkpointing.state.codecs import Codec
from checkpointing.errors import CheckpointConfigError

SnapshotMode = Literal["async", "eager"]
ChangeDetection = Literal["auto", "compare"]

MIN_CHUNK_BYTES = 4096
DEFAULT_CHUNK_BYTES = 1 << 20  # chosen by bench/bench_incremental.py: see docs/benchmarks.md ("Incremental saves")
DEFAULT_YIELD_S = 30.0  # bench/bench_cost.py: see docs/benchmarks.md ("What a save costs the loop")
S3_MIN_PART_BYTES = 5 << 20  # S3 refuses smaller multipart parts (but the last)


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """CheckpointManager(local_dir, *, ...): every option. Each is checked when the manager is created:
    a CheckpointConfigError names the wrong one and how to fix it. (They are the fields of
    checkpointing.options.ManagerOptions, whose docstring this is, and CheckpointManager.__init__'s.)

    Where the checkpoints live:
    local_dir: the local tier, a directory on fast node-local storage (created if missing). Ranks on
        one host passing the same directory share it. One writing process per directory: a second
        one gets DirectoryLockedError naming the holder (read_only=True needs no lock).
    remote: URL of the durable tier (s3://bucket/prefix, file:///path, memory://name, any fsspec
        URL); every committed step is uploaded there in the background. None: local tier only.
    storage_options: handed to the fsspec filesystem of `remote` (endpoint_url, key, secret, ...).
        Never printed: it is left out of repr() and of every message.
    keep_local: which committed steps the local tier keeps: a whole number N keeps the newest N
        (default 2), None keeps all, or a retention policy (checkpointing.KeepLatest(n),
        KeepEvery(n): steps divisible by n, KeepBest(n, "loss", mode="min"): the n best by a metric
        passed to save(..., metrics={"loss": ...}), KeepSteps([...])), combined with `|`:
        KeepLatest(2) | KeepEvery(1000) keeps what either keeps. Whatever the policy, the newest
        committed step stays, and a step whose upload is not finished is never deleted locally.
    keep_remote: the same for the remote tier (None, the default, keeps all).
    read_only: only read (default False): steps(), tiers(), latest_step(), restore(), stats() work;
        nothing is created, written or deleted on any tier (no TIER file, no tidying of incomplete
        steps, no writer lock, no metrics file) and nothing is hooked (no optimizer step hook, no
        signal handler); save(), delete() and handle_preemption() raise CheckpointConfigError. The
        directory may be one this process cannot write; it must exist unless `remote` is given. A
        directory without a TIER file (never opened by a writing manager, e.g. a copy of a remote
        tier) is read like the remote tier: as holding every primary copy.
    process_group: the ranks that checkpoint together (default: torch.distributed's WORLD when it
        is initialised, else this process alone). Creating the manager, restore(), delete() and
        close() are collective calls; save() is called by every rank but waits for none.
    timeout_s: longest wait for another rank (its report, rank 0's verdict, a restore agreement, a
        collective call) before the call fails with an error naming the ranks that did not answer.

    How a save is taken:
    snapshot: "async" (default) lets the copy into staging overlap the next forward/backward and
        guards the next optimizer.step(); "eager" copies everything before save() returns.
    staging_budget_bytes: upper bound of the staging pool (None: one full copy of the state).
        A smaller budget streams the state through a ring and the guard waits for the writer.
    chunk_bytes: largest chunk (default 1 MiB, at least 4096); every chunk carries its own digest.
    write_block_bytes: size of one write syscall to the pack file (a multiple of 4096, >= 1 MiB).
    direct_io: use O_DIRECT for pack writes where the filesystem supports it (default True).
    fsync: make every write durable before the commit marker (default True; off only for tests).
    codecs: opt-in codecs (checkpointing.Codec, PickleCodec) for values that are neither tensors,
        state_dict() objects nor JSON-like primitives; each needs a unique name. Restore never
        unpickles anything without one.
    incremental: reuse the chunks that did not change since the previous save (or since the step
        restored) instead of writing them again (default True); False: each save writes everything.
    change_detection: how an incremental save finds the chunks that changed. "auto": where the
        kernel reports written pages (Linux >= 6.7, pagewrites.py), chunks of CPU tensors not
        written since the previous save are not even read, the rest are compared byte for byte;
        elsewhere everything is compared. "compare": always compare every byte (for memory that a
        device writes by DMA into pages pinned outside PyTorch, e.g. RDMA-registered CPU tensors).
    reverify_every: with incremental saves, every chunk a save borrows from an earlier file is
        read back and digested at least once in any `reverify_every` consecutive saves that borrow
        it (default 10), on the background thread after each commit (a damaged one is written anew
        by the next save); None turns this off.
    reverify_bytes_per_s: the pace of those reads (default 200e6).
    background_yield_s: once a save's snapshot is copied (at normal priority: the guard before
        optimizer.step() waits for it), the threads doing the rest (digests, writes, commit,
        retention) run at the lowest CPU priority (Linux SCHED_IDLE: only on a core nothing else
        wants), so that a training loop that keeps every core busy is not slowed by them. They go
        back to normal priority as soon as anything waits for the save (the next save(),
        handle.wait(), wait(), delete(), close(), an emergency save) or this many seconds after the
        snapshot (default 30.0; at most timeout_s / 4, so that no rank waits for another past its
        timeout), which bounds how much later a step becomes durable. SaveStats.yielded_s is the
        time spent so. Uploads to the remote tier yield the same way, from the start of each
        upload until something waits for it or this many seconds have passed (save/uploader.py).
        None: always normal priority. Where the process may not raise a thread's
        priority back (not Linux; neither CAP_SYS_NICE nor RLIMIT_NICE >= 20) the threads keep
        normal priority (save/yielding.py).

    Uploads to the remote tier:
    upload_concurrency: multipart parts (of one rank) uploaded at a time (default 8).
    upload_part_bytes: size of one multipart part (default 64 MiB; S3: at least 5 MiB); a file up
        to this size goes up in one request.
    upload_bytes_per_s: pace each rank's uploads to this rate (None: as fast as the link allows).

    Peer copies (each node's steps also committed on other nodes' local tiers; docs/design.md):
    peer_copies: how many other nodes hold a copy of each node's committed steps (default 0: off).
        A node is a local tier (the ranks sharing one local_dir); the job needs peer_copies + 1 of
        them. After a step commits locally, each node's leader copies its files to its peers in the
        background over a socket of its own (never the training process group); handle.wait() and
        wait() also wait for those copies. A node whose local directory was lost restores from a
        peer's copy before the remote tier.
    peer_bandwidth: pace each node's outgoing copies to this many bytes per second (None: unpaced).

    The training loop:
    interval: what `mgr.should_save(step)` answers: None (no schedule: should_save raises), a
        whole number N (every N steps: step % N == 0), or "auto" (Daly's optimum interval from the
        measured cost of saves and `mtbf_s`; see checkpointing/plan/schedule.py).
    mtbf_s: the job's mean time between failures in seconds (with interval="auto" only).
    on_metrics: called with each save's record (a dict, the fields of SaveStats) once it is
        complete, on a background thread; its exceptions are logged and never stop saving.
    """

    keep_local: int | RetentionPolicy | None = 2
    keep_remote: int | RetentionPolicy | None = None
    snapshot: SnapshotMode = "async"
    staging_budget_bytes: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    write_block_bytes: int = 32 << 20
    direct_io: bool = True
    fsync: bool = True
    incremental: bool = True
    change_detection: ChangeDetection = "auto"
    reverify_every: int | None = DEFAULT_REVERIFY_EVERY
    reverify_bytes_per_s: float = DEFAULT_REVERIFY_BYTES_PER_S
    background_yield_s: float | None = DEFAULT_YIELD_S
    remote: str | None = None
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
    codecs: tuple[Codec, ...] = ()
    timeout_s: float = 600.0
    upload_concurrency: int = 8
    upload_part_bytes: int = 64 << 20
    upload_bytes_per_s: float | None = None
    interval: int | Literal["auto"] | None = None
    mtbf_s: float | None = None
    on_metrics: Callable[[dict[str, Any]], Any] | None = dataclasses.field(default=None, repr=False)
    read_only: bool = False
    peer_copies: int = 0
    peer_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for name, what in (("read_only", "only read"), ("incremental", "write only what changed"), ("fsync", "make each step durable"),
                           ("direct_io", "write with O_DIRECT where the file system takes it")):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointConfigError(f"{name}={getattr(self, name)!r} is invalid: pass True ({what}) or False")
        for name in ("keep_local", "keep_remote"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, RetentionPolicy) and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise CheckpointConfigError(
                    f"{name}={value!r} is invalid: pass a whole number >= 1 (keep the newest N steps), a retention policy "
                    "(KeepLatest(2) | KeepEvery(1000), KeepBest(3, 'loss'), KeepSteps([...]) from checkpointing), "
                    "or None to keep every step"
                )
        if self.snapshot not in ("async", "eager"):
            raise CheckpointConfigError(
                f"snapshot={self.snapshot!r} is invalid: use 'async' (copy overlaps compute, guarded "
                "before optimizer.step) or 'eager' (copy before save returns)"
            )
        if self.change_detection not in ("auto", "compare"):
            raise CheckpointConfigError(
                f"change_detection={self.change_detection!r} is invalid: use 'auto' (skip memory the kernel saw no "
                "write to, compare the rest) or 'compare' (compare every byte)"
            )
        self._check_reverify()
        y = self.background_yield_s
        if y is not None and not _positive(y):
            raise CheckpointConfigError(
                f"background_yield_s={y!r} is invalid: pass the most seconds a save's background work may yield the CPU "
                "to the training loop (> 0, default 30), or None to run it at normal priority"
            )
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < MIN_CHUNK_BYTES:
            raise CheckpointConfigError(
                f"chunk_bytes={self.chunk_bytes!r} is invalid: pass an int >= {MIN_CHUNK_BYTES}"
            )
        if not isinstance(self.write_block_bytes, int) or self.write_block_bytes < (1 << 20) or self.write_block_bytes % 4096:
            raise CheckpointConfigError(
                f"write_block_bytes={self.write_block_bytes!r} is invalid: pass a multiple of 4096 >= 1 MiB"
            )
        budget = self.staging_budget_bytes
        if budget is not None and (not isinstance(budget, int) or budget < 2 * self.chunk_bytes):
            raise CheckpointConfigError(
                f"staging_budget_bytes={budget!r} is too small: it must hold at least two chunks "
                f"(2 * chunk_bytes = {2 * self.chunk_bytes}); raise it or lower chunk_bytes"
            )
        self._check_remote()
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise CheckpointConfigError(f"timeout_s={self.timeout_s!r} is invalid: pass a number of seconds > 0")
        self._check_observability()
        self._check_peers()
        names = [c.name for c in self.codecs]
        if len(set(names)) != len(names):
            raise CheckpointConfigError(f"codecs have duplicate names {names}: give each codec a unique name (one PickleCodec "
                                        "takes every class it may rebuild: PickleCodec(A, B), not PickleCodec(A), PickleCodec(B))")

    @property
    def yield_s(self) -> float | None:
        """How long a save's background threads may yield the CPU: background_yield_s, at most a
        quarter of timeout_s (a rank that yields never keeps the others waiting past their timeout)."""
        y = self.background_yield_s
        return None if y is None else min(float(y), self.timeout_s / 4)

    @property
    def local_retention(self) -> RetentionPolicy | None:
        """keep_local as a policy (n: KeepLatest(n)); None keeps every step."""
        return as_policy(self.keep_local)

    @property
    def remote_retention(self) -> RetentionPolicy | None:
        """keep_remote as a policy (n: KeepLatest(n)); None keeps every step."""
        return as_policy(self.keep_remote)

    def _check_reverify(self) -> None:
        every, rate = self.reverify_every, self.reverify_bytes_per_s
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise CheckpointConfigError(
                f"reverify_every={every!r} is invalid: pass a whole number of saves >= 1 (each borrowed chunk is read back "
                "at least once in that many saves), or None to turn re-verification off"
            )
        if not _positive(rate):
            raise CheckpointConfigError(f"reverify_bytes_per_s={rate!r} is invalid: pass bytes per second > 0 (default 200e6)")

    def _check_observability(self) -> None:
        iv = self.interval
        if iv is not None and iv != "auto" and (isinstance(iv, bool) or not isinstance(iv, int) or iv < 1):
            raise CheckpointConfigError(
                f"interval={iv!r} is invalid: pass a whole number of steps >= 1, 'auto' (Daly's interval from the "
                "measured save cost and mtbf_s), or None"
            )
        m = self.mtbf_s
        if iv == "auto":
            if m is None or isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 1e12:  # (a huge int too)
                raise CheckpointConfigError(
                    f"interval='auto' needs mtbf_s, the job's mean time between failures in seconds (> 0, at most 1e12); got mtbf_s={m!r}. "
                    "Estimate it from your cluster's failure log (24 h = 86400; N nodes failing independently: node MTBF / N)"
                )
        elif m is not None:
            raise CheckpointConfigError(f"mtbf_s={m!r} has no effect without interval='auto': pass interval='auto' or leave mtbf_s=None")
        if self.on_metrics is not None and not callable(self.on_metrics):
            raise CheckpointConfigError(
                f"on_metrics={type(self.on_metrics).__name__} is not callable: pass a function taking one dict (a save's record)"
            )

    def _check_peers(self) -> None:
        k, rate = self.peer_copies, self.peer_bandwidth
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise CheckpointConfigError(f"peer_copies={k!r} is invalid: pass a whole number >= 0 (0: no peer copies)")
        if rate is not None and not _positive(rate):
            raise CheckpointConfigError(f"peer_bandwidth={rate!r} is invalid: pass bytes per second > 0, or None for no limit")
        if rate is not None and k == 0:
            raise CheckpointConfigError(f"peer_bandwidth={rate!r} has no effect without peer copies: pass peer_copies >= 1, "
                                        "or leave peer_bandwidth=None")

    def _check_remote(self) -> None:
        from checkpointing.storage.redact import redact_url

        if self.remote is None:
            if self.storage_options:
                raise CheckpointConfigError("storage_options were given without remote=...: they configure the remote tier only")
            if self.keep_remote is not None:
                raise CheckpointConfigError(
                    f"keep_remote={self.keep_remote!r} has no effect without a remote tier: pass remote='s3://bucket/prefix' "
                    "(or any fsspec URL), or leave keep_remote=None"
                )
            return
        if not isinstance(self.remote, str) or "://" not in self.remote:
            shown = redact_url(self.remote) if isinstance(self.remote, str) else type(self.remote).__name__
            raise CheckpointConfigError(
                f"remote={shown!r} is not a URL: pass s3://bucket/prefix, file:///absolute/path or another fsspec URL"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise CheckpointConfigError(f"storage_options must be a dict (got a {type(self.storage_options).__name__})")
        conc = self.upload_concurrency
        if isinstance(conc, bool) or not isinstance(conc, int) or not 1 <= conc <= 256:
            raise CheckpointConfigError(f"upload_concurrency={conc!r} is invalid: pass an int in 1..256 (parts in flight per rank)")
        part = self.upload_part_bytes
        minimum = S3_MIN_PART_BYTES if self.remote.split("://", 1)[0] in ("s3", "s3a") else 1 << 16
        if isinstance(part, bool) or not isinstance(part, int) or part < minimum:
            raise CheckpointConfigError(
                f"upload_part_bytes={part!r} is invalid: pass an int >= {minimum} (S3 multipart parts are at least 5 MiB)"
            )
        rate = self.upload_bytes_per_s
        if rate is not None and not (_positive(rate) or rate == math.inf):  # inf: no limit, as None
            raise CheckpointConfigError(f"upload_bytes_per_s={rate!r} is invalid: pass bytes per second > 0, or None for no limit")


@dataclasses.dataclass(frozen=True)
class PreemptionOptions:
    """What `mgr.handle_preemption(state, ...)` accepts besides the state.

    grace_s: seconds from the signal until the process must be gone (the scheduler's grace
        period, less a margin: Kubernetes' terminationGracePeriodSeconds defaults to 30, SLURM's
        KillWait to 30). Within it the manager takes the emergency save, waits for its local
        commit and exits; when it runs out first, the process exits anyway (nothing is corrupted:
        a step without its commit marker is invisible).
    signals: the signals that mean "you are about to be stopped" (SIGTERM by default; SIGUSR1 is
        common with SLURM's --signal). SIGKILL and SIGSTOP cannot be handled.
    """

    grace_s: float = 30.0
    signals: tuple[int, ...] = (signal.SIGTERM,)

    def __post_init__(self) -> None:
        g = self.grace_s
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
            raise CheckpointConfigError(
                f"grace_s={g!r} is invalid: pass the seconds between the signal and the hard kill (> 0), less a margin"
            )
        sigs = (self.signals,) if isinstance(self.signals, int) else self.signals
        if not isinstance(sigs, (tuple, list)) or not sigs:
            raise CheckpointConfigError(f"signals={self.signals!r} is invalid: pass a tuple of signals, e.g. (signal.SIGTERM,)")
        out = []
        for sig in sigs:
            try:
                num = signal.Signals(sig)
            except (ValueError, TypeError):
                raise CheckpointConfigError(f"signals: {sig!r} is not a signal of this platform; use signal.SIGTERM, signal.SIGUSR1, ...") from None
            if num in (signal.SIGKILL, signal.SIGSTOP):
                raise CheckpointConfigError(f"signals: {num.name} cannot be caught by any process; handle SIGTERM (or SIGUSR1) instead")
            out.append(num)
        object.__setattr__(self, "signals", tuple(dict.fromkeys(out)))


def _positive(x: object) -> bool:
    """A number of seconds or bytes per second: an int or float > 0 that a float holds (not an int past 1.8e308)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return 0 < float(x) < math.inf
    except OverflowError:
        return False

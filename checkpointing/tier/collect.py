"""Reference-safe deletion on one tier: retention, delete of a step, incomplete steps, `checkpointing gc` (I/O).

An incremental save's manifest references chunks in earlier steps' files, so deleting a step is
two things: retiring it (its COMMIT goes, so nobody restores it) and collecting the files that no
committed step and no save in flight needs any more. Retention (`apply_retention`), an explicit
delete (`delete_committed`: mgr.delete, `checkpointing rm`) and `checkpointing gc` all go through
`collect`. The protocol (docs/format.md, "Pins and garbage collection") in short:

- a writer pins its step before it creates any file there or refers to any earlier file: a pin
  (step-N/PIN.r<rank>.<token>.json) names the earlier files it may take chunks from; it then
  confirms its base step is still committed (else it takes nothing), and removes the pin once the
  step is committed (its manifest protects the files from then on) or has failed;
- a collector (G1) removes the COMMIT of each step it retires, (G2) lists the files of every
  uncommitted step directory, (G3) reads the pins, (G4) lists the committed steps again and reads
  their manifests, and (G5) deletes the files listed in G2 that no pin and no manifest names, in
  directories nobody pins and that did not commit meanwhile.

Why it is safe: a file listed in G2 in a pinned directory was created after its pin (W1 before the
file), so G3 sees the pin, or the writer committed before G3 and G4 sees the step. A save whose pin G3 missed pinned after G3, so it confirmed its base
after G1: it either sees the base retired and takes nothing from it, or the base was not being
retired and G4 finds it committed, with every file it references.

One moment precedes W1: the writer makes the step's directory, then its pin in it. A directory G2
found empty may be that one: it goes once older than EMPTY_DIR_GRACE_S, unless every pin is dead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Collection

from checkpointing.tier import catalog, holders, temporaries
from checkpointing.format import naming
from checkpointing.errors import CheckpointError, CheckpointNotFoundError
from checkpointing.plan.retention import RetentionPolicy, as_policy, steps_to_delete
from checkpointing.storage import Storage
from checkpointing.tier.pins import PIN_PREFIX, pins_in

log = logging.getLogger("checkpointing")

# an empty step directory younger than this may be a writer's, about to receive its pin (above)
EMPTY_DIR_GRACE_S = 60.0


@dataclasses.dataclass(frozen=True)
class Garbage:
    path: str
    nbytes: int
    reason: str


@dataclasses.dataclass
class Collected:
    retired: list[int]  # steps whose COMMIT this run removed (would remove, dry run)
    garbage: list[Garbage]  # files removed (would be removed, dry run)
    kept: dict[int, int]  # uncommitted step -> files left because committed steps still reference them
    pinned: list[int]  # uncommitted steps left alone: a save in flight pins them
    problems: list[str]  # what stopped the collection of data (nothing was deleted because of it)
    failed: dict[int, str] = dataclasses.field(default_factory=dict)  # keep_going: step -> the delete that failed there


def collect(
    storage: Storage,
    *,
    retire: Collection[int] = (),
    protect: Collection[int] = (),
    min_age_s: float = 0.0,
    pin_ttl_s: float | None = None,
    now: float | None = None,
    dry_run: bool = False,
    measure: bool = False,
    scan_committed: bool = True,
    on_delete: Callable[[Garbage], object] | None = None,
    spare: Callable[[str], bool] | None = None,
    drop_spares: bool = False,
    keep_going: bool = False,
) -> Collected:
    """Retire the committed steps `retire`, then remove every file on the tier that nothing needs.

    `protect`: steps the caller has in flight (left alone whether pinned yet or not). Files younger
    than `min_age_s` are left alone (they may belong to a writer that pins nothing: needs mtime()).
    A pin older than `pin_ttl_s` is taken for a crashed writer's (None: every pin holds).
    `measure`: report sizes (one request per file on object stores). `scan_committed`: also
    remove files inside committed steps' directories that nothing references (stale pins, a losing
    writer's files, temporaries); retention after a save skips that scan. `spare`: offered each
    pack file of a retired step before it is deleted; True when it kept the file instead (as a
    spare for the next save to write over: LocalStorage.keep_spare). `drop_spares`: also remove the
    spare pack files (`checkpointing gc`, which holds the directory's writer lock).
    """
    ages = _Ages(storage, time.time() if now is None else now, min_age_s, pin_ttl_s)
    retire = sorted(set(retire))
    listing = _retire(storage, retire, dry_run)  # G1
    committed = [s for s in listing.committed if not (dry_run and s in retire)]
    uncommitted = sorted(set(listing.incomplete) | (set(retire) & set(listing.committed) if dry_run else set()))
    out = Collected([s for s in retire if s in listing.committed] if dry_run else list(retire), [], {}, [], [])
    if not uncommitted and not scan_committed:
        return out  # nothing to collect: no manifest needs reading
    # G2: what is there now (files created later belong to writers that pinned first)
    names = {s: storage.list(naming.step_dir(s)) for s in uncommitted}
    pins = holders.read_pins(storage, uncommitted, protect, ages.dead)  # G3
    refs = holders.read_manifests(storage, skip=retire if dry_run else ())  # G4
    out.pinned, out.problems = pins.pinned, pins.problems + refs.problems
    if out.problems:  # a step we cannot read may reference anything: delete no data
        return out
    sweep = _Sweep(storage, out, ages, pins.live | refs.live, dry_run=dry_run, measure=measure, on_delete=on_delete, spare=spare,
                   keep_going=keep_going)
    for s in uncommitted:  # G5: delete what nothing needs
        if s in pins.pinned or s in refs.own:  # pinned, or committed since G2
            continue
        reason = f"step {s} retired" if s in retire else "incomplete step (no COMMIT)"
        sweep.uncommitted_step(s, names[s], reason, pins.dead.get(s, []))
    for s in committed if scan_committed else ():
        if s in refs.own:
            sweep.committed_step(s, refs.own[s])
    for path in [p for p in (temporaries.root_temporaries(storage) if scan_committed else []) if temporaries.stale(ages.age(p), ages.min_age_s)]:
        sweep.drop(path, "a temporary file a killed writer left at the root")  # a killed put's (temporaries.py)
    if drop_spares:
        sweep.spares()
    return out


@dataclasses.dataclass(frozen=True)
class _Ages:
    """How old files are (Storage.mtime against `now`), for the min_age_s and pin_ttl_s filters."""

    storage: Storage
    now: float
    min_age_s: float
    pin_ttl_s: float | None

    def age(self, path: str) -> float | None:
        try:
            return self.now - self.storage.mtime(path)
        except (FileNotFoundError, OSError):
            return None

    def young(self, path: str) -> bool:
        """Younger than min_age_s: it may belong to a writer that pins nothing."""
        a = self.age(path) if self.min_age_s > 0 else None
        return a is not None and a < self.min_age_s

    def just_made(self, path: str) -> bool:
        """A directory younger than EMPTY_DIR_GRACE_S (an empty step directory: maybe a writer's, its
        pin to come); a stray object of that name is not one. With pin_ttl_s <= 0 (a writer tidying
        at start: every pin is a crashed save's) no writer is making one."""
        if self.pin_ttl_s is not None and self.pin_ttl_s <= 0:
            return False
        try:
            self.storage.size(path)
            return False
        except OSError:  # a directory (or gone)
            a = self.age(path)
        return a is not None and a < EMPTY_DIR_GRACE_S

    def dead(self, pin: str) -> bool:
        """A crashed writer's pin: older than pin_ttl_s (with pin_ttl_s <= 0, every pin)."""
        if self.pin_ttl_s is None:
            return False
        a = self.age(pin) if self.pin_ttl_s > 0 else None
        return self.pin_ttl_s <= 0 or (a is not None and a > self.pin_ttl_s)


def _retire(storage: Storage, retire: list[int], dry_run: bool) -> catalog.StepListing:
    """G1: remove the COMMIT of each step to retire, and the pins in its directory (a dry run removes
    nothing), then list the steps. A committed step is saved by no one (saving a committed step is
    refused), so a pin there is a writer's that died between its commit and the pin's removal, or an
    interrupted upload's that a later process resumed and committed; left, it would hold the retired
    step's files as "a save in flight" until some writer's next start."""
    if not dry_run:
        for step in retire:
            _uncommit(storage, step)
    return catalog.list_steps(storage)


def _uncommit(storage: Storage, step: int) -> None:
    storage.delete(naming.commit_name(step))
    for pin in pins_in(storage, [step]).get(step, ()):
        storage.delete(pin)


class _Sweep:
    """G5: delete (a dry run: only report) the files nothing needs, recording each in `out`."""

    def __init__(self, storage: Storage, out: Collected, ages: _Ages, live: frozenset[str], *, dry_run: bool,
                 measure: bool, on_delete: Callable[[Garbage], object] | None, spare: Callable[[str], bool] | None = None,
                 keep_going: bool = False) -> None:
        self.storage, self.out, self.ages, self.live = storage, out, ages, live
        self.dry_run, self.measure, self.on_delete, self.spare = dry_run, measure, on_delete, spare
        self.keep_going = keep_going  # a file that cannot be deleted leaves its step for next time, not the others

    def drop(self, path: str, reason: str) -> None:
        nbytes = _size(self.storage, path) if self.measure else 0
        if not self.dry_run:
            if self.spare is not None and naming.is_pack(path.rpartition("/")[2]) and self.spare(path):
                reason += "; kept as a spare pack file for the next save to write over"
            else:
                self.storage.delete(path)
        self.out.garbage.append(Garbage(path, nbytes, reason))
        if self.on_delete is not None:
            self.on_delete(self.out.garbage[-1])

    def uncommitted_step(self, step: int, names: list[str], reason: str, dead_pins: list[str]) -> None:
        """The files G2 listed in an uncommitted, unpinned step (manifest first, then pins, then data);
        its directory too once nothing is left in it (one G2 found empty: once it is not just made)."""
        sdir = naming.step_dir(step)
        kept = 0
        ordered = sorted(names, key=lambda n: (not n.startswith("manifest."), not n.startswith(PIN_PREFIX), n))
        for n in [n for n in ordered if naming.written_in_step(n)]:  # another name is a user's: it stays, and so does the directory
            path = f"{sdir}/{n}"
            if path in self.live or self.ages.young(path):
                kept += path in self.live
                continue
            try:
                self.drop(path, reason if path not in dead_pins else "pin of a crashed save")
            except OSError as exc:
                if not self.keep_going:
                    raise
                self.out.failed[step] = f"{self.storage.url}/{path}: {type(exc).__name__}: {exc}"
                return
        if kept:
            self.out.kept[step] = kept
        elif (not self.dry_run and not self.ages.young(sdir) and (names or not self.ages.just_made(sdir))
              and catalog.plain_object(self.storage, sdir) is False):  # a user's object of that name beside it stays
            self.storage.remove_dir(sdir)

    def spares(self) -> None:
        """The spare pack files (LocalStorage.keep_spare): nothing references them; a writer about to
        take one finds it gone and writes a new file."""
        names = self.storage.list(naming.SPARES_DIR)
        for n in [n for n in names if naming.is_spare(n)]:  # another name is a user's file: it stays
            path = f"{naming.SPARES_DIR}/{n}"
            if not self.ages.young(path):
                self.drop(path, "spare pack file (kept for the next save to write over)")
        if names and not self.dry_run:
            self.storage.remove_dir(naming.SPARES_DIR)

    def committed_step(self, step: int, own: set[str]) -> None:
        """Files in a committed step's directory that neither it nor any live pin or manifest names."""
        sdir = naming.step_dir(step)
        for n in [n for n in self.storage.list(sdir) if naming.written_in_step(n)]:
            path = f"{sdir}/{n}"
            if n.startswith(PIN_PREFIX) and not self.ages.dead(path):
                continue  # its writer committed and is about to remove it
            if path not in own and path not in self.live and not self.ages.young(path):
                self.drop(path, "not referenced by the step's manifest")


def apply_retention(storage: Storage, keep: int | RetentionPolicy | None, *, protect: int | Collection[int] | None = None,
                    in_flight: Collection[int] = (), sweep: bool = False, where: str | None = None) -> list[int]:
    """Retire the committed steps the tier's retention does not keep and collect what they alone
    referenced; returns the retired steps. `keep`: a policy (plan/retention.py), n for the newest n,
    None to keep all; the newest committed step and those in `protect` always stay. A policy that
    reads metrics (KeepBest) gets them from the steps' COMMIT markers. `in_flight`: this process's
    saves (or uploads) in flight. The retention of both tiers after each save or upload.

    `sweep`: collect also when no step is retired (a failed upload's files on the remote tier), and
    leave an OSError to the caller; without it a failed read or delete is logged and retried next time.
    `where`: the tier as the log names it (default "in <url>").
    """
    doomed = retire_by_policy(storage, keep, protect=protect, sweep=sweep, where=where)
    if doomed or sweep:
        collect_retired(storage, in_flight=in_flight, sweep=sweep, where=where)
    return doomed


def retire_by_policy(storage: Storage, keep: int | RetentionPolicy | None, *, protect: int | Collection[int] | None = None,
                     sweep: bool = False, where: str | None = None) -> list[int]:
    """apply_retention's first half, quick: remove the COMMIT markers of the steps the retention does
    not keep (from then on no listing, restore or save sees them) and return those steps; their
    files stay until `collect_retired` (a large file's unlink can take a good part of a second)."""
    try:
        doomed = to_retire(storage, keep, protect=protect)
    except OSError as exc:  # a failed read must not stop training; retried after the next save
        if sweep:
            raise
        log.warning("checkpointing: could not apply retention to %s: %s", where or storage.url, exc)
        return []
    retired = []
    for step in doomed:  # one step that cannot be deleted (permissions, an immutable directory) holds back no other
        try:
            _uncommit(storage, step)
        except OSError as exc:  # with `sweep` too: the caller's warning would not say which step, nor go on
            _cannot_retire(storage, step, exc, where)
            continue
        retired.append(step)
    return retired


_REPORTED: set[tuple[str, int, bool]] = set()  # (tier, step, its files) whose failed retirement was a warning once


def _cannot_retire(storage: Storage, step: int, exc: OSError | str, where: str | None, *, files: bool = False) -> None:
    """A warning once per process for each step that could not be retired (its COMMIT) or emptied (`files`)."""
    level = logging.DEBUG if (storage.url, step, files) in _REPORTED else logging.WARNING
    _REPORTED.add((storage.url, step, files))
    what = "the files of retired step %d" % step if files else "step %d" % step
    cause = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    fix = "then `checkpointing gc` removes them" if files else f"or remove it (checkpointing rm {storage.url} --step {step} --force)"
    log.log(level, "checkpointing: retention could not delete %s from %s (%s); the other steps are retired as usual, and "
            "this one is tried again after each save: fix the permissions of %s/%s, %s", what, where or storage.url, cause,
            storage.url, naming.step_dir(step), fix)


def to_retire(storage: Storage, keep: int | RetentionPolicy | None, *, protect: int | Collection[int] | None = None) -> list[int]:
    """The committed steps of `storage` the retention does not keep (nothing is removed)."""
    policy = as_policy(keep)
    if policy is None:
        return []
    committed = catalog.list_steps(storage).committed
    return steps_to_delete(catalog.step_infos(storage, committed, metrics=bool(policy.metric_names)), policy, protect=protect)


def collect_retired(storage: Storage, *, in_flight: Collection[int] = (), sweep: bool = False, where: str | None = None,
                    spare: Callable[[str], bool] | None = None) -> None:
    """apply_retention's second half: remove the files of retired (and other uncommitted) steps that
    no committed step, pin or save in flight (`in_flight`) needs (pack files `spare` keeps are moved
    aside instead, see collect)."""
    try:
        result = collect(storage, protect=in_flight, scan_committed=False, spare=spare, keep_going=True)
    except OSError as exc:
        if sweep:
            raise
        log.warning("checkpointing: could not remove retired steps' files from %s (the next retention or "
                    "`checkpointing gc` removes them): %s", where or storage.url, exc)
        return
    for p in result.problems:
        log.warning("checkpointing: retention %s kept every data file: %s", where or f"in {storage.url}", p)
    for step, failure in result.failed.items():
        _cannot_retire(storage, step, failure, where, files=True)


def delete_step(storage: Storage, step: int) -> None:
    """Retire `step` (if committed) and remove what only it referenced."""
    collect(storage, retire=[step])


def delete_committed(storage: Storage, step: int, *, in_flight: Collection[int] = (), measure: bool = False) -> Collected:
    """Delete the committed step `step` on this tier (mgr.delete, `checkpointing rm`): retention's
    deletion for one named step. Its COMMIT goes first; then whatever no committed step and no save
    in flight (`in_flight`, pins) references: files of `step` that later steps borrow chunks from
    stay (`kept`). CheckpointNotFoundError when `step` is not committed here; CheckpointError when
    its COMMIT cannot be removed. A failure after that (the step is deleted, some of its files are
    left) is logged: the next retention or `checkpointing gc` removes them."""
    if step not in catalog.list_steps(storage).committed:
        raise CheckpointNotFoundError(f"step {step} is not committed in {storage.url}")
    try:
        result = collect(storage, retire=[step], protect=in_flight, scan_committed=False, measure=measure)
    except OSError as exc:
        if catalog.committed_digest(storage, step) is not None:
            raise CheckpointError(f"could not delete step {step} from {storage.url}: {exc}") from exc
        log.warning("checkpointing: deleted step %d from %s, but some of its files are left (%s): the next retention "
                    "or `checkpointing gc` removes them", step, storage.url, exc)
        return Collected([step], [], {}, [], [str(exc)])
    for p in result.problems:
        log.warning("checkpointing: deleted step %d from %s and kept every data file: %s", step, storage.url, p)
    return result


def remove_incomplete(storage: Storage) -> None:
    """A writer's start, under the writer lock: remove the saves that did not commit (every pin is a
    crashed save's) and log each step removed."""
    result = collect(storage, pin_ttl_s=0)
    for step in sorted({naming.parse_step_dir(g.path.split("/")[0]) for g in result.garbage if g.reason.startswith("incomplete")}):
        log.info("checkpointing: removed incomplete step %d (a save that did not commit) from %s", step, storage.url)
    for p in result.problems:
        log.warning("checkpointing: not tidying %s: %s", storage.url, p)


def _size(storage: Storage, path: str) -> int:
    try:
        return storage.size(path)
    except (FileNotFoundError, EOFError, OSError):
        return 0

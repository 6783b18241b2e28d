"""The commands on a tier: `ls`, `verify`, `gc`, `rm` and `export`, each what it does and prints (layer: cli; `inspect`: inspecting.py).

Each takes the parsed arguments and the console to print on, and returns the exit code (0 fine, 1
damage found); a command that cannot go on raises fmt.CommandFailed. On a terminal, verify, gc and
export show a progress bar (progress.py); piped output is the plain lines only. ls and inspect lay
their tables out with tables.py: the columns a user needs first, fitted to the terminal, each unit
in its header; --wide shows every column; --json output is what it always was.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from checkpointing.cli import convert, fmt, tables
from checkpointing.cli.progress import Bar, each
from checkpointing.cli.targets import committed_step, open_target
from checkpointing.errors import CheckpointError
from checkpointing.format import naming
from checkpointing.format.manifest import Manifest
from checkpointing.format.step_sizes import step_usage
from checkpointing.plan.retention import tier_states
from checkpointing.storage import FsspecStorage, LocalStorage, Storage, multipart
from checkpointing.tier import catalog, collect, pins
from checkpointing.tier import lock as writer_lock
from checkpointing.tier.identity import tier_id_of
from checkpointing.tier.verify import in_short, missing_files, verify_step

# (column, row key, drop: 0 only with --wide, what it means)
_LS_SIZES = (("size", "bytes", 1, "size: the step's state"), ("new", "new", 3, "new: written by its save (incremental saves reuse the rest)"),
             ("unique", "unique", 0, "unique: referenced by no other listed step"), ("shared", "shared", 0, "shared: also referenced by another"))
_RETIRED = "retired: deleted, but later steps still use chunks in its files"


def ls(args: argparse.Namespace, console: Console) -> int:
    """Every step of the tier with its state, sizes and commit time (--remote: and where it is durable)."""
    local_dir = args.remote and "://" not in args.dir  # then --storage-option is the remote tier's
    storage = open_target(args.dir, () if local_dir else args.storage_option)
    listing = catalog.list_steps(storage)
    tiers: dict[int, str] = {}
    title = f"checkpoints in {storage.url}"
    if args.remote:
        remote = open_target(args.remote, args.storage_option)
        tiers = tier_states(listing.committed, catalog.list_steps(remote).committed)
        title += f" (tiers: + {remote.url})" if tiers else ""
    rows = _step_rows(storage, listing, tiers)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        console.print(f"no checkpoints in {escape(storage.url)}")
        return 0
    tables.show(console, _steps_view(rows, title, with_tiers=bool(tiers), width=console.width, wide=args.wide))
    for r in rows:
        if r.get("error"):
            console.print(f"step {r['step']} {r['state']}: {r['error']}", markup=False, highlight=False)
    return 0


def _step_rows(storage: Storage, listing: catalog.StepListing, tiers: dict[int, str]) -> list[dict[str, Any]]:
    """One row per step (the JSON of `ls --json`): state, tier, commit time, size, tensors, shared/unique bytes."""
    rows: list[dict[str, Any]] = []
    manifests: dict[int, Manifest] = {}
    here = tier_id_of(storage)
    for step in sorted(set(listing.committed + listing.incomplete) | set(tiers)):
        committed = step in listing.committed
        row: dict[str, Any] = {"step": step, "state": "committed" if committed else "incomplete" if step in listing.incomplete else "remote only"}
        if tiers:
            row["tier"] = tiers.get(step, "")
        if committed:
            row["committed_at"] = _committed_at(storage, step)
            try:
                manifests[step] = catalog.load_manifest(storage, step)
                row["tensors"] = len(manifests[step].tensors)
                row["bytes"] = manifests[step].nbytes
                if manifests[step].metrics:
                    row["metrics"] = dict(manifests[step].metrics)  # save(..., metrics=...)
                lost = missing_files(storage, manifests[step], here=here)
                if lost:
                    row["state"], row["error"] = "damaged", f"{in_short(lost)}: run checkpointing verify"
            except CheckpointError as exc:
                row["state"] = "damaged"
                row["error"] = str(exc)
        elif step in listing.incomplete:
            row["state"] = _incomplete_state(storage.list(naming.step_dir(step)))
        rows.append(row)
    used = {f.path.split("/", 1)[0] for m in manifests.values() for f in m.files}
    for row in rows:  # data files no committed step uses are an interrupted save's, not a retired step's
        if row["state"] == "retired" and naming.step_dir(row["step"]) not in used:
            row["state"] = "incomplete"
    for step, u in step_usage(manifests, here).items():
        row = next(r for r in rows if r["step"] == step)
        row.update(stored=u.referenced, new=u.new, unique=u.unique, shared=u.shared)
    return rows


def _incomplete_state(names: list[str]) -> str:
    """A step directory without COMMIT: a save in flight (pinned), retired (only data files left) or incomplete."""
    if any(n.startswith(pins.PIN_PREFIX) for n in names):
        return "in flight"
    if names and not any(n.startswith(("manifest.", pins.PIN_PREFIX)) for n in names):
        return "retired"
    return "incomplete"


def _committed_at(storage: Storage, step: int) -> str:
    try:
        return _dt.datetime.fromtimestamp(storage.mtime(naming.commit_name(step)), _dt.timezone.utc).isoformat(timespec="seconds")
    except (FileNotFoundError, OSError):
        return ""


def _steps_view(rows: list[dict[str, Any]], title: str, *, with_tiers: bool, width: int | None, wide: bool) -> tables.View:
    """The table of `ls`: step, state, where, sizes (one unit for them all), commit time, metrics."""
    unit = fmt.size_unit(r.get(k) for _, k, _, _ in _LS_SIZES for r in rows)
    columns = [tables.Column("step"), tables.Column("state", justify="left")]
    columns += [tables.Column("tier", justify="left")] if with_tiers else []
    columns += [tables.Column(name, unit.name, default=drop > 0, drop=drop, note=note) for name, _, drop, note in _LS_SIZES]
    columns += [tables.Column("tensors", default=False), tables.Column("committed", "UTC", justify="left", drop=2)]
    with_metrics = any("metrics" in r for r in rows)
    columns += [tables.Column("metrics", justify="left", drop=1, flex=True)] if with_metrics else []
    cells = []
    for r in rows:
        style = {"committed": "green", "damaged": "red", "remote only": "cyan"}.get(r["state"], "yellow")
        row: list[tables.Cell] = [str(r["step"]), Text(r["state"], style=style)] + ([Text(r["tier"])] if with_tiers else [])
        row += [unit(r.get(k)) for _, k, _, _ in _LS_SIZES]
        at = r.get("committed_at", "")  # 2026-11-24T03:16:24+00:00: to the minute by default
        row += [str(r.get("tensors", "")), Text(at if wide else at[:16].replace("T", " "))]
        if with_metrics:
            row.append(Text(" ".join(f"{k}={v:.4g}" for k, v in sorted(r.get("metrics", {}).items()))))
        cells.append(row)
    notes = [_RETIRED] if any(r["state"] == "retired" for r in rows) else []
    return tables.fit(columns, cells, width=width, wide=wide, title=title, notes=notes)


def verify(args: argparse.Namespace, console: Console) -> int:
    """Check every digest of one step or of every committed step; 1 when any is damaged."""
    storage = open_target(args.dir, args.storage_option)
    listing = catalog.list_steps(storage)
    steps = [committed_step(storage, args.step)] if args.step is not None else listing.committed
    unreadable = {} if args.step is not None else {s: catalog.unreadable_commit(storage, s) for s in listing.incomplete}
    damaged = 0
    for step, why in sorted(unreadable.items()):
        if why:
            damaged += 1
            console.print(f"[red]DAMAGED[/red] step {step}: 1 problem(s)")
            console.print(f"  - {why}", markup=False)
    if not steps and not damaged:
        raise fmt.CommandFailed(f"{storage.url}: no committed step to verify")
    here = tier_id_of(storage)
    for step in each(console, "verifying steps", steps):
        report = verify_step(storage, step, here=here)
        if report.ok:
            others = f"; {report.elsewhere} shard(s) live on other ranks' local tiers" if report.elsewhere else ""
            console.print(f"[green]ok[/green]      step {step}: {report.tensors} tensors, {fmt.size(report.bytes_checked)} verified{others}")
        else:
            damaged += 1
            console.print(f"[red]DAMAGED[/red] step {step}: {len(report.problems)} problem(s)")
            for p in report.problems:
                console.print(f"  - {p}", markup=False)
    if damaged:
        total = len(steps) + sum(1 for why in unreadable.values() if why)
        console.print(f"[red]{damaged} of {total} step(s) damaged[/red]")
        return 1
    console.print(f"all {len(steps)} step(s) verified")
    return 0


def gc(args: argparse.Namespace, console: Console) -> int:
    """Remove (--dry-run: list) what no committed step references, saying why each is removed or left."""
    storage = open_target(args.dir, args.storage_option)
    options = dict(min_age_s=args.min_age_s, pin_ttl_s=args.pin_ttl_s, measure=True, drop_spares=True)
    result = collect.collect(storage, dry_run=True, **options)
    # removing: only under the directory's writer lock (a manager writing there holds it: tidying is its job then);
    # a directory no manager ever wrote to, with nothing to remove, is left as it was (no WRITER file made)
    if not args.dry_run and (result.garbage or _has_lock_file(storage)):
        try:
            held = writer_lock.acquire(root, purpose="checkpointing gc") if (root := _lock_root(storage)) else None
        except CheckpointError as exc:
            raise fmt.CommandFailed(f"{exc}; `checkpointing gc --dry-run` needs no lock") from None
        try:
            with Bar(console, "removing", len(result.garbage)) as bar:  # about as many as the look above found
                result = collect.collect(storage, on_delete=lambda g: bar.advance(), **options)
        finally:
            if held is not None:
                held.release()
    for p in result.problems:
        console.print(f"[red]skipped[/red] {escape(p)}: no data removed (a step that cannot be read may reference any file)")
    for step in result.pinned:
        console.print(f"left step {step}: a save in flight pins it", highlight=False)
    for step, n in sorted(result.kept.items()):
        console.print(f"left {n} file(s) of step {step}: later steps still reference their chunks", highlight=False)
    verb = "would remove" if args.dry_run else "removed"
    for g in result.garbage:
        console.print(f"{verb} {g.path} ({fmt.size(g.nbytes)}): {g.reason}", markup=False, highlight=False)
    stale = _stale_uploads(storage, args.min_age_s, abort=not args.dry_run)
    for path, age in stale:
        console.print(f"{'would abort' if args.dry_run else 'aborted'} the unfinished multipart upload of {path} "
                      f"(started {age / 3600:.1f} h ago)", markup=False, highlight=False)
    total_size = fmt.size(sum(g.nbytes for g in result.garbage))
    if not result.garbage and not stale:
        younger = f" older than --min-age-s {args.min_age_s:g} s (younger objects may be a save's in flight)" if args.min_age_s > 0 else ""
        console.print(f"nothing unreferenced{younger} in {escape(storage.url)}")
    elif not result.garbage:
        console.print(f"{len(stale)} unfinished upload(s)" + (": run without --dry-run to abort them" if args.dry_run else " aborted"))
    elif args.dry_run:
        console.print(f"{len(result.garbage)} unreferenced object(s), {total_size}: run without --dry-run to remove them")
    else:
        console.print(f"removed {len(result.garbage)} unreferenced object(s), {total_size}")
    return 0


def _stale_uploads(storage: Storage, min_age_s: float, *, abort: bool) -> list[tuple[str, float]]:
    """S3: multipart uploads older than `min_age_s` that never finished (their parts cost storage); aborted unless a dry run.
    Only of names a save writes (a step directory's files, the metrics file): another program's uploads there are its own."""
    if not isinstance(storage, FsspecStorage):
        return []
    found = [up for up in multipart.stale_uploads(storage, min_age_s) if _written_by_a_save(up[0])]
    for path, upload_id, _ in found if abort else ():
        multipart.abort_upload(storage, path, upload_id)
    return [(path, age) for path, _, age in found]


def _written_by_a_save(path: str) -> bool:
    """Whether `path` (below a checkpoint's root) is a name a save writes."""
    parts = path.split("/")
    if len(parts) == 1:
        return parts[0] == naming.METRICS_NAME
    return len(parts) == 2 and naming.parse_step_dir(parts[0]) is not None and naming.written_in_step(parts[1])


def _has_lock_file(storage: object) -> bool:
    root = _lock_root(storage)
    return root is not None and os.path.lexists(root / writer_lock.LOCK_NAME)


def _lock_root(storage: object) -> Path | None:
    """The directory whose writer lock removing from `storage` takes: a local directory; a file:// URL of a
    directory a manager writes as its local tier (it has a WRITER file); none for other tiers."""
    if isinstance(storage, LocalStorage):
        return storage.root
    if isinstance(storage, FsspecStorage) and storage.endpoint.is_local:
        root = Path(storage.root)  # the path fsspec resolved from the URL
        return root if os.path.lexists(root / writer_lock.LOCK_NAME) else None
    return None


def rm(args: argparse.Namespace, console: Console) -> int:
    """Delete one committed step (what only it references goes; chunks later steps use stay), as mgr.delete does
    on one tier: the newest step only with --force, a local directory only under its writer lock."""
    storage = open_target(args.dir, args.storage_option)
    committed_step(storage, args.step)  # a step that is not there needs no lock (nor a WRITER file where there was none)
    try:  # a manager writing there holds the lock: it deletes with mgr.delete(step), in that process
        held = writer_lock.acquire(root, purpose="checkpointing rm") if (root := _lock_root(storage)) else None
    except CheckpointError as exc:
        raise fmt.CommandFailed(f"{exc}; or delete the step in that process: mgr.delete({args.step})") from None
    try:
        step = committed_step(storage, args.step)
        newest = catalog.list_steps(storage).committed[-1]
        if step == newest and not args.force:
            raise fmt.CommandFailed(f"step {step} is the newest committed step in {storage.url}: pass --force to delete it anyway")
        result = collect.delete_committed(storage, step, measure=True)
    finally:
        if held is not None:
            held.release()
    for p in result.problems:
        console.print(f"[yellow]kept every data file[/yellow]: {escape(p)} (`checkpointing gc` removes them later)")
    for kept_step, n in sorted(result.kept.items()):
        console.print(f"left {n} file(s) of step {kept_step}: later steps still use their chunks", highlight=False)
    total = fmt.size(sum(g.nbytes for g in result.garbage))
    console.print(f"deleted step {step} from {escape(storage.url)}: its COMMIT, then {len(result.garbage)} object(s) "
                  f"nothing else references ({total})", highlight=False)
    return 0


def export(args: argparse.Namespace, console: Console) -> int:
    """Write a step's full (unsharded) tensors: one torch.save file, or safetensors for Hugging Face (cli/convert.py)."""
    return convert.run_export(args, console)

"""`checkpointing ls|inspect|verify|gc|report TARGET` (also `python -m checkpointing`).

TARGET is a checkpoint directory or any tier URL (s3://bucket/prefix, file:///path, memory://...).
Credentials for a URL come from `--storage-option key=value` (repeatable; dotted keys nest, e.g.
client_kwargs.region_name=us-east-1) or from the environment the cloud SDK reads
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...). They are never printed.

Exit codes: 0 fine, 1 damage found (verify), 2 bad usage, an unreachable tier, or nothing to show.
On a terminal, verify and gc show a progress bar; piped output is the plain lines only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from checkpointing.tier import catalog
from checkpointing.tier import collect, pins
from checkpointing.format import naming
from checkpointing.cli import report
from checkpointing.errors import CheckpointError
from checkpointing.restore.export import export_step
from checkpointing.plan.retention import tier_states
from checkpointing.storage import LocalStorage, Storage, open_storage
from checkpointing.format.step_sizes import step_usage
from checkpointing.tier.tierfile import read_tier_id
from checkpointing.tier.verify import verify_step


def _storage(target: str, args: argparse.Namespace | None = None) -> Storage:
    """The tier at `target`: a directory that must exist, or a URL opened with the --storage-option values."""
    options = _storage_options(getattr(args, "storage_option", None) or [])
    if "://" not in target:
        root = Path(target)
        if not root.is_dir():
            raise SystemExit(_fail(f"{target}: no such checkpoint directory"))
        if options:
            raise SystemExit(_fail("--storage-option applies to URLs (s3://bucket/prefix), not to a directory"))
        return LocalStorage(root, direct=False)
    try:
        storage = open_storage(target, options or None)
        storage.list("")  # reachable, and the credentials work
    except (CheckpointError, OSError) as exc:
        raise SystemExit(_fail(f"cannot open {_redacted(target)}: {exc}")) from None
    return storage


def _redacted(target: str) -> str:
    from checkpointing.storage.retry import redact_url

    return redact_url(target)


def _storage_options(pairs: list[str]) -> dict[str, Any]:
    """['a=1', 'client_kwargs.region_name=x'] -> {'a': 1, 'client_kwargs': {'region_name': 'x'}}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(_fail(f"--storage-option {key or pair!r}: expected KEY=VALUE"))
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SystemExit(_fail(f"--storage-option {key}: {part} is both a value and a group"))
        node[leaf] = _value(raw)
    return out


def _value(raw: str) -> Any:
    """true/false/null, integers and floats as such; anything else (a key, a URL) stays a string."""
    if raw in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[raw]
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _fail(msg: str) -> int:
    Console(stderr=True).print(f"[red]error:[/red] {msg}")
    return 2


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _committed_at(storage: Storage, step: int) -> str:
    mtime = getattr(storage, "mtime", None)
    if mtime is None:
        return ""
    try:
        return _dt.datetime.fromtimestamp(mtime(naming.commit_name(step)), _dt.timezone.utc).isoformat(timespec="seconds")
    except (FileNotFoundError, OSError):
        return ""


def cmd_ls(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args)
    listing = catalog.list_steps(storage)
    tiers: dict[int, str] = {}
    if args.remote:
        remote = _storage(args.remote, args)
        tiers = tier_states(listing.committed, catalog.list_steps(remote).committed)
    rows: list[dict[str, Any]] = []
    manifests: dict[int, Any] = {}
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
            except CheckpointError as exc:
                row["state"] = "damaged"
                row["error"] = str(exc)
        elif step in listing.incomplete:
            names = storage.list(naming.step_dir(step))
            row["state"] = "in flight" if any(n.startswith(pins.PIN_PREFIX) for n in names) else \
                "retired" if names and not any(n.startswith(("manifest.", pins.PIN_PREFIX)) for n in names) else "incomplete"
        rows.append(row)
    for step, u in step_usage(manifests, read_tier_id(storage)).items():
        row = next(r for r in rows if r["step"] == step)
        row.update(stored=u.referenced, new=u.new, unique=u.unique, shared=u.shared)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"checkpoints in {storage.url}" + (f" (tiers: + {remote.url})" if tiers else ""),
                  caption="size: the state; new: written by that save; unique: referenced by no other listed step; "
                          "shared: also referenced by another (incremental saves); retired: deleted, but later steps "
                          "still use chunks in its files")
    columns = ["step", "state"] + (["tier"] if tiers else []) + ["size", "new", "unique", "shared", "tensors", "committed at (UTC)"]
    for col in columns:
        table.add_column(col, justify="right" if col in ("step", "size", "new", "unique", "shared", "tensors") else "left")
    for r in rows:
        style = {"committed": "green", "damaged": "red", "remote only": "cyan"}.get(r["state"], "yellow")
        cells = [str(r["step"]), f"[{style}]{r['state']}[/{style}]"] + ([r["tier"]] if tiers else [])
        sizes = [_human(r[k]) if k in r else "" for k in ("bytes", "new", "unique", "shared")]
        table.add_row(*cells, *sizes, str(r.get("tensors", "")), r.get("committed_at", ""))
    Console().print(table)
    if not rows:
        Console().print("no checkpoints")
    return 0


def _resolve_step(storage: Storage, step: int | None) -> int:
    committed = catalog.list_steps(storage).committed
    if step is None:
        if not committed:
            raise SystemExit(_fail(f"{storage.url}: no committed step"))
        return committed[-1]
    if step not in committed:
        raise SystemExit(_fail(f"step {step} is not committed in {storage.url} (committed: {committed})"))
    return step


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args)
    step = _resolve_step(storage, args.step)
    try:
        manifest = catalog.load_manifest(storage, step)
    except CheckpointError as exc:
        return _fail(str(exc)) - 1
    if args.json:
        print(json.dumps({
            "step": step, "format_version": manifest.format_version, "bytes": manifest.nbytes,
            "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                         "chunks": sum(len(s.chunks) for s in t.shards)} for t in manifest.tensors],
            "tree": manifest.tree,
        }, indent=2))
        return 0
    table = Table(title=f"step {step}: {len(manifest.tensors)} tensors, {_human(manifest.nbytes)} (format v{manifest.format_version})")
    for col in ("key", "dtype", "shape", "size", "chunks"):
        table.add_column(col, justify="right" if col in ("size", "chunks") else "left")
    for t in manifest.tensors:
        table.add_row(t.key, t.dtype, "x".join(map(str, t.shape)) or "scalar", _human(t.nbytes), str(sum(len(s.chunks) for s in t.shards)))
    console = Console()
    console.print(table)
    values = _values(manifest.tree, ())
    if values:
        console.print("[bold]values[/bold]")
        for key, val in values[: args.max_values]:
            console.print(f"  {key} = {val}", markup=False)
        if len(values) > args.max_values:
            console.print(f"  ... {len(values) - args.max_values} more (--max-values)")
    return 0


def _values(node: dict, path: tuple) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    key = "/".join(map(str, path))
    if "dict" in node:
        for k, child in node["dict"]:
            out += _values(child, path + (k,))
    elif "list" in node or "tuple" in node:
        for i, child in enumerate(node.get("list", node.get("tuple"))):
            out += _values(child, path + (i,))
    elif "stateful" in node:
        out += _values(node["stateful"], path)
    elif "value" in node:
        out.append((key, json.dumps(node["value"])[:120]))
    elif "float" in node:
        out.append((key, node["float"]))
    elif "bytes" in node:
        out.append((key, f"<{len(node['bytes']) * 3 // 4} bytes>"))
    elif "codec" in node:
        out.append((key, f"<codec {node['codec']}>"))
    return out


class _Bar:
    """A progress bar on a terminal (rich; drawn below the lines printed meanwhile, removed at the end)."""

    def __init__(self, console: Console, what: str, total: int) -> None:
        self._progress: Progress | None = None
        if console.is_terminal and total > 0:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), console=console, transient=True)
            self._task = self._progress.add_task(what, total=total)

    def __enter__(self) -> "_Bar":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)


def _with_bar(console: Console, what: str, items: list) -> Iterator:
    """`items`, advancing a progress bar (on a terminal only) after each."""
    with _Bar(console, what, len(items)) as bar:
        for item in items:
            yield item
            bar.advance()


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args)
    steps = [_resolve_step(storage, args.step)] if args.step is not None else catalog.list_steps(storage).committed
    if not steps:
        return _fail(f"{storage.url}: no committed step to verify")
    console = Console()
    damaged = 0
    for step in _with_bar(console, "verifying steps", steps):
        report = verify_step(storage, step)
        if report.ok:
            others = f"; {report.elsewhere} shard(s) live on other ranks' local tiers" if report.elsewhere else ""
            console.print(f"[green]ok[/green]      step {step}: {report.tensors} tensors, {_human(report.bytes_checked)} verified{others}")
        else:
            damaged += 1
            console.print(f"[red]DAMAGED[/red] step {step}: {len(report.problems)} problem(s)")
            for p in report.problems:
                console.print(f"  - {p}", markup=False)
    if damaged:
        console.print(f"[red]{damaged} of {len(steps)} step(s) damaged[/red]")
        return 1
    console.print(f"all {len(steps)} step(s) verified")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args)
    console = Console()
    options = dict(min_age_s=args.min_age_s, pin_ttl_s=args.pin_ttl_s, measure=True)
    if args.dry_run:
        result = collect.collect(storage, dry_run=True, **options)
    else:
        total = len(collect.collect(storage, dry_run=True, min_age_s=args.min_age_s, pin_ttl_s=args.pin_ttl_s).garbage)
        with _Bar(console, "removing", total) as bar:
            result = collect.collect(storage, on_delete=lambda g: bar.advance(), **options)
    for p in result.problems:
        console.print(f"[red]skipped[/red] {p}: no data removed (a step that cannot be read may reference any file)", markup=False)
    for step in result.pinned:
        console.print(f"left step {step}: a save in flight pins it", highlight=False)
    for step, n in sorted(result.kept.items()):
        console.print(f"left {n} file(s) of step {step}: later steps still reference their chunks", highlight=False)
    verb = "would remove" if args.dry_run else "removed"
    for g in result.garbage:
        console.print(f"{verb} {g.path} ({_human(g.nbytes)}): {g.reason}", markup=False, highlight=False)
    total = _human(sum(g.nbytes for g in result.garbage))
    if not result.garbage:
        console.print(f"nothing unreferenced in {storage.url}")
    elif args.dry_run:
        console.print(f"{len(result.garbage)} unreferenced object(s), {total}: run without --dry-run to remove them")
    else:
        console.print(f"removed {len(result.garbage)} unreferenced object(s), {total}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args)
    step = _resolve_step(storage, args.step)
    console = Console()
    total = len(catalog.load_manifest(storage, step).tensors)
    with _Bar(console, f"exporting step {step}", total) as bar:
        nbytes = export_step(storage, step, args.out, progress=bar.advance)
    console.print(f"step {step}: {total} tensors, {_human(nbytes)} written to {args.out} (torch.load(..., weights_only=True) reads it)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    return report.run(args, Console())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="checkpointing", description="Inspect, verify and tidy checkpoints on any tier.")
    sub = parser.add_subparsers(dest="command", required=True)
    target = "checkpoint directory, or a tier URL (s3://bucket/prefix, file:///path, ...)"

    def tier_parser(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("dir", metavar="TARGET", help=target)
        p.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE", default=[],
                       help="fsspec storage option for a URL (repeatable; e.g. endpoint_url=http://127.0.0.1:9000); "
                            "credentials may come from the environment instead")
        return p

    p = tier_parser("ls", "list steps with size and state")
    p.add_argument("--remote", metavar="URL", default=None, help="also list this remote tier: a column says where each step is durable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)
    p = tier_parser("inspect", "show a step's tensors and values")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed step")
    p.add_argument("--json", action="store_true")
    p.add_argument("--max-values", type=int, default=50)
    p.set_defaults(func=cmd_inspect)
    p = tier_parser("verify", "check every digest; exit 1 on damage")
    p.add_argument("--step", type=int, default=None, help="default: every committed step")
    p.set_defaults(func=cmd_verify)
    p = tier_parser("gc", "remove data no committed step references (incomplete steps, a losing writer's files)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--min-age-s", type=float, default=3600.0,
                   help="leave objects younger than this alone: they may belong to a save in flight (default 3600; 0: everything)")
    p.add_argument("--pin-ttl-s", type=float, default=86400.0,
                   help="a pin (a save in flight) older than this is a crashed writer's and protects nothing (default 86400)")
    p.set_defaults(func=cmd_gc)
    p = tier_parser("export", "write a step's full (unsharded) tensors to one torch.save file")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed step")
    p.add_argument("--out", required=True, metavar="FILE", help="the file to write ({'step', 'world_size', 'tensors': {key: tensor}})")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("report", help="stall-time table (and --plot) from a directory's metrics.jsonl")
    report.add_arguments(p)
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except (CheckpointError, OSError) as exc:  # an unreachable tier, a failed delete: messages carry no credentials
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

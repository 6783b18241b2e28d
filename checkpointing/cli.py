"""`checkpointing ls|inspect|verify DIR` (also `python -m checkpointing`).

Exit codes: 0 fine, 1 damage found (verify), 2 bad usage or nothing to show.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from . import catalog, layout
from .errors import CheckpointError
from .storage import LocalStorage
from .verify import verify_step


def _storage(path: str) -> LocalStorage:
    root = Path(path)
    if not root.is_dir():
        raise SystemExit(_fail(f"{path}: no such checkpoint directory"))
    return LocalStorage(root, direct=False)


def _fail(msg: str) -> int:
    Console(stderr=True).print(f"[red]error:[/red] {msg}")
    return 2


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _step_size(storage: LocalStorage, step: int) -> int:
    sdir = layout.step_dir(step)
    return sum(storage.size(f"{sdir}/{name}") for name in storage.list(sdir))


def cmd_ls(args: argparse.Namespace) -> int:
    storage = _storage(args.dir)
    listing = catalog.list_steps(storage)
    rows: list[dict[str, Any]] = []
    for step in sorted(listing.committed + listing.incomplete):
        committed = step in listing.committed
        row: dict[str, Any] = {"step": step, "state": "committed" if committed else "incomplete", "bytes": _step_size(storage, step)}
        if committed:
            commit_path = storage.root / layout.commit_name(step)
            row["committed_at"] = _dt.datetime.fromtimestamp(commit_path.stat().st_mtime, _dt.timezone.utc).isoformat(timespec="seconds")
            try:
                row["tensors"] = len(catalog.load_manifest(storage, step).tensors)
            except CheckpointError as exc:
                row["state"] = "damaged"
                row["error"] = str(exc)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"checkpoints in {storage.root}")
    for col in ("step", "state", "size", "tensors", "committed at (UTC)"):
        table.add_column(col, justify="right" if col in ("step", "size", "tensors") else "left")
    for r in rows:
        style = {"committed": "green", "incomplete": "yellow", "damaged": "red"}[r["state"]]
        table.add_row(str(r["step"]), f"[{style}]{r['state']}[/{style}]", _human(r["bytes"]), str(r.get("tensors", "")), r.get("committed_at", ""))
    Console().print(table)
    if not rows:
        Console().print("no checkpoints")
    return 0


def _resolve_step(storage: LocalStorage, step: int | None) -> int:
    committed = catalog.list_steps(storage).committed
    if step is None:
        if not committed:
            raise SystemExit(_fail(f"{storage.root}: no committed step"))
        return committed[-1]
    if step not in committed:
        raise SystemExit(_fail(f"step {step} is not committed in {storage.root} (committed: {committed})"))
    return step


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = _storage(args.dir)
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


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _storage(args.dir)
    steps = [_resolve_step(storage, args.step)] if args.step is not None else catalog.list_steps(storage).committed
    if not steps:
        return _fail(f"{storage.root}: no committed step to verify")
    console = Console()
    damaged = 0
    for step in steps:
        report = verify_step(storage, step)
        if report.ok:
            console.print(f"[green]ok[/green]      step {step}: {report.tensors} tensors, {_human(report.bytes_checked)} verified")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="checkpointing", description="Inspect and verify checkpoint directories.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list steps with size and state")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("inspect", help="show a step's tensors and values")
    p.add_argument("dir")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed step")
    p.add_argument("--json", action="store_true")
    p.add_argument("--max-values", type=int, default=50)
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every digest; exit 1 on damage")
    p.add_argument("dir")
    p.add_argument("--step", type=int, default=None, help="default: every committed step")
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

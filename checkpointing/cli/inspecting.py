"""`checkpointing inspect`: one step's tensors and plain values, per rank where the ranks saved different ones (layer: cli).

A step saved by several ranks holds one tree per distinct set of values (format.md: `trees`,
`rank_trees`) and, under one key, one tensor entry per distinct content (per-rank state). The
tensor table then has a `ranks` column (whose tree points at each entry: "all" for shared ones), the
values are shown per tree with the ranks that saved it, and `--json` gives every tree, `rank_trees`
and each tensor's ranks beside rank 0's `tree` (as before).
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from checkpointing.cli import fmt, tables
from checkpointing.cli.targets import committed_step, open_target
from checkpointing.errors import CheckpointError
from checkpointing.format.manifest import Manifest
from checkpointing.state.tree import join_key
from checkpointing.storage import Storage
from checkpointing.tier import catalog
from checkpointing.tier.identity import tier_id_of
from checkpointing.tier.verify import missing_files


def inspect(args: argparse.Namespace, console: Console) -> int:
    """A step's tensors (key, dtype, shape, size, chunks; ranks when they differ) and its plain values."""
    if args.max_values < 0:
        raise fmt.CommandFailed(f"--max-values must be >= 0, got {args.max_values}")
    storage = open_target(args.dir, args.storage_option)
    step = committed_step(storage, args.step)
    try:
        manifest = catalog.load_manifest(storage, step)
    except CheckpointError as exc:
        raise fmt.CommandFailed(str(exc), code=1) from None
    ranks = tensor_ranks(manifest)
    if args.json:
        print(json.dumps({
            "step": step, "format_version": manifest.format_version, "bytes": manifest.nbytes, "world_size": manifest.world_size,
            "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                         "chunks": sum(len(s.chunks) for s in t.shards), "ranks": ranks[i]} for i, t in enumerate(manifest.tensors)],
            "tree": manifest.tree, "trees": list(manifest.trees), "rank_trees": list(manifest.rank_trees),
        }, indent=2))
        return _files_state(storage, manifest, Console(stderr=True))
    title = f"step {step}: {len(manifest.tensors)} tensors, {fmt.size(manifest.nbytes)} (format v{manifest.format_version})"
    tables.show(console, _tensors_view(manifest, ranks, title, width=console.width, wide=args.wide))
    for t, tree in enumerate(manifest.trees):
        values = _values(tree, ())
        if not values:
            continue
        savers = [r for r, i in enumerate(manifest.rank_trees) if i == t]
        console.print("[bold]values[/bold]" + ("" if len(manifest.trees) == 1 else f" of {_ranks_text(savers, manifest.world_size, 'rank')}"))
        for key, val in values[: args.max_values]:
            console.print(f"  {key} = {val}", markup=False)
        if len(values) > args.max_values:
            console.print(f"  ... {len(values) - args.max_values} more (--max-values)", markup=False)
    return _files_state(storage, manifest, console)


def tensor_ranks(manifest: Manifest) -> list[list[int]]:
    """Per tensor entry, the ranks whose tree points at it (ascending)."""
    out: list[set[int]] = [set() for _ in manifest.tensors]
    for t, tree in enumerate(manifest.trees):
        used = _entries(tree)
        for r, i in enumerate(manifest.rank_trees):
            if i == t:
                for e in used:
                    out[e].add(r)
    return [sorted(s) for s in out]


def _entries(node: dict) -> set[int]:
    """The tensor table entries a tree points at."""
    found: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if "tensor" in n or "ndarray" in n:
            found.add(n.get("tensor", n.get("ndarray")))
        elif "dict" in n:
            stack.extend(child for _, child in n["dict"])
        elif "list" in n or "tuple" in n:
            stack.extend(n.get("list", n.get("tuple")))
        elif "stateful" in n:
            stack.append(n["stateful"])
    return found


def _ranks_text(ranks: list[int], world_size: int, word: str = "") -> str:
    """"all" for every rank, else "rank 1" / "ranks 0, 2-3"."""
    if len(ranks) == world_size:
        return "all" if not word else f"all {world_size} ranks"
    spans: list[str] = []
    for r in ranks:
        if spans and spans[-1].split("-")[-1] == str(r - 1):
            spans[-1] = f"{spans[-1].split('-')[0]}-{r}"
        else:
            spans.append(str(r))
    text = ", ".join(spans)
    return text if not word else f"{word}{'s' if len(ranks) > 1 else ''} {text}"


_COLUMNS = (
    tables.Column("key", justify="left", flex=True, breaks="/.", min_width=16), tables.Column("dtype", justify="left"),
    tables.Column("shape", justify="left"), tables.Column("size"), tables.Column("chunks"),
    tables.Column("shards", default=False), tables.Column("files", default=False),
)
_RANKS = tables.Column("ranks", justify="left")


def _tensors_view(manifest: Manifest, ranks: list[list[int]], title: str, *, width: int | None, wide: bool) -> tables.View:
    """The tensor table: a long key wraps after "/" or "."; a size keeps its unit (they span B to GB); a ranks
    column when some entry is not every rank's."""
    per_rank = any(len(r) != manifest.world_size for r in ranks)
    rows: list[list[tables.Cell]] = []
    for i, t in enumerate(manifest.tensors):
        chunks = [c for s in t.shards for c in s.chunks]
        rows.append([Text(t.key), Text(t.dtype), "x".join(map(str, t.shape)) or "scalar", fmt.size(t.nbytes), str(len(chunks)),
                     str(len(t.shards)), str(len({c.file for c in chunks}))] + ([Text(_ranks_text(ranks[i], manifest.world_size))] if per_rank else []))
    return tables.fit(_COLUMNS + ((_RANKS,) if per_rank else ()), rows, width=width, wide=wide, title=title)


def _files_state(storage: Storage, manifest: Manifest, console: Console) -> int:
    """1 (and a line per file) when a data file this tier should hold is missing or of the wrong size (verify.missing_files)."""
    bad = missing_files(storage, manifest, here=tier_id_of(storage))
    for line in bad:
        console.print(f"[red]damaged[/red] {escape(line)}")
    if bad:
        console.print(f"step {manifest.step} is damaged: run `checkpointing verify` for details", markup=False)
    return 1 if bad else 0


def _values(node: dict, path: tuple) -> list[tuple[str, str]]:
    """The tree's plain values as (key path, short text), in tree order."""
    out: list[tuple[str, str]] = []
    key = join_key(path)
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
        out.append((key, f"<{len(node['bytes']) * 3 // 4 - node['bytes'][-2:].count('=')} bytes>"))
    elif "codec" in node:
        out.append((key, f"<codec {node['codec']}>"))
    return out

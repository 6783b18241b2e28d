"""`checkpointing export` and `checkpointing import`: their arguments and what they print (layer: cli).

export TARGET --out PATH [--format torch|safetensors] [--step N] [--only GLOB]... [--exclude GLOB]...
       [--strip-prefix P] [--dtype bf16|fp16|fp32] [--max-shard-size 5GB] [--force]
    torch (the default): one torch.save file of full tensors; safetensors: a Hugging Face directory
    (model.safetensors, or shards plus model.safetensors.index.json), streamed file by file.
import SRC DEST --step N [--under KEY] [--only GLOB]... [--exclude GLOB]... [--dtype ...] [--tie ALIAS=NAME]...
    SRC: a DCP directory, a torch.save file, a .safetensors file or a Hugging Face directory;
    DEST: a checkpoint directory or tier URL. The work is checkpointing.interop's.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from checkpointing.cli import fmt
from checkpointing.cli.progress import Bar
from checkpointing.cli.targets import committed_step, open_target, path_or_url, storage_options
from checkpointing.storage.redact import redact_url
from checkpointing.tier import catalog


def export_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `export` beyond TARGET and --storage-option."""
    p.add_argument("--step", type=int, default=None, help="default: the newest committed step")
    p.add_argument("--format", choices=("torch", "safetensors"), default="torch",
                   help="torch: one torch.save file {'step', 'world_size', 'tensors': {key: tensor}} (default); "
                        "safetensors: a Hugging Face directory (model.safetensors, or shards and model.safetensors.index.json)")
    p.add_argument("--out", required=True, metavar="PATH", type=path_or_url, help="the file (torch) or directory (safetensors) to write")
    _selection_arguments(p, "export")
    p.add_argument("--strip-prefix", metavar="TEXT", default=None, help="remove this from the start of every name (e.g. 'model.')")
    p.add_argument("--max-shard-size", metavar="SIZE", default=None,
                   help="safetensors: bytes per file, e.g. 5GB (the default), 500MB, 2GiB")
    p.add_argument("--force", action="store_true", help="replace an earlier export at --out")


def import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", type=path_or_url, help="a DCP checkpoint directory, a torch.save file, a .safetensors file, or a "
                                              "Hugging Face directory (model.safetensors.index.json); DCP metadata is a "
                                              "pickle: import only checkpoints you trust")
    p.add_argument("dest", metavar="DEST", type=path_or_url, help="checkpoint directory, or a tier URL (s3://bucket/prefix, ...)")
    p.add_argument("--step", type=int, required=True, help="the step number to commit the import as")
    p.add_argument("--under", metavar="KEY", default=None,
                   help="put the imported state under this top-level key (e.g. model, for a run that saves {'model': model})")
    _selection_arguments(p, "import")
    p.add_argument("--tie", action="append", default=[], metavar="ALIAS=NAME",
                   help="save ALIAS sharing NAME's tensor (tied weights a file left out, e.g. lm_head.weight=transformer.wte.weight)")
    p.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE", default=[],
                   help="fsspec storage option for a DEST URL (repeatable)")
    p.add_argument("--format", dest="kind", choices=("dcp", "torch", "safetensors", "hf"), default=None,
                   help="what SRC is (default: told from SRC)")


def _selection_arguments(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--only", action="append", metavar="GLOB", default=None,
                   help=f"{verb} only these keys (repeatable; 'model' takes everything under model)")
    p.add_argument("--exclude", action="append", metavar="GLOB", default=None, help=f"do not {verb} these keys (repeatable)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="cast the floating-point tensors")


def run_export(args: argparse.Namespace, console: Console) -> int:
    """Write a step's full tensors as a torch.save file or a safetensors directory."""
    from checkpointing.interop import export_safetensors, export_torch  # on use: the other commands need none of it

    storage = open_target(args.dir, args.storage_option)
    step = committed_step(storage, args.step)
    total = len(catalog.load_manifest(storage, step).tensors)
    options = dict(only=args.only, exclude=args.exclude, strip_prefix=args.strip_prefix, dtype=args.dtype, force=args.force)
    with Bar(console, f"exporting step {step}", total) as bar:
        if args.format == "safetensors":
            result = export_safetensors(storage, args.out, step, max_shard_size=args.max_shard_size or "5GB", progress=bar.advance, **options)
        elif args.max_shard_size is not None:
            raise fmt.CommandFailed("--max-shard-size applies to --format safetensors")
        else:
            result = export_torch(storage, args.out, step, progress=bar.advance, **options)
    reader = "torch.load(..., weights_only=True) reads it" if args.format == "torch" else \
        "from_pretrained reads it beside a config.json" if len(result.files) == 1 else f"{len(result.files) - 1} files and the index"
    console.print(f"step {step}: {result.tensors} tensors, {fmt.size(result.nbytes)} written to {args.out} ({reader})",
                  markup=False, highlight=False)
    if result.tied:
        shown = ", ".join(f"{a} -> {n}" for a, n in list(result.tied.items())[:4]) + (" ..." if len(result.tied) > 4 else "")
        console.print(f"tied weights written once: {shown}", markup=False, highlight=False)
    return 0


def run_import(args: argparse.Namespace, console: Console) -> int:
    """Commit a DCP / torch.save / safetensors / Hugging Face checkpoint as one step."""
    from checkpointing.interop import import_checkpoint  # on use: it brings the manager and DCP

    tie = {}
    for pair in args.tie:
        alias, sep, name = pair.partition("=")
        if not sep or not alias or not name:
            raise fmt.CommandFailed(f"--tie {pair!r}: expected ALIAS=NAME, e.g. lm_head.weight=transformer.wte.weight")
        tie[alias] = name
    result = import_checkpoint(args.src, args.dest, args.step, under=args.under, only=args.only, exclude=args.exclude,
                               dtype=args.dtype, tie=tie, kind=args.kind, storage_options=storage_options(args.storage_option) or None)
    console.print(f"imported {args.src} ({result.source_kind}) as step {result.step} of {redact_url(args.dest)}: {result.tensors} tensors, "
                  f"{fmt.size(result.nbytes)}", markup=False, highlight=False)
    return 0

"""`checkpointing ls|inspect|verify|gc|rm|export|report TARGET` and `checkpointing import SRC TARGET`
(also `python -m checkpointing`): the arguments, and which command runs (layer: cli).

TARGET is a checkpoint directory or any tier URL (s3://bucket/prefix, file:///path, memory://...).
Credentials for a URL come from `--storage-option key=value` (repeatable; dotted keys nest, e.g.
client_kwargs.region_name=us-east-1) or from the environment the cloud SDK reads
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...). They are never printed.

Exit codes: 0 fine, 1 damage found (verify; any command that meets a damaged or hostile checkpoint),
2 bad usage, an unreachable tier, or nothing to show, 3 a bug of this library (a one-line message;
CHECKPOINTING_DEBUG=1 lets the traceback out).
The commands are commands.py (on a tier), convert.py (export and import) and report.py (from
metrics.jsonl); `main` is the one place where a failure becomes an error line and an exit code
(fmt.fail).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from rich.console import Console
from rich.errors import MarkupError

from checkpointing.cli import commands, convert, inspecting, report
from checkpointing.cli.fmt import USAGE, CommandFailed, fail
from checkpointing.cli.targets import add_target
from checkpointing.errors import CheckpointCorruptError, CheckpointError

INTERNAL = 3  # the exit code of a bug in this library (not of the checkpoint)


DISTRIBUTION = "tiered-checkpointing"  # what pip installs; the import name is checkpointing


def _version() -> str:
    """The installed distribution's version (a source tree that was never installed says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{version(DISTRIBUTION)} ({DISTRIBUTION})"
    except PackageNotFoundError:
        return f"(not installed: pip install {DISTRIBUTION})"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each subcommand sets `func(args, console) -> exit code`."""
    parser = argparse.ArgumentParser(prog="checkpointing", description="Inspect, verify and tidy checkpoints on any tier.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def tier_parser(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        add_target(p)
        return p

    p = tier_parser("ls", "list steps with size and state")
    p.add_argument("--remote", metavar="URL", default=None, help="also list this remote tier: a column says where each step is durable "
                   "(--storage-option values are this URL's when TARGET is a directory)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--wide", action="store_true", help="every column (unique and shared bytes, tensors), however wide")
    p.set_defaults(func=commands.ls)
    p = tier_parser("inspect", "show a step's tensors and values")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed step")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--max-values", type=int, default=50, help="at most this many primitive values shown (default 50)")
    p.add_argument("--wide", action="store_true", help="every column (shards, files), keys unwrapped, however wide")
    p.set_defaults(func=inspecting.inspect)
    p = tier_parser("verify", "check every digest; exit 1 on damage")
    p.add_argument("--step", type=int, default=None, help="default: every committed step")
    p.set_defaults(func=commands.verify)
    p = tier_parser("gc", "remove data no committed step references (incomplete steps, a losing writer's files)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--min-age-s", type=float, default=3600.0,
                   help="leave objects younger than this alone: they may belong to a save in flight (default 3600; 0: everything)")
    p.add_argument("--pin-ttl-s", type=float, default=86400.0,
                   help="a pin (a save in flight) older than this is a crashed writer's and protects nothing (default 86400)")
    p.set_defaults(func=commands.gc)
    p = tier_parser("rm", "delete a committed step (chunks later steps use stay); the newest only with --force")
    p.add_argument("--step", type=int, required=True, help="the step to delete")
    p.add_argument("--force", action="store_true", help="also delete the newest committed step")
    p.set_defaults(func=commands.rm)
    p = tier_parser("export", "write a step's full tensors: one torch.save file, or safetensors for Hugging Face")
    convert.export_arguments(p)
    p.set_defaults(func=commands.export)
    p = sub.add_parser("import", help="commit a DCP, torch.save, safetensors or Hugging Face checkpoint as one step")
    convert.import_arguments(p)
    p.set_defaults(func=convert.run_import)
    p = sub.add_parser("report", help="stall-time table (and --plot) from a tier's metrics.jsonl (a remote tier holds rank 0's copy)")
    report.add_arguments(p)
    p.set_defaults(func=report.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: its exit code; a failure is printed as one error line on stderr."""
    args = build_parser().parse_args(argv)
    for stream in (sys.stdout, sys.stderr):  # a key the terminal's encoding lacks is shown escaped, not a failed command
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    if os.environ.get("CHECKPOINTING_DEBUG"):
        return args.func(args, Console())
    try:
        return args.func(args, Console())
    except BrokenPipeError:  # the reader stopped early (`| head`): no message; 1 as Python and rich exit on EPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more reaches the closed pipe at exit
        return 1
    except CommandFailed as exc:
        return fail(Console(stderr=True), str(exc), exc.code)
    except CheckpointError as exc:  # damage found while reading, an unreachable tier: messages carry no credentials
        return fail(Console(stderr=True), str(exc), 1 if isinstance(exc, CheckpointCorruptError) else USAGE)
    except (OSError, ValueError, OverflowError, MemoryError, RecursionError, MarkupError) as exc:  # odd directory contents
        return fail(Console(stderr=True), f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug of ours: one line, never a traceback, and a way to report it
        return fail(Console(stderr=True), f"internal error ({type(exc).__name__}: {exc}); please report it with the "
                    "command line (CHECKPOINTING_DEBUG=1 shows the traceback)", INTERNAL)


if __name__ == "__main__":
    sys.exit(main())

"""Shared fixtures. Tests live beside their helpers (tests/_models.py) and import them directly."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Keep torch to one intra-op thread (the I/O thread and child processes share 2 cores)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Call the `checkpointing` CLI in-process: run_cli("ls", path) -> (exit code, stdout + stderr), printed
    `columns` wide (250 unless given: most tests check content, tests/test_cli_width.py how it fits)."""
    from checkpointing.cli.app import main

    def call(*argv: str, columns: int = 250) -> tuple[int, str]:
        monkeypatch.setenv("COLUMNS", str(columns))
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out + out.err

    return call

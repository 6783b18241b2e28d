"""examples/train_2d.py as users launch it (issue 16): torchrun on 4 ranks as FSDP2 over tensor parallel
(dp=2, tp=2), then a resume on 2 ranks as tensor parallel only (dp=1, tp=2): another mesh, another
world size. Real processes on gloo on 127.0.0.1; two launches (torchrun start-up dominates the cost).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import _dist

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_2d.py"


def _torchrun(n: int, *args: str) -> str:
    proc = _dist.torchrun(n, str(SCRIPT), *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}


def test_2d_example_resumes_on_another_mesh_with_the_uninterrupted_losses(tmp_path):
    from checkpointing.cli.app import main as cli

    ck = str(tmp_path / "ck")
    first = _torchrun(4, "--dir", ck, "--steps", "4", "--save-every", "2", "--dp", "2", "--tp", "2")
    assert "mesh dp=2 tp=2 (4 ranks), no checkpoint" in first and "steps on disk [2, 4]" in first, first
    uninterrupted = _losses(first)
    assert sorted(uninterrupted) == [1, 2, 3, 4], first

    # the job died after step 2 was committed: step 4 never was
    assert cli(["rm", ck, "--step", "4", "--force"]) == 0
    second = _torchrun(2, "--dir", ck, "--steps", "4", "--save-every", "2", "--dp", "1", "--tp", "2")
    assert "mesh dp=1 tp=2 (2 ranks), resumed from step 2" in second and "steps on disk [2, 4]" in second, second
    resumed = _losses(second)
    assert sorted(resumed) == [3, 4], second
    # The restored weights and AdamW state are the saved bytes, and both runs see the same tokens.
    # The losses are still not bit-equal: the 4-rank run averages two data-parallel halves of the
    # batch (and its gradients are averaged by FSDP's reduce-scatter), the 2-rank run takes one mean
    # over the whole batch, so float sums round differently (about 1e-7 relative per step). A model
    # or AdamW state restored wrongly moves the loss by far more: a restore of the weights without
    # the AdamW state moves step 4's loss by about 1e-2 relative.
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-4), (step, first, second)


def test_2d_example_refuses_a_mesh_that_does_not_fit_the_job():
    spec = importlib.util.spec_from_file_location("train_2d", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.layout_problems(2, 2, 4) == [] and example.layout_problems(1, 2, 2) == [] and example.layout_problems(4, 1, 4) == []
    assert example.layout_problems(1, 2, 4) == ["--dp 1 x --tp 2 = 2, but the job has 4 ranks: the mesh must use every rank"]
    assert [p.split(" must ")[0] for p in example.layout_problems(1, 3, 3)] == ["--tp 3"]

"""CheckpointingTrainer with a real transformers.Trainer on the CPU (checkpointing/integrations/transformers.py).

A tiny GPT-2 (2 layers, 32 wide, dropout on) built from a config trains on 24 fixed random
sequences in batches of 4 (6 steps per epoch, shuffled by the Trainer's sampler) for 12 steps,
saving every 4. A run interrupted after step 8 (a callback stops it there, as a crash after the
save would) and resumed by a new Trainer must end bit for bit where the uninterrupted run ends:
weights, AdamW moments and the LR schedule (which needs the dataloader position, the RNG states
and the scheduler restored). Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import checkpointing  # noqa: E402
from checkpointing import CheckpointError, CheckpointManager, CheckpointMismatchError, CheckpointNotFoundError  # noqa: E402
from checkpointing.format import naming  # noqa: E402
from checkpointing.integrations import _hf_markers as markers  # noqa: E402
from checkpointing.integrations import transformers as ckpt_hf  # noqa: E402
from checkpointing.integrations._hf_retention import BEST_STEP  # noqa: E402
from checkpointing.integrations.transformers import SaveTotalLimit  # noqa: E402
from checkpointing.plan.retention import StepInfo  # noqa: E402
from checkpointing.storage import RetryPolicy  # noqa: E402
from faults import Fault, HeldUploads, inject, waiting_for_upload  # noqa: E402
from s3_server import s3_bucket, s3_endpoint  # noqa: E402,F401 - fixtures
from test_yielding import _until  # noqa: E402

MAX_STEPS, SAVE_STEPS, CRASH_AT = 12, 4, 8


@pytest.fixture(autouse=True)
def _offline_and_quiet(monkeypatch: pytest.MonkeyPatch, one_torch_thread: None) -> Any:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class StopAt(TrainerCallback):
    """Ends training after global step `k` (after its save): what a crash right after the save leaves."""

    def __init__(self, k: int) -> None:
        self.k = k

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.k:
            control.should_training_stop = True


class StartStep(TrainerCallback):
    """Records the global step a run starts from (0 fresh, N when resumed from checkpoint-N)."""

    start: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.start = state.global_step


class FoldersNameCommittedSteps(TrainerCallback):
    """Checks, after every step and every save, that each checkpoint-N folder's step is committed."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def check(self) -> None:
        folders = folder_steps(self.out)
        if folders:
            assert set(folders) <= set(committed(self.out / "checkpointing"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.check()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.check()


def dataset(n: int = 24, seq: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (seq,), generator=g)
        out.append({"input_ids": x, "labels": x.clone()})
    return out


def make(out: Path, *, cls: type = ckpt_hf.CheckpointingTrainer, callbacks: list | None = None, trainer_kwargs: dict | None = None,
         **args: Any) -> Any:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0))
    settings: dict[str, Any] = dict(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="steps", save_steps=SAVE_STEPS,
                                    max_steps=MAX_STEPS, per_device_train_batch_size=4, seed=7, data_seed=7, dataloader_num_workers=0,
                                    logging_steps=1, learning_rate=1e-2, disable_tqdm=True)
    settings.update(args)
    return cls(model=model, args=TrainingArguments(**settings), train_dataset=dataset(), callbacks=callbacks, **(trainer_kwargs or {}))


def final_state(trainer: Any) -> dict[str, Any]:
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    return {"model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optim": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in opt.state_dict()["state"].items()},
            "sched": trainer.lr_scheduler.state_dict()}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for i in a["optim"]:
        for k in a["optim"][i]:
            x, y = a["optim"][i][k], b["optim"][i][k]
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else type(x) is type(y) and x == y), (i, k)
    assert a["sched"] == b["sched"]


def folder_steps(out: Path) -> list[int]:
    return sorted(n for n, _ in markers.scan(str(out)))


def committed(root: Path) -> list[int]:
    with CheckpointManager(root, read_only=True) as mgr:
        return mgr.steps()


@pytest.fixture(scope="module")
def _module_setting() -> Any:
    """What the autouse fixture sets, for the module-scoped runs below (set up before it)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, _module_setting: None) -> dict[str, Any]:
    """The uninterrupted run to MAX_STEPS (with one torch thread, as every test here)."""
    out = tmp_path_factory.mktemp("reference")
    trainer = make(out)
    trainer.train()
    return {"out": out, "final": final_state(trainer)}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory, _module_setting: None) -> Path:
    """An output_dir whose run stopped after step CRASH_AT (checkpoints 4 and 8); tests copy it."""
    out = tmp_path_factory.mktemp("interrupted") / "out"
    watch = FoldersNameCommittedSteps(out)  # checks during the run: a folder appears only once its step is committed
    make(out, callbacks=[StopAt(CRASH_AT), watch]).train()
    assert folder_steps(out) == [4, 8] == committed(out / "checkpointing")  # train() waited for the last save
    return out


def copy_of(interrupted: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(interrupted, out)
    return out


def resume(out: Path, how: Any, reference: dict[str, Any]) -> tuple[Any, int | None]:
    start = StartStep()
    trainer = make(out, callbacks=[start])
    trainer.train(resume_from_checkpoint=how)
    assert_same(final_state(trainer), reference["final"])
    return trainer, start.start


def test_uninterrupted_run_matches_transformers_trainer(reference: dict[str, Any], tmp_path: Path) -> None:
    stock = make(tmp_path / "stock", cls=Trainer)
    stock.train()
    assert_same(final_state(stock), reference["final"])  # our saves change nothing in the training itself

    out = reference["out"]
    assert folder_steps(out) == [4, 8, 12] == committed(out / "checkpointing")
    for step in (4, 8, 12):  # each folder: the Trainer's state and our pointer, no model/optimizer/RNG files
        folder = out / f"checkpoint-{step}"
        assert sorted(os.listdir(folder)) == ["checkpointing.json", "trainer_state.json"]
        assert transformers.TrainerState.load_from_json(str(folder / "trainer_state.json")).global_step == step
    assert [n for n in os.listdir(out) if n.startswith(".")] == [markers.PUBLISHED_NAME]  # no staging folder left
    tree = checkpointing.load(out / "checkpointing", 12)
    assert set(tree) == {"model", "optimizer", "scheduler", "rng", "trainer"}
    for k, v in reference["final"]["model"].items():
        assert torch.equal(tree["model"][k], v), k
    assert transformers.trainer_utils.get_last_checkpoint(str(out)) == str(out / "checkpoint-12")


def test_resume_true_is_bit_exact_and_unpickles_nothing(interrupted: Path, reference: dict[str, Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = copy_of(interrupted, tmp_path)

    def no_unpickling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    _, start = resume(out, True, reference)
    assert start == CRASH_AT
    assert folder_steps(out) == [4, 8, 12] == committed(out / "checkpointing")


def test_resume_from_an_explicit_older_folder_replaces_newer_steps(interrupted: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    out = copy_of(interrupted, tmp_path)
    before = checkpointing.load(out / "checkpointing", 8)["trainer"]["state_json"]
    _, start = resume(out, str(out / "checkpoint-4"), reference)
    assert start == 4
    assert folder_steps(out) == [4, 8, 12] == committed(out / "checkpointing")
    after = checkpointing.load(out / "checkpointing", 8)
    assert after["trainer"]["state_json"] == (out / "checkpoint-8" / "trainer_state.json").read_text()
    assert after["trainer"]["state_json"] != before  # step 8 was saved again (its log history says so)


def test_resuming_with_another_optimizer_says_how_to_start_from_the_weights(interrupted: Path, tmp_path: Path) -> None:
    """The Trainer cannot leave the optimizer out of a resume: the error says what works instead, and it does."""
    out = copy_of(interrupted, tmp_path)
    trainer = make(out, optim="sgd")
    with pytest.raises(CheckpointMismatchError, match="The Trainer resumes the optimizer and scheduler it saved") as info:
        trainer.train(resume_from_checkpoint=True)
    assert "SGD" in str(info.value) and "without resume_from_checkpoint" in str(info.value), info.value
    fresh = make(tmp_path / "fresh", optim="sgd", max_steps=1)
    fresh.model.load_state_dict(checkpointing.load(out / "checkpointing", step=8, keys="model")["model"])  # as the error says
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                 checkpointing.load(out / "checkpointing", 8)["model"].values()))
    fresh.train()


def test_adafactor_with_its_schedule_resumes_bit_exactly(tmp_path: Path) -> None:
    """Adafactor (relative_step) and AdafactorSchedule hold lr as a 0-d tensor once stepped, a fresh pair floats."""
    from transformers.optimization import Adafactor, AdafactorSchedule

    def adafactor(out: Path, cls: type, callbacks: list | None = None) -> Any:
        trainer = make(out, cls=cls, callbacks=callbacks)
        opt = Adafactor(trainer.model.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None)
        trainer.optimizer, trainer.lr_scheduler = opt, AdafactorSchedule(opt)
        return trainer

    stock = adafactor(tmp_path / "stock", Trainer)
    stock.train()
    out = tmp_path / "out"
    adafactor(out, ckpt_hf.CheckpointingTrainer, [StopAt(CRASH_AT)]).train()
    resumed = adafactor(out, ckpt_hf.CheckpointingTrainer)
    resumed.train(resume_from_checkpoint=True)
    assert_same(final_state(resumed), final_state(stock))
    assert isinstance(resumed.optimizer.param_groups[0]["lr"], torch.Tensor)


@pytest.mark.parametrize("crash", ["commit marker lost", "step gone"])
def test_folder_of_an_uncommitted_step_is_never_resumed(crash: str, interrupted: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    out = copy_of(interrupted, tmp_path)
    step_dir = out / "checkpointing" / naming.step_dir(CRASH_AT)
    if crash == "commit marker lost":
        (step_dir / naming.COMMIT_NAME).unlink()  # what a crash between writing and committing leaves
    else:
        shutil.rmtree(step_dir)
    assert (out / "checkpoint-8" / "trainer_state.json").exists()  # the Trainer's get_last_checkpoint would take it

    with pytest.raises(CheckpointNotFoundError, match="not committed"):
        make(out).train(resume_from_checkpoint=str(out / "checkpoint-8"))
    trainer, start = resume(out, True, reference)
    assert start == 4  # the newest committed step
    assert folder_steps(out) == [4, 8, 12] == committed(out / "checkpointing")


def lose_folder_before_publication(out: Path, step: int) -> None:
    """What a run that died between the commit of `step` and the rename of its folder leaves: no folder, none recorded."""
    shutil.rmtree(out / f"checkpoint-{step}")
    record = out / markers.PUBLISHED_NAME
    doc = json.loads(record.read_text())
    doc["published"] = [e for e in doc["published"] if e[0] != step]
    record.write_text(json.dumps(doc))


def test_folder_lost_after_commit_is_rebuilt_from_the_step(interrupted: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    out = copy_of(interrupted, tmp_path)
    lose_folder_before_publication(out, 8)
    _, start = resume(out, True, reference)
    assert start == CRASH_AT
    assert folder_steps(out) == [4, 8, 12] == committed(out / "checkpointing")


def test_removing_the_newest_folder_rolls_back_as_with_the_stock_trainer(interrupted: Path, reference: dict[str, Any],
                                                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = copy_of(interrupted, tmp_path)
    assert {step for step, _ in markers.published(str(out))} == {4, 8}
    shutil.rmtree(out / "checkpoint-8")  # the user rolls back to checkpoint-4
    with caplog.at_level("WARNING", logger="checkpointing"):
        _, start = resume(out, True, reference)
    assert start == 4  # not step 8, whose folder the user removed
    assert "not resuming from steps [8], whose folders were removed from" in caplog.text
    assert folder_steps(out) == [4, 8, 12] == committed(out / "checkpointing")  # the run saved step 8 again, replacing it


@pytest.mark.parametrize("record", ["damaged", "a directory"])
def test_an_unreadable_record_of_published_folders_never_undoes_a_roll_back(record: str, interrupted: Path, reference: dict[str, Any],
                                                                            tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = copy_of(interrupted, tmp_path)
    shutil.rmtree(out / "checkpoint-8")
    path = out / markers.PUBLISHED_NAME
    path.unlink()
    if record == "damaged":
        path.write_text('{"transformers_checkpointing": 1, "published": [[4, "')
    else:
        path.mkdir()
    with caplog.at_level("WARNING", logger="checkpointing"):
        _, start = resume(out, True, reference)  # train() goes on even where the record cannot be written
    assert start == 4 and f"{markers.PUBLISHED_NAME} there cannot be read" in caplog.text
    assert folder_steps(out) == [4, 8, 12] == committed(out / "checkpointing")
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_a_checkpoint_folder_copied_into_another_run_is_refused(interrupted: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    """The folder is a pointer: copied beside another run's own step 8, it must not resume that run's weights."""
    other = tmp_path / "other"
    shutil.copytree(reference["out"], other)
    assert 8 in committed(other / "checkpointing")
    shutil.copytree(interrupted / "checkpoint-8", other / "from-interrupted")
    with pytest.raises(CheckpointError, match="another save made that step.*copy the output_dir"):
        make(other).train(resume_from_checkpoint=str(other / "from-interrupted"))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copytree(interrupted / "checkpoint-8", empty / "checkpoint-8")
    with pytest.raises(CheckpointNotFoundError, match="copied from another run"):
        make(empty / "out").train(resume_from_checkpoint=str(empty / "checkpoint-8"))


def test_folders_not_written_by_us_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        make(out).train(resume_from_checkpoint=True)
    with pytest.raises(CheckpointError, match="not written by CheckpointingTrainer"):
        make(out).train(resume_from_checkpoint=str(out / "checkpoint-5"))
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint folder"):
        make(out).train(resume_from_checkpoint=str(out / "checkpoint-6"))


@pytest.mark.parametrize("limit,best", [(2, False), (2, True), (1, True)])
def test_save_total_limit_and_best_model(limit: int, best: bool, tmp_path: Path) -> None:
    out = tmp_path / "out"
    extra: dict[str, Any] = {}
    if best:  # the eval loss (on other random data) is lowest early on: a step that rotation by age alone would drop
        extra = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss")
    trainer = make(out, save_steps=2, save_total_limit=limit, trainer_kwargs={"eval_dataset": dataset(8, seed=1)} if best else None,
                   **extra)
    trainer.train()
    steps = committed(out / "checkpointing")
    assert folder_steps(out) == steps  # the folders and the steps agree
    if not best:
        assert steps == [10, 12]
        return
    top = trainer.state.best_global_step
    assert top not in (10, 12)  # the case this test is about: the best step is an old one
    assert trainer.state.best_model_checkpoint == str(out / f"checkpoint-{top}")
    if limit == 1:  # the Trainer's end-of-training cleanup keeps only the best folder; its step stays alone
        assert steps == [top]
    else:
        assert steps == [top, 12]  # the best and the newest, as the Trainer's rotation keeps them
    saved = checkpointing.load(out / "checkpointing", top, keys=["model"])["model"]
    for k, v in trainer.model.state_dict().items():  # load_best_model_at_end loaded the best step's weights
        assert torch.equal(saved[k], v), k


def test_resume_from_the_remote_tier_alone(reference: dict[str, Any], tmp_path: Path) -> None:
    """A replaced machine: output_dir (folders and local steps) is gone; the remote tier has the steps."""
    out, remote = tmp_path / "out", (tmp_path / "remote").as_uri()
    first = make(out, callbacks=[StopAt(CRASH_AT)], trainer_kwargs={"remote": remote, "incremental": False})
    first.train()
    shutil.rmtree(out)
    start = StartStep()
    trainer = make(out, callbacks=[start], trainer_kwargs={"remote": remote})
    trainer.train(resume_from_checkpoint=True)  # checkpoint-8 is written again from the step, then resumed
    assert start.start == CRASH_AT
    assert_same(final_state(trainer), reference["final"])
    assert folder_steps(out) == [4, 8, 12]


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 20])
@pytest.mark.parametrize("best", [None, 2, 6, 12])
def test_save_total_limit_policy_keeps_what_the_trainers_rotation_keeps(limit: int, best: int | None, tmp_path: Path) -> None:
    steps = list(range(2, 13, 2))
    for s in steps:
        (tmp_path / f"checkpoint-{s}").mkdir()
    best_folder = None if best is None else str(tmp_path / f"checkpoint-{best}")
    transformers.trainer_utils.rotate_checkpoints(str(tmp_path), save_total_limit=limit, best_model_checkpoint=best_folder)
    theirs = sorted(n for n, _ in markers.scan(str(tmp_path)))

    # the best step has the lowest eval_loss; the others tie (as the Trainer's, our best is the first of equals)
    infos = [StepInfo(s, {"eval_loss": 1.0 if s == best else 2.0}) for s in steps]
    ours = SaveTotalLimit(limit, "eval_loss" if best is not None else None).kept(infos)
    assert sorted(ours) == theirs


def test_save_total_limit_keeps_the_trainers_best_checkpoint_not_the_best_saved_metric() -> None:
    """Evaluated more often than saved: the best metric fell at an unsaved step (6), so the Trainer's
    best_model_checkpoint stays checkpoint-4 although step 8 logged a better metric than step 4."""
    infos = [StepInfo(4, {BEST_STEP: 4.0, "eval_loss": 3.0}), StepInfo(8, {BEST_STEP: 4.0, "eval_loss": 2.0}),
             StepInfo(12, {BEST_STEP: 4.0, "eval_loss": 2.5})]
    assert SaveTotalLimit(2, "eval_loss").kept(infos) == {4, 12}
    none_yet = [StepInfo(s, {BEST_STEP: -1.0, "eval_loss": float(s)}) for s in (4, 8, 12)]
    assert SaveTotalLimit(2, "eval_loss").kept(none_yet) == {8, 12}


_TWO_PROCESSES = r"""
import json, os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, TrainerCallback
from checkpointing.integrations import transformers as ckpt_hf
out, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
data = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))
class DS(torch.utils.data.Dataset):
    def __len__(self): return len(data)
    def __getitem__(self, i): return {"input_ids": data[i], "labels": data[i]}
class Start(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        print(f"START {rank} {state.global_step}", flush=True)
best = sys.argv[3] == "best"  # keep one folder, the best by a metric that is best early: the Trainer removes the last
extra = dict(eval_strategy="steps", eval_steps=5, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True) if best else {}
args = TrainingArguments(output_dir=out, max_steps=steps, save_steps=5, save_total_limit=1 if best else 2, per_device_train_batch_size=4,
                         report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True, logging_steps=100, **extra)
trainer = ckpt_hf.CheckpointingTrainer(model=model, args=args, train_dataset=DS(), eval_dataset=DS() if best else None, callbacks=[Start()],
                                       timeout_s=60)
trainer.train(resume_from_checkpoint=True if resume else None)
print(f"DONE {rank} {trainer.state.global_step} {trainer.state.best_global_step}", flush=True)
"""


def test_two_processes_resume_the_same_folder_after_one_was_lost(tmp_path: Path) -> None:
    """Under torchrun, process 0 alone writes the checkpoint-N folders: after a crash between a commit
    and its folder's rename (the folder missing), every process resumes the folder process 0 wrote back;
    and the folders the Trainer's own cleanup removes take their steps with them on every rank."""
    import socket
    import subprocess
    import sys

    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(_TWO_PROCESSES)

    def torchrun(steps: int, mode: str) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), str(script), str(out), str(steps), mode],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    torchrun(10, "fresh")
    lose_folder_before_publication(out, 10)  # committed, its folder never renamed into place
    log = torchrun(15, "resume")
    assert "START 0 10" in log and "START 1 10" in log and "DONE 0 15" in log and "DONE 1 15" in log, log
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-15"]
    # save_total_limit=1 with a best checkpoint: process 0 alone removes the other folders at the end of train(), and
    # the step goes on every rank (delete() is collective: process 1 used to leave process 0 waiting for it)
    shutil.rmtree(out)
    log = torchrun(10, "best")
    done = [line.split() for line in log.splitlines() if line.startswith("DONE")]
    assert sorted(d[1] for d in done) == ["0", "1"] and {d[3] for d in done} == {"5"}, log
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-5"] and committed(out / "checkpointing") == [5]


class FailLastUpload(TrainerCallback):
    """Before the last save: its upload fails (an outage), held until the end of train() waits for it."""

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref, self.held = trainer_ref, None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == MAX_STEPS - 1 and self.held is None:
            remote = self.trainer_ref[0].checkpoints.manager.remote_storage
            remote.retry = RetryPolicy(attempts=2, base_s=0.001, cap_s=0.002)
            inject(remote, Fault("*", "denied", times=-1, path=f"*{naming.step_dir(MAX_STEPS)}*"))
            self.held = remote.endpoint.fs = HeldUploads(remote.endpoint.fs, naming.step_dir(MAX_STEPS))
            main = threading.current_thread()
            threading.Thread(target=lambda: (_until(lambda: self.held.waiting.is_set() and waiting_for_upload(main, MAX_STEPS),
                                                    "the end of train() waits"), self.held.opened.set()), daemon=True).start()


def test_an_upload_failing_while_train_ends_is_logged_not_raised(tmp_path: Path, s3_bucket: Any, caplog: Any) -> None:
    """The last save's upload in flight at the end of train(), then failing: logged (the step is committed locally and
    its folder published), not raised, as a failure a moment earlier is."""
    url, options = s3_bucket
    ref: list = []
    fail = FailLastUpload(ref)
    trainer = make(tmp_path / "out", callbacks=[fail], trainer_kwargs={"remote": url, "storage_options": options})
    ref.append(trainer)
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        trainer.train()
    assert fail.held is not None and fail.held.opened.is_set()
    assert "upload" in caplog.text and folder_steps(tmp_path / "out") == [4, 8, 12]

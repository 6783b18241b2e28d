"""TieredCheckpointManager (checkpointing/integrations/torchtitan.py) driven as torchtitan's Trainer drives it.

torchtitan 0.3.0's Trainer cannot train here: `torchtitan.trainer` imports triton at module load
(models/common -> token_dispatcher -> minimal_async_ep.kernels), it picks "cuda" as the device when
none is available, and its language models' attention has no CPU training path (FlexAttention has no
CPU backward, varlen needs flash attention, sdpa was removed for them). So these tests build the
checkpointer exactly as the Trainer does (`config.checkpoint.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states={"train_state": ...}, sd_adapter=..., base_folder=...)`)
around torchtitan's own components: ModelWrapper (made by the checkpointer), OptimizersContainer
(fused AdamW, from `default_adamw`), LRSchedulersContainer (warmup + linear decay) and
ParallelAwareDataloader (a torchdata StatefulDataLoader), and run the Trainer's call order: load(step=
load_step) once, then per step zero_grad, forward/backward, maybe_wait_for_staging(), optimizers.step(),
lr_schedulers.step(), save(step, last_step=step == steps).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import IterableDataset

pytest.importorskip("torchtitan")
from _dist import run_ranks  # noqa: E402
from faults import Fault, inject  # noqa: E402
from s3_server import s3_bucket, s3_endpoint  # noqa: E402,F401 - fixtures
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402

import checkpointing  # noqa: E402
from checkpointing.errors import (CheckpointConfigError, CheckpointError, CheckpointNotFoundError,  # noqa: E402
                                  CheckpointUploadError)
from checkpointing.integrations.torchtitan import META, TieredCheckpointManager  # noqa: E402

STEPS = 8
VOCAB = 32


class TokenStream(IterableDataset):
    """Deterministic token sequences (each data-parallel rank its own); its position is its state."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.i = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(self.i * 101 + self.rank)
            self.i += 1
            x = torch.randint(0, VOCAB, (8,), generator=g)
            yield {"input": x}, (x * 7 + 3) % VOCAB

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.i = sd["i"]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(torch.relu(self.norm(self.tok_embeddings(x))))


class TrainState:
    """What torchtitan's Trainer saves as "train_state" (Trainer.state_dict)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


@dataclasses.dataclass
class Run:
    model: TinyLM
    optimizers: Any
    lr_schedulers: Any
    dataloader: ParallelAwareDataloader
    train_state: TrainState
    checkpointer: Any
    saved: list[int] = dataclasses.field(default_factory=list)

    def train(self, steps: int = STEPS, *, load_step: int = -1, stop: int | None = None) -> "Run":
        """torchtitan Trainer.train()'s order of calls; `stop` ends the process early (a crash after that step)."""
        self.checkpointer.load(step=load_step)
        batches = iter(self.dataloader)
        while self.train_state.step < steps:
            self.train_state.step += 1
            self.optimizers.zero_grad()
            inputs, labels = next(batches)
            self.train_state.ntokens_seen += labels.numel()
            loss = nn.functional.cross_entropy(self.model(inputs["input"]).flatten(0, 1), labels.flatten())
            loss.backward()
            if dist.is_initialized() and dist.get_world_size() > 1:  # data parallel: what DDP/FSDP's reduction does
                for p in self.model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            if self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == steps):
                self.saved.append(self.train_state.step)
            if stop is not None and self.train_state.step == stop:
                break
        return self

    def close(self) -> None:
        self.checkpointer.close()


def make_run(root: Path, *, seed: int = 0, rank: int = 0, world: int = 1, **checkpoint: Any) -> Run:
    torch.manual_seed(seed)
    model = TinyLM()
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    dataloader = ParallelAwareDataloader(TokenStream(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    train_state = TrainState()
    config = TieredCheckpointManager.Config(**{"enable": True, **checkpoint})
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                                states={"train_state": train_state}, sd_adapter=None, base_folder=str(root))
    return Run(model, optimizers, lr_schedulers, dataloader, train_state, checkpointer)


def assert_same_training_state(a: Run, b: Run) -> None:
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    oa, ob = a.optimizers.state_dict(), b.optimizers.state_dict()
    assert oa.keys() == ob.keys()
    for k in oa:
        assert torch.equal(oa[k], ob[k]) if isinstance(oa[k], torch.Tensor) else oa[k] == ob[k], k
    assert a.lr_schedulers.state_dict() == b.lr_schedulers.state_dict()
    assert a.train_state.state_dict() == b.train_state.state_dict()
    assert a.dataloader.dataset.i == b.dataloader.dataset.i  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """STEPS steps without a crash, with checkpointing disabled (torchtitan's default)."""
    run = make_run(tmp_path_factory.mktemp("reference"), enable=False)
    run.train()
    assert run.saved == [] and not run.checkpointer.load()
    return run


def test_resume_after_a_crash_is_bit_exact_and_the_last_save_is_model_only(tmp_path: Path, reference: Run) -> None:
    opts = dict(interval=2, keep_latest_k=2, export_dtype="bfloat16")  # last_save_model_only=True: torchtitan's default
    crashed = make_run(tmp_path, **opts).train(stop=5)
    crashed.close()
    assert crashed.saved == [2, 4]
    folder = tmp_path / "checkpoint"
    step4 = checkpointing.load(folder, 4)
    assert step4[META] == {"model_only": False, "export_dtype": None}
    assert set(step4) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", META}
    assert step4["train_state"] == {"step": 4, "ntokens_seen": 64}

    resumed = make_run(tmp_path, seed=1, **opts)  # other initial weights: the load must replace them all
    resumed.train()
    assert resumed.saved == [6, 8]
    assert_same_training_state(reference, resumed)
    assert resumed.checkpointer.manager.steps() == [6, 8]  # keep_latest_k=2
    resumed.close()

    last = checkpointing.load(folder, 8)
    assert set(last) == {"model", META} and last[META] == {"model_only": True, "export_dtype": "bfloat16"}
    for name, param in reference.model.state_dict().items():
        assert last["model"][name].dtype == torch.bfloat16
        assert torch.equal(last["model"][name], param.to(torch.bfloat16)), name

    again = make_run(tmp_path, seed=2, **opts)
    with pytest.raises(CheckpointError, match=r"step 8 .* holds only the model.*checkpoint.load_step=6"):
        again.checkpointer.load()
    assert again.checkpointer.load(step=6)
    assert again.train_state.step == 6
    again.close()

    # a new run from the exported weights: initial_load_path reads them back into the float32 model
    successor = make_run(tmp_path / "successor", seed=3, initial_load_path=str(folder))
    assert successor.checkpointer.load() and successor.train_state.step == 0
    for name, param in successor.model.state_dict().items():
        assert param.dtype == torch.float32
        assert torch.equal(param, reference.model.state_dict()[name].to(torch.bfloat16).float()), name
    successor.close()


def test_load_step_resumes_an_older_step_and_replaces_the_newer_ones(tmp_path: Path) -> None:
    first = make_run(tmp_path, interval=1, keep_latest_k=3, last_save_model_only=False).train(6)
    first.close()
    assert first.checkpointer.manager.steps() == [4, 5, 6]
    old5 = checkpointing.load(tmp_path / "checkpoint", 5)

    with pytest.raises(CheckpointNotFoundError, match=r"load_step=2: step 2 .*not committed.*\[4, 5, 6\]"):
        make_run(tmp_path, interval=1, keep_latest_k=3).checkpointer.load(step=2)

    again = make_run(tmp_path, seed=3, interval=1, keep_latest_k=3, last_save_model_only=False)
    again.train(6, load_step=4)  # the first save (step 5) deletes 5 and 6 of the abandoned run, then saves anew
    assert again.saved == [5, 6] and again.checkpointer.manager.steps() == [4, 5, 6]
    again.close()
    new5 = checkpointing.load(tmp_path / "checkpoint", 5)
    for name in old5["model"]:  # the same training from step 4 again: the same values
        assert torch.equal(old5["model"][name], new5["model"][name]), name
    assert old5["optimizer"].keys() == new5["optimizer"].keys()


def test_a_damaged_newest_step_is_passed_over_and_training_resumes_from_the_one_before(tmp_path: Path, reference: Run) -> None:
    from hostile import flip_bits

    first = make_run(tmp_path, interval=2, keep_latest_k=0, last_save_model_only=False).train(stop=6)
    first.close()
    pack = next((tmp_path / "checkpoint" / "step-0000000006").glob("*.pack"))
    flip_bits(pack, pack.stat().st_size // 2)  # bit rot in the newest step: every restart would stop on it
    resumed = make_run(tmp_path, seed=1, interval=2, keep_latest_k=0, last_save_model_only=False)
    resumed.train()  # load(-1): step 6 is passed over (and deleted), step 4 restored; 6 and 8 saved anew
    assert resumed.saved == [6, 8] and resumed.checkpointer.manager.steps() == [2, 4, 6, 8]
    assert_same_training_state(reference, resumed)
    resumed.close()


def test_a_run_that_restarts_its_step_count_replaces_the_steps_it_saves_again(tmp_path: Path) -> None:
    first = make_run(tmp_path, interval=3, keep_latest_k=0, last_save_model_only=False).train(6)
    first.close()
    again = make_run(tmp_path, seed=1, interval=3, keep_latest_k=0, last_save_model_only=False, exclude_from_loading=["train_state"])
    again.train(6)  # loads step 6's weights, counts from 0: saves 3 and 6 again, as torchtitan's checkpointer overwrites them
    assert again.saved == [3, 6] and again.checkpointer.manager.steps() == [3, 6]
    again.close()
    saved = checkpointing.load(tmp_path / "checkpoint", 6)
    assert saved["train_state"]["step"] == 6
    for name, param in again.model.state_dict().items():
        assert torch.equal(saved["model"][name], param), name


def test_sync_mode_exclude_from_loading_and_stall_records(tmp_path: Path) -> None:
    run = make_run(tmp_path, interval=3, async_mode="disabled", last_save_model_only=False)
    run.checkpointer.load()
    batches = iter(run.dataloader)
    for _ in range(3):
        run.train_state.step += 1
        run.optimizers.zero_grad()
        inputs, labels = next(batches)
        nn.functional.cross_entropy(run.model(inputs["input"]).flatten(0, 1), labels.flatten()).backward()
        run.checkpointer.maybe_wait_for_staging()
        run.optimizers.step()
        run.lr_schedulers.step()
        run.checkpointer.save(run.train_state.step)
    assert run.checkpointer.manager.latest_step() == 3  # async_mode="disabled": durable when save() returns
    assert [s.step for s in run.checkpointer.manager.stats()] == [3]
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.close()

    fresh = make_run(tmp_path, seed=4, exclude_from_loading=["dataloader", "lr_scheduler"])
    assert fresh.checkpointer.load()
    assert fresh.train_state.step == 3
    assert fresh.dataloader.dataset.i == 0  # type: ignore[attr-defined]  # excluded: its own (fresh) position
    assert fresh.lr_schedulers.state_dict() == {"last_epoch": 0}
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    fresh.close()

    bad = make_run(tmp_path, exclude_from_loading=["data"])
    with pytest.raises(CheckpointConfigError, match="exclude_from_loading names 'data'"):
        bad.checkpointer.load()
    bad.close()


def test_seed_checkpoint_initial_load_path_and_load_only(tmp_path: Path, reference: Run) -> None:
    seed = make_run(tmp_path / "seed")
    seed.checkpointer.save(curr_step=0, last_step=True)  # torchtitan.train with checkpoint.create_seed_checkpoint
    seed_weights = {k: v.clone() for k, v in seed.model.state_dict().items()}
    seed.close()
    assert set(checkpointing.load(tmp_path / "seed" / "checkpoint", 0)) == {"model", META}

    from_seed = make_run(tmp_path / "seed", seed=5)
    assert from_seed.checkpointer.load()  # step 0 loads the model only, as torchtitan does
    assert from_seed.train_state.step == 0
    for k, v in from_seed.model.state_dict().items():
        assert torch.equal(v, seed_weights[k]), k
    from_seed.close()

    full = make_run(tmp_path / "full", interval=4, last_save_model_only=False).train(4)
    full.close()
    initial = make_run(tmp_path / "new", seed=6, initial_load_path=str(tmp_path / "full" / "checkpoint"))
    assert initial.checkpointer.load()  # its own folder is empty: the initial load, model only by default
    assert initial.train_state.step == 0
    for k, v in initial.model.state_dict().items():
        assert torch.equal(v, full.model.state_dict()[k]), k
    initial.close()

    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"")
    foreign = make_run(tmp_path / "other", initial_load_path=str(dcp_dir))
    with pytest.raises(CheckpointConfigError, match="checkpointing import"):
        foreign.checkpointer.load()
    foreign.close()

    reader = make_run(tmp_path / "full", seed=7, load_only=True, interval=1)
    assert reader.checkpointer.load() and reader.train_state.step == 4
    assert reader.checkpointer.save(5) is False
    reader.close()
    assert checkpointing.CheckpointManager(tmp_path / "full" / "checkpoint", read_only=True).steps() == [4]

    # an evaluation: load_only in a folder that does not exist, from initial_load_path (as torchtitan's checkpointer does)
    evaluation = make_run(tmp_path / "eval", seed=8, load_only=True, initial_load_path=str(tmp_path / "full" / "checkpoint"),
                          initial_load_model_only=False)
    assert evaluation.checkpointer.load() and evaluation.train_state.step == 4
    assert evaluation.checkpointer.save(5) is False
    evaluation.close()
    assert not (tmp_path / "eval").exists()


def test_initial_load_path_on_s3_with_storage_options_and_no_remote_tier(tmp_path: Path, s3_bucket: tuple[str, dict]) -> None:
    url, options = s3_bucket
    source = make_run(tmp_path / "source", interval=2, last_save_model_only=False, remote=url, storage_options=options).train(2)
    source.close()
    successor = make_run(tmp_path / "successor", seed=4, initial_load_path=url, storage_options=options)
    assert successor.checkpointer.load() and successor.train_state.step == 0
    for name, param in successor.model.state_dict().items():
        assert torch.equal(param, source.model.state_dict()[name]), name
    successor.close()


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_upload_is_logged_and_training_goes_on_unless_strict(tmp_path: Path, strict: bool, caplog: pytest.LogCaptureFixture) -> None:
    run = make_run(tmp_path, interval=2, last_save_model_only=False, strict=strict, remote=f"memory://titan-{uuid.uuid4().hex}")
    inject(run.checkpointer.manager.remote_storage, Fault("*", "denied", times=-1))  # every request to the remote tier: 403
    with pytest.raises(CheckpointUploadError) as info:
        run.train(6)  # save(6) raises step 2's failed upload (save() waits for every upload but the newest)
    if strict:
        assert run.saved == [2, 4] and run.train_state.step == 6 and "step 2" in str(info.value)
    else:  # logged at save(6), which then saves; the last step's save raises its own failed upload
        assert run.saved == [2, 4] and "step 6" in str(info.value)
        assert any("upload of step 2" in r.getMessage() and "training goes on" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointUploadError, match="upload of step 4"):  # save_future: the newest async save's
        run.checkpointer.save_future.result(timeout=10)
    with contextlib.suppress(CheckpointUploadError):
        run.close()  # the rest of the failed uploads
    assert checkpointing.CheckpointManager(tmp_path / "checkpoint", read_only=True).steps() == ([2, 4] if strict else [2, 4, 6])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"last_save_in_hf": True}, "checkpointing export"),
        ({"initial_load_in_hf": True}, "checkpointing import"),
        ({"folder": "s3://bucket/run"}, "checkpoint.remote='s3://bucket/run'"),
        ({"async_mode": "threads"}, "async_mode"),
        ({"keep_remote": -1}, "keep_remote"),
    ],
)
def test_unsupported_options_are_refused_when_the_config_is_built(options: dict[str, Any], match: str) -> None:
    with pytest.raises(CheckpointConfigError, match=match) as info:
        TieredCheckpointManager.Config(enable=True, **options)
    assert isinstance(info.value, ValueError)  # what torchtitan's own config checks raise


def test_torchtitans_own_config_checks_still_apply() -> None:
    with pytest.raises(ValueError, match="at least 2 checkpoint"):
        TieredCheckpointManager.Config(enable=True, keep_latest_k=1)


def _two_ranks_crash_and_resume(rank: int, world: int, root: str) -> tuple[list[int], list[str]]:
    """On each of 2 gloo ranks (one process each, sharing the local tier as ranks of one host do)."""
    torch.set_num_threads(1)
    reference = make_run(Path(root) / "reference", rank=rank, world=world, enable=False).train(4)
    opts: dict[str, Any] = dict(interval=2, last_save_model_only=False, rank=rank, world=world)
    make_run(Path(root), **opts).train(4, stop=3).close()
    resumed = make_run(Path(root), seed=10 + rank, **opts).train(4)
    assert_same_training_state(reference, resumed)
    steps = resumed.checkpointer.manager.steps()
    resumed.close()
    return steps, sorted(resumed.dataloader.state_dict())


def test_two_data_parallel_ranks_resume_bit_exact(tmp_path: Path) -> None:
    """Each rank saves its own dataloader state (torchtitan keys it "dp_rank_<r>"); the model and
    optimizer state are the same on both ranks (gradients averaged, as with DDP)."""
    results = run_ranks(_two_ranks_crash_and_resume, 2, str(tmp_path), tmp=tmp_path, timeout=180)
    assert results == [([2, 4], ["dp_rank_0", "world_size"]), ([2, 4], ["dp_rank_1", "world_size"])]


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchtitan" / "config_registry.py"


def test_example_config_registry_defines_the_documented_configs() -> None:
    tree = ast.parse(EXAMPLE.read_text(), str(EXAMPLE))
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"llama3_debugmodel_tiered", "llama3_8b_tiered_s3"} <= functions
    assert "TieredCheckpointManager.Config(" in EXAMPLE.read_text()


def test_example_config_builds_where_torchtitans_models_import() -> None:
    """torchtitan's model registry imports triton (absent from a CPU-only install): runs where it is installed."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("titan_example_configs", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.llama3_debugmodel_tiered()
    assert isinstance(config.checkpoint, TieredCheckpointManager.Config)
    assert (config.checkpoint.enable, config.checkpoint.interval, config.checkpoint.keep_latest_k) == (True, 5, 3)

"""What save() accepts and what loading runs: lazy views, unsupported layouts, PickleCodec's allowlist."""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle

import pytest
import torch

import checkpointing
from checkpointing import CheckpointError, CheckpointManager, PickleCodec, StateError
from checkpointing.state.tree import flatten_state


@dataclasses.dataclass
class Config:
    name: str
    extra: object = None


@dataclasses.dataclass
class Other:
    value: int


class Exploit:
    """Unpickling this runs a shell command (what a tampered checkpoint would hold)."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/checkpointing-pickle-exploit-ran",))


def test_conj_and_neg_views_round_trip_as_their_values(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 4j, -5j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0, 3.0])
    state = {"conj": z.conj(), "neg": torch._neg_view(x), "both": torch._neg_view(z).conj()}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
        plain = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
        assert mgr.restore(plain) == 1
        for k in state:
            assert torch.equal(plain[k], expected[k]), k
        # into lazy views as targets: they read back as the saved values too
        views = {"conj": torch.zeros(3, dtype=torch.complex64).conj(), "neg": torch._neg_view(torch.zeros(3)),
                 "both": torch._neg_view(torch.zeros(3, dtype=torch.complex64)).conj()}
        assert mgr.restore(views) == 1
        for k in state:
            assert torch.equal(views[k].resolve_conj().resolve_neg(), expected[k]), k


def test_a_conj_view_is_copied_at_save_time(tmp_path):
    z = torch.tensor([1 + 1j, 2 + 2j])
    with CheckpointManager(tmp_path) as mgr:
        h = mgr.save(1, {"c": z.conj()})
        z.mul_(10)  # changed right after save() returned, outside any optimizer step
        h.wait()
        out = {"c": torch.zeros(2, dtype=z.dtype)}
        mgr.restore(out)
    assert torch.equal(out["c"], torch.tensor([1 - 1j, 2 - 2j]))


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), ["nested", "unbind"]),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), ["nested", "unbind"]),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), ["quantized", "dequantize"]),
        (lambda: torch.eye(3).to_sparse(), ["sparse", "to_dense"]),
        (lambda: torch.empty(2, device="meta"), ["meta", "materialize"]),
    ],
    ids=["nested", "jagged", "quantized", "sparse", "meta"],
)
def test_unsupported_layouts_are_refused_at_save_naming_key_and_remedy(tmp_path, make, words):
    value = make()
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateError) as info:
            mgr.save(1, {"outer": {"t": value}})
        assert mgr.steps() == []
    message = str(info.value)
    assert "outer/t" in message
    for word in words:
        assert word in message, message
    assert "Internal error" not in message


def test_pickle_codec_round_trips_allowed_types(tmp_path):
    codec = PickleCodec(Config, Other)
    value = Config("gpt", extra=[Other(3), {1, 2}])
    with CheckpointManager(tmp_path, codecs=[codec]) as mgr:
        mgr.save(1, {"cfg": value}).wait()
        out = {"cfg": None}
        mgr.restore(out)
    assert out["cfg"] == value


def test_pickle_codec_refuses_at_save_a_value_holding_another_type():
    with pytest.raises(StateError, match="Other"):
        flatten_state({"cfg": Config("gpt", extra=Other(1))}, codecs=(PickleCodec(Config),))


def test_pickle_codec_never_runs_a_tampered_pickle():
    marker = "/tmp/checkpointing-pickle-exploit-ran"
    if os.path.exists(marker):
        os.remove(marker)
    codec = PickleCodec(Config)
    tampered = base64.b64encode(pickle.dumps(Exploit())).decode("ascii")
    with pytest.raises(CheckpointError, match="system") as info:
        codec.decode(tampered)
    assert "would run code" in str(info.value) and "do not add that name" in str(info.value)  # no advice to allow-list it
    assert "PickleCodec(..., system)" not in str(info.value)
    assert not os.path.exists(marker)
    with pytest.raises(CheckpointError, match="base64"):
        codec.decode("not base64 !")
    with pytest.raises(CheckpointError, match="damaged"):
        codec.decode(base64.b64encode(b"\x80\x05garbage").decode("ascii"))


def test_a_tampered_checkpoint_does_not_run_code_on_restore(tmp_path):
    """The manifest's codec data replaced by a pickle that runs a command: restore refuses it."""
    marker = "/tmp/checkpointing-pickle-exploit-ran"
    if os.path.exists(marker):
        os.remove(marker)
    codec = PickleCodec(Config)
    with CheckpointManager(tmp_path, codecs=[codec]) as mgr:
        mgr.save(1, {"cfg": Config("a")}).wait()
    good = codec.encode(Config("a"))
    evil = base64.b64encode(pickle.dumps(Exploit())).decode("ascii")
    _rewrite_manifest(tmp_path, 1, good, evil)
    with CheckpointManager(tmp_path, codecs=[codec]) as mgr:
        with pytest.raises(CheckpointError):
            mgr.restore({"cfg": None})
    assert not os.path.exists(marker)


def _rewrite_manifest(root, step, old: str, new: str) -> None:
    """Replace a string in a committed step's manifest and re-seal its COMMIT (a tamperer can do the same)."""
    import hashlib
    import json

    from checkpointing.format.manifest import canonical_json

    step_dir = root / f"step-{step:010d}"
    manifest = next(step_dir.glob("manifest.*.json"))
    data = manifest.read_bytes().replace(old.encode(), new.encode())
    assert data != manifest.read_bytes()
    manifest.chmod(0o644)
    manifest.write_bytes(data)
    commit = step_dir / "COMMIT"
    marker = json.loads(commit.read_bytes())
    marker["manifest_digest"] = "sha256:" + hashlib.sha256(data).hexdigest()
    commit.chmod(0o644)
    commit.write_bytes(canonical_json(marker))


_FREED_AFTER_SAVE = r"""
import sys, torch
from checkpointing import CheckpointManager, CheckpointSaveError
torch.manual_seed(0)
# 64 MiB of weights copied first, then the layer freed: the free lands before the copy reaches it (one that
# unmaps pages while a memmove reads them is not caught: staging.py)
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 1024))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
with CheckpointManager(sys.argv[1], keep_local=None) as mgr:
    for step in (1, 2):
        model(torch.randn(2, 4096)).sum().backward()
        opt.step()  # the manager defers the copy of what the optimizer steps, to its next step()
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        handle = mgr.save(step, {"model": model})
    for p in reversed(list(model[1].parameters())):
        storage = p.data.untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)  # freed after save() returned, as FSDP frees unsharded parameters
        if sys.argv[3] == "again":
            storage.resize_(size)  # and allocated again (as FSDP does before the next forward): other memory
    torch.save(reference, sys.argv[2])
    try:
        handle.wait()
        print("saved")
    except CheckpointSaveError as exc:
        print("refused:", exc)
"""


@pytest.mark.parametrize("then", ["freed", "again"])
def test_memory_freed_after_save_returns_fails_that_save_not_the_process(tmp_path, then):
    """A storage resized to 0 before the background copy reached it is refused, never read after it was freed;
    resized back to its size (new memory, its address changed), it is refused too, never saved with what it holds."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FREED_AFTER_SAVE, str(tmp_path / "ck"), str(tmp_path / "ref.pt"), then],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]  # not a segmentation fault
    assert out.stdout.startswith(("saved", "refused:")), out.stdout + out.stderr[-2000:]
    if out.stdout.startswith("refused:"):
        assert "freed, shrunk or moved" in out.stdout and "wait_staged" in out.stdout
    with CheckpointManager(tmp_path / "ck", read_only=True) as mgr:
        assert mgr.steps() == ([1, 2] if out.stdout.startswith("saved") else [1])
        if out.stdout.startswith("saved"):
            loaded = checkpointing.load(tmp_path / "ck", 2)["model"]
            reference = torch.load(tmp_path / "ref.pt")
            assert all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_a_parameter_written_in_place_after_save_returns_fails_that_save_or_is_saved_as_it_was(tmp_path):
    """An in-place write that is not the optimizer's step (which waits for the copy), made before the deferred copy
    reached the tensor: the save fails naming it; never does the step hold the new values as the old ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcomes = []
    with CheckpointManager(tmp_path / "ck", keep_local=None) as mgr:
        for step in range(1, 4):
            model(torch.randn(2, 1024)).sum().backward()
            opt.step()  # the copy of what the optimizer steps is deferred to its next step()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            handle = mgr.save(step, {"model": model})
            with torch.no_grad():
                for p in reversed(list(model.parameters())):
                    p.mul_(0.5)  # as a callback that edits the weights right after a checkpoint
            try:
                handle.wait()
            except checkpointing.CheckpointSaveError as exc:
                assert "written in place after save() returned" in str(exc) and "wait_staged" in str(exc)
                outcomes.append("refused")
                continue
            outcomes.append("saved")
            loaded = checkpointing.load(tmp_path / "ck", step)["model"]
            assert all(torch.equal(loaded[k], before[k]) for k in before), "the step holds values written after save()"
    assert "refused" in outcomes or outcomes == ["saved"] * 3


def _fsdp2_written_in_place_after_save(rank, world, root, how):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with CheckpointManager(root) as mgr:
        as_dicts = how == "state_dict"  # the optimizer seen stepping: its tensors defer as the objects' do
        handle = mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()} if as_dicts else {"model": model, "optim": opt})
        with torch.no_grad():
            for p in model.parameters():
                if how == "dtensor":
                    p.mul_(0.5)  # a DTensor written in place: its own version counter moves, not its local shard's
                else:
                    p.to_local().mul_(0.5)  # through its local shard: the shard's counter moves, not the DTensor's
        try:
            handle.wait()
        except checkpointing.CheckpointSaveError as exc:
            return "refused" if "written in place after save() returned" in str(exc) else str(exc)
    loaded = checkpointing.load(root, 1)["model"]
    return "saved as it was" if all(torch.equal(loaded[k], before[k]) for k in before) else "saved with the new values"


@pytest.mark.parametrize("how", ["dtensor", "to_local", "state_dict"])
def test_a_sharded_parameter_written_in_place_after_save_returns_fails_that_save(tmp_path, how):
    """FSDP2: an in-place write to a DTensor parameter before the deferred copy reached it is caught as with a plain
    tensor, made through the DTensor (it used to go unseen, and the step held the values written after save()) or
    through its local shard, with the module and optimizer in the state or their state_dict()s (detached copies,
    whose counters no write to the parameters moves)."""
    from _dist import run_ranks

    results = run_ranks(_fsdp2_written_in_place_after_save, 2, str(tmp_path / "ck"), how, tmp=tmp_path)
    assert all(r in ("refused", "saved as it was") for r in results), results

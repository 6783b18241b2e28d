"""`checkpointing export` to Hugging Face safetensors and to torch.save (issue 19, items 1 and 4).

Real checkpoints written by CheckpointManager (one process, a 2-rank FSDP2 run on gloo, an S3 tier
on a local moto server), read back with the safetensors library and with transformers'
from_pretrained on a tiny GPT-2 built from a config (offline). Nothing mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import _dist
from _dist import run_ranks
from _models import child_env
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

import checkpointing
from checkpointing import CheckpointConfigError, CheckpointManager
from checkpointing.interop import export_safetensors, export_torch


def _state() -> dict[str, torch.Tensor]:
    """Tensors of every dtype a model holds (and a scalar, and an empty one)."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 24, generator=g),
        "block.0.weight": torch.randn(24, 24, generator=g).to(torch.bfloat16),
        "block.0.bias": torch.randn(24, generator=g).to(torch.float16),
        "block.0.scale": torch.randn((), generator=g, dtype=torch.float64),
        "positions": torch.arange(17, dtype=torch.int64),
        "mask": torch.rand(5, 7, generator=g) > 0.5,
        "codes": torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, 3),
    }


def _save(directory: Path, state: dict, step: int = 3, **extra) -> None:
    with CheckpointManager(directory) as mgr:
        mgr.save(step, {"model": state, "optim": {"lr": 0.1, "momentum": torch.ones(4)}, "epoch": 2, **extra}).wait()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_single_file_is_bit_exact_and_names_are_the_state_dict_keys(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    result = export_safetensors(tmp_path / "ck", tmp_path / "out", only="model")
    assert [Path(f).name for f in result.files] == ["model.safetensors"] and sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(state)
    assert all(_same(got[k], v) for k, v in state.items()), [k for k, v in state.items() if not _same(got[k], v)]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["checkpointing.step"] == "3"
    assert result.tensors == len(state) and result.nbytes == sum(t.numel() * t.element_size() for t in state.values())


def test_without_only_names_are_dotted_paths_and_strip_prefix_removes_one(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    export_safetensors(tmp_path / "ck", tmp_path / "all")
    names = set(load_file(tmp_path / "all" / "model.safetensors"))
    assert names == {f"model.{k}" for k in state} | {"optim.momentum"}  # tensors only: epoch and lr are not
    export_safetensors(tmp_path / "ck", tmp_path / "stripped", exclude="optim", strip_prefix="model.")
    assert set(load_file(tmp_path / "stripped" / "model.safetensors")) == set(state)
    with pytest.raises(CheckpointConfigError, match="matches no key"):
        export_safetensors(tmp_path / "ck", tmp_path / "typo", only="modle")
    with pytest.raises(CheckpointConfigError, match="starts no exported name"):
        export_safetensors(tmp_path / "ck", tmp_path / "typo", only="model", strip_prefix="model.")
    assert not (tmp_path / "typo").exists()


def test_sharded_export_has_a_complete_index_and_bounded_files(tmp_path):
    state = {f"layers.{i}.weight": torch.randn(64, 64) for i in range(10)} | {"big": torch.randn(128, 128), "tiny": torch.ones(3)}
    _save(tmp_path / "ck", state)
    limit = 40_000  # two 16 KiB tensors per file; "big" (64 KiB) alone in its own
    result = export_safetensors(tmp_path / "ck", tmp_path / "out", only="model", max_shard_size=limit)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n == 7 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(state) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values()) == result.nbytes
    merged = {}
    for name in shards:
        part = load_file(out / name)
        assert sum(t.numel() * 4 for t in part.values()) <= limit or list(part) == ["big"], (name, list(part))
        assert all(index["weight_map"][k] == name for k in part)
        merged.update(part)
    assert all(_same(merged[k], v) for k, v in state.items())
    for name in [*shards, "model.safetensors.index.json"]:  # as the umask says, as the torch export and the checkpoint itself
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~_umask(), name


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_dtype_casts_only_floating_tensors_in_both_formats(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    export_safetensors(tmp_path / "ck", tmp_path / "bf16", only="model", dtype="bf16")
    export_torch(tmp_path / "ck", tmp_path / "bf16.pt", only="model", dtype="bf16", strip_prefix="block.0.")
    st = load_file(tmp_path / "bf16" / "model.safetensors")
    pt = torch.load(tmp_path / "bf16.pt", weights_only=True)["tensors"]
    assert sorted(pt) == sorted(k.removeprefix("block.0.") for k in state)
    for k, v in state.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert _same(st[k], want), k
        assert _same(pt[k.removeprefix("block.0.")], want), k


def test_torch_format_keeps_manifest_keys_and_takes_the_same_selection(tmp_path, run_cli):
    state = _state()
    _save(tmp_path / "ck", state)
    code, text = run_cli("export", str(tmp_path / "ck"), "--out", str(tmp_path / "all.pt"))
    assert code == 0, text
    data = torch.load(tmp_path / "all.pt", weights_only=True)
    assert data["step"] == 3 and set(data["tensors"]) == {f"model/{k}" for k in state} | {"optim/momentum"}
    code, text = run_cli("export", str(tmp_path / "ck"), "--only", "model", "--out", str(tmp_path / "model.pt"))
    assert code == 0, text
    model = torch.load(tmp_path / "model.pt", weights_only=True)["tensors"]
    assert all(_same(model[k], v) for k, v in state.items()) and set(model) == set(state)


def test_export_refuses_to_overwrite_without_force(tmp_path, run_cli):
    _save(tmp_path / "ck", {f"w{i}": torch.randn(32, 32) for i in range(4)})
    out = tmp_path / "out"
    args = ("export", str(tmp_path / "ck"), "--format", "safetensors", "--only", "model", "--out", str(out))
    assert run_cli(*args, "--max-shard-size", "5KB")[0] == 0
    assert len(list(out.glob("model-*-of-00004.safetensors"))) == 4
    (out / "config.json").write_text("{}")
    code, text = run_cli(*args)
    assert code == 2 and "already holds an export" in text and "--force" in text
    assert len(list(out.glob("model-*.safetensors"))) == 4  # untouched
    code, text = run_cli(*args, "--force")
    assert code == 0, text
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # the earlier shards and index are gone
    pt = tmp_path / "full.pt"
    assert run_cli("export", str(tmp_path / "ck"), "--out", str(pt))[0] == 0
    before = pt.read_bytes()
    code, text = run_cli("export", str(tmp_path / "ck"), "--out", str(pt), "--dtype", "fp16")
    assert code == 2 and "exists" in text and pt.read_bytes() == before
    assert run_cli("export", str(tmp_path / "ck"), "--out", str(pt), "--dtype", "fp16", "--force")[0] == 0
    assert torch.load(pt, weights_only=True)["tensors"]["model/w0"].dtype == torch.float16


def test_export_to_a_place_nothing_can_be_written_is_a_usage_error(tmp_path, run_cli):
    _save(tmp_path / "ck", {"w": torch.randn(8)})
    for fmt_args, out in ((), "/proc/nowhere.pt"), (("--format", "safetensors"), "/proc/nowhere"):
        code, text = run_cli("export", str(tmp_path / "ck"), *fmt_args, "--out", out)
        assert code == 2 and f"cannot write {out}" in text and "internal error" not in text, text


def test_export_never_writes_into_the_checkpoint_it_reads_nor_to_a_url(tmp_path, run_cli):
    ck = tmp_path / "ck"
    _save(ck, {"w": torch.randn(8, 8)}, step=5)
    (tmp_path / "link").symlink_to(ck)
    manifest = next((ck / "step-0000000005").glob("manifest.*.json"))
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file() and p.name != "WRITER"}
    for out, extra in ((ck, ("--format", "safetensors")), (ck / "step-0000000005" / "full.pt", ()), (manifest, ("--force",)),
                       (tmp_path / "link" / "step-0000000005", ("--format", "safetensors", "--force"))):
        code, text = run_cli("export", str(ck), "--out", str(out), *extra)
        assert code == 2 and "inside the checkpoint directory" in text and "Traceback" not in text, text
    after = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file() and p.name != "WRITER"}
    assert after == before  # the committed step is as it was
    code, text = run_cli("export", str(ck), "--out", "s3://bucket/hf", "--format", "safetensors")
    assert code == 2 and "local path" in text and not (Path.cwd() / "s3:").exists()
    with pytest.raises(CheckpointConfigError, match="inside the checkpoint directory"):
        export_torch(ck, ck / "x.pt")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing-dir")
    with pytest.raises(CheckpointConfigError, match="is a link to .*missing-dir, which does not exist"):
        export_safetensors(ck, tmp_path / "dangling")


def test_tiny_gpt2_exported_loads_with_from_pretrained_and_gives_identical_logits(tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    with CheckpointManager(tmp_path / "ck") as mgr:  # as a training run saves it: compiled (names gain _orig_mod.)
        mgr.save(7, {"model": torch.compile(model), "step": 7}).wait()
    out = tmp_path / "hf"
    code, text = run_cli("export", str(tmp_path / "ck"), "--format", "safetensors", "--only", "model", "--out", str(out))
    assert code == 0 and "lm_head.weight -> transformer.wte.weight" in text, text
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert json.loads(f.metadata()["checkpointing.tied"]) == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # as save_pretrained writes it
    assert not any("_orig_mod" in n for n in names)
    model.config.save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_two_rank_fsdp2_checkpoint_exports_merged_full_tensors(tmp_path):
    directory, ref_path = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    run_ranks(_dist.save_and_reference, 2, directory, ref_path, tmp=tmp_path)
    ref = torch.load(ref_path)
    model_ref = {k.removeprefix("model/"): v for k, v in ref.items() if k.startswith("model/")}
    export_safetensors(directory, tmp_path / "out", only="model", max_shard_size="4KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    got = {}
    for name in set(index["weight_map"].values()):
        got.update(load_file(tmp_path / "out" / name))
    assert set(got) == set(model_ref)  # parameters and the buffer, named as the module names them
    assert all(_same(got[k], v) for k, v in model_ref.items()), [k for k, v in model_ref.items() if not _same(got[k], v)]
    loaded = checkpointing.load(directory, keys="model")  # what load() merges, the export merges alike
    assert all(_same(got[k], v) for k, v in loaded["model"].items())


_PROBE = r"""
import sys, json, torch
torch.set_num_threads(1)
from checkpointing.interop import export_safetensors
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
export_safetensors(sys.argv[1], sys.argv[2], only="model", max_shard_size=sys.argv[3])
print(json.dumps({"before": before, "after": hwm()}))
"""


def test_export_memory_is_bounded_by_the_largest_file_not_the_step(tmp_path):
    state = {f"layers.{i}.weight": torch.randn(1024, 1024) for i in range(48)}  # 48 x 4 MiB = 192 MiB
    total = sum(t.numel() * 4 for t in state.values())
    _save(tmp_path / "ck", state)
    del state
    shard = 16 << 20
    done = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "ck"), str(tmp_path / "out"), str(shard)],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    growth = probe["after"] - probe["before"]
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) == total // shard
    assert growth < 4 * shard < total / 2, f"peak RSS grew by {growth / 2**20:.0f} MiB exporting {total / 2**20:.0f} MiB"


def test_export_from_s3(tmp_path, s3_bucket):
    url, options = s3_bucket
    state = _state()
    with CheckpointManager(tmp_path / "local", remote=url, storage_options=options) as mgr:
        mgr.save(1, {"model": state}).wait()
        mgr.wait()
    result = export_safetensors(url, tmp_path / "out", only="model", storage_options=options, dtype="fp32")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert result.step == 1
    assert all(_same(got[k], v.float() if v.is_floating_point() else v) for k, v in state.items())


def test_a_truncated_data_file_is_refused_before_anything_is_allocated(tmp_path):
    """Export checks every data file's size against the manifest first (one listing per directory on
    an object store): a truncated pack is named, with what to do, and nothing is written."""
    from checkpointing import CheckpointCorruptError

    _save(tmp_path / "ck", _state())
    [pack] = (tmp_path / "ck" / "step-0000000003").glob("*.pack")
    with open(pack, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointCorruptError, match=r"lie past its end \(100 bytes\)") as info:
        export_safetensors(tmp_path / "ck", tmp_path / "out", only="model")
    assert pack.name in str(info.value) and "export another step" in str(info.value)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_a_missing_data_file_is_named(tmp_path):
    from checkpointing import CheckpointCorruptError

    _save(tmp_path / "ck", _state())
    [pack] = (tmp_path / "ck" / "step-0000000003").glob("*.pack")
    pack.unlink()
    with pytest.raises(CheckpointCorruptError, match="missing or not a regular file") as info:
        export_safetensors(tmp_path / "ck", tmp_path / "out", only="model")
    assert pack.name in str(info.value) and "export another step" in str(info.value) and "other tiers" not in str(info.value)

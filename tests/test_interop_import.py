"""`checkpointing import`: DCP, torch.save, safetensors and Hugging Face checkpoints as one committed step (issue 19, item 2).

Sources are written by the real libraries (torch.distributed.checkpoint.save, torch.save,
safetensors, transformers' save_pretrained on a tiny GPT-2 built from a config, offline); the
imported step is read back with restore() and load(), and the next save of a run that restored it
must be incremental against it. Nothing mocked.
"""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.nn as nn

from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

import checkpointing
from checkpointing import CheckpointConfigError, CheckpointError, CheckpointManager
from checkpointing.interop import export_safetensors, import_checkpoint


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 50))


def _same_params(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_dcp_checkpoint_imports_restores_bit_exact_and_the_next_save_is_incremental(tmp_path, run_cli):
    import torch.distributed.checkpoint as dcp

    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(6).view(2, 3)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "epoch": 4, "cfg": {"lr": 0.5, "tags": ["a", "b"]}},
             checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    code, text = run_cli("import", str(tmp_path / "dcp"), str(tmp_path / "ck"), "--step", "100")
    assert code == 0 and "(dcp) as step 100" in text, text
    fresh = _model(1)
    state = {"model": fresh, "epoch": 0, "cfg": {}}
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.steps() == [100]
        assert mgr.restore(state) == 100
        _same_params(model, fresh)
        assert state["epoch"] == 4 and state["cfg"] == {"lr": 0.5, "tags": ["a", "b"]}
        stats = mgr.save(101, {"model": fresh, "epoch": 5, "cfg": state["cfg"]}).wait()  # the fine-tuning run's first save
    assert stats.bytes_reused == stats.bytes_total > 0 and stats.bytes_written < stats.bytes_total / 10


def test_dcp_import_takes_only_the_selected_keys(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = _model(0)
    dcp.save({"model": model.state_dict(), "ema": model.state_dict(), "step": 3, "when": datetime.date(2026, 1, 2)},
             checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(CheckpointConfigError, match="when.*exclude="):  # an object neither a tensor nor JSON-like
        import_checkpoint(tmp_path / "dcp", tmp_path / "ck", 0)
    result = import_checkpoint(tmp_path / "dcp", tmp_path / "ck", 0, exclude=["ema", "step", "when"])
    assert result.source_kind == "dcp" and result.tensors == len(model.state_dict())
    loaded = checkpointing.load(tmp_path / "ck")
    assert sorted(loaded) == ["model"]
    with pytest.raises(CheckpointConfigError, match="matches no key"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "ck2", 0, only="modle")


def test_torch_save_file_imports_under_a_key_and_loads(tmp_path):
    model = _model(0)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    result = import_checkpoint(tmp_path / "weights.pt", tmp_path / "ck", 5, under="model", dtype="bf16")
    assert result.source_kind == "torch" and result.step == 5
    loaded = checkpointing.load(tmp_path / "ck")
    assert sorted(loaded) == ["model"] and sorted(loaded["model"]) == sorted(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(loaded["model"][k], v.to(torch.bfloat16)), k
    torch.save({"blob": torch.ones(2), "obj": nn.Linear(2, 2)}, tmp_path / "pickled.pt")  # a module: not weights_only
    with pytest.raises(CheckpointConfigError, match=r"holds objects of type torch\.nn\.modules\.linear\.Linear.*never runs") as info:
        import_checkpoint(tmp_path / "pickled.pt", tmp_path / "ck", 6)
    assert "\x1b" not in str(info.value) and "load it yourself" in str(info.value)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointConfigError, match="cannot be read as a torch.save file"):
        import_checkpoint(tmp_path / "junk.pt", tmp_path / "ck", 6, kind="torch")
    with pytest.raises(CheckpointError, match="already committed"):
        import_checkpoint(tmp_path / "weights.pt", tmp_path / "ck", 5, under="model")
    for bad in (-1, 10**11, True):  # refused before anything is created at the destination
        with pytest.raises(CheckpointConfigError, match=r"pass the step number .*an int in 0\.\.9999999999"):
            import_checkpoint(tmp_path / "weights.pt", tmp_path / "new", bad, under="model")
        assert not (tmp_path / "new").exists()


def test_safetensors_export_round_trips_through_import_with_its_tied_weights(tmp_path, offline):
    model = _gpt2(0)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"model": model}).wait()
    export_safetensors(tmp_path / "run", tmp_path / "hf", only="model")
    result = import_checkpoint(tmp_path / "hf" / "model.safetensors", tmp_path / "ck", 1, under="model")
    assert result.source_kind == "safetensors"
    fresh = _gpt2(1)
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.restore({"model": fresh}) == 1  # strict: lm_head.weight came back tied, from the file's metadata
        assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
        _same_params(model, fresh)
        stats = mgr.save(2, {"model": fresh}).wait()
    assert stats.bytes_reused == stats.bytes_total


def test_a_torch_export_imports_back_into_the_layout_it_was_saved_in(tmp_path):
    from checkpointing.interop import export_torch

    model, weird = _model(0), {"a/b": torch.arange(3.0), "100%": torch.ones(2)}  # "/" and "%" inside one key's name
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, {"model": model, "extra": weird, "epoch": 7}).wait()
    export_torch(tmp_path / "run", tmp_path / "full.pt")
    assert import_checkpoint(tmp_path / "full.pt", tmp_path / "ck", 3).source_kind == "torch"
    fresh, extra = _model(1), {"a/b": torch.zeros(3), "100%": torch.zeros(2)}
    with CheckpointManager(tmp_path / "ck") as mgr:  # the export holds tensors only: the epoch stays out
        assert mgr.restore({"model": fresh, "extra": extra}) == 3
    _same_params(model, fresh)
    assert torch.equal(extra["a/b"], weird["a/b"]) and torch.equal(extra["100%"], weird["100%"])


def test_a_torch_export_of_tied_weights_holds_each_key_and_imports_back_tied(tmp_path):
    from checkpointing.interop import export_torch

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    model = Tied()
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, {"model": model}).wait()
    export_torch(tmp_path / "run", tmp_path / "full.pt", only="model")
    tensors = torch.load(tmp_path / "full.pt", weights_only=True)["tensors"]
    assert sorted(tensors) == ["emb.weight", "head.weight"] and tensors["emb.weight"].data_ptr() == tensors["head.weight"].data_ptr()
    Tied().load_state_dict(tensors)  # the file loads into the model as it is
    export_torch(tmp_path / "run", tmp_path / "all.pt")
    import_checkpoint(tmp_path / "all.pt", tmp_path / "ck", 3)
    fresh = Tied()
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.restore({"model": fresh}) == 3
    assert torch.equal(fresh.emb.weight, model.emb.weight) and fresh.head.weight is fresh.emb.weight


@pytest.mark.parametrize("tied", ['{"b": ["a"]}', '["a"]', '{"": "a"}', "{"])
def test_a_safetensors_file_with_malformed_tie_metadata_imports_its_tensors_without_the_ties(tmp_path, tied):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(3), "b": torch.zeros(2)}, tmp_path / "x.safetensors", metadata={"checkpointing.tied": tied})
    import_checkpoint(tmp_path / "x.safetensors", tmp_path / "ck", 0)
    tree = checkpointing.load(tmp_path / "ck")
    assert sorted(tree) == ["a", "b"] and torch.equal(tree["b"], torch.zeros(2))


def test_sharded_hugging_face_directory_imports_as_one_step(tmp_path, run_cli, offline):
    model = _gpt2(0)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    code, text = run_cli("import", str(tmp_path / "hf"), str(tmp_path / "ck"), "--step", "0", "--under", "model",
                         "--tie", "lm_head.weight=transformer.wte.weight")
    assert code == 0 and "(hf) as step 0" in text, text
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.steps() == [0]
        fresh = _gpt2(3)
        assert mgr.restore({"model": fresh}) == 0
    x = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x).logits, fresh(x).logits)
    code, text = run_cli("import", str(tmp_path / "hf"), str(tmp_path / "ck2"), "--step", "0", "--tie", "lm_head.weight=nope")
    assert code == 2 and "'nope' is not a name the source holds" in text


def test_import_refuses_a_checkpoint_of_this_library_and_runs_one_process(tmp_path):
    with CheckpointManager(tmp_path / "ours") as mgr:
        mgr.save(1, {"x": torch.ones(2)}).wait()
    with pytest.raises(CheckpointConfigError, match="no import needed"):
        import_checkpoint(tmp_path / "ours", tmp_path / "ck", 1)
    with pytest.raises(CheckpointError, match="no such file"):
        import_checkpoint(tmp_path / "missing.pt", tmp_path / "ck", 1)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointConfigError, match="neither a torch.save file"):
        import_checkpoint(tmp_path / "notes.txt", tmp_path / "ck", 1)
    torch.save({"x": torch.arange(3.0)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    import_checkpoint(tmp_path / "legacy.pt", tmp_path / "legacy", 1)  # the pre-zip format is still read
    assert torch.equal(checkpointing.load(tmp_path / "legacy")["x"], torch.arange(3.0))


def test_import_to_s3(tmp_path, s3_bucket):
    url, options = s3_bucket
    model = _model(0)
    torch.save({"model": model.state_dict(), "step": 9}, tmp_path / "full.pt")
    result = import_checkpoint(tmp_path / "full.pt", url, 9, storage_options=options)
    assert result.dest == url
    loaded = checkpointing.load(url, storage_options=options)
    assert loaded["step"] == 9 and all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match=f"step 9 is already committed in {url}: import as another step") as info:
        import_checkpoint(tmp_path / "full.pt", url, 9, storage_options=options)
    assert "ckpt-import" not in str(info.value)  # not the scratch directory the import uses


def test_hf_format_on_a_single_file_says_it_takes_a_directory(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointConfigError, match="is a file: a Hugging Face checkpoint is the directory"):
        import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ck", 0, kind="hf")


def test_dcp_checkpoint_of_a_plain_optimizer_state_dict_resumes_exactly(tmp_path):
    """DCP keys an optimizer's per-parameter state by the string of its id ("0"): it comes back keyed by the int,
    as Optimizer.load_state_dict() needs (it ignores other keys: the moments would be lost without a word)."""
    import torch.distributed.checkpoint as dcp

    def build():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, opt = build()
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    import_checkpoint(tmp_path / "dcp", tmp_path / "ours", step=3)
    assert list(checkpointing.load(tmp_path / "ours", 3)["optim"]["state"]) == [0, 1]
    model2, opt2 = build()
    with CheckpointManager(tmp_path / "ours") as mgr:
        assert mgr.restore({"model": model2, "optim": opt2}) == 3
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(torch.ones(1, 4)).sum().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight) and torch.equal(model.bias, model2.bias)


def test_a_dcp_directory_or_a_torch_save_file_opened_as_ours_says_to_import_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"))
    before = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    for opener in (lambda: CheckpointManager(tmp_path / "dcp"), lambda: CheckpointManager(tmp_path / "dcp", read_only=True)):
        with pytest.raises(CheckpointConfigError, match=r"DCP\) checkpoint \(.*dcp/\.metadata\).*checkpointing import"):
            opener()
    with pytest.raises(checkpointing.CheckpointNotFoundError, match=r"\.metadata.*checkpointing import"):
        checkpointing.load(tmp_path / "dcp")
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == before  # nothing written beside it
    for step in (10, 20):  # torchtitan's layout: a DCP checkpoint per step-N folder
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "titan" / f"step-{step}"))
    with pytest.raises(CheckpointConfigError, match=r"titan/step-20/\.metadata.*checkpointing import .*titan/step-20 NEW_DIR"):
        CheckpointManager(tmp_path / "titan")
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(checkpointing.CheckpointNotFoundError, match="is a file.*checkpointing import"):
        checkpointing.load(tmp_path / "model.pt")
    with pytest.raises(CheckpointConfigError, match="is a file.*checkpointing import"):
        CheckpointManager(tmp_path / "model.pt")


def test_a_torch_export_brings_lists_tuples_and_int_keys_back_as_saved(tmp_path):
    """README: an export comes back in the layout it was saved in. Its names join every path with "/": the file's
    "layout" says where a list, a tuple or an int-keyed dict (an optimizer's state) was, and import rebuilds them;
    only= and strip_prefix map past what they leave out; a file written before "layout" still imports (as dicts)."""
    from checkpointing.interop import export_torch

    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = {"lst": [torch.ones(2), torch.arange(3.0)], "tup": (torch.zeros(1), [torch.ones(1)]), "optim": opt.state_dict(),
             "byname": {"0": torch.full((2,), 5.0)}}  # str keys that look like ints stay str
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, saved).wait()
    export_torch(tmp_path / "run", tmp_path / "full.pt")
    import_checkpoint(tmp_path / "full.pt", tmp_path / "ck", 1)
    back = checkpointing.load(tmp_path / "ck")
    assert isinstance(back["lst"], list) and [t.tolist() for t in back["lst"]] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
    assert isinstance(back["tup"], tuple) and isinstance(back["tup"][1], list) and torch.equal(back["tup"][1][0], torch.ones(1))
    assert sorted(back["optim"]["state"]) == [0, 1] and torch.equal(back["optim"]["state"][1]["exp_avg"], opt.state_dict()["state"][1]["exp_avg"])
    assert list(back["byname"]) == ["0"]
    target = {"lst": [torch.zeros(2), torch.zeros(3)], "tup": (torch.ones(1), [torch.zeros(1)])}
    with CheckpointManager(tmp_path / "ck", read_only=True) as mgr:
        assert mgr.restore(target, only=["lst", "tup"]) == 1
    assert torch.equal(target["lst"][1], torch.arange(3.0)) and torch.equal(target["tup"][0], torch.zeros(1))
    export_torch(tmp_path / "run", tmp_path / "opt.pt", only="optim")  # names "state/0/exp_avg", ...
    import_checkpoint(tmp_path / "opt.pt", tmp_path / "ck2", 1)
    assert sorted(checkpointing.load(tmp_path / "ck2")["state"]) == [0, 1]
    export_torch(tmp_path / "run", tmp_path / "lst.pt", strip_prefix="tu")  # "tup/1/0" -> "p/1/0": segments kept
    import_checkpoint(tmp_path / "lst.pt", tmp_path / "ck4", 1)
    assert isinstance(checkpointing.load(tmp_path / "ck4")["p"], tuple)
    old = torch.load(tmp_path / "full.pt", weights_only=True)
    del old["layout"]
    torch.save(old, tmp_path / "old.pt")
    import_checkpoint(tmp_path / "old.pt", tmp_path / "ck3", 1)
    assert sorted(checkpointing.load(tmp_path / "ck3")["lst"]) == ["0", "1"]


def test_a_dcp_directory_with_a_damaged_data_file_is_refused_clearly_and_nothing_is_written(tmp_path, run_cli):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(1000), "b": torch.zeros(10)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    data = sorted((tmp_path / "dcp").glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointConfigError, match="DCP could not read its data files"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "ck", 0)
    code, text = run_cli("import", str(tmp_path / "dcp"), str(tmp_path / "ck"), "--step", "0")
    assert code == 2 and "Traceback" not in text and ".distcp file missing, or cut short" in text, text
    data.unlink()
    code, text = run_cli("import", str(tmp_path / "dcp"), str(tmp_path / "ck"), "--step", "0")
    assert code == 2 and "Traceback" not in text, text
    assert not (tmp_path / "ck").exists()


def test_a_sharded_hugging_face_directory_follows_its_index_and_refuses_a_tensor_it_lacks(tmp_path):
    """The weight map says which file holds each tensor (from_pretrained follows it): a second copy in another file is
    not taken, and a name no file holds where the index says is refused, before anything is committed."""
    from safetensors.torch import save_file

    f1, f2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"

    def hf(name: str, second: dict, weight_map: dict):
        d = tmp_path / name
        d.mkdir()
        save_file({"a": torch.ones(3), "b": torch.ones(2)}, str(d / f1), metadata={"format": "pt"})
        save_file(second, str(d / f2), metadata={"format": "pt"})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return d

    src = hf("hf", {"a": torch.full((3,), 7.0), "c": torch.ones(2)}, {"a": f1, "b": f1, "c": f2})
    import_checkpoint(src, tmp_path / "ck", 0)
    back = checkpointing.load(tmp_path / "ck")
    assert sorted(back) == ["a", "b", "c"] and torch.equal(back["a"], torch.ones(3))
    src = hf("hf2", {"c": torch.ones(2)}, {"a": f1, "b": f1, "lm_head.weight": f1, "c": f2})
    with pytest.raises(CheckpointConfigError, match=r"lacks 1 tensor\(s\) the index assigns to it \(lm_head.weight\)"):
        import_checkpoint(src, tmp_path / "ck2", 0)
    assert not (tmp_path / "ck2").exists()


def test_a_failed_import_writes_nothing_to_the_destination(tmp_path):
    """A value the manager cannot save (a set in a DCP checkpoint, a sparse tensor in a torch.save file) is refused
    before the destination is opened: no directory, no TIER, no lock left behind."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2), "s": {1, 2}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(CheckpointConfigError, match="exclude"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "ck", 0)
    torch.save({"w": torch.ones(2), "s": torch.eye(3).to_sparse()}, tmp_path / "sparse.pt")
    with pytest.raises(CheckpointConfigError):
        import_checkpoint(tmp_path / "sparse.pt", tmp_path / "ck", 0)
    assert not (tmp_path / "ck").exists()

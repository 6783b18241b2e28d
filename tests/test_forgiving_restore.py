"""Restore maps what users hold onto what was saved, and never skips in silence.

Compiled and plain modules (`_orig_mod.`), a module and its state_dict() map onto each other both
ways; only=/exclude= restore part of a state and leave the rest as it is; inside a selection a key
on one side only is still an error; a pattern that matches nothing is an error, not a no-op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import checkpointing
from checkpointing import CheckpointManager, CheckpointMismatchError


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 3)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa.values(), sb.values()))


@pytest.fixture
def mgr(tmp_path):
    with CheckpointManager(tmp_path / "ck") as m:
        yield m


def test_compiled_and_plain_modules_restore_into_each_other(mgr):
    saved = Net(0)
    mgr.save(1, {"model": torch.compile(saved)}).wait()
    assert list(torch.compile(saved).state_dict())[0].startswith("_orig_mod.")
    plain = Net(1)
    mgr.restore({"model": plain})
    assert _same(plain, saved)
    mgr.save(2, {"model": saved}).wait()
    compiled = torch.compile(Net(2))
    mgr.restore({"model": compiled}, step=2)
    assert _same(compiled._orig_mod, saved)
    blockwise = Net(3)
    blockwise.layers[0] = torch.compile(blockwise.layers[0])  # per-block compile: layers.0._orig_mod.weight
    mgr.restore({"model": blockwise}, step=1)
    assert torch.equal(blockwise.layers[0]._orig_mod.weight, saved.layers[0].weight)


def test_a_module_and_its_state_dict_restore_into_each_other(mgr):
    saved = Net(0)
    mgr.save(1, {"model": saved}).wait()
    sd = Net(1).state_dict()
    mgr.restore({"model": sd})
    assert all(torch.equal(sd[k], v) for k, v in saved.state_dict().items())
    mgr.save(2, {"model": saved.state_dict()}).wait()
    module = Net(2)
    mgr.restore({"model": module}, step=2)
    assert _same(module, saved)


def test_only_and_exclude_restore_part_and_keep_the_rest(mgr):
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    mgr.save(1, {"model": model, "optim": opt, "epoch": 4}).wait()

    fresh = Net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state = {"model": fresh, "optim": fresh_opt, "epoch": 0}
    mgr.restore(state, only="model")
    assert _same(fresh, model) and fresh_opt.state_dict()["state"] == {} and state["epoch"] == 0

    mgr.restore(state, exclude=["optim"])
    assert state["epoch"] == 4 and fresh_opt.state_dict()["state"] == {}

    first = Net(2)
    kept = first.layers[1].weight.detach().clone()
    mgr.restore({"model": first}, only="model/layers.0.*")
    assert torch.equal(first.layers[0].weight, model.layers[0].weight) and torch.equal(first.layers[1].weight, kept)

    # the target without an optimizer: only= says so, where strict=False would have skipped keys in silence
    mgr.restore({"model": Net(3)}, only="model")


def test_inside_a_selection_strict_still_holds(mgr):
    mgr.save(1, {"model": Net(0), "epoch": 1}).wait()
    with pytest.raises(CheckpointMismatchError) as info:
        mgr.restore({"model": Net(1), "ema": torch.zeros(3)}, only=["model", "ema"])
    assert "ema: missing from the checkpoint" in str(info.value)
    with pytest.raises(CheckpointMismatchError) as info:
        mgr.restore({"model": Net(1)})
    text = str(info.value)
    assert "epoch" in text and "only=" in text and "strict=False" not in text


def test_a_pattern_that_matches_nothing_is_an_error(mgr):
    model = Net(0)
    mgr.save(1, {"model": model}).wait()
    target = Net(1)
    with pytest.raises(CheckpointMismatchError, match="'modle'.*matches no key.*'model'"):
        mgr.restore({"model": target}, only="modle")
    with pytest.raises(CheckpointMismatchError, match="'optimizer'.*matches no key"):
        mgr.restore({"model": target}, exclude="optimizer")
    assert not _same(target, model)


@pytest.mark.parametrize("compiled_target", [True, False])
def test_patterns_meet_names_that_differ_by_a_wrapper(tmp_path, compiled_target):
    """only=/exclude= written for either naming select the same parameters, never nothing in silence."""
    saved = Net(0)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"model": saved if compiled_target else torch.compile(saved)}).wait()
        for kw, restored_first in ((dict(only="model/layers.0.*"), True), (dict(only="model/_orig_mod.layers.0.*"), True),
                                   (dict(exclude="model/layers.0.*"), False), (dict(exclude="model/_orig_mod.layers.0.*"), False)):
            fresh = Net(1)
            target = torch.compile(fresh) if compiled_target else fresh
            assert mgr.restore({"model": target}, **kw) == 1
            assert torch.equal(fresh.layers[0].weight, saved.layers[0].weight) is restored_first, kw
            assert torch.equal(fresh.layers[1].weight, saved.layers[1].weight) is not restored_first, kw
    got = checkpointing.load(tmp_path / "ck", keys="model/layers.0.weight")["model"]
    assert [torch.equal(v, saved.layers[0].weight) for v in got.values()] == [True]


def _ddp_saved_restores_into_a_plain_model(rank, world, root):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Net(0)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": DDP(model)}).wait()
    plain = Net(1)
    with CheckpointManager(root, read_only=True) as mgr:  # and the other way: a plain save into DDP
        assert mgr.restore({"model": plain}) == 1
    assert _same(plain, model)
    other = Net(2)
    with CheckpointManager(f"{root}-plain") as mgr:
        mgr.save(1, {"model": other}).wait()
        wrapped = DDP(Net(3))
        assert mgr.restore({"model": wrapped}, only="model/layers.1.*") == 1
        assert mgr.restore({"model": wrapped}, only="model/module.layers.1.*") == 1  # the target's naming selects as well
    return torch.equal(wrapped.module.layers[1].weight, other.layers[1].weight), torch.equal(wrapped.module.layers[0].weight, other.layers[0].weight)


def test_distributed_data_parallel_names_meet_plain_ones(tmp_path):
    from _dist import run_ranks

    assert run_ranks(_ddp_saved_restores_into_a_plain_model, 1, str(tmp_path / "ck"), tmp=tmp_path) == [(True, False)]


def test_exclude_may_name_a_key_only_the_target_has(mgr):
    """The error for a key the step lacks suggests exclude=[...]: that works."""
    model = Net(0)
    mgr.save(1, {"model": model}).wait()
    fresh, ema = Net(1), torch.optim.swa_utils.AveragedModel(Net(2))
    with pytest.raises(CheckpointMismatchError, match="ema: missing from the checkpoint"):
        mgr.restore({"model": fresh, "ema": ema})
    assert mgr.restore({"model": fresh, "ema": ema}, exclude=["ema"]) == 1 and _same(fresh, model)
    with pytest.raises(CheckpointMismatchError, match="'emma'.*matches no key"):
        mgr.restore({"model": fresh, "ema": ema}, exclude=["emma"])


def _adam_stepped(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, 6)).sum().backward()
    opt.step()


def test_an_optimizer_state_is_replaced_whole_as_load_state_dict_does(mgr):
    """Rewinding the live objects: parameters that got state after the save lose it, as with torch's own load."""
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.layers[0].requires_grad_(False)  # frozen at the save: no state for its parameters
    _adam_stepped(model, opt)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    reference = Net(0)
    reference.load_state_dict(expect)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_opt.load_state_dict(opt.state_dict())
    model.layers[0].requires_grad_(True)
    for _ in range(2):
        _adam_stepped(model, opt)
    assert len(opt.state_dict()["state"]) == 4
    assert mgr.restore({"model": model, "optim": opt}, step=1) == 1
    assert sorted(opt.state_dict()["state"]) == sorted(ref_opt.state_dict()["state"]) == [2, 3]
    for m, o in ((model, opt), (reference, ref_opt)):
        m.layers[0].requires_grad_(True)
        _adam_stepped(m, o)
    assert _same(model, reference)  # the same next step as an optimizer given the step's state by torch


def test_lbfgs_history_of_another_length_restores(mgr):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5))
    opt = torch.optim.LBFGS([w], history_size=4, max_iter=3)

    def closure():
        opt.zero_grad()
        loss = ((w - 1) ** 4).sum()
        loss.backward()
        return loss

    opt.step(closure)
    mgr.save(1, {"w": w, "optim": opt}).wait()
    saved = [t.clone() for t in opt.state_dict()["state"][0]["old_dirs"]]
    for _ in range(3):
        opt.step(closure)
    assert len(opt.state_dict()["state"][0]["old_dirs"]) != len(saved)
    assert mgr.restore({"w": w, "optim": opt}, step=1) == 1
    got = opt.state_dict()["state"][0]["old_dirs"]
    assert len(got) == len(saved) and all(torch.equal(a, b) for a, b in zip(got, saved))


def test_part_of_a_parameters_state_into_a_fresh_optimizer_is_refused_before_anything_changes(mgr):
    model = Net(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _adam_stepped(model, opt)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    fresh = Net(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    new_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    for kw in (dict(exclude="optim/state/*/step"), dict(only=["model", "optim/state/*/exp_avg"])):
        with pytest.raises(CheckpointMismatchError, match=r"optim/state/0 .*the selection restores .* not \[.*'step'\]"):
            mgr.restore({"model": fresh, "optim": new_opt}, **kw)
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # the model was not touched
    _adam_stepped(fresh, new_opt)  # an optimizer that has state to complete it takes the part
    assert mgr.restore({"model": fresh, "optim": new_opt}, exclude="optim/state/*/step") == 1
    assert torch.equal(new_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


class WithModule(nn.Module):
    """A real submodule called `module` beside a parameter of the same shape: not DDP's wrapper."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.module = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.randn(4, 4))


def test_a_submodule_called_module_is_not_taken_for_ddps_wrapper(mgr):
    saved = WithModule(0)
    mgr.save(1, {"model": saved}).wait()
    fresh = WithModule(1)
    old_inner = fresh.module.weight.detach().clone()
    assert mgr.restore({"model": fresh}, exclude="model/weight") == 1
    assert torch.equal(fresh.module.weight, saved.module.weight) and not torch.equal(fresh.weight, saved.weight)
    fresh = WithModule(1)
    assert mgr.restore({"model": fresh}, only="model/weight") == 1
    assert torch.equal(fresh.weight, saved.weight) and torch.equal(fresh.module.weight, old_inner)


def test_rewinding_into_an_optimizer_with_other_state_keys_takes_the_saved_ones(mgr):
    """amsgrad on at the save, off now: load_state_dict() takes the saved state and its hyperparameters."""
    model = Net(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    _adam_stepped(model, opt)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    target = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=False)
    _adam_stepped(model, target)
    assert mgr.restore({"optim": target}, only="optim") == 1
    got = target.state_dict()["state"][0]
    assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    assert target.param_groups[0]["amsgrad"] is True


def test_a_key_of_another_type_is_named_as_such(mgr):
    mgr.save(1, {"d": {1: torch.ones(2)}}).wait()
    with pytest.raises(CheckpointMismatchError, match=r"d/1: missing from the checkpoint \(the step has the int key 1, the target the str key '1'"):
        mgr.restore({"d": {"1": torch.zeros(2)}})


@pytest.mark.parametrize("saved_as", ["tensor", "number"])
def test_a_number_saved_as_a_0d_tensor_or_back_takes_the_saved_form_in_optimizers_and_schedulers(mgr, saved_as):
    """Adafactor (relative_step) and its AdafactorSchedule hold lr as a 0-d tensor once stepped, a fresh pair
    holds floats: load_state_dict() takes the saved form, and so does restore (in modules a kind change is refused)."""
    def build(lr):
        model = Net(0)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return model, opt, sched

    lr = (lambda v: torch.tensor(v)) if saved_as == "tensor" else float
    model, opt, sched = build(0.1)
    _adam_stepped(model, opt)
    sched.step()
    opt.param_groups[0]["lr"] = lr(0.05)  # what Adafactor writes at each step
    sched._last_lr = [lr(0.05)]
    mgr.save(1, {"model": model, "optim": opt, "sched": sched}).wait()
    other = (lambda v: v) if saved_as == "tensor" else torch.tensor
    target, target_opt, target_sched = build(0.1)
    target_opt.param_groups[0]["lr"], target_sched._last_lr = other(0.1), [other(0.1)]
    assert mgr.restore({"model": target, "optim": target_opt, "sched": target_sched}) == 1
    for got in (target_opt.param_groups[0]["lr"], target_sched._last_lr[0]):
        assert type(got) is type(lr(0.05)) and got == lr(0.05)
    for m, o in ((model, opt), (target, target_opt)):
        _adam_stepped(m, o)
    assert _same(model, target)
    mgr.save(2, {"model": {"t": torch.tensor(3.0)}}).wait()  # a plain container keeps its kind check
    with pytest.raises(CheckpointMismatchError, match="saved as a tensor, the target holds a float"):
        mgr.restore({"model": {"t": 3.0}})


def _stepped_adam(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, width))
    opt = torch.optim.Adam(model.parameters())
    _adam_stepped_on(model, opt)
    return model, opt


def _adam_stepped_on(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def test_optimizer_state_that_does_not_fit_its_parameter_now_is_refused_before_anything_changes(mgr):
    """A new head (2 -> 3 classes) left out of the model's restore, or groups listing the parameters in another
    order: torch's load_state_dict() would take the state, and the next step() fail inside torch."""
    model, opt = _stepped_adam(2)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    target, target_opt = _stepped_adam(3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        mgr.restore({"model": target, "optim": target_opt}, exclude="model/2.*")
    text = str(info.value)
    assert "optim/state/2/exp_avg: saved [2, 8], the parameter at position 2 of the optimizer's groups is [3, 8] now" in text
    assert "exclude=['optim/state/2']" in text and "optim/state/3/exp_avg_sq" in text and "optim/state/0" not in text
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert mgr.restore({"model": target, "optim": target_opt}, exclude=["model/2.*", "optim/state/2", "optim/state/3"]) == 1
    _adam_stepped_on(target, target_opt)  # as the error says: the step runs
    reordered = torch.optim.Adam([model[2].weight, model[0].weight, model[0].bias, model[2].bias])
    with pytest.raises(CheckpointMismatchError, match="or the groups list the parameters in another order"):
        mgr.restore({"optim": reordered}, only="optim")


def test_a_scheduler_of_another_torch_class_is_refused_before_the_model_is_read(mgr):
    model = Net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mgr.save(1, {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 3)}).wait()
    target = Net(1)
    target_opt = torch.optim.SGD(target.parameters(), lr=0.5)
    with pytest.raises(CheckpointMismatchError, match=r"sched: saved from a torch.optim.lr_scheduler.StepLR, the target is a "
                                                      r"torch.optim.lr_scheduler.LambdaLR: .*exclude=\['sched'\]"):
        mgr.restore({"model": target, "optim": target_opt, "sched": torch.optim.lr_scheduler.LambdaLR(target_opt, lambda s: 1.0)})
    assert _same(target, Net(1)) and target_opt.param_groups[0]["lr"] == 0.5


class _Versioned(nn.Module):
    """Its version-1 state held log(scale); this code (version 2) converts such a state when it loads one."""
    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(4) + 0.5)

    def _load_from_state_dict(self, sd, prefix, local_metadata, *args):
        if local_metadata.get("version") is None or local_metadata["version"] < 2:
            sd[prefix + "scale"] = sd[prefix + "scale"].exp()
        super()._load_from_state_dict(sd, prefix, local_metadata, *args)


def test_a_module_that_converts_older_versions_of_its_state_is_told_the_steps_version(mgr):
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 4), _Versioned())
    mgr.save(1, {"model": saved}).wait()
    target = nn.Sequential(nn.Linear(4, 4), _Versioned())
    mgr.restore({"model": target})
    assert torch.equal(target[1].scale, saved[1].scale)  # not converted as if it were version 1


class _Seen(nn.Module):
    """Extra state (get_extra_state) holding a tensor that grows: a fresh instance holds int64[0]."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen = torch.empty(0, dtype=torch.long)

    def get_extra_state(self):
        return {"seen": self.seen}

    def set_extra_state(self, state):
        self.seen = state["seen"].clone()


class _Buffer:
    def __init__(self) -> None:
        self.data = torch.empty(0, 4)

    def state_dict(self):
        return {"data": self.data}

    def load_state_dict(self, sd):
        self.data = sd["data"].clone()


def test_extra_state_and_objects_whose_tensors_grow_restore_into_fresh_instances(mgr):
    model, buf = _Seen(), _Buffer()
    model.seen = torch.tensor([4, 7, 9])
    buf.data = torch.randn(5, 4)
    mgr.save(1, {"model": model, "buf": buf}).wait()
    fresh_model, fresh_buf = _Seen(), _Buffer()
    mgr.restore({"model": fresh_model, "buf": fresh_buf})
    assert torch.equal(fresh_model.seen, model.seen) and torch.equal(fresh_buf.data, buf.data)
    with pytest.raises(CheckpointMismatchError, match=r"model/lin.weight: saved float32\[2, 2\], target is float32\[3, 2\]"):
        bigger = _Seen()
        bigger.lin = nn.Linear(2, 3)
        mgr.restore({"model": bigger})  # a module's own parameters keep their shape check


def test_an_expanded_target_is_named_before_anything_is_read(mgr):
    mgr.save(1, {"a": torch.ones(4), "e": torch.arange(4.0).expand(3, 4)}).wait()
    a = torch.zeros(4)
    with pytest.raises(CheckpointMismatchError, match=r"e: the target is an expand\(\)ed view, whose elements share memory"):
        mgr.restore({"a": a, "e": torch.zeros(4).expand(3, 4)})
    assert torch.equal(a, torch.zeros(4))


def test_only_and_exclude_select_items_of_lists(mgr):
    mgr.save(1, {"bufs": [torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)], "sched": {"milestones": [10, 20]}}).wait()

    def target():
        return {"bufs": [torch.full((2,), -1.0) for _ in range(3)], "sched": {"milestones": [30, 40]}}

    t = target()
    mgr.restore(t, exclude=["bufs/1", "sched/milestones/0"])
    assert [b.tolist() for b in t["bufs"]] == [[0.0, 0.0], [-1.0, -1.0], [2.0, 2.0]] and t["sched"]["milestones"] == [30, 20]
    t = target()
    mgr.restore(t, only="bufs/0")
    assert [b.tolist() for b in t["bufs"]] == [[0.0, 0.0], [-1.0, -1.0], [-1.0, -1.0]] and t["sched"]["milestones"] == [30, 40]
    got = checkpointing.load(mgr.directory, keys="bufs/1")["bufs"]
    assert got[0] is None and got[2] is None and torch.equal(got[1], torch.ones(2))
    with pytest.raises(CheckpointMismatchError, match=r"sched/milestones/0: outside the selection, in a list saved with 2 items and a "
                                                      r"target of 3: select the whole list or none of it"):
        mgr.restore({"sched": {"milestones": [30, 40, 50]}}, exclude=["bufs", "sched/milestones/0"])


class _Renamed(nn.Module):
    """`lin` renamed `proj`, with the usual load_state_dict pre-hook that keeps old checkpoints loading."""

    def __init__(self, split: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.register_load_state_dict_pre_hook(self._split if split else self._rename)

    @staticmethod
    def _rename(module, sd, prefix, *args):
        for k in [k for k in sd if k.startswith(prefix + "lin.")]:
            sd[prefix + "proj." + k[len(prefix) + 4:]] = sd.pop(k)

    @staticmethod
    def _split(module, sd, prefix, *args):  # makes new values: no renaming restore can follow
        for k in [k for k in sd if k.startswith(prefix + "lin.")]:
            sd[prefix + "proj." + k[len(prefix) + 4:]] = sd.pop(k) * 1


def test_a_modules_back_compat_renames_in_its_load_state_dict_pre_hooks_are_followed(mgr):
    torch.manual_seed(0)
    old = nn.Sequential(nn.Module(), nn.Module())
    old[1].lin = nn.Linear(2, 2)
    mgr.save(1, {"model": old}).wait()
    for strict in (True, False):
        new = nn.Sequential(nn.Module(), _Renamed())
        assert mgr.restore({"model": new}, strict=strict) == 1
        assert torch.equal(new[1].proj.weight, old[1].lin.weight) and torch.equal(new[1].proj.bias, old[1].lin.bias)
    with pytest.raises(CheckpointMismatchError, match=r"model/1.proj.weight: missing from the checkpoint"):
        mgr.restore({"model": nn.Sequential(nn.Module(), _Renamed(split=True))})


@pytest.mark.parametrize("saved_compiled, target_compiled", [(False, True), (True, False), (True, True)])
def test_renames_in_pre_hooks_are_followed_across_torch_compiles_names(tmp_path, saved_compiled, target_compiled):
    wrap = lambda m, compiled: torch.compile(m, backend="eager") if compiled else m  # noqa: E731
    torch.manual_seed(0)
    old = nn.Sequential(nn.Module(), nn.Module())
    old[1].lin = nn.Linear(2, 2)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": wrap(old, saved_compiled)}).wait()
        new = nn.Sequential(nn.Module(), _Renamed())
        assert mgr.restore({"model": wrap(new, target_compiled)}) == 1
    assert torch.equal(new[1].proj.weight, old[1].lin.weight) and torch.equal(new[1].proj.bias, old[1].lin.bias)


def test_a_step_that_is_not_committed_is_named_with_the_steps_that_are(mgr):
    for step in (1, 2):
        mgr.save(step, {"w": torch.ones(2)}).wait()
    with pytest.raises(checkpointing.CheckpointNotFoundError, match=r"step 5 cannot be restored: step 5 is not committed in its local "
                                                                   r"tier .* \(committed: 1, 2\)$"):
        mgr.restore({"w": torch.zeros(2)}, step=5)


class _Lion(torch.optim.Optimizer):
    """A user's own optimizer: its state has no `step`, which torch's Adam-family load_state_dict() needs."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 1e-3})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("exp_avg", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                p.add_(state["exp_avg"].sign(), alpha=-group["lr"])


def test_a_users_optimizer_state_a_torch_optimizer_cannot_load_is_refused_before_the_model_is_read(mgr):
    model = Net(0)
    opt = _Lion(model.parameters())
    _adam_stepped(model, opt)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    target = Net(1)
    with pytest.raises(CheckpointMismatchError, match=r"optim: saved from a .*_Lion, which the target AdamW cannot load \(its "
                                                      r"load_state_dict\(\) raises KeyError: 'step'\).*exclude=\['optim'\]"):
        mgr.restore({"model": target, "optim": torch.optim.AdamW(target.parameters())})
    assert _same(target, Net(1))


def test_torch_classes_that_share_their_state_restore_into_each_other(mgr):
    import warnings

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved, target = torch.amp.GradScaler("cpu", init_scale=1024.0), ShardedGradScaler(device="cpu")
    mgr.save(1, {"scaler": saved}).wait()
    assert mgr.restore({"scaler": target}) == 1 and target.state_dict() == saved.state_dict()


def test_an_optimizers_own_load_state_dict_pre_hook_is_honoured_while_planning(mgr):
    model = Net(0)
    opt = _Lion(model.parameters())
    _adam_stepped(model, opt)
    mgr.save(1, {"optim": opt}).wait()

    def migrate(_, sd):  # the user's migration of a Lion state to AdamW's
        for s in sd["state"].values():
            s.setdefault("step", torch.tensor(1.0))
            s.setdefault("exp_avg_sq", torch.zeros_like(s["exp_avg"]))
        return sd

    target = torch.optim.AdamW(model.parameters())
    target.register_load_state_dict_pre_hook(migrate)
    assert mgr.restore({"optim": target}) == 1
    assert torch.equal(target.state[model.layers[0].weight]["exp_avg"], opt.state[model.layers[0].weight]["exp_avg"])


def test_a_refused_restore_leaves_a_lazy_module_lazy_and_names_it_beside_its_optimizer(mgr):
    src = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    src[1].register_buffer("old_stat", torch.ones(2))
    opt = torch.optim.Adam(src.parameters())
    src(torch.ones(2, 4)).sum().backward()
    opt.step()
    mgr.save(1, {"model": src, "optim": opt}).wait()
    lazy = nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 2))
    with pytest.raises(CheckpointMismatchError, match=r"model/1.old_stat: in the checkpoint but not in the target"):
        mgr.restore({"model": lazy}, only="model")
    assert lazy[0].has_uninitialized_params()  # its pre-hook was not run on the planning's stand-ins
    with pytest.raises(CheckpointMismatchError, match="an uninitialized lazy parameter: run one forward pass first"):
        mgr.restore({"model": lazy, "optim": torch.optim.Adam(lazy.parameters())})


def test_leaving_out_an_item_of_a_list_the_optimizer_does_not_hold_is_refused(mgr):
    def build():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return model, torch.optim.LBFGS(model.parameters(), history_size=4, max_iter=4)

    def step(model, opt):
        def closure():
            opt.zero_grad()
            loss = (model(torch.ones(3, 4)) - 1).pow(2).sum()
            loss.backward()
            return loss
        opt.step(closure)

    model, opt = build()
    step(model, opt)
    step(model, opt)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    fresh, fresh_opt = build()
    with pytest.raises(CheckpointMismatchError, match=r"optim/state/0/old_dirs/0: outside the selection, in a list saved with \d+ "
                                                      r"items and no such list in the target: select the whole list or none of it"):
        mgr.restore({"model": fresh, "optim": fresh_opt}, exclude="optim/state/0/old_dirs/0")

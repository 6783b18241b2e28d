"""User-side tests: realistic training states round-trip bit-exactly, training resumed
from a checkpoint matches training that never stopped, async snapshots capture the
state as of save(), staging memory does not grow, back-to-back saves queue correctly."""
from __future__ import annotations

import copy
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from checkpointing import CheckpointManager, RNGState

from _models import (
    assert_tree_equal, clone_tree, make_model, make_optim, make_sched, rss_bytes,
    step_dir_name, train_step,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _blank(obj):
    """Same structure, different leaf values (a user's 'default' template)."""
    if isinstance(obj, dict):
        return {k: _blank(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_blank(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_blank(v) for v in obj)
    if isinstance(obj, bool):
        return not obj
    if isinstance(obj, int):
        return obj + 1
    if isinstance(obj, float):
        return 12345.0
    if isinstance(obj, str):
        return obj + "_x"
    if isinstance(obj, bytes):
        return obj + b"_x"
    return obj


PRIMS = {
    "int": 7,
    "big": 2**62 + 1,
    "neg": -3,
    "zero": 0,
    "float": 0.1,
    "tiny": 5e-324,
    "huge": 1.7976931348623157e308,
    "nan": float("nan"),
    "inf": float("inf"),
    "ninf": float("-inf"),
    "negzero": -0.0,
    "str": "héllo ✓ \"quoted\" \n newline \x00 nul",
    "empty_str": "",
    "none": None,
    "t": True,
    "f": False,
    "nested": {"a": [1, 2.5, "x", None, [True, {"deep": [], "deeper": {"k": -1}}]], "b": {}},
    "empty_list": [],
    "list_of_floats": [0.5, float("nan"), -0.0, 3.0],
}


# ----------------------------------------------------------------------------- 1
def test_round_trip_realistic_state(tmp_path):
    """Transformer (tied weights) + AdamW after steps + CosineAnnealingLR + RNGState +
    primitives + plain/numpy/bf16/int64/bool tensors restore bit-exactly into FRESH objects."""
    model = make_model(0)
    opt = make_optim(model)
    sched = make_sched(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        train_step(model, opt, sched, gen)
    assert len(opt.state_dict()["state"]) > 0

    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    tensors = {
        "plain": torch.randn(7, 3),
        "bf16": torch.randn(5, 6).to(torch.bfloat16),
        "f16": torch.randn(4).to(torch.float16),
        "f64": torch.randn(3, dtype=torch.float64),
        "i64": torch.arange(-5, 5, dtype=torch.int64) * (2**40) + 3,
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "bool": torch.rand(9) > 0.5,
        "nonfinite": torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-45]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "noncontig": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
    }
    arrays = {
        "f64": np.linspace(-1, 1, 24).reshape(2, 3, 4),
        "i32": np.arange(10, dtype=np.int32),
        "u8": np.frombuffer(bytes(range(256)), dtype=np.uint8).copy(),
    }
    state = {
        "model": model, "optim": opt, "sched": sched, "rng": RNGState(),
        "prims": copy.deepcopy(PRIMS), "step": 4, "lr_hist": [0.1, 0.2],
        **{f"t_{k}": v for k, v in tensors.items()},
        **{f"np_{k}": v for k, v in arrays.items()},
    }
    exp_model = clone_tree(model.state_dict())
    exp_opt = clone_tree(opt.state_dict())
    exp_sched = clone_tree(sched.state_dict())
    exp_tensors = clone_tree(tensors)
    exp_arrays = clone_tree(arrays)

    ck = tmp_path / "ck"
    with CheckpointManager(ck, keep_local=None) as mgr:
        h = mgr.save(4, state)
        assert h.step == 4
        st = h.wait()
        assert st.ok and st.step == 4 and st["step"] == 4
        assert h.done()
        assert mgr.steps() == [4] and mgr.latest_step() == 4
        # the draws that should follow the saved RNG state
        exp_draws = (torch.rand(5), np.random.rand(3), random.random(), torch.randn(2))
    assert (ck / step_dir_name(4) / "COMMIT").exists()

    # scramble all global RNGs, build FRESH objects with different init
    torch.manual_seed(999); np.random.seed(999); random.seed(999)
    model2 = make_model(123)
    opt2 = make_optim(model2)
    sched2 = make_sched(opt2)
    fresh_tensors = {k: torch.zeros_like(v) if v.dtype != torch.bool else ~v for k, v in tensors.items()}
    fresh_tensors["noncontig"] = torch.zeros(6, 4)
    fresh_arrays = {k: np.zeros_like(v) for k, v in arrays.items()}
    state2 = {
        "model": model2, "optim": opt2, "sched": sched2, "rng": RNGState(),
        "prims": _blank(PRIMS), "step": 0, "lr_hist": [0.0, 0.0],
        **{f"t_{k}": v for k, v in fresh_tensors.items()},
        **{f"np_{k}": v for k, v in fresh_arrays.items()},
    }
    ids = {k: id(v) for k, v in state2.items()}
    with CheckpointManager(ck) as mgr2:
        assert mgr2.latest_step() == 4
        assert mgr2.restore(state2) == 4

    # objects restored in place
    for k in ["model", "optim", "sched", "rng"] + [k for k in state2 if k.startswith(("t_", "np_"))]:
        assert id(state2[k]) == ids[k], f"{k} was replaced, not restored in place"
    assert_tree_equal(exp_model, model2.state_dict(), "model")
    assert model2.head.weight is model2.tok.weight, "weight tying lost"
    assert model2.head.weight.data_ptr() == model2.tok.weight.data_ptr()
    assert_tree_equal(exp_opt, opt2.state_dict(), "optim")
    assert_tree_equal(exp_sched, sched2.state_dict(), "sched")
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    for k, v in exp_tensors.items():
        assert_tree_equal(v, state2[f"t_{k}"], f"t_{k}")
    for k, v in exp_arrays.items():
        assert_tree_equal(v, state2[f"np_{k}"], f"np_{k}")
    assert_tree_equal(PRIMS, state2["prims"], "prims")
    assert state2["step"] == 4 and type(state2["step"]) is int
    assert state2["lr_hist"] == [0.1, 0.2]

    got_draws = (torch.rand(5), np.random.rand(3), random.random(), torch.randn(2))
    assert torch.equal(exp_draws[0], got_draws[0]), "torch RNG not restored"
    assert np.array_equal(exp_draws[1], got_draws[1]), "numpy RNG not restored"
    assert exp_draws[2] == got_draws[2], "python random not restored"
    assert torch.equal(exp_draws[3], got_draws[3])


def test_round_trip_primitive_edge_cases(tmp_path):
    """Contract: bytes, dicts with int keys and tuples are JSON-like state values."""
    state = {"meta": {"blob": b"\x00\xff\x10abc", "ikeys": {1: "one", 2: "two", -7: [1]},
                      "tup": (1, "a", None), "mixed": {"x": {3: {"y": b""}}}}}
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, copy.deepcopy(state)).wait()
    tmpl = {"meta": {"blob": b"", "ikeys": {1: "", 2: "", -7: [0]}, "tup": (0, "", None),
                     "mixed": {"x": {3: {"y": b"zz"}}}}}
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.restore(tmpl) == 1
    m = tmpl["meta"]
    assert m["blob"] == b"\x00\xff\x10abc" and type(m["blob"]) is bytes
    assert m["ikeys"] == {1: "one", 2: "two", -7: [1]}, m["ikeys"]
    assert all(type(k) is int for k in m["ikeys"]), "int dict keys came back as strings"
    assert list(m["tup"]) == [1, "a", None]
    assert m["mixed"] == {"x": {3: {"y": b""}}}


# ----------------------------------------------------------------------------- 2
def _train_run(ckdir, n_steps, every, restore_step=None):
    """Train n_steps (saving every `every` with async snapshots). If restore_step is
    given, fresh objects are restored from ckdir first and training continues."""
    seed = 0 if restore_step is None else 77  # fresh objects differ when restoring
    model = make_model(seed)
    opt = make_optim(model)
    sched = make_sched(opt, total=n_steps)
    gen = torch.Generator().manual_seed(seed + 5)
    torch.manual_seed(seed + 6)
    losses = {}
    start = 1
    with CheckpointManager(ckdir, keep_local=None, snapshot="async") as mgr:
        if restore_step is not None:
            tmpl_gen = torch.zeros_like(gen.get_state())
            state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(),
                     "data": {"gen": tmpl_gen, "epoch": -1}, "step": -1}
            got = mgr.restore(state, step=restore_step)
            assert got == restore_step
            assert state["step"] == restore_step and state["data"]["epoch"] == 0
            gen.set_state(tmpl_gen)
            start = restore_step + 1
        for s in range(start, n_steps + 1):
            losses[s] = train_step(model, opt, sched, gen)
            if restore_step is None and s % every == 0:
                # state dict rebuilt each save (the generator state is a fresh tensor)
                mgr.save(s, {"model": model, "optim": opt, "sched": sched, "rng": RNGState(),
                             "data": {"gen": gen.get_state(), "epoch": 0}, "step": s})
        mgr.wait()
        steps = mgr.steps()
    return losses, model, opt, sched, steps


def test_resume_matches_uninterrupted_training(tmp_path):
    """Losses after restoring step m (fresh model/optim/sched, scrambled RNG) equal the
    uninterrupted run's losses bit-for-bit, and final weights/optimizer state match."""
    ck = tmp_path / "ck"
    N, K = 12, 3
    ref_losses, ref_model, ref_opt, ref_sched, steps = _train_run(ck, N, K)
    assert steps == [3, 6, 9, 12]
    assert all(math.isfinite(v) for v in ref_losses.values())
    # dropout + data order really are random: consecutive losses differ
    assert len(set(ref_losses.values())) == N

    for m in (6, 9):
        losses, model, opt, sched, _ = _train_run(ck, N, K, restore_step=m)
        assert sorted(losses) == list(range(m + 1, N + 1))
        for s in losses:
            assert losses[s] == ref_losses[s], f"restored from {m}: loss at step {s} {losses[s]!r} != {ref_losses[s]!r}"
        assert_tree_equal(ref_model.state_dict(), model.state_dict(), f"model(from {m})")
        assert_tree_equal(ref_opt.state_dict(), opt.state_dict(), f"optim(from {m})")
        assert_tree_equal(ref_sched.state_dict(), sched.state_dict(), f"sched(from {m})")

    # newest step by default == the final reference weights
    model = make_model(5)
    opt = make_optim(model)
    with CheckpointManager(ck, keep_local=None) as mgr:
        st = {"model": model, "optim": opt, "sched": make_sched(opt), "rng": RNGState(),
              "data": {"gen": torch.zeros_like(torch.Generator().get_state()), "epoch": 0}, "step": 0}
        assert mgr.restore(st) == 12
    assert_tree_equal(ref_model.state_dict(), model.state_dict(), "model@12")


def test_resume_without_rng_state_diverges(tmp_path):
    """Sanity check that the resume test can fail: restoring model/optim/sched but then
    using a different data order / dropout RNG gives different continued losses."""
    ck = tmp_path / "ck"
    ref_losses, *_ = _train_run(ck, 6, 3)
    model = make_model(77)
    opt = make_optim(model)
    sched = make_sched(opt, total=6)
    with CheckpointManager(ck, keep_local=None) as mgr:
        state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(),
                 "data": {"gen": torch.zeros_like(torch.Generator().get_state()), "epoch": 0}, "step": 0}
        assert mgr.restore(state, step=3) == 3
    gen = torch.Generator().manual_seed(1234)   # NOT the restored data-order state
    torch.manual_seed(4321)                     # NOT the restored dropout RNG
    losses = [train_step(model, opt, sched, gen) for _ in range(3)]
    assert losses != [ref_losses[s] for s in (4, 5, 6)]


# ----------------------------------------------------------------------------- 3
def _big_model(d=256):
    # large enough (d=256: ~12 MiB params + 24 MiB AdamW state; d=512: ~50 MiB params)
    # that the deferred copy is still running when the training loop touches the params
    return make_model(3, d=d, heads=4, layers=4, dropout=0.0)


@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["full-staging", "ring-1MiB"])
def test_async_snapshot_is_state_at_save_time(tmp_path, budget):
    """optimizer.step() runs immediately after save() returns; each checkpoint must
    hold the parameters/optimizer state as they were at save() time."""
    model = _big_model()
    opt = make_optim(model)
    sched = make_sched(opt)
    gen = torch.Generator().manual_seed(2)
    train_step(model, opt, sched, gen)  # optimizer state exists
    expected = {}
    kw = {} if budget is None else {"staging_budget_bytes": budget, "chunk_bytes": 256 << 10}
    with CheckpointManager(tmp_path / "ck", keep_local=None, snapshot="async", **kw) as mgr:
        for s in range(1, 5):
            x_loss = model(torch.randint(0, 97, (8, 16), generator=gen)).float().pow(2).mean()
            opt.zero_grad()
            x_loss.backward()
            expected[s] = (clone_tree(model.state_dict()), clone_tree(opt.state_dict()))
            before = model.tok.weight.detach().clone()
            mgr.save(s, {"model": model, "optim": opt, "sched": sched})
            opt.step()  # right after save() returns: must be guarded
            sched.step()
            assert not torch.equal(before, model.tok.weight), "step did not change params"
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4]
        if budget is not None:
            assert mgr.staging_bytes <= budget + (1 << 20)
        guard = [st.guard_wait_s for st in mgr.stats()]
        assert all(g >= 0 for g in guard)
        if budget is not None:
            # a 1 MiB ring cannot hold ~36 MiB of deferred state: optimizer.step() right
            # after save() must have been held back by the guard
            assert max(guard) > 0, f"guard never waited with a ring smaller than the state: {guard}"
    with CheckpointManager(tmp_path / "ck") as mgr:
        for s in range(1, 5):
            m2 = _big_model()
            o2 = make_optim(m2)
            assert mgr.restore({"model": m2, "optim": o2, "sched": make_sched(o2)}, step=s) == s
            assert_tree_equal(expected[s][0], m2.state_dict(), f"model@{s}")
            assert_tree_equal(expected[s][1], o2.state_dict(), f"optim@{s}")


def _mutate_in_place(model, extra):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
        extra.add_(100)


@pytest.mark.parametrize("mode", ["manager-eager", "save-eager", "wait-staged"])
def test_eager_snapshot_survives_in_place_mutation(tmp_path, mode):
    """Params mutated in place OUTSIDE any optimizer right after save() returns (eager
    modes) or after wait_staged(): the checkpoint still holds the values at save() time."""
    model = _big_model(512)
    extra = torch.arange(1 << 20, dtype=torch.float32)
    snap = "eager" if mode == "manager-eager" else "async"
    expected = {}
    with CheckpointManager(tmp_path / "ck", keep_local=None, snapshot=snap) as mgr:
        for s in (1, 2, 3):
            expected[s] = (clone_tree(model.state_dict()), extra.clone())
            if mode == "save-eager":
                h = mgr.save(s, {"model": model, "extra": extra}, eager=True)
            else:
                h = mgr.save(s, {"model": model, "extra": extra})
                if mode == "wait-staged":
                    h.wait_staged()
            _mutate_in_place(model, extra)
        mgr.wait()
        assert mgr.steps() == [1, 2, 3]
    with CheckpointManager(tmp_path / "ck") as mgr:
        for s in (1, 2, 3):
            m2 = _big_model(512)
            e2 = torch.zeros_like(extra)
            assert mgr.restore({"model": m2, "extra": e2}, step=s) == s
            assert_tree_equal(expected[s][0], m2.state_dict(), f"model@{s}")
            assert torch.equal(expected[s][1], e2), f"extra@{s}"


# ----------------------------------------------------------------------------- 4
def test_staging_memory_does_not_grow(tmp_path):
    """50 saves: staging pool allocated once (constant staging_bytes), RSS flat."""
    w = nn.Parameter(torch.randn(1 << 20))          # 4 MiB
    b = nn.Parameter(torch.randn(256, 1024))        # 1 MiB
    opt = torch.optim.SGD([w, b], lr=0.01, momentum=0.9)  # + 5 MiB momentum
    state_bytes = 2 * (w.numel() + b.numel()) * 4

    def step():
        w.grad = torch.ones_like(w)
        b.grad = torch.full_like(b, 0.5)
        opt.step()

    step()
    sizes, rss = [], {}
    with CheckpointManager(tmp_path / "ck", keep_local=2) as mgr:
        for i in range(1, 51):
            h = mgr.save(i, {"w": w, "b": b, "opt": opt, "i": i})  # the first allocates the pool behind save()
            step()
            h.wait()
            sizes.append(mgr.staging_bytes)
            if i in (10, 50):
                rss[i] = rss_bytes()
        stats = mgr.stats()
        assert len(stats) == 50 and all(s.ok for s in stats)
        assert mgr.steps() == [49, 50]
    first = sizes[0]
    assert first >= state_bytes * 0.9, f"staging {first} smaller than the state {state_bytes}"
    assert first <= state_bytes * 2.5, f"staging {first} far larger than the state {state_bytes}"
    assert set(sizes) == {first}, f"staging_bytes changed across saves: {sorted(set(sizes))}"
    assert all(s.staging_bytes == first for s in stats[1:])
    growth = rss[50] - rss[10]
    assert growth < 16 << 20, f"RSS grew {growth / 2**20:.1f} MiB between save 10 and 50"
    # restore of the last one
    w2, b2 = torch.zeros_like(w), torch.zeros_like(b)
    with CheckpointManager(tmp_path / "ck") as mgr:
        st = {"w": w2, "b": b2, "opt": torch.optim.SGD([nn.Parameter(w2), nn.Parameter(b2)], lr=0.01, momentum=0.9), "i": 0}
        assert mgr.restore(st) == 50
    assert st["i"] == 50


# ----------------------------------------------------------------------------- 5
def test_back_to_back_saves_wait_for_previous(tmp_path):
    """Saves issued back to back on a ~48 MiB state: a later save waits for the one still
    writing (wait_prev_s > 0), every step commits and restores to its own values."""
    # four distinct states of 3 x 16 MiB, saved back to back with nothing in between
    states = {s: {"p": {str(i): torch.randn(4 << 20, generator=torch.Generator().manual_seed(10 * s + i))
                        for i in range(3)}, "s": s} for s in (1, 2, 3, 4)}
    expected = {s: [t.clone() for t in st["p"].values()] for s, st in states.items()}
    handles = []
    ck = tmp_path / "ck"
    with CheckpointManager(ck, keep_local=None, snapshot="async") as mgr:
        for s in (1, 2, 3, 4):
            handles.append(mgr.save(s, states[s]))
        stats = [h.wait() for h in handles]
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4]
        all_stats = mgr.stats()
    assert [s.step for s in stats] == [1, 2, 3, 4]
    assert all(s.ok and s.error in (None, "") for s in stats)
    assert sorted(s.step for s in all_stats) == [1, 2, 3, 4]
    assert stats[0].wait_prev_s < 0.005, f"first save waited {stats[0].wait_prev_s}"
    waits = [s.wait_prev_s for s in stats[1:]]
    assert max(waits) > 0.001, f"no save waited for the previous one: {waits} (total_s={[s.total_s for s in stats]})"
    for s in stats:
        assert s.bytes_total >= 48 << 20
        assert s.total_s >= s.write_s >= 0 and s.stall_s >= 0
        d = s.as_dict()
        assert d["step"] == s.step and d["wait_prev_s"] == s.wait_prev_s
    lines = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert sorted(x["step"] for x in lines) == [1, 2, 3, 4]
    with CheckpointManager(ck) as mgr:
        for s in (1, 2, 3, 4):
            tmpl = {"p": {str(i): torch.zeros(4 << 20) for i in range(3)}, "s": 0}
            assert mgr.restore(tmpl, step=s) == s
            assert tmpl["s"] == s
            for i in range(3):
                assert torch.equal(tmpl["p"][str(i)], expected[s][i]), f"step {s} tensor {i}"

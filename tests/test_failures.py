"""User-side failure tests: background save failures (real faults), double saves,
mismatched restores, non-JSON state, on-disk corruption, the verify CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

from checkpointing import CheckpointConfigError, CheckpointCorruptError, CheckpointError, CheckpointManager, CheckpointMismatchError, CheckpointSaveError

from _models import child_env, step_dir_name


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _committed_dirs(ck):
    return sorted(p.name for p in ck.iterdir() if p.is_dir() and (p / "COMMIT").is_file())


def test_error_hierarchy():
    for cls in (CheckpointSaveError, CheckpointCorruptError, CheckpointMismatchError, CheckpointConfigError):
        assert issubclass(cls, CheckpointError), cls


# ----------------------------------------------------------------------------- background failures
def _wait_done(h, timeout=20.0):
    t0 = time.monotonic()
    while not h.done():
        assert time.monotonic() - t0 < timeout, "save never finished"
        time.sleep(0.01)


@pytest.mark.parametrize("surface", ["wait", "next-save", "mgr-wait"])
def test_failure_step_path_is_a_file(tmp_path, surface):
    """Real fault: `local_dir/step-0000000007` pre-exists as a regular FILE, so the step
    directory cannot be created. The error names step 7 and surfaces (in save() itself,
    or at the next h.wait()/mgr.wait()/save()); nothing is committed for 7; step 5 stays
    restorable; the next save works."""
    ck = tmp_path / "ck"
    w = torch.randn(1 << 16)
    mgr = CheckpointManager(ck, keep_local=None)
    try:
        mgr.save(5, {"w": w, "n": 5}).wait()
        exp5 = w.clone()
        (ck / step_dir_name(7)).write_text("I am a file, not a directory\n")
        w.add_(1.0)
        sync_err = None
        try:
            h = mgr.save(7, {"w": w, "n": 7})
        except CheckpointError as e:  # failing synchronously is acceptable too
            sync_err = e
        if sync_err is not None:
            err = sync_err
        elif surface == "wait":
            with pytest.raises(CheckpointSaveError) as ei:
                h.wait()
            err = ei.value
        elif surface == "mgr-wait":
            with pytest.raises(CheckpointSaveError) as ei:
                mgr.wait()
            err = ei.value
        else:
            _wait_done(h)
            with pytest.raises(CheckpointSaveError) as ei:
                mgr.save(8, {"w": w, "n": 8})
            err = ei.value
        assert "7" in str(err), f"error does not name step 7: {err}"
        if isinstance(err, CheckpointSaveError):
            assert err.step == 7
        # nothing committed for 7, step 5 intact
        assert (ck / step_dir_name(7)).is_file()
        assert mgr.steps() == [5] and mgr.latest_step() == 5
        assert _committed_dirs(ck) == [step_dir_name(5)]
        # the next save works (the error is reported once)
        w.add_(1.0)
        exp8 = w.clone()
        st = mgr.save(8, {"w": w, "n": 8}).wait()
        assert st.ok and st.step == 8
        mgr.wait()
        assert mgr.steps() == [5, 8]
        t = {"w": torch.zeros_like(w), "n": 0}
        assert mgr.restore(t, step=5) == 5 and torch.equal(t["w"], exp5) and t["n"] == 5
        assert mgr.restore(t) == 8 and torch.equal(t["w"], exp8) and t["n"] == 8
    finally:
        mgr.close()
    ok = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert {x["step"] for x in ok if x.get("ok", True)} >= {5, 8}
    assert any(x["step"] == 7 and x.get("ok") is False for x in ok), "failed save 7 not in metrics.jsonl"


def test_stray_file_named_like_step_dir_does_not_break_open(tmp_path):
    """A regular FILE named like a step directory (the fault above, left behind) must not
    make CheckpointManager() fail to open the directory; committed steps stay usable."""
    ck = tmp_path / "ck"
    w = torch.arange(8.0)
    with CheckpointManager(ck, keep_local=None) as mgr:
        mgr.save(5, {"w": w}).wait()
    (ck / step_dir_name(7)).write_text("stray\n")
    with CheckpointManager(ck, keep_local=None) as mgr:
        assert mgr.steps() == [5]
        t = {"w": torch.zeros(8)}
        assert mgr.restore(t) == 5 and torch.equal(t["w"], w)
        mgr.save(9, {"w": w + 1}).wait()
        assert mgr.steps() == [5, 9]


_FSIZE_CHILD = textwrap.dedent(r"""
    import json, resource, signal, sys, time
    import torch
    torch.set_num_threads(1)
    from checkpointing import CheckpointManager, CheckpointSaveError, CheckpointError

    ck = sys.argv[1]
    out = {}
    mgr = CheckpointManager(ck, keep_local=None)
    mgr.save(1, {"w": torch.arange(1000.0)}).wait()
    big = {"w": torch.randn(2 << 20)}                   # 8 MiB, over the file size limit
    # a real I/O fault that root cannot bypass: files may not grow beyond 1 MiB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    # (a) the error surfaces at h.wait()
    h = mgr.save(2, big)
    out["save2_returned"] = True
    try:
        h.wait()
        out["wait2"] = "no error"
    except CheckpointSaveError as e:
        out["wait2"] = {"type": type(e).__name__, "msg": str(e), "step": e.step}
    out["steps_after_2"] = mgr.steps()
    mgr.save(3, {"w": torch.arange(1000.0) + 3}).wait()
    out["steps_after_3"] = mgr.steps()

    # (b) the error surfaces at the next save(), once
    h = mgr.save(4, big)
    t0 = time.monotonic()
    while not h.done() and time.monotonic() - t0 < 20:
        time.sleep(0.01)
    try:
        mgr.save(5, {"w": torch.arange(1000.0) + 5})
        out["save5_first"] = "no error"
    except CheckpointSaveError as e:
        out["save5_first"] = {"type": type(e).__name__, "msg": str(e), "step": e.step}
    except CheckpointError as e:
        out["save5_first"] = {"type": type(e).__name__, "msg": str(e), "step": None}
    try:
        mgr.save(5, {"w": torch.arange(1000.0) + 5}).wait()
        out["save5_second"] = "ok"
    except CheckpointError as e:
        out["save5_second"] = f"{type(e).__name__}: {e}"
    mgr.wait()
    out["steps_final"] = mgr.steps()
    mgr.close()
    print("RESULT " + json.dumps(out))
""")


def test_background_io_failure_file_size_limit(tmp_path):
    """A real background write failure (RLIMIT_FSIZE: EFBIG) in a child process: save()
    returns, the error is raised at h.wait() / at the next save() naming the step, no
    COMMIT is left for the failed steps, earlier steps stay restorable, later saves work."""
    script = tmp_path / "child.py"
    script.write_text(_FSIZE_CHILD)
    ck = tmp_path / "ck"
    p = subprocess.run([sys.executable, str(script), str(ck)], env=child_env(),
                       capture_output=True, text=True, timeout=120)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child failed rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["save2_returned"]
    assert isinstance(out["wait2"], dict), f"h.wait() of a failed write did not raise: {out}"
    assert out["wait2"]["step"] == 2 and "2" in out["wait2"]["msg"]
    assert out["steps_after_2"] == [1]
    assert out["steps_after_3"] == [1, 3]
    assert isinstance(out["save5_first"], dict), f"next save() did not raise the background error: {out}"
    assert out["save5_first"]["step"] == 4 and "4" in out["save5_first"]["msg"], out
    assert out["save5_second"] == "ok", out
    assert out["steps_final"] == [1, 3, 5]
    # on disk: no commit marker for the failed steps
    for s in (2, 4):
        assert not (ck / step_dir_name(s)).exists()  # a failed save leaves no file, nor its directory
    assert _committed_dirs(ck) == [step_dir_name(s) for s in (1, 3, 5)]
    with CheckpointManager(ck) as mgr:
        for s, off in ((1, 0), (3, 3), (5, 5)):
            t = {"w": torch.zeros(1000)}
            assert mgr.restore(t, step=s) == s
            assert torch.equal(t["w"], torch.arange(1000.0) + off)
        assert mgr.latest_step() == 5


# ----------------------------------------------------------------------------- misuse
def test_saving_committed_step_raises(tmp_path):
    w = torch.arange(10.0)
    with CheckpointManager(tmp_path / "ck", keep_local=None) as mgr:
        mgr.save(3, {"w": w}).wait()
        with pytest.raises(CheckpointError) as ei:
            mgr.save(3, {"w": w + 1}).wait()
        assert "3" in str(ei.value)
        assert mgr.steps() == [3]
        # manager still usable
        mgr.save(4, {"w": w + 2}).wait()
    with CheckpointManager(tmp_path / "ck") as mgr:
        t = {"w": torch.zeros(10)}
        assert mgr.restore(t, step=3) == 3 and torch.equal(t["w"], w), "committed step was overwritten"


def test_restore_mismatch_lists_every_problem(tmp_path):
    torch.manual_seed(0)
    saved = {
        "model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        "shape_bad": torch.zeros(3, 4),
        "dtype_bad": torch.zeros(5, dtype=torch.float32),
        "only_in_ckpt": torch.ones(2),
        "fine": torch.arange(6.0),
    }
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, saved).wait()
    target = {
        "model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.ReLU(), nn.Linear(3, 1)),
        "shape_bad": torch.zeros(5, 4),
        "dtype_bad": torch.zeros(5, dtype=torch.float64),
        "only_in_state": torch.ones(2),
        "fine": torch.zeros(6),
    }
    with CheckpointManager(tmp_path / "ck") as mgr:
        with pytest.raises(CheckpointMismatchError) as ei:
            mgr.restore(target)
    msg = str(ei.value)
    for needle in ("shape_bad", "dtype_bad", "only_in_ckpt", "only_in_state",
                   "2.weight", "2.bias", "4.weight", "4.bias"):
        assert needle in msg, f"mismatch message does not name {needle!r}:\n{msg}"
    assert "5,4" in msg.replace(" ", ""), f"shape (5, 4) not named:\n{msg}"
    assert "float64" in msg and "float32" in msg, msg


def test_a_module_passed_where_the_state_dict_goes_gets_a_clear_error(tmp_path):
    """save(step, model) and restore(model): the dict of what to save is missing; StateError says so."""
    from checkpointing.errors import StateError

    net = nn.Linear(3, 2)
    with CheckpointManager(tmp_path / "ck") as mgr:
        with pytest.raises(StateError, match=r"dict .*'model': model.*got Linear"):
            mgr.save(1, net)
        mgr.save(2, {"model": net}).wait()
        with pytest.raises(StateError, match=r"restore\(\) needs the dict .*got Linear"):
            mgr.restore(net)
        assert mgr.steps() == [2]


def test_restore_without_checkpoint_returns_none(tmp_path):
    t = {"w": torch.arange(4.0), "n": 3}
    with CheckpointManager(tmp_path / "fresh") as mgr:
        assert mgr.latest_step() is None and mgr.steps() == []
        assert mgr.restore(t) is None
    assert torch.equal(t["w"], torch.arange(4.0)) and t["n"] == 3
    # a crashed (uncommitted) step directory is invisible too
    ck = tmp_path / "crashed"
    with CheckpointManager(ck) as mgr:
        mgr.save(9, {"w": torch.ones(4), "n": 9}).wait()
    (ck / step_dir_name(9) / "COMMIT").unlink()
    with CheckpointManager(ck) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        assert mgr.restore(t) is None
    assert torch.equal(t["w"], torch.arange(4.0)) and t["n"] == 3


class _Custom:
    def __init__(self):
        self.x = 1


@pytest.mark.parametrize("bad,needle", [
    ({"cfg": {"tag_set": {1, 2, 3}}}, "tag_set"),
    ({"my_custom_obj": _Custom()}, "my_custom_obj"),
    ({"cfg": {"lst": [1, 2, {"deep_fn": len}]}}, "deep_fn"),
], ids=["set", "custom-class", "function-in-list"])
def test_non_json_state_raises_at_save(tmp_path, bad, needle):
    ck = tmp_path / "ck"
    with CheckpointManager(ck) as mgr:
        with pytest.raises(CheckpointError) as ei:
            mgr.save(1, {"w": torch.ones(3), **bad})
        assert needle in str(ei.value), f"message does not name the key {needle!r}: {ei.value}"
        assert mgr.steps() == []
        # the manager stays usable, step 1 is still free
        mgr.save(1, {"w": torch.ones(3)}).wait()
        assert mgr.steps() == [1]


# ----------------------------------------------------------------------------- corruption
STEP = 4321
KEY = "weights_blob"


def _make_ckpt(ck):
    w = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))  # 4 MiB
    with CheckpointManager(ck, keep_local=None) as mgr:
        mgr.save(STEP, {KEY: w}).wait()
    packs = sorted((ck / step_dir_name(STEP)).glob("*.pack"))
    assert packs, list((ck / step_dir_name(STEP)).iterdir())
    return w, max(packs, key=lambda p: p.stat().st_size)


def _verify(ck):
    return subprocess.run([sys.executable, "-m", "checkpointing", "verify", str(ck)],
                          env=child_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corruption_detected(tmp_path, damage):
    ck = tmp_path / "ck"
    w, pack = _make_ckpt(ck)
    # clean: restore works and verify succeeds
    with CheckpointManager(ck) as mgr:
        t = {KEY: torch.zeros_like(w)}
        assert mgr.restore(t) == STEP and torch.equal(t[KEY], w)
    r = _verify(ck)
    assert r.returncode == 0, f"verify failed on a clean dir:\n{r.stdout}\n{r.stderr}"

    size = pack.stat().st_size
    if damage == "flip":
        with open(pack, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))
    elif damage == "truncate":
        with open(pack, "r+b") as f:
            f.truncate(size // 2)
    else:
        pack.unlink()

    with CheckpointManager(ck) as mgr:
        t = {KEY: torch.zeros_like(w)}
        with pytest.raises(CheckpointCorruptError) as ei:
            mgr.restore(t, step=STEP)
    msg = str(ei.value)
    assert str(STEP) in msg, f"does not name the step: {msg}"
    assert pack.name in msg, f"does not name the file {pack.name}: {msg}"
    if damage != "delete":
        assert KEY in msg, f"does not name the key: {msg}"
    r = _verify(ck)
    assert r.returncode != 0, f"verify passed a damaged dir ({damage}):\n{r.stdout}\n{r.stderr}"


def test_corrupt_manifest_detected(tmp_path):
    ck = tmp_path / "ck"
    w, _ = _make_ckpt(ck)
    man = sorted((ck / step_dir_name(STEP)).glob("manifest.*.json"))
    assert len(man) == 1
    text = man[0].read_text()
    man[0].write_text(text[: len(text) // 2])
    with CheckpointManager(ck) as mgr:
        with pytest.raises(CheckpointCorruptError) as ei:
            mgr.restore({KEY: torch.zeros_like(w)}, step=STEP)
    assert str(STEP) in str(ei.value)
    assert _verify(ck).returncode != 0


def test_cli_ls_and_inspect_on_clean_dir(tmp_path):
    ck = tmp_path / "ck"
    _make_ckpt(ck)
    for cmd in ("ls", "inspect"):
        r = subprocess.run([sys.executable, "-m", "checkpointing", cmd, str(ck)], env=child_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{cmd}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
        assert str(STEP) in r.stdout, f"{cmd} output does not mention step {STEP}:\n{r.stdout}"

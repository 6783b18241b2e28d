"""Pipelined saves: chunks written by the write-behind thread while later chunks are still staged.

With write_block_bytes=1 MiB every MiB of changed chunks is handed to the `ckpt-write` thread during
staging, so these states exercise the pipelined path many times per save: unaligned tensors (pages
shared by chunks of two batches), incremental saves where only some chunks changed (the unchanged
ones are decided at the end), eager chunks (buffers) staged before the pack is opened, and a real
write failure on the write-behind thread (RLIMIT_FSIZE in a child process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn

from checkpointing import CheckpointManager, load
from checkpointing.tier import catalog, verify

from _models import child_env, step_dir_name

MiB = 1 << 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.a = nn.Linear(1000, 997)  # odd sizes: every chunk after the first lies off page boundaries
    m.b = nn.Linear(997, 1531)
    m.register_buffer("stats", torch.randn(333))  # a buffer: staged eagerly, inside save()
    return m


def _snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_pipelined_full_and_incremental_saves_restore_bit_exact(tmp_path):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    want = {}
    with CheckpointManager(tmp_path / "ck", keep_local=None, write_block_bytes=MiB) as mgr:
        state_bytes = sum(t.numel() * t.element_size() for t in m.state_dict().values())
        st1 = mgr.save(1, {"m": m}).wait()
        want[1] = _snapshot(m)
        with torch.no_grad():
            m.b.weight[:400] += 1.0  # some chunks of b change, a stays the same
        st2 = mgr.save(2, {"m": m}).wait()
        want[2] = _snapshot(m)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.5)  # every chunk changes
            m.stats.add_(1.0)
        st3 = mgr.save(3, {"m": m, "opt": opt}).wait()
        want[3] = _snapshot(m)

        assert st1.bytes_total == state_bytes
        # a page at most per handed-over batch of at least 1 MiB may be written twice, never more
        assert state_bytes <= st1.bytes_written <= state_bytes + (state_bytes // MiB + 2) * 2 * 4096, st1
        assert 0 < st2.bytes_reused < st2.bytes_total, st2  # a's chunks taken from step 1
        assert st2.bytes_written < st1.bytes_written // 2, st2
        assert st3.bytes_reused == 0, st3
        for step in (1, 2, 3):
            assert verify.verify_step(mgr.storage, step).ok
            target = _model()
            with torch.no_grad():
                for t in target.state_dict().values():
                    t.zero_()
            assert mgr.restore({"m": target}, step=step, only="m") == step
            got = target.state_dict()
            for k, v in want[step].items():
                assert torch.equal(got[k], v), (step, k)
    loaded = load(tmp_path / "ck", step=3, keys="m")["m"]
    assert all(torch.equal(loaded[k], v) for k, v in want[3].items())


_FSIZE_CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    import torch
    torch.set_num_threads(1)
    from checkpointing import CheckpointManager, CheckpointSaveError

    ck = sys.argv[1]
    out = {}
    mgr = CheckpointManager(ck, keep_local=None, write_block_bytes=1 << 20)
    mgr.save(1, {"w": torch.arange(1000.0)}).wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, resource.RLIM_INFINITY))  # files stop at 3 MiB
    h = mgr.save(2, {"w": torch.randn(4 << 20)})  # 16 MiB: the write-behind thread hits the limit
    try:
        h.wait()
        out["wait2"] = "no error"
    except CheckpointSaveError as e:
        out["wait2"] = {"msg": str(e), "step": e.step}
    mgr.save(3, {"w": torch.arange(1000.0) + 3}).wait()
    out["steps"] = mgr.steps()
    mgr.close()
    print("RESULT " + json.dumps(out))
""")


def test_a_failed_write_behind_fails_the_save_and_nothing_else(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_FSIZE_CHILD)
    ck = tmp_path / "ck"
    p = subprocess.run([sys.executable, str(script), str(ck)], env=child_env(), capture_output=True, text=True, timeout=120)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child failed rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert isinstance(out["wait2"], dict) and out["wait2"]["step"] == 2, out
    assert out["steps"] == [1, 3], out
    assert not (ck / step_dir_name(2) / "COMMIT").exists()
    assert not list(ck.glob(f"{step_dir_name(2)}/*.pack"))  # the partial pack was removed
    with CheckpointManager(ck, read_only=True) as mgr:
        for step, off in ((1, 0.0), (3, 3.0)):
            t = {"w": torch.zeros(1000)}
            assert mgr.restore(t, step=step) == step
            assert torch.equal(t["w"], torch.arange(1000.0) + off)
        assert catalog.list_steps(mgr.storage).committed == [1, 3]

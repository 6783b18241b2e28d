"""Restore fills the user's preallocated tensors in place: no staging buffer, no second copy.

A fresh process (as a resumed job is) builds its model and optimizer, then restores a step into
them; its peak RSS (VmHWM) may grow by far less than the state's size, every parameter and optimizer
state tensor keeps its storage (data_ptr), and the values are the saved ones.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import torch

from _models import child_env
from checkpointing import CheckpointManager

_BUILD = r"""
import torch
def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # 12 x 4 MiB weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()  # creates exp_avg / exp_avg_sq: the state is about 3 x 48 MiB
    return model, opt
"""

_PROBE = _BUILD + r"""
import sys, json, hashlib
torch.set_num_threads(1)
from checkpointing import CheckpointManager
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
model, opt = build()
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
tensors = list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
ptrs = [t.data_ptr() for t in tensors]
mgr = CheckpointManager(sys.argv[1])
before = hwm()
step = mgr.restore({"model": model, "optim": opt})
after = hwm()
mgr.close()
print(json.dumps({"step": step, "before": before, "after": after,
                  "in_place": ptrs == [t.data_ptr() for t in (list(model.parameters())
                                       + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()])],
                  "digests": [hashlib.sha256(t.detach().numpy().tobytes()).hexdigest() for t in tensors]}))
"""


def test_restore_reads_into_the_targets_without_a_staging_copy(tmp_path):
    scope: dict = {}
    exec(_BUILD, scope)
    model, opt = scope["build"]()
    tensors = list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(7, {"model": model, "optim": opt}).wait()
    done = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "ck")], capture_output=True, text=True, timeout=180,
                          env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["step"] == 7
    assert probe["in_place"], "a parameter or optimizer state tensor was replaced instead of filled"
    assert probe["digests"] == [hashlib.sha256(t.detach().numpy().tobytes()).hexdigest() for t in tensors]
    growth = probe["after"] - probe["before"]
    assert state_bytes > 100 << 20
    assert growth < state_bytes / 8, f"peak RSS grew by {growth / 2**20:.0f} MiB restoring {state_bytes / 2**20:.0f} MiB"

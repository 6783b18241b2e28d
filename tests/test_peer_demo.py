"""The demo's two-node scenario (`examples/demo.py --peers --quick`): two gloo processes save with peer
copies, node 1's directory is deleted, node 1 restores bit-exactly from node 0's copy, and (with the
embedded S3 on 127.0.0.1) once more from object storage alone, for comparison."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _models import child_env

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


@pytest.mark.timeout(300)
def test_the_peer_demo_restores_a_lost_node_from_its_neighbour(tmp_path):
    pytest.importorskip("moto.server")
    env = child_env()
    env.pop("COLUMNS", None)
    base = tmp_path / "peers"
    r = subprocess.run([sys.executable, str(DEMO), "--peers", "--quick", "--remote", "embedded", "--dir", str(base)], env=env,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-15000:]  # both ranks write to stderr: the first failure may be far up
    out = " ".join(r.stdout.split())
    assert "local+peer+remote" in out, r.stdout[-3000:]
    assert "rank 0: restored step 12" in out and "rank 1: restored step 12" in out and "DIFFERENT" not in out, r.stdout[-3000:]
    assert out.count("bit-exact") == 3, r.stdout[-3000:]  # both ranks from the peer copy, rank 1 again from S3
    assert "fetched back step 12" in out and "from the peer copy" in out, r.stdout[-3000:]
    assert "restored step 12 from the remote tier" in out and "of the" in out and "from object storage" in out, r.stdout[-3000:]

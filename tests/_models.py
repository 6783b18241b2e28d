"""Test helpers: a tiny transformer, a training step, deterministic states and
exact-comparison helpers.  Used by test_training.py, test_failures.py and
test_crash.py (also imported by the crash child script)."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = Path(__file__).resolve().parent

VOCAB = 97
SEQ = 16


# --------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Decoder-only LM: token + position embeddings, pre-LN blocks, final LayerNorm,
    output head whose weight is TIED to the token embedding (shared Parameter)."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, vocab: int = VOCAB,
                 seq: int = SEQ, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        nn.init.normal_(self.tok.weight, std=0.02)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.int64))
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        T = idx.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
        x = self.drop(self.tok(idx) + self.pos[:T])
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


def make_model(seed: int = 0, **kw) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kw)


def make_optim(model: nn.Module, lr: float = 3e-3) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def make_sched(opt: torch.optim.Optimizer, total: int = 100):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=1e-5)


def make_batch(gen: torch.Generator, batch: int = 8, seq: int = SEQ, vocab: int = VOCAB):
    data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def train_step(model, opt, sched, gen) -> float:
    """One step; uses `gen` for data order and the GLOBAL torch RNG for dropout."""
    model.train()
    x, y = make_batch(gen)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    with torch.no_grad():
        model.step_count += 1
    return loss.item()


# --------------------------------------------------------------------------- comparisons
def clone_tree(obj):
    """Deep copy of (nested) state_dict-like structures with tensors cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def _same_scalar(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return type(a) is type(b) and a == b


def assert_tree_equal(a, b, path: str = "", tuples_as_lists: bool = False):
    """Bit-exact structural equality (tensors: dtype, shape and torch.equal; floats:
    nan==nan and signed zeros; python types must match)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: expected tensor, got {type(b)}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if a.is_floating_point():
            # bit-exact, including nan payload positions and -0.0
            ai = a.detach().contiguous().view(_int_view(a.dtype))
            bi = b.detach().contiguous().view(_int_view(b.dtype))
            assert torch.equal(ai, bi), f"{path}: tensor values differ"
        else:
            assert torch.equal(a, b), f"{path}: tensor values differ"
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: expected ndarray, got {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: array values differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: expected dict, got {type(b)}"
        assert list(a.keys()) == list(b.keys()) or set(a.keys()) == set(b.keys()), \
            f"{path}: keys {sorted(map(repr, a))} != {sorted(map(repr, b))}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}", tuples_as_lists)
        return
    if isinstance(a, (list, tuple)):
        if tuples_as_lists:
            assert isinstance(b, (list, tuple)), f"{path}: expected sequence, got {type(b)}"
        else:
            assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]", tuples_as_lists)
        return
    assert _same_scalar(a, b), f"{path}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"


def _int_view(dtype):
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]


# --------------------------------------------------------------------------- misc
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def child_env() -> dict:
    """Environment for subprocesses: the repo importable, one torch thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    return env


# --------------------------------------------------------------------------- crash-test state
class CrashNet(nn.Module):
    """~6 MB of parameters whose values are a pure function of the step."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(1024, 1024)
        self.fc2 = nn.Linear(1024, 512)
        self.norm = nn.LayerNorm(512)


CRASH_SHAPES = {"fc1.weight": (1024, 1024), "fc1.bias": (1024,), "fc2.weight": (512, 1024),
                "fc2.bias": (512,), "norm.weight": (512,), "norm.bias": (512,)}


def crash_expected(step: int) -> dict:
    """The exact parameter values the crash child holds at `step` (a pure function)."""
    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    return {name: torch.randn(shape, generator=g) for name, shape in CRASH_SHAPES.items()}


def crash_const() -> torch.Tensor:
    """A 2 MB tensor that never changes across steps (incremental reuse under retention)."""
    g = torch.Generator().manual_seed(4242)
    return torch.randn(512, 1024, generator=g)


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def crash_state() -> tuple[nn.Module, torch.Tensor, dict]:
    """A crash child's model, constant tensor and the state dict that saves both."""
    net = CrashNet()
    const = torch.zeros(512, 1024)
    return net, const, {"model": net, "const": const, "meta": {"step": -1, "tag": ""}}


def resume_crash_child(mgr, net: nn.Module, const: torch.Tensor, state: dict) -> int:
    """Restore a crash child; exit 3 (printing RESUME_MISMATCH) unless the state is exactly the
    restored step's. Prints READY <start> and returns the step it resumed at (0 on a fresh run)."""
    start = mgr.restore(state)
    if start is None:
        start = 0
    else:
        exp = crash_expected(start)
        sd = net.state_dict()
        bad = [k for k in exp if not torch.equal(sd[k], exp[k])]
        if bad or not torch.equal(const, crash_const()) or state["meta"] != {"step": start, "tag": "crash"}:
            print(f"RESUME_MISMATCH {start} {bad} {state['meta']}", flush=True)
            sys.exit(3)
    const.copy_(crash_const())
    print(f"READY {start}", flush=True)
    return start


if __name__ == "__main__":  # pragma: no cover
    sys.exit("helper module")

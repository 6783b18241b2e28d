"""Stateful helpers users put in their state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Captures and restores the torch (CPU and CUDA), numpy global and python `random` generators.

        state = {"model": model, "optim": opt, "rng": RNGState()}
        mgr.restore(state)   # the generators continue exactly where the saved run was
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        sd: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "numpy": {"name": np_name, "keys": np_keys, "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        py = sd["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        n = sd["numpy"]
        np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(sd["cuda"]))

"""numpy arrays as state values: shapes kept (0-d too), and a dtype torch lacks refused by key."""

from __future__ import annotations

import numpy as np
import pytest

import checkpointing
from checkpointing import CheckpointManager, StateError


def test_numpy_arrays_keep_their_shape_through_save_load_and_restore(tmp_path):
    saved = {"scalar": np.array(3.5), "vec": np.arange(6, dtype=np.int64), "strided": np.arange(12.0).reshape(3, 4)[:, ::2]}
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, saved).wait()
    loaded = checkpointing.load(tmp_path / "ck")
    for key, value in saved.items():
        assert np.asarray(loaded[key]).shape == value.shape and np.array_equal(np.asarray(loaded[key]), value), key
    target = {"scalar": np.array(0.0), "vec": np.zeros(6, dtype=np.int64), "strided": np.zeros((3, 2))}
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.restore(target) == 1
    for key, value in saved.items():
        assert target[key].shape == value.shape and np.array_equal(target[key], value), key


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble])
def test_a_numpy_dtype_torch_lacks_is_refused_naming_the_key(tmp_path, dtype):
    if np.dtype(dtype).itemsize <= 8 or np.dtype(dtype) in (np.dtype(np.float64), np.dtype(np.complex128)):
        pytest.skip("longdouble is float64 on this platform")
    with CheckpointManager(tmp_path / "ck") as mgr:
        with pytest.raises(StateError, match=r"state\['opt/ema'\] is a numpy array of dtype .*astype"):
            mgr.save(1, {"opt": {"ema": np.arange(3, dtype=dtype)}})

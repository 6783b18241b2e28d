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


@pytest.mark.parametrize("target, why", [
    (np.zeros(4)[::-1], r"a reversed view: torch cannot write through negative strides; pass np.ascontiguousarray\(a\)"),
    (np.zeros(4, dtype=">f8"), r"not in native byte order"),
    (np.frombuffer(bytes(32), dtype=np.float64), r"read-only: pass a writable array"),
], ids=["reversed", "big-endian", "read-only"])
def test_a_numpy_target_restore_cannot_write_into_is_named_before_anything_is_read(tmp_path, target, why):
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.arange(4.0), "a": np.arange(4.0)}).wait()
        before = np.full(4, -1.0)
        with pytest.raises(checkpointing.CheckpointMismatchError, match=r"a: saved float64\[4\], target is numpy .*" + why):
            mgr.restore({"w": before, "a": target})
        assert np.array_equal(before, np.full(4, -1.0))


@pytest.mark.parametrize("value", [np.ma.masked_invalid([0.5, np.nan, 0.25]), np.matrix([[1.0, 2.0]])], ids=["masked", "matrix"])
def test_a_numpy_subclass_is_refused_at_save_not_saved_without_its_own_data(tmp_path, value):
    with CheckpointManager(tmp_path / "ck") as mgr:
        with pytest.raises(StateError, match=r"state\['m'\] is a numpy\..*subclass of numpy.ndarray whose own data would be lost"):
            mgr.save(1, {"m": value})
        mgr.save(2, {"m": np.asarray(value)}).wait()  # as the error says


def test_a_memory_mapped_array_is_saved_as_the_array_it_is(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(6.0))
    mapped = np.load(path, mmap_mode="r")
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"a": mapped}).wait()
    assert np.array_equal(np.asarray(checkpointing.load(tmp_path / "ck")["a"]), np.arange(6.0))

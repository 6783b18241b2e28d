"""Byte views of tensor memory, for copies and reads that bypass torch (pure: no I/O)."""

from __future__ import annotations

import ctypes

import torch


def tensor_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy). Keep `t` alive."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")

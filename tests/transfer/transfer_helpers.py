"""Helpers shared by the transfer tests (a uniquely named module: test folders share sys.path)."""

from __future__ import annotations

import numpy as np


def bf16_weights(n: int, seed: int = 0) -> np.ndarray:
    """n bf16 values from normal(0, 0.02), as uint16 bit patterns (numpy has no bfloat16)."""
    x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    return (x.view(np.uint32) >> 16).astype(np.uint16)

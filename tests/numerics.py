"""The error measure every test and GPU check uses: rel-RMS in float64."""

from __future__ import annotations

import math

import numpy as np


def as_float64(value) -> np.ndarray:
    """numpy, JAX or torch arrays (bf16 included) as float64; torch itself is not imported."""
    if hasattr(value, "detach"):  # a torch tensor (bf16 ones have no numpy view)
        value = value.detach().float().cpu().numpy()
    return np.asarray(value).astype(np.float64)


def rel_rms(out, expected) -> float:
    """||out - expected||_2 / ||expected||_2 in float64; 0 or inf when expected is all zeros; nan if out is."""
    out, expected = as_float64(out), as_float64(expected)
    if out.shape != expected.shape:
        raise ValueError(f"out: shape {out.shape} does not match expected {expected.shape}")
    err = float(np.linalg.norm((out - expected).ravel()))
    ref = float(np.linalg.norm(expected.ravel()))
    if ref == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / ref

"""What the kernels ask of the device they run on: one place for the probes, so every backend declines alike."""

from __future__ import annotations

import jax

H200_NUM_SMS = 132  # the machine the defaults were measured on; a device that does not report its SMs is taken as one


def is_gpu() -> bool:
    return jax.default_backend() == "gpu"


def is_hopper() -> bool:
    """An sm_90 GPU (wgmma, TMA): what the Mosaic GPU kernels need."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


def hopper_reason() -> str | None:
    """None on an sm_90 GPU, else the decline reason the Mosaic GPU kernels give."""
    if is_hopper():
        return None
    return f"backend: wgmma needs an sm_90 GPU (or interpret=True), got {jax.devices()[0].device_kind!r}"


def num_sms() -> int:
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else H200_NUM_SMS

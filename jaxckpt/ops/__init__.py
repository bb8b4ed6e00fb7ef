"""Checkpointed prefill ops: one public entry per op with `implementation=`, and its paged-pool form.

Each op folder holds the float64 `reference`, the portable `xla` path and GPU kernels (`pallas_*`) behind `api.py`;
each implementation's tuning is a typed config (`config=`), which also picks the implementation it tunes.
"""

from jaxckpt.ops.common.configs import (DeltaPallasMosaicGpuConfig, DeltaPallasTritonConfig, SequenceParallelConfig,
                                       SsdPallasMosaicGpuConfig, SsdPallasTritonConfig, XlaConfig)
from jaxckpt.ops.conv1d.api import causal_conv1d, causal_conv1d_paged
from jaxckpt.ops.delta_rule.api import gated_delta_rule, gated_delta_rule_paged, kda, kda_paged
from jaxckpt.ops.ssd.api import ssd, ssd_paged

__all__ = ["DeltaPallasMosaicGpuConfig", "DeltaPallasTritonConfig", "SequenceParallelConfig",
           "SsdPallasMosaicGpuConfig", "SsdPallasTritonConfig", "XlaConfig", "causal_conv1d", "causal_conv1d_paged",
           "gated_delta_rule", "gated_delta_rule_paged", "kda", "kda_paged", "ssd", "ssd_paged"]

"""Grouped (ragged) matmul for MoE experts: rows sorted by group times each group's matrix; see README.md."""

from jaxckpt.ops.grouped_matmul.api import IMPLEMENTATIONS, grouped_matmul
from jaxckpt.ops.grouped_matmul.pallas_triton import GroupedMatmulConfig, default_config

__all__ = ["IMPLEMENTATIONS", "GroupedMatmulConfig", "default_config", "grouped_matmul"]

"""Flax NNX layers over packed rows and paged state pools: Mamba2, Gated DeltaNet, Kimi Delta Attention, attention.

Every layer is called as `layer(x [T, d_model], meta: StepMetadata, pools) -> (out [T, d_model], pools)`: pure, the
pools in and the new pools out. Recurrent layers' pools are (conv_pool, recurrent_pool), shapes from
`layer.state_shapes`; attention's are (k_pages, v_pages). See README.md beside this file.
"""

from jaxckpt.layers.attention import Attention
from jaxckpt.layers.common import Linear, ShortConv, load_params, param_dict, state_pools
from jaxckpt.layers.gdn import GatedDeltaNet
from jaxckpt.layers.kda import KimiDeltaAttention
from jaxckpt.layers.mamba2 import Mamba2Mixer
from jaxckpt.layers.metadata import StepMetadata, pack_tokens, validate_step
from jaxckpt.layers.norm import GatedRMSNorm, RMSNorm

RECURRENT_LAYERS = (Mamba2Mixer, GatedDeltaNet, KimiDeltaAttention)

__all__ = ["Attention", "GatedDeltaNet", "GatedRMSNorm", "KimiDeltaAttention", "Linear", "Mamba2Mixer",
           "RECURRENT_LAYERS", "RMSNorm", "ShortConv", "StepMetadata", "load_params", "pack_tokens", "param_dict",
           "state_pools", "validate_step"]

"""Builders of the tests against vLLM itself: a stand-in for vLLM's config and vLLM's layer classes without __init__."""

import importlib
from types import SimpleNamespace

import pytest
import torch


def vllm_module(name):
    """The vLLM module `name`; skips the test where it does not import (some need GPU-only packages)."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        pytest.skip(f"{name} does not import here: {error}")


def vllm_config(mode, *, block_size=1024, prefix_match_unit=None, num_speculative_tokens=0, page_size_padded=None):
    """The parts of a `VllmConfig` that the layers' spec methods and the plugin read."""
    cache = SimpleNamespace(mamba_block_size=block_size, mamba_page_size_padded=page_size_padded,
                            mamba_cache_mode=mode, use_replayssm=False, prefix_match_unit=prefix_match_unit)
    return SimpleNamespace(cache_config=cache, num_speculative_tokens=num_speculative_tokens,
                           compilation_config=SimpleNamespace(static_forward_context={}))


def vllm_layer(cls, cfg, name, state, *, mamba_type=None, **attrs):
    """vLLM's layer class without its __init__, with `state` = (shapes, dtypes) and `attrs` set, registered in `cfg`'s
    forward context under `name`."""
    shapes, dtypes = state
    namespace = {"__init__": lambda self: torch.nn.Module.__init__(self),
                 "get_state_shape": lambda self: shapes, "get_state_dtype": lambda self: dtypes}
    if mamba_type is not None:
        namespace["mamba_type"] = property(lambda self: mamba_type)
    layer = type(f"Stub{cls.__name__}", (cls,), namespace)()
    layer.__dict__.update(attrs)
    cfg.compilation_config.static_forward_context[name] = layer
    return layer

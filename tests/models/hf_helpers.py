"""Shared by the published-architecture tests: randomize a transformers model so every weight matters, save it
sharded, run transformers' own cached path, build our steps, and measure relative RMS errors."""

from __future__ import annotations

import numpy as np

from jaxckpt.layers import StepMetadata, pack_tokens


def rel_rms(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sqrt(np.mean((actual - expected) ** 2) / np.mean(expected ** 2)))


def randomize(model, seed: int) -> None:
    """O(1) activations everywhere: transformers' init (std 0.02, zero norms) would leave the MoE, the norms and the
    gates nearly inert, so a swapped weight would hardly show."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=gen).log())
            elif leaf == "dt_bias":
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
            elif "norm" in name and p.ndim == 1:
                base = 1.0 if p.abs().sum() > 0 else 0.0  # ones-centred weights stay so, (1 + w) ones zero
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)


def hf_cached_run(model, prefix, continuation, decode_tokens):
    """transformers' own cached path: prefill `prefix`, then `continuation` in one call, then one token at a time.

    Returns (cache after the prefix as a deep copy, logits of the continuation [L, V], decode logits [n, V]).
    """
    import copy

    import torch

    with torch.no_grad():
        out = model(torch.tensor([prefix]), use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        at_prefix = copy.deepcopy(cache)
        out = model(torch.tensor([continuation]), cache=cache, use_cache=True)
        continued = out.logits[0].numpy()
        decoded = []
        for token in decode_tokens:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            decoded.append(out.logits[0, -1].numpy())
    return at_prefix, continued, np.stack(decoded)


def hf_logits(model, tokens, cache=None):
    import torch

    with torch.no_grad():
        kwargs = {} if cache is None else {"cache": cache, "use_cache": True}
        return model(torch.tensor([list(tokens)]), **kwargs).logits[0].numpy()


def step(config, token_rows, *, num_kv_pages, num_state_slots, num_tokens=None, **meta_args):
    meta = StepMetadata.build([len(r) for r in token_rows], block_size=config.block_size,
                              max_model_len=config.max_model_len, num_kv_pages=num_kv_pages,
                              num_state_slots=num_state_slots, num_tokens=num_tokens, **meta_args)
    return pack_tokens(token_rows, meta.num_tokens), meta


def hf_modeling(name: str):
    """transformers' `modeling_{name}` imported with its pure-PyTorch fallbacks: FLA's Triton kernels (installed for
    torch_bridge) cannot run on the CPU, and transformers picks them at import time when `fla` imports."""
    import importlib
    import sys

    full = f"transformers.models.{name}.modeling_{name}"
    if full not in sys.modules:
        saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
        sys.modules["fla"] = None
        try:
            importlib.import_module(full)
        finally:
            del sys.modules["fla"]
            sys.modules.update(saved)
    return sys.modules[full]

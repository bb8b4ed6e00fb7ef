"""Shared by the published-architecture tests: randomize a transformers model so every weight matters, save it
sharded, run transformers' own cached path, build our steps, and measure relative RMS errors."""

from __future__ import annotations

import numpy as np

from jaxckpt.layers import StepMetadata, pack_tokens
from tests.numerics import rel_rms


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


# Shared by the published-architecture tests: caches of 24 pages of 8 tokens and 8 slots, one prefill shape of 64
# tokens (4 rows, 4 checkpoints, 8 blocks) and one decode shape, so each test file compiles two programs per model.
PAGES, SLOTS, TOKENS, BLOCK = 24, 8, 64, 8
TOL = 1e-5
VOCAB = 96  # the tiny models' vocabulary
SERVING = dict(implementation="xla", block_size=BLOCK, max_model_len=128, chunk_size=16)


def run(model, token_rows, caches, *, all_tokens=False, state=None, **meta_args):
    """One jitted step of `model` (or of `state` in its graph) over `token_rows` -> (logits, caches)."""
    from flax import nnx

    from jaxckpt.models.common import forward

    graphdef, own_state = nnx.split(model)
    decode = meta_args.get("num_decodes", 0) == len(token_rows)
    tokens, meta = step(model.config, token_rows, num_kv_pages=PAGES, num_state_slots=SLOTS,
                        num_tokens=len(token_rows) if decode else TOKENS, num_rows=4, num_checkpoints=4,
                        max_blocks=8, **meta_args)
    return forward(graphdef, own_state if state is None else state, tokens, meta, caches, all_tokens=all_tokens)


def random_rows(seed, lengths, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def packed_logits(model, rows, state=None):
    """Every token's logits of `rows` prefilled together from NaN-poisoned caches, split per row."""
    tables, page = [], 1
    for row in rows:
        need = -(-len(row) // BLOCK)
        tables.append(list(range(page, page + need)))
        page += need
    logits, _ = run(model, rows, model.init_caches(PAGES, SLOTS, fill=np.nan), all_tokens=True, state=state,
                    context_lens=[0] * len(rows), block_tables=tables, initial_state_indices=[0] * len(rows),
                    final_state_indices=list(range(1, len(rows) + 1)))
    bounds = np.cumsum([0] + [len(r) for r in rows])
    return [np.asarray(logits)[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def packed_errors(hf, model, rows, state=None) -> list[float]:
    """rel-RMS of each row's logits, packed in one step, against transformers run on the row alone."""
    return [rel_rms(logits, hf_logits(hf, row)) for row, logits in zip(rows, packed_logits(model, rows, state))]


def assert_packed_rows_match(hf, model, rows):
    """Rows of several lengths in one packed step match transformers run on each row alone."""
    errors = packed_errors(hf, model, rows)
    assert max(errors) <= TOL, f"rows of {[len(r) for r in rows]}: rel-RMS {errors}"


def assert_reference_logits_match(hf, model, row):
    """The uncached oracle (`CausalLM.reference_logits`: float64 recurrent ops) matches transformers."""
    err = rel_rms(model.reference_logits(row), hf_logits(hf, row))
    assert err <= TOL, f"reference logits of {len(row)} tokens: rel-RMS {err:.2e}"


def assert_caught(hf, model, name, change, rows):
    """Parameter `name` changed by `change` moves the packed logits far past TOL: the comparison catches it."""
    errors = packed_errors(hf, model, rows, state=corrupted(model, name, change))
    assert max(errors) > 100 * TOL, f"{name} corrupted, still rel-RMS {errors}"


def swapped(i, j):
    """A corruption: entries i and j of a parameter's first axis exchanged (two experts swapped)."""
    def change(w):
        w = w.copy()
        w[[i, j]] = w[[j, i]]
        return w
    return change


def assert_in_files(folder, names):
    """The saved folder names these tensors (the published names, which transformers renames on load)."""
    from jaxckpt.models.common import read_safetensors

    files = read_safetensors(folder)
    missing = [name for name in names if name not in files]
    assert not missing, missing


def hf_state(hf) -> dict:
    """transformers' in-memory state dict as numpy arrays."""
    return {k: v.detach().numpy() for k, v in hf.state_dict().items()}


def assert_same_as_transformers(hf, model, name, *, experts, expert):
    """Our parameter `name` equals transformers' of that name, and expert `expert` of our stacked `experts`
    ([E, in, out], the grouped matmul's layout) is transformers' ([E, out, in]) transposed."""
    from jaxckpt.layers import param_dict

    ours, theirs = param_dict(model), hf_state(hf)
    np.testing.assert_array_equal(ours[name], theirs[name])
    np.testing.assert_array_equal(ours[experts][expert], theirs[experts][expert].T)


def assert_loads_from_memory(hf, cls, model):
    """`cls.from_params` over transformers' in-memory state dict builds the same parameters as the files gave."""
    from jaxckpt.layers import param_dict

    ours = param_dict(model)
    from_memory = param_dict(cls.from_params(hf.config.to_dict(), hf_state(hf), **SERVING))
    assert ours.keys() == from_memory.keys()
    assert all(np.array_equal(a, from_memory[k]) for k, a in ours.items())


def bf16_params(hf, cls, prefix) -> dict:
    """The parameters of `cls.from_pretrained` over `hf` saved in bf16 (the config's dtype, so the model's)."""
    import copy
    import tempfile

    import torch

    from jaxckpt.layers import param_dict

    folder = tempfile.mkdtemp(prefix=prefix)
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(folder)
    ours = cls.from_pretrained(folder, block_size=8, max_model_len=128)
    assert ours.config.dtype == "bfloat16"
    return param_dict(ours)


def corrupted(model, name, change):
    """The state of a copy of `model` with parameter `name` changed (same graph and shapes: no recompile)."""
    from flax import nnx

    from jaxckpt.layers import load_params, param_dict

    copy = nnx.clone(model)
    load_params(copy, {name: change(param_dict(copy)[name])}, strict=False)
    return nnx.split(copy)[1]


def capture_routing(hf, router_of, tokens):
    """Inputs and (weights, experts) of every transformers router while it runs `tokens`; `router_of(layer)` is a
    decoder layer's router module (None for dense layers), whose output ends with (weights, experts)."""
    captured = []
    routers = [r for r in map(router_of, hf.model.layers) if r is not None]
    hooks = [r.register_forward_hook(lambda m, args, out: captured.append((args[0], out[-2], out[-1])))
             for r in routers]
    try:
        hf_logits(hf, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return [(x.detach().reshape(-1, x.shape[-1]).numpy(), w.detach().float().numpy(), i.numpy())
            for x, w, i in captured]


def assert_same_routing(captured, routes):
    """Per layer the same experts per token (as sets) and their weights to 1e-5; `routes[i](x)` -> (weights,
    experts) of our i-th MoE block."""
    assert len(captured) == len(routes) > 0
    for (inputs, weights, experts), route in zip(captured, routes):
        ours_weights, ours_experts = (np.asarray(a) for a in route(inputs))
        np.testing.assert_array_equal(np.sort(ours_experts, axis=-1), np.sort(experts, axis=-1))
        np.testing.assert_allclose(np.take_along_axis(ours_weights, np.argsort(ours_experts, axis=-1), axis=-1),
                                   np.take_along_axis(weights, np.argsort(experts, axis=-1), axis=-1),
                                   rtol=1e-5, atol=1e-6)


def check_checkpoint_resume(hf, model, prompt, decode_tokens):
    """Ours: one prefill of 30 tokens exporting checkpoints at 16 and 24; resume from the 16 one over tokens 16..30,
    then 3 decode steps. transformers: prefill 16, continue 14 in one call, decode 3, all on its own cache. The two
    caches at 16 convert into each other, and either side resumes from the other's. Returns the worst rel-RMS."""
    from jaxckpt.models import export_state, import_state
    from jaxckpt.models.common import from_hf_cache, hf_dynamic_cache

    worst = 0.0

    def check(what, actual, expected):
        nonlocal worst
        err = rel_rms(actual, expected)
        assert err <= TOL, f"{what}: rel-RMS {err:.2e}"
        worst = max(worst, err)

    at_16, hf_continued, hf_decoded = hf_cached_run(hf, prompt[:16], prompt[16:], decode_tokens)
    caches = model.init_caches(PAGES, SLOTS, fill=np.nan)
    first, caches = run(model, [prompt], caches, all_tokens=True, context_lens=[0], block_tables=[[1, 2, 3, 4]],
                        initial_state_indices=[0], final_state_indices=[1], checkpoint_cu=[0, 2],
                        checkpoint_offsets=[16, 24], checkpoint_state_indices=[2, 3])
    check("prefill", np.asarray(first)[:30], hf_logits(hf, prompt))

    # our checkpoint at 16 in transformers' layout equals transformers' own cache after 16 tokens
    exported = export_state(caches, slot=2, pages=[1, 2], num_tokens=16, block_size=BLOCK)
    theirs = from_hf_cache(at_16)
    for i, (a, b) in enumerate(zip(exported, theirs)):
        assert a.keys() == b.keys(), (i, a.keys(), b.keys())
        for key in a:
            assert a[key].shape == b[key].shape, (i, key, a[key].shape, b[key].shape)
            columns = slice(1, None) if key == "conv" else slice(None)  # transformers' oldest conv column is unread
            check(f"layer {i} {key}", a[key][..., columns], b[key][..., columns])

    # resume from our checkpoint (slot 2, pages 1-2 shared), then decode
    continued, caches = run(model, [prompt[16:]], caches, all_tokens=True, context_lens=[16],
                            block_tables=[[1, 2, 5, 6]], initial_state_indices=[2], final_state_indices=[4])
    check("resume", np.asarray(continued)[:14], hf_continued)
    for n, token in enumerate(decode_tokens):
        logits, caches = run(model, [[token]], caches, context_lens=[30 + n], block_tables=[[1, 2, 5, 6, 7]],
                             initial_state_indices=[4], final_state_indices=[4], num_decodes=1)
        check(f"decode step {n}", np.asarray(logits)[0], hf_decoded[n])

    # transformers resumes from our exported checkpoint ...
    check("transformers from our checkpoint", hf_logits(hf, prompt[16:], cache=hf_dynamic_cache(hf.config, exported)),
          hf_continued)
    # ... and we resume from transformers' cache, written into a fresh slot and fresh pages
    caches = import_state(model.init_caches(PAGES, SLOTS, fill=np.nan), theirs, slot=5, pages=[8, 9],
                          block_size=BLOCK)
    continued, _ = run(model, [prompt[16:]], caches, all_tokens=True, context_lens=[16],
                       block_tables=[[8, 9, 10, 11]], initial_state_indices=[5], final_state_indices=[6])
    check("ours from transformers' cache", np.asarray(continued)[:14], hf_continued)
    return worst


def save_sharded(hf, prefix, *, max_shard_size="40KB"):
    """`save_pretrained` into a fresh temporary folder in several shards; returns the folder."""
    import tempfile

    folder = tempfile.mkdtemp(prefix=prefix)
    hf.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder

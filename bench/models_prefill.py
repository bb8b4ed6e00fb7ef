"""Prefill throughput of a Qwen3-Next-shaped stack: jaxckpt's `Qwen3NextForCausalLM` with and without checkpoints,
beside transformers' own `Qwen3NextForCausalLM` at the same widths, dtype and GPU.

GPU (1x H200): `python -m bench.models_prefill --name models_prefill_h200` (writes bench/results/<name>.json and .md,
or under $OUT when set). CPU check of the whole script: `python -m bench.models_prefill --tiny`.

Model: Qwen3-Next-80B-A3B's widths: hidden 2048; GDN 16 key / 32 value heads of 128; gated attention 16 query / 2 KV
heads of 256 (a quarter rotated); MoE 512 experts of width 512, 10 routed + 1 shared of 512; vocabulary 151936;
4 layers (GDN, GDN, GDN, attention); random bf16 weights (transformers' init), about 6.8 B parameters. transformers
builds the model on the GPU; jaxckpt loads the same weights from its state dict (`from_params`), so both run
identical weights. One prompt per length (default 8192 and 32768), one row from a fresh state.

Rows:
- `hf_prefill`: transformers' forward with a fresh `DynamicCache` (`use_cache=True`, `logits_to_keep=1`), sdpa
  attention, its fastest installed paths; the row's `fallbacks` field names the functions that fell back to their
  PyTorch reference (FLA, causal-conv1d), and `experts` the MoE implementation it used.
- `prefill`: ours (jitted, warm, caches donated), checkpoints `none`, `per_row` (the last `--every` boundary) and
  `every_N` (one per `--every` = 1024 tokens, in-kernel exports to the state pools), with the default paged
  attention; `--attention xla pallas_triton` adds checkpoint-free rows with each one named (`attention` field). The
  default's checkpoint-free row also carries the device time and its largest kernels (`--device-time`).
- `speedup`: ours without checkpoints over transformers (goal >= 1.5x); `export`: ours with over without (goal
  within 3%).
- `parity`: the two models' last-token logits, rel-RMS (bf16: both sides round differently; a sanity check, not a
  tolerance).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
if "--tiny" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (Recorder, jax_device_fields, jax_time, one_prompt_step, out_dir, rel_rms,  # noqa: E402
                          stats as time_stats)



def hf_config(*, tiny: bool, dtype: str):
    from transformers import Qwen3NextConfig

    if tiny:
        widths = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, intermediate_size=128)
    else:
        widths = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, intermediate_size=5120)
    return Qwen3NextConfig(**widths, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                           rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                            "partial_rotary_factor": 0.25},
                           max_position_embeddings=65536, dtype=dtype)


def hf_modeling(on_gpu: bool):
    """transformers' modeling_qwen3_next; on the CPU with FLA blocked (its Triton kernels need a GPU)."""
    import importlib

    name = "transformers.models.qwen3_next.modeling_qwen3_next"
    if on_gpu or name in sys.modules:
        return importlib.import_module(name)
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


def hf_paths(modeling) -> dict:
    """Which implementation each of transformers' kernel hooks resolved to at import ("torch" = its fallback)."""
    found = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(modeling, name, None)
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()))) if fn else {}
        impl = cells.get("implementation")
        found[name] = "unknown" if impl is None else (
            "torch" if impl is cells.get("torch_function") else f"{impl.__module__}.{impl.__name__}")
    return found


def to_numpy(tensor) -> np.ndarray:
    import ml_dtypes
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return tensor.cpu().numpy()


def time_torch(fn, *, reps: int) -> dict:
    import torch

    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return time_stats(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny widths, 256 / 512 tokens")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="prompt lengths (default 8192 32768)")
    parser.add_argument("--modes", nargs="+", default=["none", "per_row", "every"],
                        choices=["none", "per_row", "every"])
    parser.add_argument("--every", type=int, default=None, help="checkpoint interval (default 1024; tiny 64)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per configuration (after one warm call)")
    parser.add_argument("--skip-hf", action="store_true", help="ours only (transformers not timed)")
    parser.add_argument("--attention", nargs="*", default=[], choices=["xla", "pallas_triton"],
                        help="also time these paged attentions by name (checkpoint-free rows)")
    parser.add_argument("--device-time", action="store_true",
                        help="device time and largest kernels of the default checkpoint-free row")
    parser.add_argument("--name", default=None, help="result file name (default models_prefill_tiny_cpu / _gpu)")
    args = parser.parse_args(argv)

    import torch

    on_gpu = torch.cuda.is_available() and not args.tiny
    dtype = "bfloat16" if on_gpu else "float32"
    every = args.every or (64 if args.tiny else 1024)
    lengths = args.tokens or ([256, 512] if args.tiny else [8192, 32768])
    rec = Recorder(args.name or ("models_prefill_tiny_cpu" if args.tiny else "models_prefill_gpu"), out_dir())
    shape = {"hidden": 2048, "gdn": [16, 32, 128], "attn": [16, 2, 256], "experts": [512, 10, 512], "layers": 4}
    if args.tiny:
        shape = {"tiny": True}

    began = time.perf_counter()
    modeling = hf_modeling(on_gpu)
    config = hf_config(tiny=args.tiny, dtype=dtype)
    torch.manual_seed(0)
    device = "cuda" if on_gpu else "cpu"
    with torch.device(device):
        hf = modeling.Qwen3NextForCausalLM._from_config(config, attn_implementation="sdpa",
                                                        dtype=getattr(torch, dtype)).eval()
    params = {name: to_numpy(t) for name, t in hf.state_dict().items()}
    hf_config_dict = config.to_dict()
    paths = hf_paths(modeling)
    fallbacks = sorted(name for name, impl in paths.items() if impl == "torch")
    experts = getattr(hf.config, "_experts_implementation", None)
    print(f"transformers model built in {time.perf_counter() - began:.0f} s; kernel paths {paths}; experts "
          f"{experts}", flush=True)

    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, config.vocab_size, n) for n in lengths}
    hf_last: dict[int, np.ndarray] = {}
    hf_ms: dict[int, float] = {}
    for n in ([] if args.skip_hf else lengths):
        row = dict(op="hf_prefill", implementation="transformers", shape=shape | {"T": n}, rows=1, checkpoints="none",
                   dtype=dtype, kernel_paths=paths, fallbacks=fallbacks, experts=experts, attention="sdpa")
        try:
            ids = torch.tensor(prompts[n][None], device=device)

            def call():
                from transformers import DynamicCache

                with torch.inference_mode():
                    return hf(ids, cache=DynamicCache(config=hf.config), use_cache=True, logits_to_keep=1).logits

            hf_last[n] = to_numpy(call()[0, -1]).astype(np.float32)
            stats = time_torch(call, reps=args.reps)
            hf_ms[n] = stats["median_ms"]
            rec.add(**row, **stats, tokens_per_s=n / stats["median_ms"] * 1e3,
                    note=f"{n / stats['median_ms'] * 1e3:,.0f} tok/s; fell back to torch: {fallbacks or 'none'}")
        except Exception as error:  # noqa: BLE001 - a failed configuration is a result row, the run goes on
            traceback.print_exc()
            rec.add(**row, median_ms=None, note=f"failed: {type(error).__name__}: {str(error)[:300]}")
    del hf
    if on_gpu:
        torch.cuda.empty_cache()

    import jax
    from flax import nnx

    from jaxckpt.models import Qwen3NextForCausalLM

    ours_ms: dict[tuple[int, str], float] = {}
    for attention in [None, *args.attention]:
        began = time.perf_counter()
        ours = Qwen3NextForCausalLM.from_params(hf_config_dict, params, block_size=16, max_model_len=max(lengths),
                                                implementation="xla" if args.tiny else None,
                                                attention_implementation=attention)
        graphdef, state = nnx.split(ours)
        print(f"jaxckpt model (attention {attention or 'default'}) loaded in {time.perf_counter() - began:.0f} s on "
              f"{jax.devices()[0]}", flush=True)
        run_ours(rec, ours, graphdef, state, prompts, lengths, modes=args.modes if attention is None else ["none"],
                 every=every, shape=shape, dtype=dtype, attention=attention, hf_last=hf_last, reps=args.reps,
                 device_time=args.device_time and attention is None, ours_ms=ours_ms)
        del ours, graphdef, state
    del params

    for n in lengths:
        plain = ours_ms.get((n, "none"))
        if plain and n in hf_ms:
            speedup = hf_ms[n] / plain
            rec.add(op="speedup", implementation="jaxckpt vs transformers", shape=shape | {"T": n},
                    checkpoints="none", median_ms=None, speedup=speedup,
                    note=f"{speedup:.2f}x ({'met' if speedup >= 1.5 else 'missed'}: goal >= 1.5x)")
        for mode in ("per_row", "every"):
            if plain and (n, mode) in ours_ms:
                cost = ours_ms[n, mode] / plain - 1
                rec.add(op="export", implementation="jaxckpt", shape=shape | {"T": n}, checkpoints=mode,
                        median_ms=None, export_cost=cost,
                        note=f"{cost:+.1%} ({'met' if cost <= 0.03 else 'missed'}: goal within 3%)")
    path = rec.write()
    print(f"wrote {path}")
    return 0 if all(r.get("median_ms") is not None or r["op"] in ("parity", "speedup", "export")
                    for r in rec.results) else 1


def run_ours(rec, ours, graphdef, state, prompts, lengths, *, modes, every, shape, dtype, attention, hf_last, reps,
             device_time, ours_ms):
    """Our prefill rows for one model build: each length and checkpoint mode (`ours_ms` gets the default attention's
    medians), parity of the checkpoint-free rows against transformers' last-token logits."""
    import jax

    from jaxckpt.models.common import forward

    for n in lengths:
        boundaries = list(range(every, n, every))
        for mode in modes:
            offsets = {"none": [], "per_row": boundaries[-1:], "every": boundaries}[mode]
            label = {"none": "none", "per_row": f"per_row_{every}", "every": f"every_{every}"}[mode]
            row = dict(op="prefill", implementation="jaxckpt", shape=shape | {"T": n}, rows=1, checkpoints=label,
                       num_checkpoints=len(offsets), dtype=dtype, attention=attention or "default")
            try:
                tokens, meta, pages, slots = one_prompt_step(ours.config, prompts[n], offsets)
                holder = {"caches": ours.init_caches(pages, slots)}

                def call():
                    logits, holder["caches"] = forward(graphdef, state, tokens, meta, holder["caches"])
                    return logits

                first_began = time.perf_counter()
                logits = np.asarray(jax.block_until_ready(call()))[0]
                first_s = time.perf_counter() - first_began
                stats = jax_time(call, warmup=1, reps=reps)
                if attention is None:
                    ours_ms[n, mode] = stats["median_ms"]
                if device_time and mode == "none":
                    stats |= jax_device_fields(call, reps=3)
                note = f"{n / stats['median_ms'] * 1e3:,.0f} tok/s; compile + first call {first_s:.1f} s"
                rec.add(**row, **stats, tokens_per_s=n / stats["median_ms"] * 1e3, compile_and_first_s=first_s,
                        note=note)
                if mode == "none" and n in hf_last:
                    err = rel_rms(logits, hf_last[n])
                    rec.add(op="parity", implementation="jaxckpt vs transformers", shape=shape | {"T": n},
                            checkpoints="none", median_ms=None, logits_rel_rms=err,
                            note=f"last-token logits rel-RMS {err:.2e} ({dtype})")
                holder.clear()
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                rec.add(**row, median_ms=None, note=f"failed: {type(error).__name__}: {str(error)[:300]}")


if __name__ == "__main__":
    sys.exit(main())

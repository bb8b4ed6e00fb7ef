"""Multi-device prefill: the hybrid model split by head over 2 GPUs against 1 GPU, one long prefill, with and without
checkpoint export.

GPU (2x H200): `python -m bench.sharded --name sharded_h200x2` (writes bench/results/<name>.json and .md, or under
$OUT when set). CPU check of the whole script: `python -m bench.sharded --tiny` (2 host devices, tiny model).

Model: `HybridConfig.bench()` at 4x its width: d_model 8192 (MLP 32768), GDN 64 key / 128 value heads of 128,
attention 64 query / 8 KV heads of 128, the same 8 layers (GDN, GDN, GDN, attention) x 2, vocabulary 32768; head
dims unchanged, so every head count divides by 2 and the per-head kernels are the bench ones. bf16 random weights,
about 10.6 B parameters (21 GB), so one H200 holds the whole model. One prompt of 32768 tokens in one forward (one
row, fresh state), jitted, warm, caches donated; checkpoint settings `none`, `every` (one per `--every` 1024
tokens: 31 in-kernel exports to the state pools) and, with `--modes`, `per_row` (the last such boundary).

Rows: the forward on 1 device and on a mesh of 2 (`jaxckpt.models.sharded.ShardedHybrid`), tokens/s, compile +
first call; `speedup` (2 vs 1 per setting, goal >= 1.8x); `export` (the forward's cost of its checkpoints, per
device count) and `slot_to_host` (reading one checkpoint slot of every layer back to the host). A configuration
that fails is recorded as a row with the error and the run goes on; one that would end past `--budget-s` (judged
from the last run on the same device count) is recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

if "--tiny" in sys.argv:
    # 2 host devices on the CPU: the count is fixed when jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import Recorder, jax_time, one_prompt_step, out_dir  # noqa: E402
from jaxckpt.models import HybridConfig, HybridModel, forward  # noqa: E402
from jaxckpt.models.sharded import ShardedHybrid, head_mesh  # noqa: E402

def wide_config(width: int, *, tiny: bool) -> HybridConfig:
    """The bench model (or the tiny one, for the CPU check) with `width` times its d_model and head counts."""
    if tiny:
        return HybridConfig.tiny_sharded(layer_types=("gdn", "gdn", "gdn", "attention"), max_model_len=512,
                                         dtype="bfloat16")
    base = HybridConfig.bench()
    names = ("d_model", "num_heads", "num_kv_heads", "gdn_num_k_heads", "gdn_num_v_heads", "mamba_num_heads",
             "kda_num_heads")
    return HybridConfig.bench(**{name: getattr(base, name) * width for name in names})


def checkpoints(num_tokens: int, mode: str, every: int) -> list[int]:
    """Query-relative checkpoint offsets of the one row: none, the last `every` boundary, or one per `every`."""
    boundaries = list(range(every, num_tokens, every))
    return {"none": [], "per_row": boundaries[-1:], "every": boundaries}[mode]


class Timed:
    """A forward over caches it threads through (they are donated), timed with `bench.common.jax_time`."""

    def __init__(self, call, caches, tokens, meta):
        self.call, self.caches, self.tokens, self.meta = call, caches, tokens, meta

    def __call__(self):
        logits, self.caches = self.call(self.tokens, self.meta, self.caches)
        return logits, self.caches

    def first(self) -> tuple[np.ndarray, float]:
        began = time.perf_counter()
        logits, _ = jax.block_until_ready(self())
        return np.asarray(logits), time.perf_counter() - began


def slot_to_host_ms(caches, slot: int, *, reps: int = 3) -> float:
    """Median time to read one slot of every recurrent layer's pools (a whole checkpoint) back to the host."""
    parts = [pool for pools, kind in zip(caches.layers, caches.layer_types) if kind != "attention" for pool in pools]
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        jax.device_get([pool[slot] for pool in parts])
        times.append((time.perf_counter() - began) * 1e3)
    return float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny model, 256 tokens, 2 host devices")
    parser.add_argument("--width", type=int, default=4, help="width multiple of the GPU bench model (default 4)")
    parser.add_argument("--tokens", type=int, default=None, help="prefill tokens (default 32768; tiny 256)")
    parser.add_argument("--devices", type=int, default=2, help="the sharded run's device count (default 2)")
    parser.add_argument("--modes", nargs="+", default=["none", "every"], choices=["none", "per_row", "every"])
    parser.add_argument("--every", type=int, default=None, help="checkpoint interval (default 1024; tiny 64)")
    parser.add_argument("--reps", type=int, default=2, help="timed calls per configuration (after one warm call)")
    parser.add_argument("--budget-s", type=float, default=290.0,
                        help="skip configurations that would end after this many seconds (default %(default)s)")
    parser.add_argument("--implementation", default=None, choices=["xla", "pallas_triton"],
                        help="force one kernel implementation (default: the fastest available)")
    parser.add_argument("--name", default=None, help="result file name (default sharded_tiny_cpu / sharded_gpu)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    num_tokens = args.tokens or (256 if args.tiny else 32768)
    every = args.every or (64 if args.tiny else 1024)
    config = wide_config(args.width, tiny=args.tiny)
    if args.implementation:
        config = dataclasses.replace(config, implementation=args.implementation)
    rec = Recorder(args.name or ("sharded_tiny_cpu" if args.tiny else "sharded_gpu"), out_dir())
    if jax.device_count() < args.devices:
        rec.add(op="hybrid_prefill", implementation=f"{args.devices} devices", shape=None, checkpoints=None,
                median_ms=None, note=f"failed: JAX has {jax.device_count()} device(s)")
        rec.write()
        return 1

    model = HybridModel(config, rngs=nnx.Rngs(0))
    params = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    shape = {"T": num_tokens, "d_model": config.d_model, "gdn": [config.gdn_num_k_heads, config.gdn_num_v_heads],
             "attn": [config.num_heads, config.num_kv_heads], "params_B": round(params / 1e9, 3)}
    print(f"model: {shape}, layers {config.layer_types}, d_ff {config.d_ff}, {config.dtype}, init "
          f"{time.perf_counter() - began:.0f} s", flush=True)
    graphdef, state = nnx.split(model)
    single = lambda tokens, meta, caches: forward(graphdef, state, tokens, meta, caches)  # noqa: E731
    runners: dict[int, tuple] = {}

    def runner(devices: int):
        """(forward, init_caches) on 1 device or sharded over `devices`, built on first use."""
        if devices not in runners:
            if devices == 1:
                runners[1] = (single, model.init_caches)
            else:
                sharded = ShardedHybrid(model, head_mesh(devices))
                runners[devices] = (sharded.forward, sharded.init_caches)
        return runners[devices]

    # the 2-vs-1 speedup first, then the export cost under sharding, then on one device
    order = [(1, "none"), (args.devices, "none")]
    order += [(args.devices, m) for m in args.modes if m != "none"] + [(1, m) for m in args.modes if m != "none"]
    order = [(d, m) for d, m in order if m in args.modes]
    names = {"none": "none", "per_row": f"per_row_{every}", "every": f"every_{every}"}
    timings: dict[tuple[int, str], float] = {}
    cost_s: dict[int, float] = {}  # seconds the last configuration on this device count took
    logits_of: dict[tuple[int, str], np.ndarray] = {}
    for devices, mode in order:
        label = "1 device" if devices == 1 else f"{devices} devices (heads)"
        offsets = checkpoints(num_tokens, mode, every)
        row = dict(op="hybrid_prefill", implementation=label, shape=shape, rows=1, checkpoints=names[mode],
                   num_checkpoints=len(offsets), dtype=config.dtype)
        ends = time.perf_counter() - began + cost_s.get(devices, 0.0)
        if ends > args.budget_s:
            rec.add(**row, median_ms=None, note=f"skipped: would end at ~{ends:.0f} s, past --budget-s "
                                                f"{args.budget_s:.0f}")
            continue
        timed = None
        try:
            call, init_caches = runner(devices)
            prompt = np.random.default_rng(0).integers(0, config.vocab_size, num_tokens)
            tokens, meta, num_pages, num_slots = one_prompt_step(config, prompt, offsets)
            timed = Timed(call, init_caches(num_pages, num_slots), tokens, meta)
            logits_of[devices, mode], first_s = timed.first()
            stats = jax_time(timed, warmup=1, reps=args.reps)
            cost_s[devices] = first_s + (args.reps + 1) * stats["median_ms"] / 1e3
            timings[devices, mode] = stats["median_ms"]
            throughput = num_tokens / stats["median_ms"] * 1e3
            extra = dict(tokens_per_s=throughput, compile_and_first_s=round(first_s, 2))
            note = f"{throughput:,.0f} tok/s; compile + first call {first_s:.1f} s"
            if devices > 1 and (1, mode) in logits_of:
                want = logits_of[1, mode]
                extra["logits_rel_err"] = float(np.max(np.abs(logits_of[devices, mode] - want)) / np.max(np.abs(want)))
                note += f"; logits vs 1 device: max rel err {extra['logits_rel_err']:.1e}"
            if offsets:
                extra["slot_to_host_ms"] = slot_to_host_ms(timed.caches, 2)
                note += f"; one checkpoint slot to host {extra['slot_to_host_ms']:.1f} ms"
            rec.add(**row, **stats, **extra, note=note)
        except Exception as error:  # noqa: BLE001 - a failed configuration is a result row, the run goes on
            traceback.print_exc()
            rec.add(**row, median_ms=None, note=f"failed: {type(error).__name__}: {str(error)[:300]}")
        finally:
            timed = None  # frees this configuration's caches before the next one allocates its own

    for mode in args.modes:
        one, many = timings.get((1, mode)), timings.get((args.devices, mode))
        if one and many:
            speedup = one / many
            met = "met" if speedup >= 1.8 else "missed"
            rec.add(op="speedup", implementation=f"{args.devices} vs 1 devices", shape=shape, checkpoints=names[mode],
                    median_ms=None, speedup=speedup, note=f"{speedup:.2f}x (goal >= 1.8x: {met})")
    for devices in (1, args.devices):
        base = timings.get((devices, "none"))
        for mode in [m for m in args.modes if m != "none"]:
            with_ckpt = timings.get((devices, mode))
            if base and with_ckpt:
                cost = with_ckpt / base - 1
                count = len(checkpoints(num_tokens, mode, every))
                rec.add(op="export", implementation="1 device" if devices == 1 else f"{devices} devices (heads)",
                        shape=shape, checkpoints=names[mode], num_checkpoints=count, median_ms=None,
                        export_cost=cost, note=f"{cost:+.1%} forward time for {count} checkpoints")
    path = rec.write()
    print(f"wrote {path} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`jaxckpt demo`: a shared-prefix workload through the continuous-batching engine in each mode, a closed loop at
`--concurrency` requests in flight, checked against the uncached forward, with a table per mode (and optionally a TTFT
plot and the numbers as JSON).

The workload has three kinds of prompt: families sharing a system prompt, conversations whose turns extend the
earlier turns, and vLLM #45238's shape (1500 shared / 700 unique tokens with block 528, scaled to the block size) where
the prompt's last block boundary falls in the unique tail.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from jaxckpt.engine.scheduler import ENGINE_MODES, MODES, Engine, EngineConfig, HybridRunner, RequestResult
from jaxckpt.models.hybrid import HybridConfig, HybridModel
from jaxckpt.plan import bucket_size

_WORDS = ("the state of a recurrent layer after each block boundary is what the prefix cache keeps so a later prompt "
          "that shares the prefix resumes there instead of recomputing it the scheduler asks the rules where a "
          "checkpoint may be taken and the kernel writes it from inside the forward").split()


@dataclasses.dataclass(frozen=True)
class DemoPrompt:
    group: str
    tokens: list[int]


def _text(rng: np.random.Generator, length: int) -> list[int]:
    """`length` byte tokens of word salad (the tiny model's vocabulary is bytes)."""
    words = rng.choice(_WORDS, size=length // 2 + 1)
    return list(" ".join(words).encode()[:length])


def workload(block_size: int, *, families: int = 2, members: int = 3, conversations: int = 2, turns: int = 3,
             unique_tails: int = 4, seed: int = 0) -> list[DemoPrompt]:
    """Prompts in arrival order (the three kinds interleaved); lengths scale with the block size."""
    rng = np.random.default_rng(seed)
    groups: list[list[DemoPrompt]] = []
    for _ in range(families):
        system = _text(rng, int(3.4 * block_size))
        groups.append([DemoPrompt("system-prompt family", system + _text(rng, int(rng.integers(block_size // 2,
                                                                                              2 * block_size))))
                       for _ in range(members)])
    for _ in range(conversations):
        history, turns_list = _text(rng, int(1.5 * block_size)), []
        for _ in range(turns):
            history = history + _text(rng, int(rng.integers(block_size // 2, 2 * block_size)))
            turns_list.append(DemoPrompt("conversation", list(history)))
            history = history + _text(rng, block_size)  # the assistant's reply, part of the next turn's prompt
        groups.append(turns_list)
    # vLLM #45238 (1500 shared / 700 unique tokens at block 528), scaled to this block size
    num_shared, num_unique = round(1500 * block_size / 528), round(700 * block_size / 528)
    shared = _text(rng, num_shared)
    label = f"#45238 ({num_shared}/{num_unique} @ {block_size})"
    groups.append([DemoPrompt(label, shared + _text(rng, num_unique)) for _ in range(unique_tails)])
    ordered = []
    for i in range(max(len(g) for g in groups)):
        ordered += [g[i] for g in groups if i < len(g)]
    return ordered


class _Progress:
    """tqdm when installed, else a one-line counter on stderr."""

    def __init__(self, total: int, *, enabled: bool):
        self.total, self.count, self.enabled, self.bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="prompt", file=sys.stderr)
            except ImportError:
                pass

    def update(self, label: str):
        self.count += 1
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update()
        elif self.enabled:
            print(f"\r{label}: {self.count}/{self.total} prompts", end="", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(ENGINE_MODES)} (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="requests in flight (closed loop) and running at once (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="cache block / KV page tokens (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="greedy tokens per prompt (first one included)")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="token budget and shape bucket of a prefill step (default: the longest prompt, rounded "
                             "up to a power of two)")
    parser.add_argument("--families", type=int, default=2, help="system prompts, %(default)s")
    parser.add_argument("--members", type=int, default=3, help="prompts per system prompt, %(default)s")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--unique-tails", type=int, default=4, help="prompts of the #45238 family, %(default)s")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="max relative error of first-token logits vs the uncached forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="TTFT per prompt per mode (matplotlib)")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the numbers as JSON")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="a Hugging Face folder (config.json, *.safetensors) of a Qwen3-Next, Kimi-Linear or "
                             "GraniteMoeHybrid model to serve instead of the tiny hybrid")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="split the model by head over the first N devices (GPUs, or N host devices on the CPU); "
                             "any N, 1 included, uses the tiny model with head counts divisible by 8")


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `demo` to a CLI's subparsers; the parsed namespace runs through `run(args)`."""
    parser = subparsers.add_parser("demo", help="stream a shared-prefix workload through the prefix-cache engine",
                                   description=__doc__)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxckpt demo", description=__doc__)
    add_arguments(parser)
    return parser


def _check(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ENGINE_MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {ENGINE_MODES}")
    if not modes:
        raise ValueError("--modes: name at least one mode")
    for name in ("block_size", "max_new_tokens", "prefill_tokens", "concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be positive, got {value}")
    for name in ("families", "members", "conversations", "turns", "unique_tails"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be non-negative, got {getattr(args, name)}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot: needs matplotlib (pip install 'jaxckpt[bench]')")
    if args.model is not None and args.devices is not None:
        raise ValueError("--devices: the engine splits only the tiny hybrid by head; drop it with --model")
    if args.devices is not None:
        if args.devices < 1:
            raise ValueError(f"--devices: must be positive, got {args.devices}")
        if args.devices > jax.device_count():
            raise ValueError(f"--devices: {args.devices} requested, JAX has {jax.device_count()} "
                             f"{jax.default_backend()} device(s); on the CPU run it as `jaxckpt demo --devices N`, "
                             "which starts JAX with N host devices")
    return modes


PUBLISHED = {"qwen3_next": "Qwen3NextForCausalLM", "kimi_linear": "KimiLinearForCausalLM",
             "granitemoehybrid": "GraniteMoeHybridForCausalLM"}


def load_published(path: str, *, block_size: int, max_model_len: int):
    """The `jaxckpt.models` class for the folder's `model_type`, loaded by the files' own names."""
    from jaxckpt import models
    from jaxckpt.models.common import read_config

    model_type = read_config(path).get("model_type")
    if model_type not in PUBLISHED:
        raise ValueError(f"--model: {path} holds model_type {model_type!r}; the demo serves {sorted(PUBLISHED)}")
    return getattr(models, PUBLISHED[model_type]).from_pretrained(path, block_size=block_size,
                                                                 max_model_len=max_model_len)

def run(args: argparse.Namespace) -> int:
    modes = _check(args)
    began = time.perf_counter()
    block = args.block_size
    prompts = workload(block, families=args.families, members=args.members, conversations=args.conversations,
                       turns=args.turns, unique_tails=args.unique_tails, seed=args.seed)
    if not prompts:
        raise ValueError("--families/--conversations/--unique-tails: the workload is empty")
    longest = max(len(p.tokens) for p in prompts)
    prefill_tokens = args.prefill_tokens or bucket_size(longest, minimum=64)
    # the tiny model's length, unless the workload needs more; a whole number of blocks either way
    max_model_len = -(-max(HybridConfig.tiny().max_model_len, longest + args.max_new_tokens) // block) * block
    mesh = None
    if args.model is not None:
        model = load_published(args.model, block_size=block, max_model_len=max_model_len)
        config, layer_types = model.config, model.config.kinds
        # the workload's byte tokens, folded into the model's vocabulary
        prompts = [dataclasses.replace(p, tokens=[t % config.vocab_size for t in p.tokens]) for p in prompts]
        name = f"{type(model).__name__} from {args.model}"
    else:
        if args.devices is None:
            config = HybridConfig.tiny(block_size=block, max_model_len=max_model_len)
        else:
            from jaxckpt.models.sharded import head_mesh

            config = HybridConfig.tiny_sharded(block_size=block, max_model_len=max_model_len)
            mesh = head_mesh(args.devices)
        model = HybridModel(config, rngs=nnx.Rngs(args.seed))
        layer_types, name = config.layer_types, "tiny hybrid model"
    runner = HybridRunner(model, prefill_tokens=prefill_tokens, num_rows=args.concurrency, mesh=mesh)
    max_blocks = config.max_model_len // block
    # room for every prompt's pages and states: the demo measures hits, not eviction
    pages = sum(-(-(len(p.tokens) + args.max_new_tokens) // block) for p in prompts) + 1
    engine_kwargs = dict(num_kv_pages=pages, num_state_slots=2 * len(prompts) + max_blocks + 2,
                         max_new_tokens=args.max_new_tokens, max_num_scheduled_tokens=prefill_tokens,
                         max_num_seqs=args.concurrency)
    placement = "one device" if mesh is None else f"split by head over {args.devices} device(s)"
    print(f"jaxckpt demo: {name} ({', '.join(layer_types)}), block {block}, "
          f"{jax.default_backend()}, {placement}, {len(prompts)} prompts per mode at concurrency {args.concurrency}, "
          f"alignment {model.checkpoint_alignment()}")

    references: dict[tuple, np.ndarray] = {}
    report = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "devices": args.devices,
              "block_size": block, "concurrency": args.concurrency,
              "model": args.model, "layer_types": list(layer_types), "prompts": len(prompts), "modes": {}}
    results: dict[str, list[RequestResult]] = {}
    progress = _Progress(len(prompts) * len(modes), enabled=not args.no_progress and sys.stderr.isatty())
    worst = 0.0
    failures = 0
    for mode in modes:
        engine = Engine(runner, EngineConfig(mode=mode, **engine_kwargs))
        results[mode] = engine.run([p.tokens for p in prompts], concurrency=args.concurrency,
                                   on_done=lambda _, m=mode: progress.update(m))
        rows = []
        for prompt, result in zip(prompts, results[mode]):
            if result.status != "finished":
                raise RuntimeError(f"{mode}: request {result.request_id} {result.status}: {result.reason}")
            key = tuple(prompt.tokens)
            if key not in references:
                references[key] = runner.reference_logits(prompt.tokens)[-1]
            err = _rel_err(result.first_logits, references[key])
            worst = max(worst, err)
            failures += err > args.tolerance
            rows.append(dict(group=prompt.group, prompt_len=result.prompt_len, hit_tokens=result.hit_tokens,
                             attention_hit_tokens=result.attention_hit_tokens,
                             prefill_forwards=result.prefill_forwards, prefill_tokens=result.prefill_tokens,
                             checkpoints=result.checkpoints, ttft_ms=1e3 * result.ttft_s, rel_err=err))
        stats, cache = engine.stats, engine.cache_stats
        ttfts = [r["ttft_ms"] for r in rows]
        duration = max(r.finish_s for r in results[mode]) - min(r.arrival_s for r in results[mode])
        report["modes"][mode] = dict(
            steps=len(engine.steps), max_rows=max(s.num_decodes + s.num_prefill_rows for s in engine.steps),
            p99_ttft_ms=float(np.percentile(ttfts, 99)),
            input_tok_s=sum(len(p.tokens) for p in prompts) / duration,
            forwards=stats.forwards, prefill_forwards=stats.prefill_forwards, decode_forwards=stats.decode_forwards,
            prefill_tokens=stats.prefill_tokens, checkpoints=stats.checkpoints,
            published_states=stats.published_states, hit_tokens=cache.hit_tokens, query_tokens=cache.query_tokens,
            hit_rate=cache.hit_rate, hit_prompts=cache.hit_requests, attention_hit_tokens=cache.attention_hit_tokens,
            mean_ttft_ms=float(np.mean([r["ttft_ms"] for r in rows])), requests=rows)
    progress.close()
    report["compile_seconds"] = runner.compile_seconds
    report["compiled_shapes"] = len(runner.compiled)
    report["max_rel_err"] = worst
    report["parity_failures"] = failures
    report["tolerance"] = args.tolerance

    _print_tables(report, modes, prompts)
    checked = len(prompts) * len(modes)
    print(f"compile: {len(runner.compiled)} shapes, {runner.compile_seconds:.1f} s (kept out of the numbers above)")
    print(f"parity: {checked - failures}/{checked} first-token logits within {args.tolerance:g} of the uncached "
          f"forward (max rel err {worst:.1e})")
    report["wall_seconds"] = time.perf_counter() - began
    print(f"wall: {report['wall_seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        _plot(report, modes, args.plot)
        print(f"wrote {args.plot}")
    return 1 if failures else 0


def _print_tables(report: dict, modes: list[str], prompts: list[DemoPrompt]):
    header = (f"{'mode':<15} {'steps':>5} {'prefill':>7} {'decode':>6} {'rows':>4} {'tokens computed':>15} "
              f"{'hit tokens':>10} {'hit rate':>8} {'hit prompts':>11} {'mean TTFT ms':>12} {'p99':>7} "
              f"{'input tok/s':>11}")
    print(header)
    print("-" * len(header))
    for mode in modes:
        m = report["modes"][mode]
        print(f"{mode:<15} {m['steps']:>5} {m['prefill_forwards']:>7} {m['decode_forwards']:>6} {m['max_rows']:>4} "
              f"{m['prefill_tokens']:>15} {m['hit_tokens']:>10} {m['hit_rate']:>8.1%} "
              f"{m['hit_prompts']:>7}/{len(prompts):<3} {m['mean_ttft_ms']:>12.1f} {m['p99_ttft_ms']:>7.1f} "
              f"{m['input_tok_s']:>11.0f}")
    groups = list(dict.fromkeys(p.group for p in prompts))
    print("\nprompts served from the cache (hit/prompts; tokens hit vs what the attention pages alone matched)")
    print(f"{'workload':<26}" + "".join(f" {mode:>22}" for mode in modes))
    for group in groups:
        cells = []
        for mode in modes:
            rows = [r for r in report["modes"][mode]["requests"] if r["group"] == group]
            hits = sum(r["hit_tokens"] > 0 for r in rows)
            tokens = sum(r["hit_tokens"] for r in rows)
            attention = sum(r["attention_hit_tokens"] for r in rows)
            cells.append(f"{hits}/{len(rows)} ({tokens}/{attention} tok)")
        print(f"{group:<26}" + "".join(f" {c:>22}" for c in cells))


def _plot(report: dict, modes: list[str], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for mode in modes:
        ttft = [r["ttft_ms"] for r in report["modes"][mode]["requests"]]
        ax.plot(range(len(ttft)), ttft, marker="o", label=f"{mode} (mean {np.mean(ttft):.1f} ms)")
    ax.set_xlabel("prompt (arrival order)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"align-mode prefix cache, block {report['block_size']}, {report['backend']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

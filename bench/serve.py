"""Serving benchmark (issue #23): requests through the continuous-batching engine in a closed loop, per mode.

GPU (one H200, the `bench` model in bf16): one invocation per workload, e.g.
  python -m bench.serve --workload random                      # ISL 8000 / OSL 32, 48 prompts, block 768
  python -m bench.serve --workload random --block 528          # and 1152
  python -m bench.serve --workload shared_prefix
  python -m bench.serve --workload 45238
CPU smoke run: `python -m bench.serve --tiny`. Writes <name>.json, <name>.md (and <name>.png with matplotlib) under
$OUT or bench/results.

Method. A closed loop at each --concurrency C: C requests are submitted at once and the next prompt whenever one
ends (finished, failed or cancelled), so C are always in flight; the engine admits up to C of them at a time
(max_num_seqs = C). Every mode runs the same prompts in the same order on a fresh cache with the same token budget
(--budget, chunked prefill) and the same shape buckets (powers of two of the real token count, so under 2x; decode-only
steps unpadded); compiles are timed apart and kept off the engine clock, which every time below is read from. Each
mode runs --repeats times (3 on the GPU), the modes' order rotated from one round to the next, and the run of median
duration is the one reported, every run's duration beside it: with one pass of the modes in a fixed order,
one_checkpoint's engine steps took 4% less time than no_prefix_cache's at concurrency 1 and 7% more at concurrency 4
(H100, block 528), running the same compiled forward.
- Steps: how many held a prefill row and how many only decode rows, and the engine time of each kind.
- TTFT: arrival to first token (queueing included); TPOT: (last token - first token) / (OSL - 1); mean, p50, p99.
- input tok/s: prompt tokens of all requests / duration (first arrival to last finish), as `vllm bench serve`
  counts them; computed tok/s: prompt tokens the prefill steps computed / duration.
- hit rate: prompt tokens served from the cache / prompt tokens; tokens computed and steps per mode.
- two_step's tail steps (the step running a prompt's rest after the split cut it at its last boundary): how many, and
  their time apart. Predicted saving of a checkpoint mode over two_step: the mean over requests of the time of the
  tail step each two_step request waited for (one fewer engine step per prompt crossing its last boundary); measured:
  mean TTFT(two_step) - mean TTFT(mode).
- Logits: every request's first-token logits in each mode against the same request with prefix caching off
  (no_prefix_cache), relative RMS, worst request.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bench.common import cli_main, environment, out_dir, rel_rms
from jaxckpt.engine.runner import HybridRunner
from jaxckpt.engine.scheduler import BASELINE, ENGINE_MODES, Engine, EngineConfig
from jaxckpt.models.hybrid import HybridConfig, HybridModel

WORKLOADS = ("random", "shared_prefix", "45238")
DEFAULTS = dict(random=dict(block=768), shared_prefix=dict(block=768), **{"45238": dict(block=528)})


@dataclasses.dataclass(frozen=True)
class Prompt:
    group: str
    tokens: list[int]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_workload(rng, *, num_prompts: int, isl: int, vocab: int) -> list[Prompt]:
    return [Prompt("random", rng.integers(0, vocab, isl).tolist()) for _ in range(num_prompts)]


def shared_prefix_workload(rng, *, num_prompts: int, isl: int, vocab: int, families: int = 4,
                           turns: int = 4) -> list[Prompt]:
    """Half the prompts from `families` system prompts (0.6 isl shared + a 0.2..0.4 isl question), half from
    conversations whose every turn extends the previous one (0.2 isl first message, then a 0.1 isl reply and a
    0.1 isl message per turn); the groups interleaved so a turn is submitted some requests after the last."""
    text = lambda n: rng.integers(0, vocab, max(int(n), 1)).tolist()  # noqa: E731
    systems = [text(0.6 * isl) for _ in range(families)]
    groups: list[list[Prompt]] = [[] for _ in range(families)]
    for i in range(num_prompts // 2):
        groups[i % families].append(Prompt("system-prompt family",
                                           systems[i % families] + text(rng.uniform(0.2, 0.4) * isl)))
    conversations = _cdiv(num_prompts - num_prompts // 2, turns)
    for _ in range(conversations):
        history, turns_list = text(0.2 * isl), []
        for _ in range(turns):
            turns_list.append(Prompt("conversation", list(history)))
            history = history + text(0.1 * isl) + text(0.1 * isl)
        groups.append(turns_list)
    ordered = []
    for i in range(max(len(g) for g in groups)):
        ordered += [g[i] for g in groups if i < len(g)]
    return ordered[:num_prompts]


def workload_45238(rng, *, num_prompts: int, shared: int, unique: int, vocab: int, families: int) -> list[Prompt]:
    """vLLM #45238: prompts of `shared` tokens common to their family and `unique` of their own."""
    prefixes = [rng.integers(0, vocab, shared).tolist() for _ in range(families)]
    return [Prompt(f"#45238 ({shared}/{unique})", prefixes[i % families] + rng.integers(0, vocab, unique).tolist())
            for i in range(num_prompts)]


class ShapeLog(HybridRunner):
    """HybridRunner recording, per step, the padded token count against the real one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.worst_padding = 1.0

    def forward(self, step):
        padded = self.shape_of(step)[0]
        self.worst_padding = max(self.worst_padding, padded / len(step.tokens))
        return super().forward(step)


def _pct(values, q):
    return float(np.percentile(values, q)) if values else None


def serve(runner, prompts: list[Prompt], *, mode: str, concurrency: int, osl: int, budget: int, pages: int,
          slots: int) -> tuple[dict, list]:
    """One closed-loop run; returns (metrics, per-request results)."""
    engine = Engine(runner, EngineConfig(mode=mode, num_kv_pages=pages, num_state_slots=slots, max_new_tokens=osl,
                                         max_num_scheduled_tokens=budget, max_num_seqs=concurrency))
    pending = list(range(len(prompts)))
    ids, in_flight = [], set()
    waited_tail: dict[int, float] = {}   # request -> time of the tail step it waited for (two_step)
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            ids.append(engine.add_request(prompts[pending.pop(0)].tokens))
            in_flight.add(ids[-1])
        before = {req.request_id: req.first_token_s for req in engine.running}
        record = engine.step()
        if record is None:
            raise RuntimeError("the engine ran nothing with requests in flight")
        for rid in list(in_flight):
            done = engine.results.get(rid)
            req = next((r for r in engine.running if r.request_id == rid), None)
            tail = (done.tail_step if done else req is not None and req.tail_step)
            first = done.first_token_s if done else (req.first_token_s if req else None)
            if tail and first is not None and before.get(rid, 0.0) is None:
                waited_tail[rid] = record.seconds
            if done is not None:
                in_flight.discard(rid)
    results = [engine.results[rid] for rid in ids]
    bad = [r for r in results if r.status != "finished"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not finish, e.g. {bad[0].status}: {bad[0].reason}")
    ttft = [1e3 * r.ttft_s for r in results]
    tpot = [1e3 * r.tpot_s for r in results if r.tpot_s is not None]
    duration = max(r.finish_s for r in results) - min(r.arrival_s for r in results)
    stats, cache = engine.stats, engine.cache_stats
    tails = [s for s in engine.steps if s.tail_rows]
    metrics = dict(
        mode=mode, concurrency=concurrency, requests=len(results), duration_s=duration,
        mean_ttft_ms=float(np.mean(ttft)), p50_ttft_ms=_pct(ttft, 50), p99_ttft_ms=_pct(ttft, 99),
        mean_tpot_ms=float(np.mean(tpot)) if tpot else None, p99_tpot_ms=_pct(tpot, 99),
        input_tok_s=sum(r.prompt_len for r in results) / duration,
        computed_tok_s=stats.prefill_tokens / duration,
        output_tok_s=sum(len(r.generated) for r in results) / duration,
        hit_rate=cache.hit_rate if mode != BASELINE else 0.0, hit_requests=cache.hit_requests,
        attention_hit_tokens=cache.attention_hit_tokens, tokens_computed=stats.prefill_tokens,
        prefill_steps=stats.prefill_forwards, decode_steps=stats.decode_forwards, checkpoints=stats.checkpoints,
        published_states=stats.published_states, evicted_pages=cache.evicted_pages,
        evicted_slots=cache.evicted_slots,
        tail_steps=len(tails), tail_steps_s=sum(s.seconds for s in tails),
        mean_tail_step_ms=1e3 * float(np.mean([s.seconds for s in tails])) if tails else None,
        tail_wait_per_request_ms=1e3 * sum(waited_tail.values()) / len(results),
        step_s=sum(s.seconds for s in engine.steps), steps=len(engine.steps),
        prefill_step_s=sum(s.seconds for s in engine.steps if s.num_prefill_rows),
        decode_step_s=sum(s.seconds for s in engine.steps if not s.num_prefill_rows))
    return metrics, results


def attention_preflight(config: HybridConfig, attention: str) -> tuple[str, str]:
    """Runs the chosen paged attention once against the plain one at the model's head layout; (attention that will
    run, note). A kernel that fails to build or disagrees falls back to the plain path, recorded."""
    if attention == "xla":
        return "xla", "plain jnp paged attention"
    import jax.numpy as jnp

    from jaxckpt.layers.attention import paged_attention
    from jaxckpt.layers.metadata import StepMetadata

    page = config.block_size
    rng = np.random.default_rng(0)
    groups = config.num_heads // config.num_kv_heads
    lens, ctx = [1, 1, 900, 300], [1200, 40, 0, 2 * page]
    pages = sum(_cdiv(q + c, page) for q, c in zip(lens, ctx)) + 1
    tables, used = [], 1
    for q, c in zip(lens, ctx):
        tables.append(np.arange(used, used + _cdiv(q + c, page)))
        used += len(tables[-1])
    meta = jax.tree.map(jnp.asarray, StepMetadata.build(
        lens, context_lens=ctx, block_tables=tables, initial_state_indices=[1] * 4, final_state_indices=[2, 3, 4, 5],
        block_size=page, num_kv_pages=pages, num_state_slots=6, num_rows=4))
    t, dt = meta.positions.shape[0], jnp.dtype(config.dtype)
    q = jnp.asarray(rng.standard_normal((t, config.num_kv_heads, groups, config.head_dim)), jnp.float32) * 0.1
    kv = [jnp.asarray(rng.standard_normal((t, config.num_kv_heads, config.head_dim)), dt) for _ in range(2)]
    pools = tuple(jnp.asarray(rng.standard_normal((pages, page, config.num_kv_heads, config.head_dim)), dt)
                  for _ in range(2))
    try:
        outs = {impl: np.asarray(jax.jit(lambda *a, impl=impl: paged_attention(
            *a, block_size=page, implementation=impl)[0])(q, *kv, meta, pools))[:int(meta.cu_seqlens[-1])]
            for impl in ("xla", attention)}
        err = rel_rms(outs[attention], outs["xla"])
    except Exception as error:  # noqa: BLE001 - recorded; the run goes on with the plain path
        traceback.print_exc()
        return "xla", f"{attention} failed ({type(error).__name__}: {str(error)[:200]}); plain path used"
    if not err <= 2e-2:
        return "xla", f"{attention} disagrees with the plain path (rel RMS {err:.1e}); plain path used"
    return attention, f"{attention} flash attention (rel RMS {err:.1e} vs the plain path on a test step)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny widths, short prompts, fp32")
    parser.add_argument("--modes", default=",".join(ENGINE_MODES), help="comma-separated subset of %(default)s")
    parser.add_argument("--concurrency", default=None, help="comma-separated closed-loop concurrencies (default 4; "
                                                            "tiny 1,3)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 48 (tiny 8)")
    parser.add_argument("--isl", type=int, default=None, help="prompt tokens (random, shared_prefix); default 8000 "
                                                              "(tiny 200)")
    parser.add_argument("--osl", type=int, default=None, help="output tokens per request; default 32 (tiny 4)")
    parser.add_argument("--block", type=int, default=None,
                        help="cache block = KV page (default 768; 528 for 45238; tiny 32)")
    parser.add_argument("--shared", type=int, default=1500, help="45238: shared tokens (tiny: scaled to the block)")
    parser.add_argument("--unique", type=int, default=700, help="45238: unique tokens (tiny: scaled to the block)")
    parser.add_argument("--families", type=int, default=4, help="45238 and shared_prefix: distinct shared prefixes")
    parser.add_argument("--budget", type=int, default=None, help="max_num_scheduled_tokens (default 8192; tiny 256)")
    parser.add_argument("--min-bucket", type=int, default=None,
                        help="smallest token bucket of a step with prefill rows (default 1: every bucket under 2x "
                             "the step; tiny: the budget, one compile)")
    parser.add_argument("--attention", choices=("xla", "pallas_triton"), default=None,
                        help="paged attention (default pallas_triton on a GPU, xla elsewhere)")
    parser.add_argument("--name", default=None, help="result file name (default serve_<workload>[_tiny])")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each mode per concurrency, the modes' order rotated each time; the run of "
                             "median duration is reported (default 3; tiny 1)")
    return parser


def run(args: argparse.Namespace) -> Path:
    began = time.perf_counter()
    tiny = args.tiny
    block = args.block or (32 if tiny else DEFAULTS[args.workload]["block"])
    isl = args.isl or (200 if tiny else 8000)
    osl = args.osl or (4 if tiny else 32)
    num_prompts = args.num_prompts or (8 if tiny else 48)
    budget = args.budget or (256 if tiny else 8192)
    repeats = args.repeats or (1 if tiny else 3)
    concurrencies = [int(c) for c in (args.concurrency or ("1,3" if tiny else "4")).split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ENGINE_MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {ENGINE_MODES}")
    for name, value in (("--block", block), ("--isl", isl), ("--osl", osl), ("--num-prompts", num_prompts),
                        ("--budget", budget), ("--repeats", repeats), *(("--concurrency", c) for c in concurrencies)):
        if value < 1:
            raise ValueError(f"{name}: must be positive, got {value}")
    if budget < block:
        raise ValueError(f"--budget: {budget} is below the block {block}")
    rng = np.random.default_rng(args.seed)
    base = (HybridConfig.tiny(layer_types=HybridConfig.bench().layer_types[:4]) if tiny else HybridConfig.bench())
    vocab = base.vocab_size
    if args.workload == "random":
        prompts = random_workload(rng, num_prompts=num_prompts, isl=isl, vocab=vocab)
        shape = dict(isl=isl)
    elif args.workload == "shared_prefix":
        prompts = shared_prefix_workload(rng, num_prompts=num_prompts, isl=isl, vocab=vocab, families=args.families)
        shape = dict(isl=isl, families=args.families)
    else:
        shared, unique = args.shared, args.unique
        if tiny:
            shared, unique = round(shared * block / 528), round(unique * block / 528)
        prompts = workload_45238(rng, num_prompts=num_prompts, shared=shared, unique=unique, vocab=vocab,
                                 families=args.families)
        shape = dict(shared=shared, unique=unique, families=args.families)
    longest = max(len(p.tokens) for p in prompts)
    max_model_len = _cdiv(longest + osl, block) * block
    attention = args.attention or ("pallas_triton" if jax.default_backend() == "gpu" else "xla")
    config = dataclasses.replace(base, block_size=block, max_model_len=max_model_len)
    attention, attention_note = attention_preflight(config, attention)
    config = dataclasses.replace(config, attention_implementation=attention)
    name = args.name or f"serve_{args.workload}" + ("_tiny" if tiny else "")
    out = out_dir()
    print(f"serve: {args.workload} workload, {num_prompts} prompts {shape}, OSL {osl}, block {block}, budget "
          f"{budget}, concurrency {concurrencies}, modes {modes}; model {'tiny' if tiny else 'bench'} "
          f"{config.dtype} {'/'.join(config.layer_types)}, {attention_note}; {jax.default_backend()} "
          f"({jax.devices()[0]})", flush=True)
    model = HybridModel(config, rngs=nnx.Rngs(args.seed))
    per_request = _cdiv(longest + osl - 1, block)
    # the pools hold every request's pages and states at once: the benchmark measures hits and steps, not eviction
    pages = num_prompts * per_request + 1
    slots = num_prompts * (per_request + 2) + 2 * budget // block + 8
    runner = ShapeLog(model, prefill_tokens=args.min_bucket or (budget if tiny else 1),
                      num_rows=max(concurrencies), num_checkpoints=max(concurrencies) * 2)
    report = dict(name=name, **environment(), workload=args.workload, shape=shape, prompts=num_prompts, osl=osl,
                  block=block, budget=budget, model="tiny" if tiny else "bench", dtype=config.dtype,
                  layer_types=list(config.layer_types), attention=attention, attention_note=attention_note,
                  backend=jax.default_backend(), pools=dict(num_kv_pages=pages, num_state_slots=slots), runs=[])
    for concurrency in concurrencies:
        firsts, runs = {}, {mode: [] for mode in modes}
        # the same modes back to back in another order each time: a drift of the machine over the run (clocks,
        # temperature, allocator state) lands on every mode, not on whichever runs last
        for repeat in range(repeats):
            for mode in modes[repeat % len(modes):] + modes[:repeat % len(modes)]:
                print(f"[{time.perf_counter() - began:6.1f} s] concurrency {concurrency}, {mode}, run {repeat + 1}",
                      flush=True)
                metrics, results = serve(runner, prompts, mode=mode, concurrency=concurrency, osl=osl,
                                         budget=budget, pages=pages, slots=slots)
                metrics["ttft_ms"] = [1e3 * r.ttft_s for r in results]
                runs[mode].append((metrics, results))
                print(f"    mean TTFT {metrics['mean_ttft_ms']:.1f} ms, {metrics['input_tok_s']:.0f} input tok/s, "
                      f"hit rate {metrics['hit_rate']:.1%}, {metrics['steps']} steps", flush=True)
        for mode in modes:
            ordered = sorted(runs[mode], key=lambda run: run[0]["duration_s"])
            metrics, results = ordered[(len(ordered) - 1) // 2]
            metrics["durations_s"] = [run[0]["duration_s"] for run in runs[mode]]
            firsts[mode] = [r.first_logits for r in results]
            report["runs"].append(metrics)
        derive(report, concurrency, firsts)
        write(report, out)
    report["compiles"] = dict(shapes=len(runner.compiled), seconds=runner.compile_seconds,
                              worst_padding=runner.worst_padding)
    report["wall_s"] = time.perf_counter() - began
    path = write(report, out)
    print(table(report))
    print(f"wrote {path}")
    return path


def derive(report: dict, concurrency: int, firsts: dict):
    """Predicted and measured savings against two_step, the 3% check against no_prefix_cache, logits agreement."""
    runs = {r["mode"]: r for r in report["runs"] if r["concurrency"] == concurrency}
    two = runs.get("two_step")
    for mode, r in runs.items():
        if two is not None and mode != "two_step":
            r["measured_saving_ms"] = two["mean_ttft_ms"] - r["mean_ttft_ms"]
            r["predicted_saving_ms"] = two["tail_wait_per_request_ms"]
            r["ttft_vs_two_step"] = r["mean_ttft_ms"] / two["mean_ttft_ms"] - 1
            r["input_tok_s_vs_two_step"] = r["input_tok_s"] / two["input_tok_s"] - 1
        if BASELINE in runs and mode != BASELINE:
            r["ttft_vs_no_prefix_cache"] = r["mean_ttft_ms"] / runs[BASELINE]["mean_ttft_ms"] - 1
        reference = firsts.get(BASELINE) or firsts.get("two_step")
        if reference is not None:
            r["logits_rel_rms_worst"] = max(rel_rms(a, b) for a, b in zip(firsts[mode], reference))


def _durations(run: dict) -> str:
    """The reported run's duration, then every run's in the order they ran."""
    every = run["durations_s"]
    return f"{run['duration_s']:.2f}" + (f" ({', '.join(f'{d:.2f}' for d in every)})" if len(every) > 1 else "")


def _fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def table(report: dict) -> str:
    lines = [f"# {report['name']}", "",
             f"{report['workload']} workload {report['shape']}, {report['prompts']} prompts, OSL {report['osl']}, "
             f"block {report['block']}, budget {report['budget']}; {report['model']} model, {report['dtype']}, "
             f"{report['attention_note']}; {report['backend']}: {report['device']}", f"command: `{report['command']}`",
             "",
             "| conc | mode | duration s (runs) | mean TTFT ms | p50 | p99 | TPOT ms | input tok/s | computed tok/s | "
             "hit rate | tokens computed | prefill / decode steps (s) | tail steps (ms total) | "
             "saving ms measured / predicted | TTFT vs two_step | input tok/s vs two_step | TTFT vs no cache | "
             "logits rel RMS |",
             "| --- " * 18 + "|"]
    for r in report["runs"]:
        pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"  # noqa: E731
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {_durations(r)} | {_fmt(r['mean_ttft_ms'])} | "
            f"{_fmt(r['p50_ttft_ms'])} | {_fmt(r['p99_ttft_ms'])} | {_fmt(r['mean_tpot_ms'], '.2f')} | "
            f"{_fmt(r['input_tok_s'], '.0f')} | "
            f"{_fmt(r['computed_tok_s'], '.0f')} | {100 * r['hit_rate']:.1f}% | {r['tokens_computed']} | "
            f"{r['prefill_steps']} ({r['prefill_step_s']:.2f}) / {r['decode_steps']} ({r['decode_step_s']:.2f}) | "
            f"{r['tail_steps']} ({1e3 * r['tail_steps_s']:.1f}) | "
            f"{_fmt(r.get('measured_saving_ms'))} / {_fmt(r.get('predicted_saving_ms'))} | "
            f"{pct(r.get('ttft_vs_two_step'))} | {pct(r.get('input_tok_s_vs_two_step'))} | "
            f"{pct(r.get('ttft_vs_no_prefix_cache'))} | {_fmt(r.get('logits_rel_rms_worst'), '.1e')} |")
    if "compiles" in report:
        c = report["compiles"]
        lines += ["", f"compiles: {c['shapes']} shapes, {c['seconds']:.1f} s (off the clock); worst padding "
                      f"{c['worst_padding']:.2f}x of a step's real tokens; wall {report['wall_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{report['name']}.json"
    path.write_text(json.dumps(report, indent=1))
    (out_dir / f"{report['name']}.md").write_text(table(report))
    if importlib.util.find_spec("matplotlib") is not None and report["runs"]:
        plot(report, out_dir / f"{report['name']}.png")
    return path


def plot(report: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({r["concurrency"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4), squeeze=False)
    for ax, concurrency in zip(axes[0], concurrencies):
        for r in (r for r in report["runs"] if r["concurrency"] == concurrency):
            ttft = np.sort(r["ttft_ms"])
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=f"{r['mode']} "
                                                                          f"(mean {r['mean_ttft_ms']:.0f} ms)")
        ax.set_xlabel("TTFT, ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{report['workload']}, block {report['block']}, concurrency {concurrency}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return cli_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())

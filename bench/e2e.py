"""End-to-end prefill of the hybrid model (issue #9): one checkpointed forward against vLLM's two-step path and a
plain forward, then vLLM #45238's shared-prefix workload through the prefix-cache engine.

GPU (one H200): `python -m bench.e2e --name e2e_h200`; CPU smoke run: `python -m bench.e2e --tiny`. Writes
<name>.json and <name>.md (bench/common.py's schema) under $OUT or bench/results, rewritten after every piece.

Model: `HybridConfig.bench()` (bf16, random weights, 8 layers: three GDN then one attention, twice) or `.tiny()`.
One prompt of --isl random tokens; per block size B (--blocks) the checkpoint position is the one
`jaxckpt.plan.prefill_checkpoints` gives, the rule the engine uses (the prompt's last B boundary), and:
- plain: one forward of all tokens from a fresh state, no checkpoint entries (compiled once, timed beside each B);
- checkpointed: that forward exporting the state at the boundary into a state-pool slot;
- step1, step2: tokens [0, boundary), then [boundary, isl) from step1's states and KV pages (vLLM without
  checkpoints); two_step = step1 + step2 medians.
Derived per B: ckpt/plain (goal <= 1.05), ckpt/two_step (goal < 1), measured saving = two_step - checkpointed,
predicted saving = step2 - (plain - step1): the second forward's cost minus what its tokens add inside one forward.
Checked once per B, untimed: checkpointed vs plain logits, the checkpoint state vs step1's final state (conv window
and recurrent state of every recurrent layer), two-step vs plain logits (max abs error / max abs value).

Timing: each shape (tokens, checkpoint entries) is compiled once ahead of time and reused across block sizes (plain
and checkpointed serve every B); `bench.common.jax_time` median, p20, p80; compile time is recorded apart.

#45238: `jaxckpt.engine.demo.workload`'s family of --requests prompts sharing 1500 tokens with 700 unique each at
block 528, served in each engine mode (two_step, one_checkpoint, several): prefix hit rate, forwards, tokens computed
and TTFT per request per mode. Steps are not padded, so each distinct step length compiles once (four shapes).

Pieces run in priority order (the first block, #45238, the other blocks); one whose compiles would end past
--deadline-s is skipped and recorded as such.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import traceback
from collections import Counter
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from bench.common import Recorder, cli_main, jax_time, out_dir
from jaxckpt.engine.demo import workload
from jaxckpt.engine.scheduler import MODES, Engine, EngineConfig, HybridRunner
from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.models.hybrid import HybridConfig, HybridModel
from jaxckpt.plan import NULL_SLOT, prefill_checkpoints

ISL, BLOCKS, ENGINE_BLOCK, REPS = 8000, (768, 528, 1152), 528, 10
TINY_ISL, TINY_BLOCKS, TINY_ENGINE_BLOCK, TINY_REPS = 240, (48, 32, 72), 32, 3
RATIO_GOAL = 1.05
# state-pool slots of the standalone forwards (slot 0 is the null slot)
FINAL, CHECKPOINT, STEP1_FINAL, STEP2_FINAL, NUM_SLOTS = 1, 2, 3, 4, 5


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


@contextlib.contextmanager
def recorded_choices():
    """Yields a list collecting (op, implementation, declined) for every implementation choice traced inside.

    The library hands its `Choice` only to the op entry that asked for it, so the chooser is wrapped while tracing.
    """
    from jaxckpt.ops.common import api
    from jaxckpt.ops.conv1d.api import REGISTRY as CONV1D
    from jaxckpt.ops.delta_rule.api import GDN_REGISTRY, KDA_REGISTRY
    from jaxckpt.ops.ssd.api import REGISTRY as SSD

    names = {id(GDN_REGISTRY): "gdn", id(KDA_REGISTRY): "kda", id(SSD): "ssd", id(CONV1D): "conv1d"}
    choose, log = api.choose_implementation, []

    def chooser(registry, implementation, **call):
        choice = choose(registry, implementation, **call)
        log.append((names.get(id(registry), "?"), choice.name, choice.declined))
        return choice

    api.choose_implementation = chooser
    try:
        yield log
    finally:
        api.choose_implementation = choose


def summarize_choices(log) -> dict:
    """{op: {"used": {implementation: layers}, "declined": [reasons]}} over the layers of one compiled forward."""
    ops: dict[str, tuple[Counter, set]] = {}
    for op, name, declined in log:
        used, reasons = ops.setdefault(op, (Counter(), set()))
        used[name] += 1
        reasons.update(f"{n}: {reason[:160]}" for n, reason in declined)
    return {op: {"used": dict(used), "declined": sorted(reasons)} for op, (used, reasons) in ops.items()}


def describe_choices(summary: dict) -> str:
    return "; ".join(f"{op}: " + ", ".join(f"{name} x{count}" for name, count in entry["used"].items())
                     + (f" (declined {' | '.join(entry['declined'])})" if entry["declined"] else "")
                     for op, entry in summary.items())


class Forwards:
    """The model's step jitted and compiled ahead of time once per shape (tokens, checkpoint entries).

    Caches are not donated, so one set of inputs can be timed again and again; the pool copy that costs (tens of MB
    at bench size) is far below 1% of a forward.
    """

    def __init__(self, model: HybridModel):
        graphdef, self.params = nnx.split(model)
        self._jitted = jax.jit(lambda params, tokens, meta, caches: nnx.merge(graphdef, params)(tokens, meta, caches))
        self.compiled: dict[tuple[int, int], dict] = {}

    def has(self, num_tokens: int, checkpoint: int | None) -> bool:
        return (num_tokens, int(checkpoint is not None)) in self.compiled

    def get(self, tokens, meta: StepMetadata, caches) -> tuple[dict, bool]:
        """(compiled entry: executable, compile_s, implementations; whether it was compiled by this call)."""
        key = (tokens.shape[0], meta.checkpoint_offsets.shape[0])
        if key in self.compiled:
            return self.compiled[key], False
        print(f"    compiling tokens={key[0]} checkpoint entries={key[1]}", flush=True)
        began = time.perf_counter()
        with recorded_choices() as log:
            executable = self._jitted.lower(self.params, tokens, meta, caches).compile()
        entry = dict(executable=executable, compile_s=time.perf_counter() - began,
                     implementations=summarize_choices(log))
        print(f"    compiled in {entry['compile_s']:.1f} s: {describe_choices(entry['implementations'])}", flush=True)
        self.compiled[key] = entry
        return entry, True


@dataclasses.dataclass
class Setup:
    config: HybridConfig
    model: HybridModel
    forwards: Forwards
    prompt: np.ndarray      # i32[isl]
    caches: object          # fresh (all-zero) caches, never donated
    num_kv_pages: int
    label: str              # --implementation, or "auto"
    reps: int
    began: float
    deadline_s: float

    @property
    def isl(self) -> int:
        return len(self.prompt)

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def longest_compile(self) -> float:
        return max((e["compile_s"] for e in self.forwards.compiled.values()), default=0.0)


class Run(NamedTuple):
    median_ms: float
    logits: np.ndarray      # [vocab] of the step's last token
    caches: object


def past_deadline(rec: Recorder, setup: Setup, op: str, shape: dict, *, compiles: int) -> bool:
    """Records a skipped row when the piece, with `compiles` new compiles as long as the longest so far, would start
    or end past --deadline-s: compiles dominate a bench-size run, and the results file should hold what was left out."""
    expected = setup.elapsed() + compiles * setup.longest_compile()
    if expected <= setup.deadline_s:
        return False
    rec.add(op=op, implementation=setup.label, shape=shape, median_ms=None,
            note=f"skipped: {setup.elapsed():.0f} s elapsed, {expected:.0f} s expected with its compiles, past "
                 f"--deadline-s {setup.deadline_s:g}")
    return True


def step_meta(setup: Setup, start: int, end: int, *, initial_slot: int, final_slot: int,
              checkpoint: int | None) -> StepMetadata:
    """One row computing prompt tokens [start, end), its checkpoint (absolute position) into slot CHECKPOINT.

    Every step gets the whole prompt's page table: the paged attention reads all of a row's pages for each token, so
    one table width keeps the per-token attention cost equal across plain, checkpointed, step1 and step2.
    """
    table = np.arange(1, setup.num_kv_pages, dtype=np.int32)
    offsets = np.asarray([] if checkpoint is None else [checkpoint - start], np.int32)
    return StepMetadata.build(
        [end - start], context_lens=[start], block_tables=[table], initial_state_indices=[initial_slot],
        has_initial_state=[initial_slot != NULL_SLOT], final_state_indices=[final_slot],
        checkpoint_cu=[0, offsets.size], checkpoint_offsets=offsets,
        checkpoint_state_indices=np.full(offsets.size, CHECKPOINT, np.int32), block_size=setup.config.block_size,
        num_kv_pages=setup.num_kv_pages, num_state_slots=NUM_SLOTS, max_model_len=setup.config.max_model_len,
        num_tokens=end - start, num_rows=1, num_checkpoints=offsets.size, max_blocks=table.size)


def timed_forward(rec: Recorder, setup: Setup, op: str, start: int, end: int, caches, *, block: int | None,
                  final_slot: int, initial_slot: int = NULL_SLOT, checkpoint: int | None = None) -> Run | None:
    """Compiles (once per shape), runs once untimed for the checks, times, records the row; None on failure."""
    shape = dict(isl=setup.isl, block=block, tokens=end - start, context=start)
    if past_deadline(rec, setup, op, shape, compiles=int(not setup.forwards.has(end - start, checkpoint))):
        return None
    print(f"[{setup.elapsed():6.1f} s] {op}: tokens [{start}, {end})"
          + (f", checkpoint at {checkpoint}" if checkpoint is not None else ""), flush=True)
    try:
        meta = jax.device_put(step_meta(setup, start, end, initial_slot=initial_slot, final_slot=final_slot,
                                        checkpoint=checkpoint))
        tokens = jax.device_put(setup.prompt[start:end])
        entry, fresh = setup.forwards.get(tokens, meta, caches)
        args = (setup.forwards.params, tokens, meta, caches)
        logits, new_caches = entry["executable"](*args)
        timing = jax_time(entry["executable"], *args, warmup=2, reps=setup.reps)
    except Exception as error:  # noqa: BLE001 - record the failure and go on, as bench/ops_bench.py does
        traceback.print_exc()
        rec.add(op=op, implementation=setup.label, shape=shape, median_ms=None,
                note=f"FAIL {type(error).__name__}: {str(error)[:300]}")
        return None
    rec.add(op=op, implementation=setup.label, shape=shape, rows=1,
            checkpoints="none" if checkpoint is None else f"1 at {checkpoint}",
            num_checkpoints=int(checkpoint is not None), dtype=setup.config.dtype,
            compile_s=entry["compile_s"] if fresh else 0.0, implementations=entry["implementations"],
            note=f"compile {entry['compile_s']:.1f} s" if fresh else "compiled shape reused", **timing)
    return Run(timing["median_ms"], np.asarray(logits)[0], new_caches)


def state_errors(setup: Setup, caches, slot: int, other_caches, other_slot: int) -> tuple[float, float]:
    """Worst relative error over the recurrent layers of (conv window, recurrent state) between two slots."""
    conv, recurrent = 0.0, 0.0
    for layer_type, pools, other in zip(setup.config.layer_types, caches.layers, other_caches.layers):
        if layer_type == "attention":
            continue
        conv = max(conv, rel_err(pools[0][slot], other[0][other_slot]))
        recurrent = max(recurrent, rel_err(pools[1][slot], other[1][other_slot]))
    return conv, recurrent


def bench_block(rec: Recorder, setup: Setup, block: int) -> dict:
    """The four forwards of one block size, the derived rows and the checks.

    The plain forward's compiled shape serves every block, but it is timed again beside each block's checkpointed
    forward so that each ratio compares back-to-back measurements rather than ones minutes apart.
    """
    isl = setup.isl
    offsets, columns = prefill_checkpoints([0], [isl], hash_block_size=block, block_size=block,
                                           alignment=setup.model.checkpoint_alignment())
    shape = dict(isl=isl, block=block)
    if columns[0] < 0:
        rec.add(op="checkpointed", implementation=setup.label, shape=shape, median_ms=None,
                note="declined: jaxckpt.plan gives no checkpoint for this prompt and block")
        return dict(block=block)
    boundary = int(offsets[0])
    print(f"== block {block}: checkpoint at {boundary} (column {int(columns[0])}), "
          f"two-step split {boundary} + {isl - boundary}", flush=True)
    plain = timed_forward(rec, setup, "plain", 0, isl, setup.caches, block=block, final_slot=FINAL)
    ckpt = timed_forward(rec, setup, "checkpointed", 0, isl, setup.caches, block=block, final_slot=FINAL,
                         checkpoint=boundary)
    step1 = timed_forward(rec, setup, "step1", 0, boundary, setup.caches, block=block, final_slot=STEP1_FINAL)
    step2 = None if step1 is None else timed_forward(rec, setup, "step2", boundary, isl, step1.caches, block=block,
                                                     initial_slot=STEP1_FINAL, final_slot=STEP2_FINAL)
    summary = dict(block=block, boundary=boundary, plain=plain and plain.median_ms, ckpt=ckpt and ckpt.median_ms,
                   step1=step1 and step1.median_ms, step2=step2 and step2.median_ms)
    derived = dict(implementation=setup.label, shape=shape, median_ms=None)
    two_step = None
    if step1 and step2:
        two_step = step1.median_ms + step2.median_ms
        rec.add(op="two_step", implementation=setup.label, shape=shape, checkpoints="none", median_ms=two_step,
                note="step1 + step2 medians")
    if ckpt and plain:
        ratio = ckpt.median_ms / plain.median_ms
        met = ratio <= RATIO_GOAL
        rec.add(op="ckpt/plain", **derived, ratio=ratio, goal=f"<= {RATIO_GOAL}", met=met,
                note=f"{ratio:.3f} (goal <= {RATIO_GOAL}: {'met' if met else 'missed'})")
        summary.update(ratio_plain=ratio)
    if ckpt and two_step:
        ratio = ckpt.median_ms / two_step
        rec.add(op="ckpt/two_step", **derived, ratio=ratio, goal="< 1", met=ratio < 1,
                note=f"{ratio:.3f} (goal < 1: {'met' if ratio < 1 else 'missed'})")
        summary.update(two_step=two_step, ratio_two_step=ratio)
    if ckpt and plain and two_step:
        measured = two_step - ckpt.median_ms
        predicted = step2.median_ms - (plain.median_ms - step1.median_ms)
        rec.add(op="saving", implementation=setup.label, shape=shape, median_ms=measured, measured_ms=measured,
                predicted_ms=predicted,
                note=f"measured {measured:.3f} ms = two_step - checkpointed; predicted {predicted:.3f} ms = "
                     "step2 - (plain - step1), the second forward's cost minus what its tokens add to one forward")
        summary.update(measured_saving=measured, predicted_saving=predicted)
    checks = {}
    if ckpt and plain:
        checks["ckpt_logits_vs_plain"] = rel_err(ckpt.logits, plain.logits)
    if ckpt and step1:
        checks["ckpt_conv_state_vs_step1"], checks["ckpt_recurrent_state_vs_step1"] = state_errors(
            setup, ckpt.caches, CHECKPOINT, step1.caches, STEP1_FINAL)
    if step2 and plain:
        checks["two_step_logits_vs_plain"] = rel_err(step2.logits, plain.logits)
    if checks:
        rec.add(op="verify", **derived, **checks,
                note="rel. error (max abs diff / max abs): " + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()))
    summary.update(checks)
    return summary


class ExactRunner(HybridRunner):
    """HybridRunner without padding of prefill steps (`bucket_size(n, minimum=n) == n`): each distinct step length
    compiles once and no padding tokens blur the TTFT comparison between modes."""

    def forward(self, step):
        if not step.num_decodes:
            self.prefill_tokens = len(step.tokens)
        return super().forward(step)


def bench_45238(rec: Recorder, setup: Setup, *, block: int, requests: int, seed: int) -> dict:
    """vLLM #45238's family (1500 shared / 700 unique tokens at block 528, scaled) through each engine mode."""
    prompts = [p.tokens for p in workload(block, families=0, conversations=0, unique_tails=requests, seed=seed)]
    longest = max(len(p) for p in prompts)
    shape = dict(requests=requests, shared=round(1500 * block / 528), unique=round(700 * block / 528), block=block)
    print(f"== #45238: {requests} requests of {shape['shared']} shared + {shape['unique']} unique tokens, block "
          f"{block}; one request at a time, one first token each, unpadded steps", flush=True)
    pages_per_prompt = _cdiv(longest + 1, block)
    config = dataclasses.replace(setup.config, block_size=block, max_model_len=pages_per_prompt * block)
    model = nnx.eval_shape(lambda: HybridModel(config, rngs=nnx.Rngs(0)))
    nnx.update(model, setup.forwards.params)  # the bench model's weights; only the KV page size differs
    runner = ExactRunner(model, num_checkpoints=max(1, (longest - 1) // block))
    engine_kwargs = dict(num_kv_pages=requests * pages_per_prompt + 1,
                         num_state_slots=requests * (pages_per_prompt + 2) + 2, max_new_tokens=1,
                         max_num_scheduled_tokens=longest)
    served, summary = {}, {}
    for mode in MODES:
        op = f"45238 {mode}"
        # two_step brings two new step lengths (up to the boundary, the rest), each later mode one more
        if past_deadline(rec, setup, op, shape, compiles=2 if mode == MODES[0] else 1):
            continue
        print(f"[{setup.elapsed():6.1f} s] {op}", flush=True)
        try:
            engine = Engine(runner, EngineConfig(mode=mode, **engine_kwargs))
            served[mode] = engine.run(prompts)
        except Exception as error:  # noqa: BLE001 - record the failure and go on
            traceback.print_exc()
            rec.add(op=op, implementation=setup.label, shape=shape, median_ms=None,
                    note=f"FAIL {type(error).__name__}: {str(error)[:300]}")
            continue
        ttfts = [1e3 * r.ttft_s for r in served[mode]]
        for i, (r, ttft) in enumerate(zip(served[mode], ttfts)):
            rec.add(op=op, implementation=setup.label, shape={**shape, "request": i}, rows=1,
                    checkpoints=r.checkpoints, dtype=setup.config.dtype, median_ms=ttft, p20_ms=None, p80_ms=None,
                    n=1, ttft_ms=ttft, hit_tokens=r.hit_tokens, attention_hit_tokens=r.attention_hit_tokens,
                    prefill_forwards=r.prefill_forwards, prefill_tokens=r.prefill_tokens,
                    note=f"TTFT (one sample); hit {r.hit_tokens}/{r.prompt_len} tokens (attention pages alone "
                         f"{r.attention_hit_tokens}); prefill forwards {r.prefill_forwards}, tokens computed "
                         f"{r.prefill_tokens}")
        stats, cache = engine.stats, engine.cache_stats
        summary[mode] = dict(hit_rate=cache.hit_rate, hit_requests=cache.hit_requests,
                             forwards=stats.prefill_forwards, tokens_computed=stats.prefill_tokens,
                             ttft_ms=ttfts)
        rec.add(op=op, implementation=setup.label, shape={**shape, "request": "all"}, rows=requests,
                checkpoints=stats.checkpoints, dtype=setup.config.dtype, median_ms=float(np.median(ttfts)),
                p20_ms=None, p80_ms=None, n=requests, **summary[mode],
                note=f"hit rate {cache.hit_rate:.1%} ({cache.hit_requests}/{requests} requests hit); prefill "
                     f"forwards {stats.prefill_forwards}, tokens computed {stats.prefill_tokens}; median TTFT")
        rec.write()
    if len(served) > 1:
        base = next(iter(served))
        worst = max(rel_err(r.first_logits, b.first_logits)
                    for results in served.values() for r, b in zip(results, served[base]))
        rec.add(op="45238 check", implementation=setup.label, shape=shape, median_ms=None, max_rel_diff=worst,
                note=f"first-token logits of every request agree across modes to {worst:.1e} (relative to {base})")
    rec.add(op="45238 compile", implementation=setup.label, shape=shape, median_ms=None,
            compile_s=runner.compile_seconds, compiled_shapes=len(runner.compiled),
            note=f"limited to {requests} requests (--requests): one compile per distinct step length, "
                 f"{len(runner.compiled)} shapes, {runner.compile_seconds:.1f} s with two warm-up runs each, kept "
                 "out of the TTFTs")
    return summary


def print_summary(setup: Setup, blocks: list[dict], engine: dict, compile_s: float, compiles: int):
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\nend to end, {setup.label} implementation, {setup.config.dtype}, isl {setup.isl} (ms: medians)")
    header = (f"{'block':>5} {'ckpt at':>7} {'plain':>9} {'ckpt':>9} {'step1':>9} {'step2':>9} {'two_step':>9} "
              f"{'ckpt/plain':>10} {'ckpt/2step':>10} {'saving':>8} {'predicted':>9} {'logits err':>10} "
              f"{'state err':>9}")
    lines = []
    for b in blocks:
        state = [b.get(k) for k in ("ckpt_conv_state_vs_step1", "ckpt_recurrent_state_vs_step1")]
        state = None if None in state else max(state)
        lines.append(f"{b['block']:>5} {fmt(b.get('boundary'), 'd'):>7} {fmt(b.get('plain')):>9} "
                     f"{fmt(b.get('ckpt')):>9} {fmt(b.get('step1')):>9} {fmt(b.get('step2')):>9} "
                     f"{fmt(b.get('two_step')):>9} {fmt(b.get('ratio_plain'), '.3f'):>10} "
                     f"{fmt(b.get('ratio_two_step'), '.3f'):>10} {fmt(b.get('measured_saving')):>8} "
                     f"{fmt(b.get('predicted_saving')):>9} {fmt(b.get('ckpt_logits_vs_plain'), '.1e'):>10} "
                     f"{fmt(state, '.1e'):>9}")
    print("\n".join([header, "-" * len(header), *lines]))
    print(f"goals: ckpt/plain <= {RATIO_GOAL}, ckpt/2step < 1; saving = two_step - ckpt, predicted = step2 - "
          "(plain - step1); errors: ckpt vs plain logits, ckpt state vs step1's final state")
    if engine:
        print(f"\n#45238 through the engine ({'/'.join(engine)}), TTFT ms per request")
        print(f"{'mode':<15} {'hit rate':>8} {'requests hit':>12} {'forwards':>8} {'tokens computed':>15}  TTFT")
        for mode, m in engine.items():
            print(f"{mode:<15} {m['hit_rate']:>8.1%} {m['hit_requests']:>12} {m['forwards']:>8} "
                  f"{m['tokens_computed']:>15}  " + " ".join(f"{t:.1f}" for t in m["ttft_ms"]))
    print(f"\nstandalone forwards: {compiles} compiled shapes, {compile_s:.1f} s; wall {setup.elapsed():.1f} s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: HybridConfig.tiny() widths in the bench layer pattern, short prompt")
    parser.add_argument("--name", default=None, help="result file name (default: e2e, or e2e_tiny with --tiny)")
    parser.add_argument("--blocks", type=int, nargs="+", default=None,
                        help=f"block sizes (default: {' '.join(map(str, BLOCKS))}; tiny "
                             f"{' '.join(map(str, TINY_BLOCKS))})")
    parser.add_argument("--isl", type=int, default=None, help=f"prompt tokens (default: {ISL}; tiny {TINY_ISL})")
    parser.add_argument("--skip-45238", action="store_true", help="leave out the engine workload")
    parser.add_argument("--requests", type=int, default=4, help="requests of the #45238 family (default: 4)")
    parser.add_argument("--engine-block", type=int, default=None,
                        help=f"block of the #45238 workload (default: {ENGINE_BLOCK}; tiny {TINY_ENGINE_BLOCK})")
    parser.add_argument("--implementation", default=None,
                        help="op implementation of every recurrent layer, e.g. xla or pallas_triton (default: the "
                             "library's automatic choice)")
    parser.add_argument("--reps", type=int, default=None, help=f"timed calls per forward (default: {REPS}; tiny "
                                                               f"{TINY_REPS})")
    parser.add_argument("--deadline-s", type=float, default=300.0,
                        help="seconds after start by which every piece, compiles included, should end: a piece "
                             "expected to end later is skipped and recorded so (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run(args: argparse.Namespace):
    """Runs the benchmark; returns the path of the JSON written."""
    began = time.perf_counter()
    isl = args.isl or (TINY_ISL if args.tiny else ISL)
    blocks = args.blocks or list(TINY_BLOCKS if args.tiny else BLOCKS)
    for name, value in (("--isl", isl), ("--requests", args.requests), *(("--blocks", b) for b in blocks)):
        if value < 1:
            raise ValueError(f"{name}: must be positive, got {value}")
    name = args.name or ("e2e_tiny" if args.tiny else "e2e")
    rec = Recorder(name, out_dir())
    # tiny widths, one period of the bench model's layer pattern: the smoke run traces the layers the GPU run times
    factory = (lambda **kw: HybridConfig.tiny(layer_types=HybridConfig.bench().layer_types[:4], **kw)) if args.tiny \
        else HybridConfig.bench
    page = factory().block_size
    config = factory(implementation=args.implementation, max_model_len=_cdiv(isl, page) * page)
    label = args.implementation or "auto"
    print(f"e2e: {'tiny' if args.tiny else 'bench'} model {config.layer_types}, d_model {config.d_model}, "
          f"{config.dtype}, {label} implementation, backend {jax.default_backend()} ({jax.devices()[0]}), isl {isl}, "
          f"blocks {blocks}", flush=True)
    model = HybridModel(config, rngs=nnx.Rngs(args.seed))
    num_kv_pages = _cdiv(isl, page) + 1
    prompt = np.random.default_rng(args.seed).integers(0, config.vocab_size, isl, dtype=np.int32)
    setup = Setup(config=config, model=model, forwards=Forwards(model), prompt=prompt,
                  caches=model.init_caches(num_kv_pages, NUM_SLOTS), num_kv_pages=num_kv_pages, label=label,
                  reps=args.reps or (TINY_REPS if args.tiny else REPS), began=began, deadline_s=args.deadline_s)
    rec.add(op="setup", implementation=label, shape=dict(isl=isl, blocks=blocks), median_ms=None,
            layer_types=list(config.layer_types), dtype=config.dtype, backend=jax.default_backend(),
            note=f"{len(config.layer_types)} layers {'/'.join(config.layer_types)}, d_model {config.d_model}, "
                 f"KV page {page}, checkpoint alignment {model.checkpoint_alignment()}, model init "
                 f"{setup.elapsed():.1f} s")
    rec.write()
    summaries, engine = [], {}
    for i, block in enumerate(blocks):
        summaries.append(bench_block(rec, setup, block))
        rec.write()
        if i == 0 and not args.skip_45238:
            engine_block = args.engine_block or (TINY_ENGINE_BLOCK if args.tiny else ENGINE_BLOCK)
            try:
                engine = bench_45238(rec, setup, block=engine_block, requests=args.requests, seed=args.seed)
            except Exception as error:  # noqa: BLE001 - record the failure and go on to the other blocks
                traceback.print_exc()
                rec.add(op="45238", implementation=label, shape=dict(block=engine_block), median_ms=None,
                        note=f"FAIL {type(error).__name__}: {str(error)[:300]}")
            rec.write()
    compiled = setup.forwards.compiled.values()
    compile_s = sum(e["compile_s"] for e in compiled)
    rec.add(op="compile", implementation=label, shape=dict(isl=isl, blocks=blocks), median_ms=None,
            compile_s=compile_s, compiled_shapes=len(compiled), wall_s=setup.elapsed(),
            note=f"standalone forwards: {len(compiled)} shapes, {compile_s:.1f} s (kept out of every time above); "
                 f"wall {setup.elapsed():.1f} s")
    path = rec.write()
    print_summary(setup, summaries, engine, compile_s, len(compiled))
    print(f"wrote {path}", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    return cli_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The engine end to end: parity with the uncached forward in every mode, forward counts, hits, cache invariants."""

import numpy as np
import pytest
from flax import nnx

from jaxckpt.engine.cache import extend_block_hashes
from jaxckpt.engine.scheduler import Engine, EngineConfig, HybridRunner
from jaxckpt.models.hybrid import HybridConfig, HybridModel
from jaxckpt.plan import NULL_SLOT

B = 16
MODES = ("two_step", "one_checkpoint", "several")
ENGINE = dict(num_kv_pages=16, num_state_slots=16, max_num_scheduled_tokens=128)


@pytest.fixture(scope="module")
def runner():
    # one prefill bucket, one decode shape and fixed pool sizes: the whole file compiles the model twice. Every pool
    # starts as NaN, so any read of a page or slot that no forward wrote shows up in the logits.
    model = HybridModel(HybridConfig.tiny(block_size=B, max_model_len=256), rngs=nnx.Rngs(0))
    return HybridRunner(model, prefill_tokens=128, fill=float("nan"))


def _text(rng, n, vocab):
    return rng.integers(1, vocab, n).tolist()


def _workload(rng, vocab):
    """Shared system prompts, a conversation extending its earlier turns, and a #45238-shaped family."""
    system = _text(rng, 3 * B + 5, vocab)
    turn1 = system + _text(rng, 20, vocab)
    turn2 = turn1 + _text(rng, 30, vocab)
    shared = _text(rng, 45, vocab)
    return [system + _text(rng, 25, vocab), system + _text(rng, 40, vocab), turn1, turn2, turn2 + _text(rng, 9, vocab),
            shared + _text(rng, 21, vocab), shared + _text(rng, 21, vocab), system + _text(rng, 25, vocab)]


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("mode", MODES)
def test_modes_match_the_uncached_forward_with_and_without_hits(runner, mode):
    rng = np.random.default_rng(21)
    prompts = _workload(rng, runner.vocab_size)
    # pools small enough that later prompts evict earlier entries
    engine = Engine(runner, EngineConfig(mode=mode, **ENGINE, max_new_tokens=3))
    results = engine.run(prompts)
    assert sum(r.hit_tokens > 0 for r in results) >= 2
    assert engine.cache_stats.evicted_pages > 0
    for prompt, result in zip(prompts, results):
        reference = runner.reference_logits(prompt + result.generated[:-1])
        assert _rel_err(result.first_logits, reference[len(prompt) - 1]) < 1e-4
        assert result.generated == [int(np.argmax(row)) for row in reference[len(prompt) - 1:]]


def test_two_step_runs_two_forwards_where_one_checkpoint_runs_one(runner):
    rng = np.random.default_rng(22)
    prompt = _text(rng, 77, runner.vocab_size)
    extended = prompt + _text(rng, 30, runner.vocab_size)
    counts = {}
    for mode in ("two_step", "one_checkpoint"):
        engine = Engine(runner, EngineConfig(mode=mode, **ENGINE, max_new_tokens=1))
        first, second = engine.run([prompt, extended])
        counts[mode] = (first.prefill_forwards, first.prefill_tokens, first.checkpoints, second.hit_tokens)
    # the state at the last boundary (64) is cached either way; two_step pays a second forward for the 13-token tail
    assert counts["two_step"] == (2, 77, 0, 64)
    assert counts["one_checkpoint"] == (1, 77, 1, 64)


def test_several_checkpoints_turn_the_45238_workload_into_hits(runner):
    rng = np.random.default_rng(23)
    # vLLM #45238 scaled from block 528: 1500 shared / 700 unique -> 45 / 21 with block 16; the last boundary (64)
    # lies in the unique tail, the boundaries inside the shared prefix are 16 and 32
    shared = _text(rng, 45, runner.vocab_size)
    prompts = [shared + _text(rng, 21, runner.vocab_size) for _ in range(4)]
    hits = {}
    for mode in ("one_checkpoint", "several"):
        engine = Engine(runner, EngineConfig(mode=mode, **ENGINE, max_new_tokens=1))
        results = engine.run(prompts)
        hits[mode] = [(r.hit_tokens, r.attention_hit_tokens) for r in results]
        for prompt, result in zip(prompts, results):
            assert _rel_err(result.first_logits, runner.reference_logits(prompt)[-1]) < 1e-4
    assert hits["one_checkpoint"] == [(0, 0)] + [(0, 32)] * 3
    assert hits["several"] == [(0, 0)] + [(32, 32)] * 3


class _Recording:
    """Wraps a runner and records which slot each forward wrote with the state after how many tokens."""

    def __init__(self, inner):
        self.inner, self.written = inner, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, step):
        qs, count = int(step.context_lens[0]), int(step.cu_seqlens[1])
        real = int(step.checkpoint_cu[-1])
        for offset, slot in zip(step.checkpoint_offsets[:real], step.checkpoint_state_indices[:real]):
            self.written[int(slot)] = tuple(self.tokens[:qs + int(offset)])
        self.written[int(step.final_state_indices[0])] = tuple(self.tokens[:qs + count])
        return self.inner.forward(step)


@pytest.mark.parametrize("mode", MODES)
def test_the_cache_publishes_only_states_a_forward_wrote(runner, mode):
    rng = np.random.default_rng(24)
    prompts = _workload(rng, runner.vocab_size) + [_text(rng, 40, runner.vocab_size)]
    recording = _Recording(runner)
    engine = Engine(recording, EngineConfig(mode=mode, **ENGINE, max_new_tokens=2))
    published = {}
    for prompt in prompts:
        recording.tokens = prompt
        engine.serve(prompt)
        for key, slot in engine.cache.slots.by_key.items():
            published[key] = recording.written[slot]
    # every published key is the chained hash of exactly the tokens whose state the slot received
    for key, tokens in published.items():
        assert len(tokens) % B == 0
        assert extend_block_hashes([], tokens, block_size=B)[-1] == key
    assert NULL_SLOT not in engine.cache.slots.by_key.values()


def test_bad_input_names_the_argument(runner):
    engine = Engine(runner, EngineConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="^prompt: must hold at least one token"):
        engine.serve([])
    with pytest.raises(ValueError, match="^prompt: .*max_model_len=256"):
        engine.serve([1] * 253)
    with pytest.raises(ValueError, match=r"^prompt: token ids must lie in \[0, 256\)"):
        engine.serve([1, 256])
    with pytest.raises(ValueError, match="^mode: "):
        EngineConfig(mode="all")

    class Misaligned(_Recording):
        def checkpoint_alignment(self):
            return 3

    with pytest.raises(ValueError, match="^block_size: 16 must be a multiple of the model's checkpoint alignment 3"):
        Engine(Misaligned(runner), EngineConfig(mode="one_checkpoint"))
    Engine(Misaligned(runner), EngineConfig(mode="two_step"))
    with pytest.raises(ValueError, match="^num_kv_pages: "):
        Engine(runner, EngineConfig(num_kv_pages=4)).serve([1] * 100)
    with pytest.raises(ValueError, match="^num_state_slots: "):
        Engine(runner, EngineConfig(mode="several", num_state_slots=4)).serve([1] * 100)

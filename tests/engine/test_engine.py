"""The engine end to end: parity with the uncached forward in every mode and at several concurrencies, continuous
batching (decode-first packing, the budget, admission as requests finish), forward counts, hits, cache invariants."""

import numpy as np
import pytest

from jaxckpt.engine.cache import extend_block_hashes
from jaxckpt.engine.scheduler import ENGINE_MODES, Engine, EngineConfig
from jaxckpt.plan import NULL_SLOT
from tests.engine.helpers import BUDGET, ENGINE, B, _text, _workload, check_parity, recorded_engine


@pytest.mark.parametrize("concurrency", [1, 3])
@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_every_request_matches_its_uncached_forward(runner, mode, concurrency):
    rng = np.random.default_rng(21)
    prompts = _workload(rng, runner.vocab_size)
    engine, recording = recorded_engine(runner, mode=mode, max_new_tokens=3)
    results = engine.run(prompts, concurrency=concurrency)
    check_parity(runner, prompts, results)
    if mode != "no_prefix_cache":
        assert sum(r.hit_tokens > 0 for r in results) >= 2
        assert engine.cache_stats.evicted_pages > 0  # pools small enough that later prompts evict earlier entries
    if concurrency > 1:
        assert max(step.num_rows for step in recording.steps) >= 2
    # every reference and lease is back: nothing leaked
    assert not engine.cache.pages.refs and not engine.cache.slots.refs


def test_steps_pack_decodes_first_under_the_budget_and_admit_as_requests_finish(runner):
    rng = np.random.default_rng(22)
    prompts = [_text(rng, n, runner.vocab_size) for n in (70, 33, 90, 18, 57, 41)]
    engine, recording = recorded_engine(runner, mode="one_checkpoint", max_new_tokens=4, max_num_seqs=3)
    results = engine.run(prompts, concurrency=6)
    check_parity(runner, prompts, results)
    first_step, last_step = {}, {}
    mixed = False
    for index, step in enumerate(recording.steps):
        lens = np.diff(step.cu_seqlens)
        assert lens.sum() <= BUDGET and step.num_rows <= 3
        # the first num_decodes rows are the decode rows, one token each, and every other row is a prefill chunk
        assert np.all(lens[:step.num_decodes] == 1)
        decode_rows = [int(step.context_lens[n]) >= len(prompts[rid]) for n, rid in enumerate(step.request_ids)]
        assert decode_rows == [True] * step.num_decodes + [False] * (step.num_rows - step.num_decodes)
        mixed |= 0 < step.num_decodes < step.num_rows
        for rid in step.request_ids:
            first_step.setdefault(rid, index)
            last_step[rid] = index
    assert mixed
    # six prompts in flight, at most three running: the fourth is admitted only after one of the first three ended
    assert sorted(first_step) == list(range(6))
    assert first_step[3] > min(last_step[r] for r in range(3))
    assert engine.stats.prefill_tokens == sum(len(p) - r.hit_tokens for p, r in zip(prompts, results))


def test_two_step_runs_the_tail_as_an_extra_step_and_one_checkpoint_does_not(runner):
    rng = np.random.default_rng(23)
    prompt = _text(rng, 77, runner.vocab_size)
    extended = prompt + _text(rng, 30, runner.vocab_size)
    counts = {}
    for mode in ("two_step", "one_checkpoint"):
        engine = Engine(runner, EngineConfig(mode=mode, **ENGINE, max_new_tokens=1))
        first, second = engine.run([prompt, extended])
        counts[mode] = (first.prefill_forwards, first.prefill_tokens, first.checkpoints, first.tail_step,
                        second.hit_tokens, second.prefill_forwards, sum(s.tail_rows for s in engine.steps))
    # the state at the last boundary (64) is cached either way; two_step pays a step for the 13-token tail, and the
    # extended prompt (hit 64, boundary 96) one for its 11-token tail
    assert counts["two_step"] == (2, 77, 0, True, 64, 2, 2)
    assert counts["one_checkpoint"] == (1, 77, 1, False, 64, 1, 0)


def test_two_step_tails_share_steps_with_other_requests_chunks(runner):
    rng = np.random.default_rng(24)
    prompts = [_text(rng, 70, runner.vocab_size) for _ in range(3)]
    steps = {}
    for mode in ("two_step", "one_checkpoint"):
        engine, recording = recorded_engine(runner, mode=mode, max_new_tokens=2)
        results = engine.run(prompts, concurrency=3)
        check_parity(runner, prompts, results)
        steps[mode] = recording.steps
        if mode == "two_step":
            # the split cuts the first and third prompts at 64; the second one's first chunk is cut at 64 by the
            # budget, which is no tail of the split's making
            assert [r.tail_step for r in results] == [True, False, True]
            assert [r.prefill_forwards for r in results] == [2, 2, 2]
            # a 6-token tail rides along with the next prompt's first 64 tokens
            assert any(sorted(np.diff(s.cu_seqlens).tolist()) == [6, 6, 64] for s in recording.steps)
        else:
            assert not any(r.tail_step for r in results)
            assert [r.checkpoints for r in results] == [1, 1, 1]
    assert len(steps["two_step"]) > len(steps["one_checkpoint"])


@pytest.mark.parametrize("concurrency", [1, 2])
def test_several_checkpoints_turn_the_45238_workload_into_hits(runner, concurrency):
    rng = np.random.default_rng(25)
    # vLLM #45238 scaled from block 528: 1500 shared / 700 unique -> 45 / 21 with block 16; the last boundary (64)
    # lies in the unique tail, the boundaries inside the shared prefix are 16 and 32
    shared = _text(rng, 45, runner.vocab_size)
    prompts = [shared + _text(rng, 21, runner.vocab_size) for _ in range(4)]
    hits = {}
    for mode in ("one_checkpoint", "several"):
        engine = Engine(runner, EngineConfig(mode=mode, **ENGINE, max_new_tokens=1))
        results = engine.run(prompts, concurrency=concurrency)
        check_parity(runner, prompts, results)
        hits[mode] = [(r.hit_tokens, r.attention_hit_tokens) for r in results]
    # the first `concurrency` prompts run together and find nothing; the later ones find the shared pages
    cold = [(0, 0)] * concurrency
    assert hits["one_checkpoint"] == cold + [(0, 32)] * (4 - concurrency)
    assert hits["several"] == cold + [(32, 32)] * (4 - concurrency)


@pytest.mark.parametrize("mode", ("two_step", "one_checkpoint", "several"))
def test_the_cache_publishes_only_states_a_forward_wrote(runner, mode):
    rng = np.random.default_rng(26)
    prompts = _workload(rng, runner.vocab_size)
    engine, recording = recorded_engine(runner, mode=mode, max_new_tokens=2)
    published = {}
    pending = list(prompts)
    while pending or engine.has_unfinished():
        while pending and len(engine.waiting) + len(engine.running) < 3:
            engine.add_request(pending.pop(0))
        engine.step()
        for key, slot in engine.cache.slots.by_key.items():
            published[key] = recording.written[slot]
        assert NULL_SLOT not in engine.cache.slots.by_key.values()
    # every published key is the chained hash of exactly the tokens whose state the slot received
    assert len(published) >= 5
    for key, tokens in published.items():
        assert len(tokens) % B == 0
        assert extend_block_hashes([], tokens, block_size=B)[-1] == key

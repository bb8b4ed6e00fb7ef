"""Bad input to the batching engine: refused requests name the rule, pools too small make requests wait without
corrupting the cache, cancelled requests give back everything, a non-finite request fails alone and publishes
nothing."""

import numpy as np
import pytest
from flax import nnx

from jaxckpt.engine.scheduler import Engine, EngineConfig, HybridRunner
from tests.engine.helpers import BUDGET, ENGINE, B, _text, check_parity, recorded_engine


def test_refused_requests_name_the_argument(runner):
    engine = Engine(runner, EngineConfig(**ENGINE, max_new_tokens=4))
    with pytest.raises(ValueError, match="^prompt: must hold at least one token"):
        engine.add_request([])
    with pytest.raises(ValueError, match="^prompt: .*max_model_len=256"):
        engine.add_request([1] * 253)
    with pytest.raises(ValueError, match=r"^prompt: token ids must lie in \[0, 256\)"):
        engine.add_request([1, 256])
    with pytest.raises(ValueError, match="^max_new_tokens: "):
        engine.add_request([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="^num_kv_pages: a request of 100 \\+ 4 tokens needs 7 pages of 16"):
        Engine(runner, EngineConfig(**(ENGINE | dict(num_kv_pages=5)))).add_request([1] * 100)
    with pytest.raises(ValueError, match="^num_state_slots: a request of 100 tokens needs 9 slots in mode 'several'"):
        Engine(runner, EngineConfig(**(ENGINE | dict(num_state_slots=8)), mode="several")).add_request([1] * 100)
    with pytest.raises(ValueError, match="^prompt: must hold at least one token"):
        engine.run([[1, 2], []])  # checked before anything runs
    assert not engine.has_unfinished() and not engine.results
    with pytest.raises(ValueError, match="^mode: "):
        EngineConfig(mode="all")
    with pytest.raises(ValueError, match="^max_num_seqs: 200 decode rows would not fit"):
        EngineConfig(max_num_seqs=200, max_num_scheduled_tokens=128)
    with pytest.raises(ValueError, match="^concurrency: "):
        engine.run([[1, 2]], concurrency=0)

    class Misaligned:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def checkpoint_alignment(self):
            return 3

    with pytest.raises(ValueError, match="^block_size: 16 must be a multiple of the model's checkpoint alignment 3"):
        Engine(Misaligned(runner), EngineConfig(mode="one_checkpoint"))
    Engine(Misaligned(runner), EngineConfig(mode="two_step"))


def test_a_pool_too_small_for_the_batch_makes_requests_wait(runner):
    rng = np.random.default_rng(31)
    shared = _text(rng, 40, runner.vocab_size)
    prompts = [shared + _text(rng, 150, runner.vocab_size) for _ in range(4)]
    # 23 usable pages: a request of 190 + 3 tokens takes 13 (less its hit), so one runs at a time however many are
    # in flight, and each evicts what the one before left behind but the shared prefix it holds
    engine, recording = recorded_engine(runner, mode="several", max_new_tokens=4)
    results = engine.run(prompts, concurrency=4)
    check_parity(runner, prompts, results)
    assert max(step.num_rows for step in recording.steps) == 1
    assert [r.hit_tokens for r in results] == [0] + [32] * 3
    assert engine.cache_stats.evicted_pages > 0


def test_cancelled_requests_free_their_pages_and_slots(runner):
    rng = np.random.default_rng(32)
    prompts = [_text(rng, n, runner.vocab_size) for n in (90, 60, 70, 50)]
    engine = Engine(runner, EngineConfig(**(ENGINE | dict(max_num_seqs=2)), mode="one_checkpoint", max_new_tokens=4))
    ids = [engine.add_request(p) for p in prompts]
    engine.step()
    assert [r.request_id for r in engine.running] == ids[:2] and len(engine.waiting) == 2
    free_pages = engine.cache.available_pages
    assert engine.cancel(ids[0]) and engine.cancel(ids[3]) and not engine.cancel(99)
    assert engine.cache.available_pages == free_pages + 6  # the 6 pages request 0 held (none published: 64 tokens
    assert not engine.cancel(ids[0])                        # computed out of 90 leave 4 full blocks, published)
    while engine.has_unfinished():
        engine.step()
    assert [engine.results[i].status for i in ids] == ["cancelled", "finished", "finished", "cancelled"]
    check_parity(runner, prompts[1:3], [engine.results[i] for i in ids[1:3]])
    assert engine.results[ids[3]].generated == [] and engine.results[ids[3]].first_logits is None
    assert not engine.cache.pages.refs and not engine.cache.slots.refs


@pytest.fixture(scope="module")
def poisoned_runner(runner):
    # the same model with a NaN embedding for token 255: a prompt holding it computes NaN from that token on. Same
    # shapes and graph, so the compiled forwards are reused.
    model = nnx.clone(runner.model)
    model.embed_tokens.weight[...] = model.embed_tokens.weight[...].at[255].set(np.nan)
    return HybridRunner(model, prefill_tokens=BUDGET, num_rows=4, fill=float("nan"))


@pytest.mark.parametrize("mode", ("two_step", "several"))
def test_a_non_finite_request_fails_alone_and_publishes_nothing(runner, poisoned_runner, mode):
    rng = np.random.default_rng(33)
    shared = _text(rng, 2 * B, runner.vocab_size)
    good = [shared + _text(rng, 40, runner.vocab_size), _text(rng, 50, runner.vocab_size)]
    bad = shared + _text(rng, 10, runner.vocab_size) + [255] + _text(rng, 30, runner.vocab_size)
    engine, recording = recorded_engine(poisoned_runner, mode=mode, max_new_tokens=3)
    results = engine.run([good[0], bad, good[1]], concurrency=3)
    assert [r.status for r in results] == ["finished", "failed", "finished"]
    assert results[1].reason.startswith("non-finite logits in the step computing tokens [0, ")
    # its neighbours in the step it failed in are intact
    assert len([s for s in recording.steps if results[1].request_id in s.request_ids][-1].request_ids) >= 2
    check_parity(runner, [good[0], good[1]], [results[0], results[2]])
    # nothing the bad request computed from its poisoned block on is findable, pages or states
    keys = engine.cache.block_hashes(bad)
    poisoned_blocks = keys[(2 * B + 10) // B:]
    assert not set(poisoned_blocks) & engine.cache.published_state_keys()
    assert all(engine.cache.pages.find(k) is None for k in poisoned_blocks)
    # what it wrote sits in slots that went back to the free list unkeyed; the check sees the NaN there
    written = [slot for slot, tokens in recording.written.items() if tokens[:len(bad)] == tuple(bad)[:len(tokens)]
               and len(tokens) > 2 * B + 10]
    assert written and not poisoned_runner.states_finite(written).any()
    assert not engine.cache.pages.refs and not engine.cache.slots.refs
    # a later request sharing the clean prefix matches its uncached forward; with a state at every boundary it
    # resumes from the shared prefix the failed request had in common with the first one
    later = shared + _text(rng, 20, runner.vocab_size)
    again = engine.run([later])
    check_parity(runner, [later], again)
    assert again[0].hit_tokens == (2 * B if mode == "several" else 0)


def test_a_row_with_non_finite_states_fails_alone(runner):
    """The state check on its own: a runner reporting one row's written states non-finite."""

    class StateFault:
        def __init__(self, inner):
            self.inner, self.fault = inner, None

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def forward(self, step):
            self.rows = list(step.request_ids)
            self.final = list(step.final_state_indices)
            return self.inner.forward(step)

        def states_finite(self, slots):
            ok = self.inner.states_finite(slots)
            if self.fault in self.rows:
                ok = ok & (np.asarray(slots) != self.final[self.rows.index(self.fault)])
            return ok

    rng = np.random.default_rng(34)
    prompts = [_text(rng, 48, runner.vocab_size) for _ in range(2)]
    fault = StateFault(runner)
    engine = Engine(fault, EngineConfig(**ENGINE, mode="one_checkpoint", max_new_tokens=2))
    fault.fault = 1
    results = engine.run(prompts, concurrency=2)
    assert [r.status for r in results] == ["finished", "failed"]
    assert results[1].reason.startswith("non-finite recurrent states")
    check_parity(runner, prompts[:1], results[:1])
    # the failed prompt's boundary states (16, 32 from its final/ckpt) are not published; the good one's are
    published = engine.cache.published_state_keys()
    assert engine.cache.block_hashes(prompts[0])[1] in published
    assert not set(engine.cache.block_hashes(prompts[1])) & published

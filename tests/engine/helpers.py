"""Shared by the engine tests: the tiny model's runner settings, the workload, parity against the uncached forward,
and a runner wrapper recording what every step wrote."""

import numpy as np

from jaxckpt.engine.scheduler import Engine, EngineConfig
from tests.numerics import rel_rms

B = 16
BUDGET = 128
ENGINE = dict(num_kv_pages=24, num_state_slots=32, max_num_scheduled_tokens=BUDGET, max_num_seqs=4)


_REFERENCES: dict[tuple, np.ndarray] = {}


def reference(runner, tokens):
    key = tuple(tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = runner.reference_logits(list(tokens))
    return _REFERENCES[key]


def _text(rng, n, vocab):
    return rng.integers(1, vocab - 1, n).tolist()


def _workload(rng, vocab):
    """Shared system prompts, a conversation extending its earlier turns, and a #45238-shaped family."""
    system = _text(rng, 3 * B + 5, vocab)
    turn1 = system + _text(rng, 20, vocab)
    turn2 = turn1 + _text(rng, 30, vocab)
    shared = _text(rng, 45, vocab)
    return [system + _text(rng, 25, vocab), system + _text(rng, 40, vocab), turn1, turn2, turn2 + _text(rng, 9, vocab),
            shared + _text(rng, 21, vocab), shared + _text(rng, 21, vocab), system + _text(rng, 25, vocab),
            _text(rng, 100, vocab)]


def check_parity(runner, prompts, results):
    for prompt, result in zip(prompts, results):
        assert result.status == "finished", result.reason
        logits = reference(runner, prompt + result.generated[:-1])
        assert rel_rms(result.first_logits, logits[len(prompt) - 1]) <= 1e-5
        assert result.generated == [int(np.argmax(row)) for row in logits[len(prompt) - 1:]]


class Recording:
    """Wraps a runner: keeps every step, and which slot each forward wrote with the state after which tokens."""

    def __init__(self, inner, engine_ref):
        self.inner, self.engine_ref, self.steps, self.written = inner, engine_ref, [], {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, step):
        self.steps.append(step)
        engine = self.engine_ref[0]
        tokens = {req.request_id: req.tokens for req in engine.running}
        for n, rid in enumerate(step.request_ids):
            qs, count = int(step.context_lens[n]), int(step.cu_seqlens[n + 1] - step.cu_seqlens[n])
            for j in range(step.checkpoint_cu[n], step.checkpoint_cu[n + 1]):
                self.written[int(step.checkpoint_state_indices[j])] = tuple(
                    tokens[rid][:qs + int(step.checkpoint_offsets[j])])
            self.written[int(step.final_state_indices[n])] = tuple(tokens[rid][:qs + count])
        return self.inner.forward(step)


def recorded_engine(runner, **config):
    ref = []
    recording = Recording(runner, ref)
    ref.append(Engine(recording, EngineConfig(**(ENGINE | config))))
    return ref[0], recording

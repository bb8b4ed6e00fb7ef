"""bench/e2e.py in its tiny CPU mode: the rows it writes, checkpointed logits equal to the plain forward's, and the
#45238 family turning from misses into hits with several checkpoints."""

import json

import pytest

from bench import e2e

REQUESTS = 3


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OUT", str(out))
        # one block keeps the run to four standalone compiles plus the engine's four
        assert e2e.main(["--tiny", "--name", "e2e_test", "--blocks", "48", "--requests", str(REQUESTS)]) == 0
    assert (out / "e2e_test.md").exists()
    return json.loads((out / "e2e_test.json").read_text())


def _rows(payload, op):
    return [r for r in payload["results"] if r["op"] == op]


def test_every_expected_row_is_there_and_nothing_failed(payload):
    ops = [r["op"] for r in payload["results"]]
    for op in ("setup", "plain", "checkpointed", "step1", "step2", "two_step", "ckpt/plain", "ckpt/two_step",
               "saving", "verify", "45238 check", "45238 compile", "compile"):
        assert ops.count(op) == 1, op
    for mode in e2e.MODES:
        assert ops.count(f"45238 {mode}") == REQUESTS + 1  # one row per request and the mode's summary
    assert not [r for r in payload["results"] if str(r.get("note", "")).startswith(("FAIL", "skipped"))]
    for op in ("plain", "checkpointed", "step1", "step2"):
        (row,) = _rows(payload, op)
        assert row["median_ms"] > 0 and row["p20_ms"] <= row["p80_ms"]
        assert row["implementations"]["gdn"]["used"] == {"xla": 3}
    (plain,), (ckpt,), (step1,), (step2,) = (_rows(payload, op) for op in ("plain", "checkpointed", "step1", "step2"))
    assert (plain["shape"]["tokens"], ckpt["shape"]["tokens"]) == (e2e.TINY_ISL, e2e.TINY_ISL)
    assert step1["shape"]["tokens"] + step2["shape"]["tokens"] == e2e.TINY_ISL
    assert ckpt["checkpoints"] == f"1 at {step1['shape']['tokens']}" == f"1 at {step2['shape']['context']}"
    (two_step,), (saving,) = _rows(payload, "two_step"), _rows(payload, "saving")
    assert two_step["median_ms"] == pytest.approx(step1["median_ms"] + step2["median_ms"])
    assert saving["measured_ms"] == pytest.approx(two_step["median_ms"] - ckpt["median_ms"])
    assert saving["predicted_ms"] == pytest.approx(step2["median_ms"] - (plain["median_ms"] - step1["median_ms"]))


def test_checkpointed_forward_matches_the_plain_forward_and_the_two_step_state(payload):
    (verify,) = _rows(payload, "verify")
    assert verify["ckpt_logits_vs_plain"] <= 1e-5
    assert verify["ckpt_conv_state_vs_step1"] <= 1e-5
    assert verify["ckpt_recurrent_state_vs_step1"] <= 1e-5
    assert verify["two_step_logits_vs_plain"] <= 1e-4


def test_45238_family_hits_only_with_several_checkpoints(payload):
    summary = {mode: next(r for r in _rows(payload, f"45238 {mode}") if r["shape"]["request"] == "all")
               for mode in e2e.MODES}
    assert summary["two_step"]["hit_requests"] == summary["one_checkpoint"]["hit_requests"] == 0
    assert summary["several"]["hit_requests"] == REQUESTS - 1
    assert summary["two_step"]["forwards"] == 2 * REQUESTS
    assert summary["one_checkpoint"]["forwards"] == summary["several"]["forwards"] == REQUESTS
    assert summary["several"]["tokens_computed"] < summary["one_checkpoint"]["tokens_computed"]
    (check,) = _rows(payload, "45238 check")
    assert check["max_rel_diff"] <= 1e-4

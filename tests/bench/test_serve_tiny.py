"""bench/serve.py in its tiny CPU mode: every mode at two concurrencies, the metrics it reports, and the properties
the tiny run can show (two_step's tail steps, the predicted saving, agreement of logits across modes)."""

import json

import pytest

from bench import serve

MODES = ("two_step", "one_checkpoint", "several", "no_prefix_cache")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OUT", str(out))
        assert serve.main(["--tiny", "--name", "serve_test", "--num-prompts", "6", "--concurrency", "1,3",
                           "--repeats", "2"]) == 0
    assert (out / "serve_test.md").read_text().count("| 3 |") == len(MODES)
    return json.loads((out / "serve_test.json").read_text())


def test_every_mode_and_concurrency_reports_its_metrics(report):
    runs = {(r["concurrency"], r["mode"]): r for r in report["runs"]}
    assert sorted(runs) == sorted((c, m) for c in (1, 3) for m in MODES)
    for r in runs.values():
        assert r["requests"] == 6 and len(r["ttft_ms"]) == 6
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_tpot_ms"] > 0 and r["input_tok_s"] > 0
        assert r["tokens_computed"] == 6 * 200  # random prompts: nothing to hit
        assert r["logits_rel_rms_worst"] <= 1e-5
        # two runs of each mode: the one reported is the shorter (the lower median), its steps split by kind
        assert len(r["durations_s"]) == 2 and r["duration_s"] == min(r["durations_s"])
        assert r["prefill_step_s"] > 0 and r["prefill_step_s"] + r["decode_step_s"] == pytest.approx(r["step_s"])
    for c in (1, 3):
        two, one = runs[(c, "two_step")], runs[(c, "one_checkpoint")]
        # ISL 200 at block 32: every prompt crosses its last boundary (192) and two_step runs its 8-token tail apart
        assert two["tail_steps"] >= 1 and two["tail_steps_s"] > 0 and one["tail_steps"] == 0
        assert two["prefill_steps"] > one["prefill_steps"]
        assert one["predicted_saving_ms"] == pytest.approx(two["tail_wait_per_request_ms"])
        assert one["measured_saving_ms"] == pytest.approx(two["mean_ttft_ms"] - one["mean_ttft_ms"])
    assert report["compiles"]["shapes"] >= 2

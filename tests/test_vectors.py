"""The shared test vectors: the committed files match their generator, the references reproduce them, the metadata
is complete, bf16 survives the file format bit for bit, and the checker rejects wrong outputs."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from tests.vectors import generate
from tests.vectors.loader import (EXACT_OUTPUTS, OPS, OUTPUT_NAMES, SEMANTICS_VERSION, TOLERANCES, check_case,
                                  load_case, load_cases, load_metadata, measure_case, read_tensors, rel_rms,
                                  vector_path)

CASES = {op: load_cases(op) for op in OPS}
ALL_CASES = [(op, case.name) for op in OPS for case in CASES[op]]
DRIFT_CASES = [
    ("gdn", "tiny_rows"), ("gdn", "bf16_qk_l2norm_vk"),
    ("kda", "tiny_rows_fused_gate"), ("kda", "bf16_lower_bound_vk"),
    ("ssd", "tiny_rows"), ("ssd", "bf16_dt_limit_kv"),
    ("conv1d", "w4_short_rows"), ("conv1d", "bf16_mixed_batch"),
]


def _case(op, name):
    return next(case for case in CASES[op] if case.name == name)


def _bits(array):
    return array.dtype, array.shape, array.tobytes()


def _expected_outputs(case):
    return tuple(np.array(case.expected[name]) for name in OUTPUT_NAMES[case.op])


def test_files_hold_exactly_the_generator_cases():
    for op in OPS:
        assert [case.name for case in CASES[op]] == [spec.name for spec in generate.SPECS[op]], op


@pytest.mark.parametrize("op,name", DRIFT_CASES)
def test_regenerated_case_is_bitwise_identical(op, name):
    fresh, stored = generate.build_case(op, name), _case(op, name)
    assert list(fresh.inputs) == list(stored.inputs)
    for arg in fresh.inputs:
        assert _bits(fresh.inputs[arg]) == _bits(stored.inputs[arg]), f"{op}/{name}/{arg}"
    for out in OUTPUT_NAMES[op]:
        assert _bits(fresh.expected[out]) == _bits(stored.expected[out]), f"{op}/{name}/{out}"
    assert fresh.options == stored.options
    assert json.loads(json.dumps(fresh.meta)) == stored.meta


@pytest.mark.parametrize("op,name", ALL_CASES)
def test_reference_reproduces_stored_expected(op, name):
    case = _case(op, name)
    outputs = generate.reference(op)(**case.arguments)
    report = check_case(case, outputs, tolerance_class="reference")
    assert report and all(r["ok"] for r in report)


def test_metadata_is_complete():
    case_keys = {"name", "description", "options", "input_dtype", "tolerance_class", "inputs", "rows", "seed"}
    for op in OPS:
        meta = load_metadata(op)
        assert meta["op"] == op
        assert meta["semantics_version"] == SEMANTICS_VERSION == "1"
        assert meta["generator"] == "tests/vectors/generate.py"
        assert meta["seed"] == str(generate.SEED)
        tolerances = meta["tolerances"]
        assert tolerances["classes"] == TOLERANCES
        assert {cls: spec["provisional"] for cls, spec in tolerances["classes"].items()} == {
            "reference": False, "fp32": False, "tf32": True, "bf16": False}
        assert [tolerances["classes"][c]["rel_rms"] for c in ("reference", "fp32", "tf32", "bf16")] == [
            1e-6, 1e-5, 2e-3, 6e-3]
        assert "rel-RMS" in tolerances["metric"]
        assert tolerances["exact"] == {"conv1d": ["final_state", "checkpoint_states"]}
        assert len(meta["cases"]) >= 10
        for entry, case in zip(meta["cases"], CASES[op]):
            assert case_keys <= set(entry), (op, entry["name"])
            assert entry["tolerance_class"] == {"float32": "fp32", "bfloat16": "bf16"}[entry["input_dtype"]]
            assert entry["description"]
            float_dtypes = {a.dtype.name for a in case.inputs.values() if a.dtype.kind in "fV"}
            assert ("bfloat16" in float_dtypes) == (entry["input_dtype"] == "bfloat16"), (op, entry["name"])
            assert "float64" not in float_dtypes
            for arg in ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets"):
                if arg in case.inputs:
                    assert case.inputs[arg].dtype == np.int32, (op, entry["name"], arg)
            for out in OUTPUT_NAMES[op]:
                assert case.expected[out].dtype == np.float32


def test_cases_cover_the_required_situations():
    for op in OPS:
        lengths = {n for case in CASES[op] for n in case.meta["rows"]}
        assert {0, 1, 2, 3, 63, 64, 65, 127, 200}.issubset(lengths) and max(lengths) >= 997, op
        assert {case.tolerance_class for case in CASES[op]} == {"fp32", "bf16"}, op
        padded = [case for case in CASES[op] if "checkpoint_cu" in case.inputs
                  and case.inputs["checkpoint_offsets"].size > case.inputs["checkpoint_cu"][-1]]
        assert padded, op
        assert any("cu_seqlens" not in case.inputs for case in CASES[op]), op
        assert any("checkpoint_cu" not in case.inputs for case in CASES[op]), op
        offsets, from_end = set(), set()
        for case in CASES[op]:
            if "checkpoint_cu" not in case.inputs:
                continue
            ccu, row_offsets = case.inputs["checkpoint_cu"], case.inputs["checkpoint_offsets"]
            for n, length in enumerate(case.meta["rows"]):
                offsets |= {int(p) for p in row_offsets[ccu[n]:ccu[n + 1]]}
                from_end |= {length - int(p) for p in row_offsets[ccu[n]:ccu[n + 1]]}
        assert 1 in offsets and 1 in from_end, op
    layouts = {case.options.get("state_layout") for op in ("gdn", "kda", "ssd") for case in CASES[op]}
    assert layouts == {"kv", "vk"}
    assert {case.options["use_qk_l2norm"] for case in CASES["gdn"]} == {True, False}
    kda_gates = {("A_log" in c.inputs, c.options.get("lower_bound") is not None) for c in CASES["kda"]}
    assert kda_gates == {(False, False), (True, False), (False, True), (True, True)}
    assert {c.inputs["D"].ndim for c in CASES["ssd"] if "D" in c.inputs} == {1, 2}
    assert any("z" in c.inputs for c in CASES["ssd"]) and any("dt_limit" in c.options for c in CASES["ssd"])
    assert {c.inputs["weight"].shape[1] for c in CASES["conv1d"]} == {2, 3, 4}
    assert {c.options["activation"] for c in CASES["conv1d"]} == {None, "silu"}


def test_bf16_inputs_load_as_ml_dtypes_bfloat16_exactly():
    case = load_case("gdn", "bf16_mixed_batch")
    fresh = generate.build_case("gdn", "bf16_mixed_batch")
    for arg in ("q", "k", "v", "beta"):
        assert case.inputs[arg].dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(case.inputs[arg].view(np.uint16), fresh.inputs[arg].view(np.uint16))


def test_every_bf16_bit_pattern_round_trips(tmp_path):
    bits = np.arange(2**16, dtype=np.uint16)
    tensors = {
        "case/bf16": bits.view(ml_dtypes.bfloat16).reshape(256, 256),
        "case/f32": np.random.default_rng(41).standard_normal((3, 5)).astype(np.float32),
        "case/i32": np.array([0, 7, -3, 2**31 - 1], np.int32),
        "case/empty": np.zeros((0, 4, 2), np.float32),
    }
    path = tmp_path / "roundtrip.safetensors"
    generate.write_safetensors(path, tensors, {"op": "gdn"})
    loaded = read_tensors(path)
    assert set(loaded) == set(tensors)
    for name, array in tensors.items():
        assert _bits(loaded[name]) == _bits(array), name
    np.testing.assert_array_equal(loaded["case/bf16"].view(np.uint16).ravel(), bits)


def test_loader_imports_neither_torch_nor_jax():
    code = ("import sys, tests.vectors.loader as l; l.load_cases('conv1d'); "
            "assert not {'torch', 'jax'} & set(sys.modules), sorted({'torch', 'jax'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=vector_path("gdn").parents[2])


def test_rel_rms_matches_its_definition():
    rng = np.random.default_rng(43)
    expected = rng.standard_normal((7, 3))
    out = expected + 1e-3 * rng.standard_normal((7, 3))
    assert rel_rms(out, expected) == pytest.approx(
        np.sqrt(np.sum((out - expected) ** 2) / np.sum(expected ** 2)), rel=1e-12)
    assert rel_rms(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_rms(np.ones(3), np.zeros(3)) == np.inf
    assert np.isnan(rel_rms(np.full(3, np.nan), np.ones(3)))


@pytest.mark.parametrize("cls", list(TOLERANCES))
def test_check_case_accepts_noise_below_the_bound_and_rejects_it_above(cls):
    case = _case("gdn", "chunk_edges")
    bound = TOLERANCES[cls]["rel_rms"]
    rng = np.random.default_rng(47)
    o, final_state, checkpoint_states = _expected_outputs(case)
    noise = rng.standard_normal(o.shape)
    noise *= np.linalg.norm(o) / np.linalg.norm(noise)
    check_case(case, (o + 0.5 * bound * noise, final_state, checkpoint_states), tolerance_class=cls)
    with pytest.raises(AssertionError, match=rf"FAIL o\[:\d+\]: .*bound={bound:.1e}"):
        check_case(case, (o + 2.0 * bound * noise, final_state, checkpoint_states), tolerance_class=cls)


def test_check_case_judges_each_valid_checkpoint_and_ignores_padding():
    case = _case("gdn", "bf16_mixed_batch")
    o, final_state, checkpoint_states = _expected_outputs(case)
    valid_tokens = int(case.inputs["cu_seqlens"][-1])
    valid_entries = int(case.inputs["checkpoint_cu"][-1])
    assert valid_tokens < o.shape[0] and valid_entries < checkpoint_states.shape[0]
    garbage_o, garbage_cp = o.copy(), checkpoint_states.copy()
    garbage_o[valid_tokens:] = 1e6
    garbage_cp[valid_entries:] = np.nan
    report = check_case(case, {"o": garbage_o, "final_state": final_state, "checkpoint_states": garbage_cp})
    assert sum(r["tensor"].startswith("checkpoint_states[") for r in report) == valid_entries

    # 2% error on one small checkpoint is far below 6e-3 of the whole checkpoint tensor, but not of that entry.
    wrong = checkpoint_states.copy()
    wrong[valid_entries - 1] *= 1.02
    with pytest.raises(AssertionError, match=rf"FAIL checkpoint_states\[{valid_entries - 1}\]"):
        check_case(case, (o, final_state, wrong))
    nan_state = final_state.copy()
    nan_state[0, 0, 0, 0] = np.nan
    with pytest.raises(AssertionError, match="FAIL final_state"):
        check_case(case, (o, nan_state, checkpoint_states))
    with pytest.raises(AssertionError, match="shape"):
        check_case(case, (o[:-1], final_state, checkpoint_states))


def test_check_case_requires_conv_states_bit_exact():
    case = _case("conv1d", "bf16_mixed_batch")
    assert EXACT_OUTPUTS["conv1d"] == ("final_state", "checkpoint_states")
    y, final_state, checkpoint_states = _expected_outputs(case)
    check_case(case, (y, final_state, checkpoint_states))
    off_by_one_ulp = final_state.copy()
    off_by_one_ulp[1, 2, 0] = np.nextafter(off_by_one_ulp[1, 2, 0], np.float32(np.inf))
    with pytest.raises(AssertionError, match=r"FAIL final_state.*bit-exact"):
        check_case(case, (y, off_by_one_ulp, checkpoint_states))
    report = measure_case(case, (y, off_by_one_ulp, checkpoint_states))
    assert [r["tensor"] for r in report if not r["ok"]] == ["final_state"]

"""Loads the shared test vectors (`tests/vectors/<op>.safetensors`) as numpy and checks outputs against them.

Plain numpy + safetensors + ml_dtypes, so the JAX package and torch_bridge read the same files and apply the same
tolerance rules. bfloat16 inputs come back as `ml_dtypes.bfloat16` arrays holding exactly the stored bits; the
expected outputs are float32 roundings of the float64 reference run on exactly those inputs. What the files hold and
how the tolerance classes were chosen is in README.md beside this file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import deserialize, safe_open

from tests.numerics import as_float64, rel_rms

OPS = ("gdn", "kda", "ssd", "conv1d")
SEMANTICS_VERSION = "1"
VECTORS_DIR = Path(__file__).resolve().parent
OUTPUT_NAMES = {
    "gdn": ("o", "final_state", "checkpoint_states"),
    "kda": ("o", "final_state", "checkpoint_states"),
    "ssd": ("y", "final_state", "checkpoint_states"),
    "conv1d": ("y", "final_state", "checkpoint_states"),
}
# Conv states are copies of raw inputs, so every implementation must reproduce them bit for bit.
EXACT_OUTPUTS = {"conv1d": ("final_state", "checkpoint_states")}

TOLERANCES = {
    "reference": {
        "rel_rms": 1e-6,
        "provisional": False,
        "meaning": "the float64 reference re-run on the stored inputs; it agrees with itself to ~1e-12, the bound is "
                   "set by the float32 rounding of the stored expected outputs",
    },
    "fp32": {
        "rel_rms": 1e-5,
        "provisional": False,
        "meaning": "fp32 chunked implementations with matmul precision HIGHEST",
    },
    "tf32": {
        "rel_rms": 2e-3,
        "provisional": True,
        "meaning": "fp32 inputs through TF32 matmul units; not yet measured on a GPU",
    },
    "bf16": {
        "rel_rms": 6e-3,
        "provisional": False,
        "meaning": "bf16 inputs, fp32 accumulation and states; 1.43x the worst rel-RMS FLA 0.6.0 reaches on these "
                   "very bf16 cases on an H200 (4.2e-3, GDN and KDA; bench/results/fla_vectors_error_h200.json)",
    },
}
METRIC = ("rel-RMS = ||out - expected||_2 / ||expected||_2 per tensor: the output over valid tokens "
          "[0, cu_seqlens[N]) as one tensor, final_state as one tensor, each valid checkpoint state (CSR entries "
          "[0, checkpoint_cu[N])) on its own; padding tokens and padded CSR entries are ignored; an all-zero "
          "expected tensor must be matched exactly. Tensors named in 'exact' must match bit for bit (atol 0) when "
          "the implementation runs in the case's input dtype.")

SAFETENSORS_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}


@dataclass(frozen=True)
class Case:
    """One test case: the arguments to feed, the float32 expected outputs and the tolerance class to hold them to."""

    op: str
    name: str
    inputs: dict  # argument name -> array, exactly as fed (bf16 as ml_dtypes.bfloat16, indices int32)
    options: dict  # scalar keyword arguments (scale, state_layout, activation, dt_limit, lower_bound, ...)
    expected: dict  # output name -> float32 array
    tolerance_class: str
    meta: dict  # the case's metadata entry (description, input_dtype, seed, ...)

    @property
    def arguments(self) -> dict:
        """Inputs and options as one keyword-argument dict: `reference(**case.arguments)`."""
        return {**self.inputs, **self.options}


def tolerance_metadata() -> dict:
    """The "tolerances" metadata entry every vector file carries."""
    return {"classes": TOLERANCES, "metric": METRIC, "exact": {op: list(names) for op, names in EXACT_OUTPUTS.items()}}


def vector_path(op: str) -> Path:
    if op not in OPS:
        raise ValueError(f"op: must be one of {OPS}, got {op!r}")
    return VECTORS_DIR / f"{op}.safetensors"


def load_metadata(op: str, *, path=None) -> dict:
    """The file's `__metadata__` with the JSON entries ("cases", "tolerances") decoded."""
    path = vector_path(op) if path is None else Path(path)
    with safe_open(path, framework="np") as f:
        raw = f.metadata() or {}
    meta = dict(raw)
    for key in ("cases", "tolerances"):
        if key in meta:
            meta[key] = json.loads(meta[key])
    return meta


def read_tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only numpy array, BF16 as ml_dtypes.bfloat16."""
    # safetensors.numpy cannot map BF16; the raw views give the bytes, and ml_dtypes gives the dtype.
    tensors = {}
    for name, view in deserialize(Path(path).read_bytes()):
        dtype = SAFETENSORS_DTYPES.get(view["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {view['dtype']}")
        array = np.frombuffer(bytes(view["data"]), dtype=dtype).reshape(view["shape"])
        array.flags.writeable = False
        tensors[name] = array
    return tensors


def load_cases(op: str, *, path=None) -> list[Case]:
    """All cases of one op, in file order."""
    path = vector_path(op) if path is None else Path(path)
    meta = load_metadata(op, path=path)
    if meta.get("op") != op:
        raise ValueError(f"{path.name}: holds op {meta.get('op')!r}, expected {op!r}")
    if meta.get("semantics_version") != SEMANTICS_VERSION:
        raise ValueError(f"{path.name}: semantics_version {meta.get('semantics_version')!r}, this loader reads "
                         f"{SEMANTICS_VERSION!r}; regenerate with `python -m tests.vectors.generate`")
    tensors = read_tensors(path)
    cases = []
    for entry in meta["cases"]:
        name = entry["name"]
        inputs = {arg: tensors[f"{name}/{arg}"] for arg in entry["inputs"]}
        expected = {out: tensors[f"{name}/{out}"] for out in OUTPUT_NAMES[op]}
        cases.append(Case(op=op, name=name, inputs=inputs, options=dict(entry["options"]), expected=expected,
                          tolerance_class=entry["tolerance_class"], meta=entry))
    return cases


def load_case(op: str, name: str) -> Case:
    for case in load_cases(op):
        if case.name == name:
            return case
    raise KeyError(f"{op}: no case named {name!r}")


def _valid_parts(case: Case, name: str, out: np.ndarray, expected: np.ndarray):
    """(label, out, expected) pieces compared on their own: valid tokens, the final state, each valid checkpoint."""
    if name == "final_state":
        return [(name, out, expected)]
    if name == "checkpoint_states":
        ccu = case.inputs.get("checkpoint_cu")
        if ccu is None:
            return []
        offsets = case.inputs["checkpoint_offsets"]
        rows = np.searchsorted(ccu, np.arange(int(ccu[-1])), side="right") - 1
        return [(f"{name}[{m}] (row {rows[m]}, offset {offsets[m]})", out[m], expected[m]) for m in range(rows.size)]
    cu = case.inputs.get("cu_seqlens")
    valid = expected.shape[0] if cu is None else int(cu[-1])
    return [(f"{name}[:{valid}]", out[:valid], expected[:valid])]


def measure_case(case: Case, outputs, *, tolerance_class: str | None = None) -> list[dict]:
    """Per-tensor comparison report (no assertion): a dict per compared piece with max_abs, rel_rms, bound, ok.

    `outputs` is the implementation's (output, final_state, checkpoint_states) tuple or a dict by output name.
    `tolerance_class` overrides the case's class (e.g. "tf32" for an fp32 case run on TF32 units).
    """
    cls = case.tolerance_class if tolerance_class is None else tolerance_class
    if cls not in TOLERANCES:
        raise ValueError(f"tolerance_class: must be one of {tuple(TOLERANCES)}, got {cls!r}")
    names = OUTPUT_NAMES[case.op]
    if not isinstance(outputs, dict):
        outputs = tuple(outputs)
        if len(outputs) != len(names):
            raise ValueError(f"outputs: expected {len(names)} arrays {names}, got {len(outputs)}")
        outputs = dict(zip(names, outputs))
    bound = TOLERANCES[cls]["rel_rms"]
    exact = EXACT_OUTPUTS.get(case.op, ())
    report = []
    for name in names:
        expected = np.asarray(case.expected[name], np.float64)
        out = as_float64(outputs[name])
        if out.shape != expected.shape:
            report.append({"tensor": name, "ok": False, "shape": out.shape, "expected_shape": expected.shape})
            continue
        for label, o, e in _valid_parts(case, name, out, expected):
            diff = np.abs(o - e)
            max_abs = float(diff.max()) if diff.size else 0.0
            if np.isnan(max_abs):
                max_abs = math.nan
            r = rel_rms(o, e)
            if name in exact:
                ok = bool(np.array_equal(o, e))
                entry_bound = 0.0
            else:
                ok = r <= bound  # False for nan
                entry_bound = bound
            report.append({"tensor": label, "ok": ok, "max_abs": max_abs, "rel_rms": r, "bound": entry_bound,
                           "exact": name in exact})
    return report


def format_report(case: Case, report: list[dict], *, tolerance_class: str | None = None) -> str:
    cls = case.tolerance_class if tolerance_class is None else tolerance_class
    tag = f"class {cls!r}" + (" (provisional)" if TOLERANCES[cls]["provisional"] else "")
    lines = [f"{case.op}/{case.name} [{tag}]:"]
    for r in report:
        status = "ok  " if r["ok"] else "FAIL"
        if "shape" in r:
            lines.append(f"  {status} {r['tensor']}: shape {r['shape']} != expected {r['expected_shape']}")
        elif r["exact"]:
            lines.append(f"  {status} {r['tensor']}: max_abs={r['max_abs']:.3e} (must be bit-exact)")
        else:
            lines.append(f"  {status} {r['tensor']}: max_abs={r['max_abs']:.3e} rel_rms={r['rel_rms']:.3e} "
                         f"bound={r['bound']:.1e}")
    return "\n".join(lines)


def check_case(case: Case, outputs, *, tolerance_class: str | None = None) -> list[dict]:
    """Asserts every output of `outputs` is within the tolerance class; returns the report when it is.

    Raises AssertionError listing every compared piece (max abs error, rel-RMS, bound) when any fails.
    """
    report = measure_case(case, outputs, tolerance_class=tolerance_class)
    if not all(r["ok"] for r in report):
        failing = [r for r in report if not r["ok"]]
        raise AssertionError(f"{len(failing)} of {len(report)} compared tensors out of tolerance\n"
                             + format_report(case, report, tolerance_class=tolerance_class))
    return report

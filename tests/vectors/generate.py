"""Writes tests/vectors/<op>.safetensors from the float64 references: `python -m tests.vectors.generate`.

`--check` regenerates in memory and compares with the committed files instead of writing them; `--ops` limits the
run to some ops. Every case draws from its own generator seeded by (SEED, crc32("<op>/<case>")), so adding or
editing one case leaves the others' bits alone. Inputs are cast to the case's dtype first, and the reference runs on
exactly the cast values; its float64 answer is stored rounded to float32.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from tests.vectors.loader import OPS, OUTPUT_NAMES, SAFETENSORS_DTYPES, SEMANTICS_VERSION, Case, load_cases, \
    load_metadata, tolerance_metadata, vector_path

SEED = 20261130
GENERATOR = "tests/vectors/generate.py"
HEAD_DIM = 16  # K = V for GDN/KDA
SSD_HEADS, SSD_HEAD_DIM, SSD_STATE_DIM = 4, 8, 16
CONV_DIM = 8
GDN_DECAY_SCALE = {"strong": 4.0, "normal": 1.0, "weak": 0.1}  # g = logsigmoid(randn) * scale
KDA_RATE_RANGE = {"strong": (1.0, 16.0), "normal": (0.5, 2.0), "weak": (0.02, 0.1)}  # exp(A_log) for fused gates
SSD_A_RANGE = {"strong": (2.0, 8.0), "normal": (0.2, 1.0), "weak": (0.01, 0.05)}  # -A; delta is about 0.7
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_TOLERANCE_CLASS = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Spec:
    """How to build one case. `checkpoints` holds each row's offsets (None: no CSR arguments at all); `initial`
    says which rows start from a random state rather than zeros (None: no initial_state argument)."""

    name: str
    description: str
    rows: tuple
    checkpoints: tuple | None = None
    initial: tuple | None = None
    dtype: str = "float32"
    pad_checkpoints: int = 0
    pad_tokens: int = 0
    packed: bool = True  # False: cu_seqlens is not passed (one row over all tokens)
    options: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return np.exp(_logsigmoid(x))


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def _softplus_inverse(y):
    return np.log(np.expm1(y))


def _layout_args(spec: Spec) -> tuple[int, dict]:
    """(T, {cu_seqlens, checkpoint_cu, checkpoint_offsets}) as int32, CSR padded with offset 0."""
    cu = np.concatenate([[0], np.cumsum(spec.rows)]).astype(np.int32)
    num_tokens = int(cu[-1]) + spec.pad_tokens
    args = {}
    if spec.packed:
        args["cu_seqlens"] = cu
    elif len(spec.rows) != 1 or spec.pad_tokens:
        raise ValueError(f"{spec.name}: an unpacked case has one row and no padding tokens")
    if spec.checkpoints is not None:
        if len(spec.checkpoints) != len(spec.rows):
            raise ValueError(f"{spec.name}: checkpoints needs one offset tuple per row")
        counts = [len(row) for row in spec.checkpoints]
        args["checkpoint_cu"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        offsets = [p for row in spec.checkpoints for p in row] + [0] * spec.pad_checkpoints
        args["checkpoint_offsets"] = np.asarray(offsets, np.int32)
    return num_tokens, args


def _initial_state(spec: Spec, rng, shape) -> np.ndarray | None:
    """[N, ...] float32 random states for the rows flagged in `spec.initial`, zeros for the others."""
    if spec.initial is None:
        return None
    if len(spec.initial) != len(spec.rows):
        raise ValueError(f"{spec.name}: initial needs one flag per row")
    states = rng.standard_normal((len(spec.rows), *shape)) * 0.5
    states[~np.asarray(spec.initial, bool)] = 0.0
    return states.astype(np.float32)


def _delta_inputs(spec: Spec, rng, *, per_channel: bool) -> dict:
    p, opts = spec.params, spec.options
    act = _DTYPES[spec.dtype]
    heads, v_heads = p["heads"], p["v_heads"]
    num_tokens, layout = _layout_args(spec)
    q = rng.standard_normal((num_tokens, heads, HEAD_DIM))
    k = rng.standard_normal((num_tokens, heads, HEAD_DIM))
    if not opts["use_qk_l2norm"]:
        q, k = _l2norm(q), _l2norm(k)  # what the kernel sees after the model's own normalisation
    v = rng.standard_normal((num_tokens, v_heads, HEAD_DIM))
    beta = _sigmoid(rng.standard_normal((num_tokens, v_heads)))
    inputs = {"q": q.astype(act), "k": k.astype(act), "v": v.astype(act)}
    gate = p.get("gate", "log")
    g_shape = (num_tokens, v_heads, HEAD_DIM) if per_channel else (num_tokens, v_heads)
    if gate == "log":
        inputs["g"] = (_logsigmoid(rng.standard_normal(g_shape)) * GDN_DECAY_SCALE[p["decay"]]).astype(np.float32)
    else:
        # Raw gate activations come straight from a projection, so they share the case dtype.
        inputs["g"] = rng.standard_normal(g_shape).astype(act)
    inputs["beta"] = beta.astype(act)
    state = _initial_state(spec, rng, (v_heads, HEAD_DIM, HEAD_DIM))
    if state is not None:
        inputs["initial_state"] = state
    inputs.update(layout)
    if gate in ("fused", "lower_bound_fused"):
        inputs["A_log"] = np.log(rng.uniform(*KDA_RATE_RANGE[p["decay"]], v_heads)).astype(np.float32)
    if gate != "log":
        bias = rng.standard_normal((v_heads, HEAD_DIM)) * 0.5 - 1.0
        inputs["dt_bias"] = (bias.reshape(-1) if p.get("flat_dt_bias") else bias).astype(np.float32)
    return inputs


def _ssd_inputs(spec: Spec, rng) -> dict:
    p = spec.params
    act = _DTYPES[spec.dtype]
    heads, groups, head_dim, state_dim = SSD_HEADS, p["groups"], SSD_HEAD_DIM, SSD_STATE_DIM
    num_tokens, layout = _layout_args(spec)
    with_bias = p.get("dt_bias", False)
    x = rng.standard_normal((num_tokens, heads, head_dim))
    dt = rng.standard_normal((num_tokens, heads)) * 0.5 - (1.0 if with_bias else 0.0)
    A = -rng.uniform(*SSD_A_RANGE[p["decay"]], heads)
    B = rng.standard_normal((num_tokens, groups, state_dim))
    C = rng.standard_normal((num_tokens, groups, state_dim))
    inputs = {"x": x.astype(act), "dt": dt.astype(act), "A": A.astype(np.float32), "B": B.astype(act),
              "C": C.astype(act)}
    if p.get("D") == "head":
        inputs["D"] = rng.standard_normal(heads).astype(np.float32)
    elif p.get("D") == "channel":
        inputs["D"] = rng.standard_normal((heads, head_dim)).astype(np.float32)
    if with_bias:
        inputs["dt_bias"] = rng.uniform(0.5, 1.5, heads).astype(np.float32)
    if p.get("z", False):
        inputs["z"] = rng.standard_normal((num_tokens, heads, head_dim)).astype(act)
    shape = (heads, head_dim, state_dim) if spec.options["state_layout"] == "vk" else (heads, state_dim, head_dim)
    state = _initial_state(spec, rng, shape)
    if state is not None:
        inputs["initial_state"] = state
    inputs.update(layout)
    return inputs


def _conv_inputs(spec: Spec, rng) -> dict:
    p = spec.params
    act = _DTYPES[spec.dtype]
    num_tokens, layout = _layout_args(spec)
    width = p["width"]
    inputs = {"x": rng.standard_normal((num_tokens, CONV_DIM)).astype(act),
              "weight": (rng.standard_normal((CONV_DIM, width)) * 0.5).astype(act)}
    if p.get("bias", False):
        inputs["bias"] = (rng.standard_normal(CONV_DIM) * 0.5).astype(act)
    state = _initial_state(spec, rng, (CONV_DIM, width - 1))
    if state is not None:
        inputs["initial_state"] = state.astype(act)  # the conv state pool holds model-dtype activations
    inputs.update(layout)
    return inputs


def _gdn(spec, rng):
    return _delta_inputs(spec, rng, per_channel=False)


def _kda(spec, rng):
    return _delta_inputs(spec, rng, per_channel=True)


def reference(op: str):
    """The op's float64 reference function."""
    if op == "gdn":
        from jaxckpt.ops.delta_rule.reference import gated_delta_rule
        return gated_delta_rule
    if op == "kda":
        from jaxckpt.ops.delta_rule.reference import kda
        return kda
    if op == "ssd":
        from jaxckpt.ops.ssd.reference import ssd
        return ssd
    from jaxckpt.ops.conv1d.reference import causal_conv1d
    return causal_conv1d


def _delta_opts(layout="kv", l2norm=False, scale=HEAD_DIM ** -0.5, **extra):
    return {"scale": scale, "use_qk_l2norm": l2norm, "state_layout": layout, **extra}


_GROUPED = {"heads": 2, "v_heads": 4}
_EQUAL = {"heads": 2, "v_heads": 2}

SPECS = {
    "gdn": [
        Spec("single_row", "one row, cu_seqlens not passed, no initial state; checkpoints at 1, chunk boundaries, "
             "len-1", rows=(200,), packed=False, checkpoints=((1, 64, 128, 199),), options=_delta_opts(),
             params={**_EQUAL, "decay": "normal"}),
        Spec("tiny_rows", "rows of 1, 2, 3 tokens and an empty row, grouped heads, strong decay; every admissible "
             "checkpoint offset", rows=(1, 2, 3, 0), checkpoints=((), (1,), (1, 2), ()),
             initial=(True, False, True, True), options=_delta_opts(), params={**_GROUPED, "decay": "strong"}),
        Spec("chunk_edges", "rows of 63, 64, 65, 127 tokens, checkpoints on both sides of 64-token chunk "
             "boundaries, 3 padded CSR entries, strong decay", rows=(63, 64, 65, 127),
             checkpoints=((1, 62), (32, 63), (1, 63, 64), (1, 63, 64, 65, 126)), pad_checkpoints=3,
             initial=(False, True, False, True), options=_delta_opts(), params={**_EQUAL, "decay": "strong"}),
        Spec("weak_decay_vk", "two rows with initial states, grouped heads, weak decay, state_layout vk",
             rows=(150, 2), checkpoints=((64, 128, 149), (1,)), initial=(True, True),
             options=_delta_opts(layout="vk"), params={**_GROUPED, "decay": "weak"}),
        Spec("qk_l2norm_scale", "raw q/k normalised inside (use_qk_l2norm), scale 0.5, a row without checkpoints",
             rows=(100, 30), checkpoints=((65,), ()), initial=(True, True),
             options=_delta_opts(l2norm=True, scale=0.5), params={**_GROUPED, "decay": "normal"}),
        Spec("no_checkpoints", "no checkpoint or initial-state arguments at all", rows=(65, 3),
             options=_delta_opts(), params={**_EQUAL, "decay": "normal"}),
        Spec("padded_csr_only", "checkpoint_cu all zero, 4 padded entries only, state_layout vk", rows=(40, 24),
             checkpoints=((), ()), pad_checkpoints=4, initial=(True, True), options=_delta_opts(layout="vk"),
             params={**_EQUAL, "decay": "normal"}),
        Spec("long_row", "one 320-token row with an initial state, weak decay, checkpoints near both ends",
             rows=(320,), checkpoints=((1, 256, 319),), initial=(True,), options=_delta_opts(),
             params={"heads": 1, "v_heads": 1, "decay": "weak"}),
        Spec("bf16_mixed_batch", "bf16 q/k/v/beta, five rows incl. an empty one, 5 padding tokens, 2 padded CSR "
             "entries, grouped heads", rows=(100, 0, 65, 3, 127),
             checkpoints=((1, 64, 99), (), (64,), (1, 2), (63,)), pad_checkpoints=2, pad_tokens=5,
             initial=(True, True, False, True, False), dtype="bfloat16", options=_delta_opts(),
             params={**_GROUPED, "decay": "normal"}),
        Spec("bf16_qk_l2norm_vk", "bf16, use_qk_l2norm, strong decay, state_layout vk", rows=(128, 1),
             checkpoints=((64,), ()), initial=(True, True), dtype="bfloat16",
             options=_delta_opts(layout="vk", l2norm=True), params={**_GROUPED, "decay": "strong"}),
        Spec("bf16_long_weak_decay", "bf16, a 1000-token row and a 65-token row, weak decay",
             rows=(1000, 65), checkpoints=((1, 256, 512, 999), (64,)), initial=(True, False), dtype="bfloat16",
             options=_delta_opts(), params={"heads": 1, "v_heads": 1, "decay": "weak"}),
    ],
    "kda": [
        Spec("single_row_log_gate", "plain per-channel log decay, one row, cu_seqlens not passed, no initial "
             "state", rows=(200,), packed=False, checkpoints=((1, 64, 128, 199),), options=_delta_opts(),
             params={**_EQUAL, "decay": "normal", "gate": "log"}),
        Spec("tiny_rows_fused_gate", "A_log + dt_bias fused gate (-exp(A_log) softplus(g + dt_bias)), rows of 1, "
             "2, 3 and 0 tokens, grouped heads, strong decay", rows=(1, 2, 3, 0),
             checkpoints=((), (1,), (1, 2), ()), initial=(True, False, True, True), options=_delta_opts(),
             params={**_GROUPED, "decay": "strong", "gate": "fused"}),
        Spec("chunk_edges_log_gate", "plain log decay, strong, rows of 63, 64, 65, 127 tokens around chunk "
             "boundaries, 3 padded CSR entries", rows=(63, 64, 65, 127),
             checkpoints=((1, 62), (32, 63), (1, 63, 64), (1, 63, 64, 65, 126)), pad_checkpoints=3,
             initial=(False, True, False, True), options=_delta_opts(),
             params={**_EQUAL, "decay": "strong", "gate": "log"}),
        Spec("weak_fused_gate_vk", "fused gate with small exp(A_log) (weak decay), grouped heads, state_layout vk",
             rows=(150, 2), checkpoints=((64, 128, 149), (1,)), initial=(True, True),
             options=_delta_opts(layout="vk"), params={**_GROUPED, "decay": "weak", "gate": "fused"}),
        Spec("lower_bound_gate", "safe gate lower_bound * sigmoid(g + dt_bias), flat [HV * K] dt_bias, "
             "use_qk_l2norm", rows=(100, 30), checkpoints=((65,), ()), initial=(True, True),
             options=_delta_opts(l2norm=True, lower_bound=-5.0),
             params={**_GROUPED, "decay": "normal", "gate": "lower_bound", "flat_dt_bias": True}),
        Spec("lower_bound_fused_gate", "safe gate with A_log: lower_bound * sigmoid(exp(A_log) (g + dt_bias)); no "
             "checkpoint or initial-state arguments", rows=(65, 3), options=_delta_opts(lower_bound=-3.0),
             params={**_EQUAL, "decay": "normal", "gate": "lower_bound_fused"}),
        Spec("padded_csr_only", "checkpoint_cu all zero, 4 padded entries only, weak log decay, state_layout vk",
             rows=(40, 24), checkpoints=((), ()), pad_checkpoints=4, initial=(True, True),
             options=_delta_opts(layout="vk"), params={**_EQUAL, "decay": "weak", "gate": "log"}),
        Spec("long_row", "one 320-token row with an initial state, weak log decay, checkpoints near both ends",
             rows=(320,), checkpoints=((1, 256, 319),), initial=(True,), options=_delta_opts(),
             params={"heads": 1, "v_heads": 1, "decay": "weak", "gate": "log"}),
        Spec("bf16_mixed_batch", "bf16 q/k/v/beta and raw gate, fused gate, five rows incl. an empty one, 5 "
             "padding tokens, 2 padded CSR entries, grouped heads", rows=(100, 0, 65, 3, 127),
             checkpoints=((1, 64, 99), (), (64,), (1, 2), (63,)), pad_checkpoints=2, pad_tokens=5,
             initial=(True, True, False, True, False), dtype="bfloat16", options=_delta_opts(),
             params={**_GROUPED, "decay": "normal", "gate": "fused"}),
        Spec("bf16_lower_bound_vk", "bf16, safe gate (lower_bound -5), use_qk_l2norm, state_layout vk",
             rows=(128, 1), checkpoints=((64,), ()), initial=(True, True), dtype="bfloat16",
             options=_delta_opts(layout="vk", l2norm=True, lower_bound=-5.0),
             params={**_GROUPED, "decay": "normal", "gate": "lower_bound"}),
        Spec("bf16_long_weak_decay", "bf16 q/k/v/beta with an fp32 log decay, a 1000-token and a 65-token row, "
             "weak decay", rows=(1000, 65), checkpoints=((1, 256, 512, 999), (64,)), initial=(True, False),
             dtype="bfloat16", options=_delta_opts(),
             params={"heads": 1, "v_heads": 1, "decay": "weak", "gate": "log"}),
    ],
    "ssd": [
        Spec("single_row", "one row, cu_seqlens not passed, no initial state, D per head",
             rows=(200,), packed=False, checkpoints=((1, 64, 128, 199),), options={"state_layout": "vk"},
             params={"groups": 1, "decay": "normal", "D": "head"}),
        Spec("tiny_rows", "rows of 1, 2, 3 and 0 tokens, 2 groups, D per channel, z gate, dt_bias, strong decay",
             rows=(1, 2, 3, 0), checkpoints=((), (1,), (1, 2), ()), initial=(True, False, True, True),
             options={"state_layout": "vk"},
             params={"groups": 2, "decay": "strong", "D": "channel", "z": True, "dt_bias": True}),
        Spec("chunk_edges", "rows of 63, 64, 65, 127 tokens around chunk boundaries, 3 padded CSR entries, strong "
             "decay, dt_bias", rows=(63, 64, 65, 127),
             checkpoints=((1, 62), (32, 63), (1, 63, 64), (1, 63, 64, 65, 126)), pad_checkpoints=3,
             initial=(False, True, False, True), options={"state_layout": "vk"},
             params={"groups": 1, "decay": "strong", "D": "head", "dt_bias": True}),
        Spec("weak_decay_kv", "weak decay, 2 groups, z gate, D per channel, state_layout kv", rows=(150, 2),
             checkpoints=((64, 128, 149), (1,)), initial=(True, True), options={"state_layout": "kv"},
             params={"groups": 2, "decay": "weak", "D": "channel", "z": True}),
        Spec("dt_limit", "delta clamped to dt_limit (0.3, 0.9), dt_bias, 2 groups", rows=(100, 30),
             checkpoints=((65,), ()), initial=(True, True), options={"state_layout": "vk", "dt_limit": [0.3, 0.9]},
             params={"groups": 2, "decay": "normal", "D": "head", "dt_bias": True}),
        Spec("no_checkpoints", "no D, no checkpoint or initial-state arguments", rows=(65, 3),
             options={"state_layout": "vk"}, params={"groups": 1, "decay": "normal"}),
        Spec("padded_csr_only", "checkpoint_cu all zero, 4 padded entries only, state_layout kv", rows=(40, 24),
             checkpoints=((), ()), pad_checkpoints=4, initial=(True, True), options={"state_layout": "kv"},
             params={"groups": 2, "decay": "normal", "D": "head"}),
        Spec("long_row", "one 320-token row with an initial state, weak decay, checkpoints near both ends",
             rows=(320,), checkpoints=((1, 256, 319),), initial=(True,), options={"state_layout": "vk"},
             params={"groups": 1, "decay": "weak", "D": "head", "dt_bias": True}),
        Spec("bf16_mixed_batch", "bf16 x/dt/B/C/z, five rows incl. an empty one, 5 padding tokens, 2 padded CSR "
             "entries, 2 groups, D per head, z, dt_bias", rows=(100, 0, 65, 3, 127),
             checkpoints=((1, 64, 99), (), (64,), (1, 2), (63,)), pad_checkpoints=2, pad_tokens=5,
             initial=(True, True, False, True, False), dtype="bfloat16", options={"state_layout": "vk"},
             params={"groups": 2, "decay": "normal", "D": "head", "z": True, "dt_bias": True}),
        Spec("bf16_dt_limit_kv", "bf16, dt_limit (0.0, 0.5), strong decay, state_layout kv", rows=(128, 1),
             checkpoints=((64,), ()), initial=(True, True), dtype="bfloat16",
             options={"state_layout": "kv", "dt_limit": [0.0, 0.5]},
             params={"groups": 1, "decay": "strong", "D": "channel"}),
        Spec("bf16_long_weak_decay", "bf16, a 1000-token and a 65-token row, weak decay, D per channel, dt_bias",
             rows=(1000, 65), checkpoints=((1, 256, 512, 999), (64,)), initial=(True, False), dtype="bfloat16",
             options={"state_layout": "vk"}, params={"groups": 1, "decay": "weak", "D": "channel", "dt_bias": True}),
    ],
    "conv1d": [
        Spec("w4_short_rows", "W=4 with bias and silu; rows of 1, 2, 3 tokens (shorter than W-1), an empty row "
             "and 65 tokens; 2 padded CSR entries", rows=(1, 2, 3, 0, 65),
             checkpoints=((), (1,), (1, 2), (), (1, 3, 63, 64)), pad_checkpoints=2,
             initial=(True, True, True, True, True), options={"activation": "silu"},
             params={"width": 4, "bias": True}),
        Spec("w2_linear", "W=2, no bias, no activation, no initial state", rows=(64, 63),
             checkpoints=((1, 63), (62,)), options={"activation": None}, params={"width": 2}),
        Spec("w3_single_row", "W=3, bias, silu, one row, cu_seqlens not passed", rows=(200,), packed=False,
             checkpoints=((1, 2, 199),), initial=(True,), options={"activation": "silu"},
             params={"width": 3, "bias": True}),
        Spec("no_checkpoints", "W=4, silu, no bias, no checkpoint arguments", rows=(127, 1), initial=(True, False),
             options={"activation": "silu"}, params={"width": 4}),
        Spec("padded_csr_only", "W=3, bias, no activation, checkpoint_cu all zero with 4 padded entries",
             rows=(5, 64), checkpoints=((), ()), pad_checkpoints=4, initial=(False, True),
             options={"activation": None}, params={"width": 3, "bias": True}),
        Spec("w4_long_row", "W=4, bias, silu, a 997-token row, checkpoints near both ends", rows=(997,),
             checkpoints=((1, 2, 3, 500, 994, 995, 996),), initial=(True,), options={"activation": "silu"},
             params={"width": 4, "bias": True}),
        Spec("bf16_mixed_batch", "bf16 everything, W=4, bias, silu, rows of 200, 0, 1, 2, 65 tokens, 3 padding "
             "tokens, 2 padded CSR entries", rows=(200, 0, 1, 2, 65),
             checkpoints=((1, 2, 3, 199), (), (), (1,), (1, 32, 64)), pad_checkpoints=2, pad_tokens=3,
             initial=(True, True, True, False, True), dtype="bfloat16", options={"activation": "silu"},
             params={"width": 4, "bias": True}),
        Spec("bf16_w2_linear", "bf16, W=2, no bias, no activation", rows=(1, 127), checkpoints=((), (1, 126)),
             initial=(True, True), dtype="bfloat16", options={"activation": None}, params={"width": 2}),
        Spec("bf16_w3_short_rows", "bf16, W=3, silu, no bias, rows of 1, 2, 3 tokens",
             rows=(1, 2, 3), checkpoints=((), (1,), (1, 2)), initial=(True, False, True), dtype="bfloat16",
             options={"activation": "silu"}, params={"width": 3}),
        Spec("bf16_long_row", "bf16, W=4, bias, silu, a 1000-token row", rows=(1000,),
             checkpoints=((1, 2, 3, 500, 997, 998, 999),), initial=(True,), dtype="bfloat16",
             options={"activation": "silu"}, params={"width": 4, "bias": True}),
    ],
}
_BUILDERS = {"gdn": _gdn, "kda": _kda, "ssd": _ssd_inputs, "conv1d": _conv_inputs}


def case_seed(op: str, name: str) -> list[int]:
    return [SEED, zlib.crc32(f"{op}/{name}".encode())]


def _spec(op: str, name: str) -> Spec:
    if op not in OPS:
        raise ValueError(f"op: must be one of {OPS}, got {op!r}")
    for spec in SPECS[op]:
        if spec.name == name:
            return spec
    raise KeyError(f"{op}: no case named {name!r}")


def build_case(op: str, name: str) -> Case:
    """Regenerates one case from its spec: the same bits the committed file holds, unless the reference drifted."""
    spec = _spec(op, name)
    rng = np.random.default_rng(case_seed(op, name))
    inputs = _BUILDERS[op](spec, rng)
    outputs = reference(op)(**inputs, **spec.options)
    expected = {out: np.ascontiguousarray(value, dtype=np.float32) for out, value in zip(OUTPUT_NAMES[op], outputs)}
    meta = {
        "name": name,
        "description": spec.description,
        "options": spec.options,
        "input_dtype": spec.dtype,
        "tolerance_class": _TOLERANCE_CLASS[spec.dtype],
        "inputs": list(inputs),
        "rows": list(spec.rows),
        "seed": case_seed(op, name),
    }
    return Case(op=op, name=name, inputs=inputs, options=dict(spec.options), expected=expected,
                tolerance_class=meta["tolerance_class"], meta=meta)


def file_metadata(op: str, cases: list[Case]) -> dict[str, str]:
    return {
        "op": op,
        "semantics_version": SEMANTICS_VERSION,
        "generator": GENERATOR,
        "seed": str(SEED),
        "cases": json.dumps([case.meta for case in cases]),
        "tolerances": json.dumps(tolerance_metadata()),
    }


def build_file(op: str) -> tuple[dict[str, np.ndarray], dict[str, str], list[Case]]:
    cases = [build_case(op, spec.name) for spec in SPECS[op]]
    tensors = {}
    for case in cases:
        for name, array in {**case.inputs, **case.expected}.items():
            tensors[f"{case.name}/{name}"] = np.ascontiguousarray(array)
    return tensors, file_metadata(op, cases), cases


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Writes the safetensors format with a byte-stable header (the library's own writer orders `__metadata__` by a
    randomly seeded hash map, so every regeneration would change the committed files).

    Tensors are laid out by descending item size, then name, which keeps every one aligned to its item size.
    """
    codes = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
    order = sorted(tensors, key=lambda name: (-tensors[name].dtype.itemsize, name))
    header = {"__metadata__": dict(sorted(metadata.items()))}
    chunks, offset = [], 0
    for name in order:
        data = np.ascontiguousarray(tensors[name])
        raw = data.tobytes()  # safetensors is little-endian, like every host this runs on
        header[name] = {"dtype": codes[data.dtype], "shape": list(data.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        f.writelines(chunks)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_file(op: str) -> list[str]:
    """Differences between the committed file and a fresh generation (empty when they agree bit for bit)."""
    path = vector_path(op)
    if not path.exists():
        return [f"{path.name}: missing"]
    _, metadata, fresh = build_file(op)
    committed_meta = load_metadata(op)
    problems = []
    for key, value in metadata.items():
        decoded = json.loads(value) if key in ("cases", "tolerances") else value
        if committed_meta.get(key) != decoded:
            problems.append(f"{path.name}: metadata {key!r} differs")
    if problems:
        return problems
    committed = {case.name: case for case in load_cases(op)}
    for case in fresh:
        old = committed[case.name]
        for name, array in {**case.inputs, **case.expected}.items():
            stored = old.inputs[name] if name in case.inputs else old.expected[name]
            if not _same(array, stored):
                problems.append(f"{path.name}: {case.name}/{name} differs")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    args = parser.parse_args(argv)
    failed = False
    for op in args.ops:
        if args.check:
            problems = check_file(op)
            failed |= bool(problems)
            print(f"{op}: " + ("matches" if not problems else "\n  ".join(["DIFFERS", *problems])))
            continue
        tensors, metadata, cases = build_file(op)
        path = vector_path(op)
        write_safetensors(path, tensors, metadata)
        print(f"{op}: {len(cases)} cases, {path.stat().st_size / 1e6:.2f} MB -> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

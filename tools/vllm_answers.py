"""Write tests/vectors/vllm_answers.json by calling vLLM 0.33.0's own functions.

The JSON holds reference answers for ``jaxckpt.plan`` so CI can check the
re-implementation without vLLM installed. Nothing in the project or its tests
may import this script; it only runs in a throwaway environment outside the
repository, for example::

    PYENV_VERSION=3.12.1 python3.12 -m venv /tmp/vllmenv
    /tmp/vllmenv/bin/pip install torch==2.14.1   # PyPI's CUDA build; runs on CPU
    /tmp/vllmenv/bin/pip install --no-deps vllm==0.33.0
    /tmp/vllmenv/bin/pip install packaging regex psutil pyzmq urllib3 pydantic \
        cbor2 "transformers<5.21" aiohttp requests openai_harmony openai pillow \
        pybase64 cloudpickle uvloop py-cpuinfo prometheus_client xgrammar \
        fastapi partial_json_parser llguidance cachetools msgspec
    /tmp/vllmenv/bin/python tools/vllm_answers.py [output.json]

No GPU is needed (about 15 s on 2 CPU cores). Every sweep is seeded, so a re-run
changes only ``meta.generated_at``.
Each table is ``{"columns": [...], "rows": [[...], ...]}``; see ``main``.
"""

import datetime
import itertools
import json
import platform
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar
from unittest import mock

import torch
import vllm
from vllm.model_executor.layers.mamba import abstract as mamba_abstract
from vllm.model_executor.layers.mamba.checkpoint import (
    compute_mamba_prefill_checkpoints,
)
from vllm.model_executor.models import ModelRegistry
from vllm.platforms.interface import Platform
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    get_kv_quant_mode,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "vectors" / "vllm_answers.json"

BF16, FP32 = torch.bfloat16, torch.float32

# Named Mamba state layouts: (shapes, dtypes).
STATES = {
    "gdn_conv_bf16_rec_fp32": (((3, 8192), (32, 128, 128)), (BF16, FP32)),
    "gdn_conv_bf16_rec_bf16": (((3, 8192), (32, 128, 128)), (BF16, BF16)),
    "mamba2_conv_bf16_ssm_fp32": (((3, 6144), (64, 64, 128)), (BF16, FP32)),
    "mamba2_conv_bf16_ssm_bf16": (((3, 6144), (64, 64, 128)), (BF16, BF16)),
    "mamba2_small_fp32": (((3, 1536), (24, 64, 64)), (FP32, FP32)),
    "kda_qkv_conv_bf16_rec_fp32": (
        ((3, 4096), (3, 4096), (3, 4096), (32, 128, 128)),
        (BF16, BF16, BF16, FP32),
    ),
    "short_conv_bf16": (((2, 2048),), (BF16,)),
}


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def table(columns, rows):
    return {"columns": list(columns), "rows": rows}


def checkpoint_position_table():
    columns = (
        "num_tokens",
        "hash_block_size",
        "drop_eagle_block",
        "num_hash_lookahead_tokens",
        "position",
    )
    inputs = []
    for h in (1, 16, 64):
        inputs += [(n, h) for n in range(301)]
    for h in (1, 3, 16, 64, 96, 528, 768, 1152, 1600):
        extra = {8000, 2002, 3602, 1159, 5000, 19 * h + 7}
        for k in (1, 2, 3, 5, 19, 50):
            extra |= {k * h - 1, k * h, k * h + 1, k * h + 2}
        extra -= set(range(301)) if h in (1, 16, 64) else set()
        inputs += [(n, h) for n in sorted(extra) if n >= 0]
    rows = []
    for n, h in inputs:
        for drop in (False, True):
            for lookahead in (0, 1, 2, 5):
                pos = get_mamba_prefill_checkpoint_position(n, h, drop, num_hash_lookahead_tokens=lookahead)
                rows.append([n, h, drop, lookahead, pos])
    return table(columns, rows)


def _valid_row(qs, qe, pos, h, b, a):
    valid = is_mamba_prefill_checkpoint_valid(
        query_start=qs,
        query_end=qe,
        checkpoint_position=pos,
        hash_block_size=h,
        mamba_block_size=b,
        checkpoint_alignment=a,
    )
    return [qs, qe, pos, h, b, a, valid]


def is_checkpoint_valid_table():
    columns = (
        "query_start",
        "query_end",
        "position",
        "hash_block_size",
        "mamba_block_size",
        "alignment",
        "valid",
    )
    rng = random.Random(1)
    rows = []
    seen = set()

    def add(qs, qe, pos, h, b, a):
        key = (qs, qe, pos, h, b, a)
        if qs < 0 or qe <= qs or pos < 0 or key in seen:
            return
        seen.add(key)
        rows.append(_valid_row(*key))

    # Small grids: query starts/ends around block and hash boundaries, positions
    # from the position rule and around the query.
    grids = {16: (1, 4, 8, 16), 32: (1, 8, 16, 32), 48: (1, 3, 16, 48)}
    for b, hs in grids.items():
        for h in hs:
            starts = sorted({0, 1, h, 2 * h, b - 1, b, b + h, 2 * b})
            for a in (1, 16, 64):
                for qs in starts:
                    for dq in (1, h, b, b + 1, 2 * b - 1, 2 * b + 1, 3 * b):
                        qe = qs + dq
                        positions = {
                            get_mamba_prefill_checkpoint_position(qe, h, False),
                            get_mamba_prefill_checkpoint_position(qe, h, True),
                            get_mamba_prefill_checkpoint_position(qe, h, False, 2),
                            qs,
                            qs + h,
                            qs + 16,
                            qs + 64,
                            qe - 1,
                            qe,
                            b,
                            2 * b,
                        }
                        for pos in sorted(positions):
                            add(qs, qe, pos, h, b, a)
            for _ in range(40):
                qs = rng.randrange(0, 3 * b)
                qe = qs + rng.randrange(1, 3 * b)
                add(qs, qe, rng.randrange(0, qe + h), h, b, None)
    # Realistic block sizes with random queries.
    realistic = {
        528: (16, 48, 528),
        768: (16, 256, 768),
        1152: (16, 64, 1152),
        1600: (16, 64, 1600),
        2096: (16, 2096),
    }
    for b, hs in realistic.items():
        for h in hs:
            for _ in range(350):
                a = rng.choice((None, 1, 1, 16, 16, 64, 64))
                kind = rng.random()
                if kind < 0.4:
                    qs = h * rng.randrange(0, 4 * b // h + 1)
                elif kind < 0.6:
                    qs = b * rng.randrange(0, 4)
                else:
                    qs = rng.randrange(0, 4 * b)
                qe = qs + rng.randrange(1, 4 * b)
                pick = rng.random()
                if pick < 0.7:
                    pos = get_mamba_prefill_checkpoint_position(qe, h, rng.random() < 0.3, rng.choice((0, 0, 1, 3)))
                else:
                    pos = rng.randrange(0, qe + h)
                add(qs, qe, pos, h, b, a)
    return table(columns, rows)


def prefill_checkpoints_table():
    columns = (
        "case",
        "seq_lens",
        "query_lens",
        "hash_block_size",
        "mamba_block_size",
        "checkpoint_alignment",
        "drop_eagle_block",
        "cache_hit_alignment_tokens",
        "num_hash_lookahead_tokens",
        "offsets",
        "cols",
    )
    gdn_rows = ([888, 700, 1244, 1256, 1212], [600, 700, 700, 1000, 700])  # (seq_lens, query_lens)
    # (case, seq_lens, query_lens, H, B, A, drop_eagle, cache_hit_unit, lookahead)
    cases = [
        ("doc_b64_fresh_200_128", [200, 128], [200, 128], 64, 64, 1, False, 64, 0),
        ("doc_b16_seq50_32_query50_16", [50, 32], [50, 16], 16, 16, 16, False, 16, 0),
        ("doc_pr53614_b64_h8_n100_eagle_a16", [100], [100], 8, 64, 16, True, 8, 0),
        ("doc_pr53614_b64_h8_n100_eagle_a1", [100], [100], 8, 64, 1, True, 8, 0),
        ("doc_amd_b192_h96_seq700_a64", [700], [700], 96, 192, 64, False, 96, 0),
        ("doc_gdn_b256_h32_rows", *gdn_rows, 32, 256, 1, False, 32, 0),
        ("doc_gdn_b256_h32_rows_eagle", *gdn_rows, 32, 256, 1, True, 32, 0),
        ("doc_b1600_h16_2002", [2002], [2002], 16, 1600, 1, False, 16, 0),
        ("doc_b1600_h16_3602_eagle", [3602], [3602], 16, 1600, 1, True, 16, 0),
        ("doc_b1152_1159_a16", [1159], [1159], 1152, 1152, 16, False, 1152, 0),
        ("doc_b768_8000", [8000], [8000], 768, 768, 1, False, 768, 0),
        ("alignment_none", [200, 128], [200, 128], 64, 64, None, False, 64, 0),
        ("empty_batch", [], [], 16, 64, 1, False, 16, 0),
    ]
    rng = random.Random(3)
    configs = [
        (16, 16),
        (16, 4),
        (64, 64),
        (64, 8),
        (256, 32),
        (528, 16),
        (768, 768),
        (768, 256),
        (1152, 64),
        (1600, 16),
        (1600, 1600),
    ]
    for i in range(260):
        b, h = rng.choice(configs)
        a = rng.choice((None, 1, 1, 16, 16, 64))
        drop = rng.random() < 0.35
        lookahead = 0 if drop else rng.choice((0, 0, 1, 3))
        unit = h if rng.random() < 0.8 else b
        seq_lens, query_lens = [], []
        for _ in range(rng.randrange(1, 7)):
            seq = rng.randrange(1, 6 * b + 2)
            kind = rng.random()
            if kind < 0.35:
                q = seq
            elif kind < 0.6:
                q = seq - h * rng.randrange(0, seq // h + 1)
            elif kind < 0.75:
                q = seq - b * rng.randrange(0, seq // b + 1)
            elif kind < 0.85:
                q = 1
            else:
                q = rng.randrange(1, seq + 1)
            if q == 0:
                q = seq
            seq_lens.append(seq)
            query_lens.append(q)
        cases.append((f"random_{i}", seq_lens, query_lens, h, b, a, drop, unit, lookahead))
    rows = []
    for case, seqs, qls, h, b, a, drop, unit, lookahead in cases:
        offsets, cols = compute_mamba_prefill_checkpoints(
            seqs,
            qls,
            hash_block_size=h,
            mamba_block_size=b,
            checkpoint_alignment=a,
            drop_eagle_block=drop,
            cache_hit_alignment_tokens=unit,
            num_hash_lookahead_tokens=lookahead,
        )
        rows.append([case, seqs, qls, h, b, a, drop, unit, lookahead, offsets, cols])
    return table(columns, rows)


class _StubMambaLayer(mamba_abstract.MambaBase):
    """A Mamba layer that only answers the checkpoint-alignment question."""

    def __init__(self, alignment):
        self._alignment = alignment

    def get_state_shape(self):
        return ((3, 64),)

    def get_state_dtype(self):
        return (BF16,)

    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.MAMBA2

    def get_prefill_checkpoint_alignment(self):
        return self._alignment


def _forward_context(layer_alignments):
    context = {"model.layers.attn.0": SimpleNamespace(kind="attention")}
    for i, a in enumerate(layer_alignments):
        context[f"model.layers.{i}.mamba"] = _StubMambaLayer(a)
    return context


def _stub_vllm_config(layer_alignments, **cache_fields):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=_forward_context(layer_alignments)),
        cache_config=SimpleNamespace(**cache_fields),
    )


ALIGNMENT_LISTS = [
    [],
    [None],
    [1],
    [16],
    [64],
    [48],
    [1, 1],
    [1, 16],
    [16, 64],
    [16, 48],
    [64, 48],
    [1, 16, 64],
    [3, 16],
    [16, None],
    [None, 64],
    [1, None, 16],
]


def model_checkpoint_alignment_table():
    columns = ("layer_alignments", "alignment")
    rows = []
    for layer_alignments in ALIGNMENT_LISTS:
        config = _stub_vllm_config(layer_alignments)
        alignment = mamba_abstract.get_mamba_prefill_checkpoint_alignment(config)
        rows.append([layer_alignments, alignment])
    return table(columns, rows)


def checkpoint_grid_table():
    columns = (
        "layer_alignments",
        "prefix_match_unit",
        "mamba_block_size",
        "grid",
        "error",
    )
    rows = []
    for layer_alignments in ALIGNMENT_LISTS:
        for unit in (None, 1, 16, 24, 64, 96, 528, 1600):
            for b in (None, 64, 528, 768, 1152, 1600):
                if unit is not None and b not in (None, 768):
                    continue
                config = _stub_vllm_config(layer_alignments, prefix_match_unit=unit, mamba_block_size=b)
                try:
                    grid = mamba_abstract.get_mamba_prefill_checkpoint_grid(config)
                    error = None
                except AssertionError:
                    grid, error = None, "AssertionError"
                rows.append([layer_alignments, unit, b, grid, error])
    return table(columns, rows)


def _spec(state, **fields):
    shapes, dtypes = STATES[state]
    return MambaSpec(shapes=shapes, dtypes=dtypes, **fields)


def mamba_spec_table():
    columns = (
        "state",
        "block_size",
        "page_size_padded",
        "spec_cache_mode",
        "config_cache_mode",
        "num_speculative_blocks",
        "num_prefill_checkpoint_blocks",
        "prefill_checkpoint_alignment",
        "max_len",
        "real_page_size_bytes",
        "page_size_bytes",
        "max_memory_usage_bytes",
        "max_num_blocks_per_req",
        "error",
    )
    rows = []
    states = (
        "gdn_conv_bf16_rec_fp32",
        "mamba2_conv_bf16_ssm_bf16",
        "kda_qkv_conv_bf16_rec_fp32",
        "short_conv_bf16",
    )
    modes = ("none", "align", "all")
    for state, b in itertools.product(states, (16, 528, 1600)):
        real = _spec(state, block_size=16).real_page_size_bytes
        # Config mode and spec mode are crossed only for one block size.
        mode_pairs = itertools.product(modes, modes) if b == 528 else ((m, m) for m in modes)
        for (mode, config_mode), padded, num_spec, ckpt, max_len in itertools.product(
            mode_pairs, (None, real + 4096, real, real - 2), range(4), (0, 1), (1, 8000, 131072)
        ):
            if padded in (real, real - 2) and (num_spec or max_len != 8000):
                continue
            alignment = 16 if ckpt else None
            spec = _spec(
                state,
                block_size=b,
                page_size_padded=padded,
                mamba_cache_mode=mode,
                num_speculative_blocks=num_spec,
                num_prefill_checkpoint_blocks=ckpt,
                prefill_checkpoint_alignment=alignment,
            )
            config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=config_mode))
            try:
                page = spec.page_size_bytes
                usage = spec.max_memory_usage_bytes(config)
                per_req = spec.max_num_blocks_per_req(config, max_len)
                error = None
            except AssertionError:
                page = usage = per_req = None
                error = "AssertionError"
            rows.append(
                [state, b, padded, mode, config_mode, num_spec, ckpt, alignment, max_len]
                + [spec.real_page_size_bytes, page, usage, per_req, error]
            )
    result = table(columns, rows)
    result["states"] = {
        name: {
            "shapes": [list(s) for s in shapes],
            "dtypes": [dtype_name(d) for d in dtypes],
        }
        for name, (shapes, dtypes) in STATES.items()
    }
    return result


def _spec_fields(spec):
    if not isinstance(spec, MambaSpec):
        return {
            "kind": type(spec).__name__,
            "block_size": spec.block_size,
            "page_size_bytes": spec.page_size_bytes,
        }
    return {
        "kind": "MambaSpec",
        "block_size": spec.block_size,
        "shapes": [list(s) for s in spec.shapes],
        "dtypes": [dtype_name(d) for d in spec.dtypes],
        "page_size_padded": spec.page_size_padded,
        "mamba_type": spec.mamba_type.name,
        "mamba_cache_mode": spec.mamba_cache_mode,
        "num_speculative_blocks": spec.num_speculative_blocks,
        "num_prefill_checkpoint_blocks": spec.num_prefill_checkpoint_blocks,
        "prefill_checkpoint_alignment": spec.prefill_checkpoint_alignment,
        "num_heads": spec.num_heads,
        "tokens_per_state": spec.tokens_per_state,
        "tp_replicated": spec.tp_replicated,
        "page_size_bytes": spec.page_size_bytes,
    }


def mamba_spec_uniform_table():
    columns = ("case", "changed_field", "self_spec", "other_specs", "uniform")
    base_fields = {
        "block_size": 528,
        "mamba_cache_mode": "align",
        "num_speculative_blocks": 1,
        "num_prefill_checkpoint_blocks": 1,
        "prefill_checkpoint_alignment": 16,
    }
    base = _spec("gdn_conv_bf16_rec_fp32", **base_fields)
    real = base.real_page_size_bytes
    same_bytes_shapes = ((3, 8192), (16, 256, 128))  # same bytes, other shape
    variants = [
        ("block_size", {"block_size": 1600}),
        ("shapes_same_bytes", {"shapes": same_bytes_shapes}),
        ("shapes_other_bytes", {"shapes": ((3, 8192), (32, 128, 64))}),
        ("dtypes", {"dtypes": (BF16, BF16)}),
        ("page_size_padded_to_real", {"page_size_padded": real}),
        ("page_size_padded_larger", {"page_size_padded": real + 4096}),
        ("mamba_type", {"mamba_type": MambaAttentionBackendEnum.GDN_ATTN}),
        ("mamba_cache_mode", {"mamba_cache_mode": "all"}),
        ("num_speculative_blocks", {"num_speculative_blocks": 0}),
        ("num_prefill_checkpoint_blocks", {"num_prefill_checkpoint_blocks": 0}),
        ("prefill_checkpoint_alignment_64", {"prefill_checkpoint_alignment": 64}),
        ("prefill_checkpoint_alignment_none", {"prefill_checkpoint_alignment": None}),
        ("num_heads", {"num_heads": 8}),
        ("tokens_per_state", {"tokens_per_state": 4}),
        ("tp_replicated", {"tp_replicated": True}),
    ]
    rows = []

    def add(case, field, others):
        collection = {f"layer.{i}": spec for i, spec in enumerate(others)}
        uniform = base.is_uniform_with_collection(collection)
        rows.append([case, field, _spec_fields(base), [_spec_fields(s) for s in others], uniform])

    add("empty_collection", None, [])
    add("only_self", None, [base])
    add("identical_copy", None, [base, _spec("gdn_conv_bf16_rec_fp32", **base_fields)])
    for field, change in variants:
        shapes, dtypes = STATES["gdn_conv_bf16_rec_fp32"]
        fields = dict(shapes=shapes, dtypes=dtypes, **base_fields)
        fields.update(change)
        other = MambaSpec(**fields)
        add(f"pair_{field}", field, [base, other])
        add(f"single_{field}", field, [other])
    attention = FullAttentionSpec(block_size=528, num_kv_heads=2, head_size=256, dtype=BF16)
    add("with_full_attention_spec", "kind", [base, attention])
    return table(columns, rows)


class _StubPlatform(Platform):
    """Platform whose only attention backends are the ones a case names."""

    backends: ClassVar[list] = []

    @classmethod
    def _find_non_ssm_backends(cls, vllm_config):
        return list(cls.backends)


def _stub_backend(name, sizes):
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return list(sizes)

    return type(
        name,
        (),
        {
            "customize_spec": classmethod(lambda cls, spec: spec),
            "get_supported_kernel_block_sizes": staticmethod(get_supported_kernel_block_sizes),
            "get_name": staticmethod(lambda: name),
        },
    )


def _stub_model_cls(state):
    shapes, dtypes = STATES[state]
    return type(
        "StubHybridModel",
        (),
        {
            "get_mamba_state_shape_from_config": classmethod(lambda cls, vllm_config: shapes),
            "get_mamba_state_dtype_from_config": classmethod(lambda cls, vllm_config: dtypes),
        },
    )


def _size_repr(size):
    return f"MultipleOf({size.base})" if isinstance(size, MultipleOf) else size


def align_block_size_table():
    columns = (
        "use_mla",
        "num_kv_heads",
        "head_size",
        "kv_dtype",
        "attn_page_bytes_per_token",
        "mamba_state",
        "mamba_page_bytes",
        "cache_block_size",
        "backend_kernel_block_sizes",
        "layer_alignments",
        "mamba_cache_mode",
        "block_size",
        "mamba_block_size",
        "mamba_page_size_padded",
    )
    attentions = [
        (False, 1, 128, BF16),
        (False, 2, 256, BF16),
        (False, 3, 256, BF16),
        (False, 1, 128, FP32),
        (True, 1, 576, BF16),
    ]
    mamba_states = [
        "gdn_conv_bf16_rec_fp32",
        "mamba2_conv_bf16_ssm_bf16",
        "kda_qkv_conv_bf16_rec_fp32",
        "short_conv_bf16",
    ]
    backend_sets = [
        ([MultipleOf(16)],),
        ([MultipleOf(64)],),
        ([16, 32],),
        ([64, 128, 256],),
        ([MultipleOf(16)], [48]),
    ]
    alignment_lists = [[], [None], [1], [16], [64], [16, 64], [48]]
    rows = []
    for (use_mla, heads, head_size, kv_dtype), state, cache_block, backend_sizes, mode in itertools.product(
        attentions, mamba_states, (16, 64), backend_sets, ("align", "none", "all")
    ):
        # The model's checkpoint alignment is read only in align mode.
        for layer_alignments in alignment_lists if mode == "align" else [[16]]:
            rows.append(
                _align_row(
                    use_mla, heads, head_size, kv_dtype, state, cache_block, backend_sizes, layer_alignments, mode
                )
            )
    result = table(columns, rows)
    result["note"] = (
        "Platform._align_hybrid_block_size(vllm_config, backend) called through "
        "a Platform subclass whose _find_non_ssm_backends returns the listed "
        "backends (the first is backend_cls); ModelRegistry.resolve_model_cls "
        "patched to a stub exposing the named Mamba state; cache_dtype 'auto', "
        "mamba_block_size and mamba_page_size_padded start as None. "
        "attn_page_bytes_per_token is FullAttentionSpec's (MLAAttentionSpec's "
        "when use_mla) at block_size 1."
    )
    return result


def _attn_page_bytes_per_token(use_mla, heads, head_size, kv_dtype):
    if use_mla:
        spec = MLAAttentionSpec(
            block_size=1,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=kv_dtype,
            cache_dtype_str="auto",
            kv_quant_mode=get_kv_quant_mode("auto"),
        )
    else:
        spec = FullAttentionSpec(block_size=1, num_kv_heads=heads, head_size=head_size, dtype=kv_dtype)
    return spec.page_size_bytes


def _align_row(use_mla, heads, head_size, kv_dtype, state, cache_block, backend_sizes, layer_alignments, mode):
    shapes, dtypes = STATES[state]
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    backends = [_stub_backend(f"STUB_{i}", sizes) for i, sizes in enumerate(backend_sizes)]
    parallel_config = SimpleNamespace()
    model_config = SimpleNamespace(
        dtype=kv_dtype,
        use_mla=use_mla,
        architecture="StubHybridModel",
        is_hybrid=True,
        get_num_kv_heads=lambda pc: heads,
        get_head_size=lambda: head_size,
    )
    cache_config = SimpleNamespace(
        cache_dtype="auto",
        block_size=cache_block,
        mamba_cache_mode=mode,
        mamba_block_size=None,
        mamba_page_size_padded=None,
        kv_cache_dtype_skip_layers=None,
    )
    vllm_config = SimpleNamespace(
        cache_config=cache_config,
        model_config=model_config,
        parallel_config=parallel_config,
        compilation_config=SimpleNamespace(static_forward_context=_forward_context(layer_alignments)),
    )
    model_cls = _stub_model_cls(state)
    _StubPlatform.backends = backends
    with mock.patch.object(
        ModelRegistry,
        "resolve_model_cls",
        lambda arch, model_config=None: (model_cls, arch),
    ):
        _StubPlatform._align_hybrid_block_size(vllm_config, backends[0])
    return [
        use_mla,
        heads,
        head_size,
        dtype_name(kv_dtype),
        _attn_page_bytes_per_token(use_mla, heads, head_size, kv_dtype),
        state,
        mamba_page,
        cache_block,
        [[_size_repr(s) for s in sizes] for sizes in backend_sizes],
        layer_alignments,
        mode,
        cache_config.block_size,
        cache_config.mamba_block_size,
        cache_config.mamba_page_size_padded,
    ]


SPLIT_COLUMNS = (
    "case",
    "cache_block_size",
    "scheduler_block_size",
    "hash_block_size",
    "mamba_partial_cache_hit",
    "use_eagle_block_drop",
    "num_hash_lookahead_tokens",
    "mamba_has_prefill_checkpoint_blocks",
    "mamba_prefill_checkpoint_alignment",
    "max_num_scheduled_tokens",
    "long_prefill_token_threshold",
    "mamba_shared_prefix_checkpoint",
    "num_computed_tokens",
    "num_prompt_tokens",
    "num_tokens",
    "shared_prefix_boundary",
    "num_new_tokens",
    "num_new_local_computed_tokens",
    "num_external_computed_tokens",
    "result",
)


def _split(
    case,
    *,
    block,
    hash_block,
    eagle=False,
    lookahead=0,
    checkpoints=False,
    alignment=None,
    budget=16384,
    threshold=0,
    shared_prefix=False,
    computed=0,
    prompt,
    num_tokens=None,
    junction=0,
    new,
    local=0,
    external=0,
):
    num_tokens = prompt if num_tokens is None else num_tokens
    partial = hash_block < block
    scheduler = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block),
        block_size=block,
        hash_block_size=hash_block,
        mamba_partial_cache_hit=partial,
        use_eagle_block_drop=eagle,
        num_hash_lookahead_tokens=lookahead,
        mamba_has_prefill_checkpoint_blocks=checkpoints,
        mamba_prefill_checkpoint_alignment=alignment,
        max_num_scheduled_tokens=budget,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=threshold),
        mamba_shared_prefix_checkpoint=shared_prefix and partial,
    )
    request = SimpleNamespace(
        num_computed_tokens=computed,
        num_prompt_tokens=prompt,
        num_tokens=num_tokens,
        shared_prefix_boundary=junction,
    )
    result = Scheduler._mamba_block_aligned_split(scheduler, request, new, local, external)
    return [
        case,
        block,
        block,
        hash_block,
        partial,
        eagle,
        lookahead,
        checkpoints,
        alignment,
        budget,
        threshold,
        scheduler.mamba_shared_prefix_checkpoint,
        computed,
        prompt,
        num_tokens,
        junction,
        new,
        local,
        external,
        result,
    ]


DOC_SPLIT_CASES = [
    # (case, kwargs, expected tokens without / with internal checkpoints)
    ("doc_8000_b768", {"block": 768, "hash_block": 768, "prompt": 8000, "new": 8000}, 7680, 8000),
    ("doc_2002_b1600_h16", {"block": 1600, "hash_block": 16, "prompt": 2002, "new": 2002}, 1600, 2002),
    (
        "doc_3602_b1600_h16_offered_2000",
        {"block": 1600, "hash_block": 16, "prompt": 3602, "new": 2000},
        1600,
        1600,
    ),
    (
        "doc_3602_b1600_h16_eagle",
        {"block": 1600, "hash_block": 16, "prompt": 3602, "new": 3602, "eagle": True},
        None,
        3602,
    ),
    (
        "doc_1159_b1152_a16",
        {"block": 1152, "hash_block": 1152, "prompt": 1159, "new": 1159},
        1152,
        1159,
    ),
    (
        "doc_5000_resume_331_b1600",
        {"block": 1600, "hash_block": 1600, "prompt": 5000, "computed": 331, "new": 4669},
        1269,
        1269,
    ),
    (
        "doc_5000_budget_1000_b1600",
        {"block": 1600, "hash_block": 1600, "prompt": 5000, "new": 1000, "budget": 1000},
        1000,
        None,
    ),
]


def mamba_block_aligned_split_table():
    rows = []
    doc_mismatches = []
    for case, kwargs, without, with_ckpt in DOC_SPLIT_CASES:
        alignment = 16 if kwargs["block"] == 1152 else 1
        for checkpoints, expected in ((False, without), (True, with_ckpt)):
            row = _split(
                f"{case}_{'ckpt' if checkpoints else 'no_ckpt'}",
                checkpoints=checkpoints,
                alignment=alignment if checkpoints else None,
                **kwargs,
            )
            rows.append(row)
            if expected is not None and row[-1] != expected:
                doc_mismatches.append([row[0], expected, row[-1]])
    rng = random.Random(7)
    hash_choices = {16: (16, 4, 8), 528: (528, 16, 48), 768: (768, 16, 256), 1600: (1600, 16, 64)}
    spec_modes = ((False, 0), (True, 0), (False, 1), (False, 3))
    configs = [
        (block, hash_block, alignment, eagle, lookahead, threshold)
        for block, hashes in hash_choices.items()
        for hash_block in hashes
        for alignment in (None, 1, 16, 64)
        for eagle, lookahead in spec_modes
        for threshold in (0, 1, 512)
        if threshold != 1 or block == 16
    ]
    for config in configs:
        rows += [_random_split(rng, *config) for _ in range(11)]
    result = table(SPLIT_COLUMNS, rows)
    result["doc_table_mismatches"] = doc_mismatches
    result["note"] = (
        "Scheduler._mamba_block_aligned_split(self, request, num_new_tokens, "
        "num_new_local_computed_tokens, num_external_computed_tokens) called "
        "unbound on a SimpleNamespace scheduler; cache_block_size is "
        "self.cache_config.block_size and scheduler_block_size is self.block_size "
        "(kept equal). mamba_partial_cache_hit = hash_block_size < block size; "
        "use_eagle_block_drop only with num_hash_lookahead_tokens == 0, as "
        "Scheduler.__init__ enforces."
    )
    return result


def _random_split(rng, block, hash_block, alignment, eagle, lookahead, threshold):
    kind = rng.random()
    if kind < 0.5:
        prompt = rng.randrange(1, 5001)
    else:
        unit = rng.choice((block, hash_block))
        prompt = max(1, unit * rng.randrange(1, max(2, 5000 // unit + 1)) + rng.choice((-1, 0, 1, 2, 7)))
    num_tokens = prompt if rng.random() < 0.85 else prompt + rng.randrange(1, 40)
    c = rng.random()
    if c < 0.35:
        computed = 0
    elif c < 0.55:
        computed = block * rng.randrange(0, prompt // block + 1)
    elif c < 0.75:
        computed = hash_block * rng.randrange(0, prompt // hash_block + 1)
    else:
        computed = rng.randrange(0, prompt + 1)
    computed = min(computed, num_tokens - 1) if num_tokens > 0 else 0
    local = external = 0
    if rng.random() < 0.15:
        room = (num_tokens - 1 - computed) // hash_block
        local = hash_block * rng.randrange(0, room + 1) if room > 0 else 0
    if rng.random() < 0.05:
        external = rng.randrange(0, max(1, num_tokens - computed - local))
    start = computed + local + external
    remainder = max(num_tokens - start, 1)
    budget = rng.choice((1000, 2048, 8192, 16384))
    cap = min(budget, threshold) if threshold > 0 else budget
    if rng.random() < 0.6:
        new = min(remainder, cap)
    else:
        new = rng.randrange(1, min(remainder, cap) + 1)
    shared_prefix = rng.random() < 0.2
    junction = rng.randrange(0, num_tokens + 1) if rng.random() < 0.25 else 0
    return _split(
        None,
        block=block,
        hash_block=hash_block,
        eagle=eagle,
        lookahead=lookahead,
        checkpoints=alignment is not None,
        alignment=alignment,
        budget=budget,
        threshold=threshold,
        shared_prefix=shared_prefix,
        computed=computed,
        prompt=prompt,
        num_tokens=num_tokens,
        junction=junction,
        new=new,
        local=local,
        external=external,
    )


def dump(data, path):
    """Compact JSON with one table row per line."""
    compact = {"separators": (",", ":")}
    parts = ["{\n", f'"meta":{json.dumps(data["meta"], **compact)}']
    for key, value in data.items():
        if key == "meta":
            continue
        extras = {k: v for k, v in value.items() if k != "rows"}
        parts.append(f',\n"{key}":{{')
        for k, v in extras.items():
            parts.append(f'"{k}":{json.dumps(v, **compact)},')
        parts.append('"rows":[\n')
        parts.append(",\n".join(json.dumps(r, **compact) for r in value["rows"]))
        parts.append("\n]}")
    parts.append("\n}\n")
    path.write_text("".join(parts))


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    started = datetime.datetime.now(datetime.UTC)
    data = {
        "meta": {
            "vllm_version": vllm.__version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "generated_at": started.isoformat(timespec="seconds"),
            "script": "tools/vllm_answers.py",
        },
        "checkpoint_position": checkpoint_position_table(),
        "is_checkpoint_valid": is_checkpoint_valid_table(),
        "prefill_checkpoints": prefill_checkpoints_table(),
        "model_checkpoint_alignment": model_checkpoint_alignment_table(),
        "checkpoint_grid": checkpoint_grid_table(),
        "mamba_spec": mamba_spec_table(),
        "mamba_spec_uniform": mamba_spec_uniform_table(),
        "align_block_size": align_block_size_table(),
        "mamba_block_aligned_split": mamba_block_aligned_split_table(),
    }
    dump(data, out)
    json.loads(out.read_text())
    sizes = {k: len(v["rows"]) for k, v in data.items() if k != "meta"}
    print(f"wrote {out} ({out.stat().st_size} bytes): {sizes}")
    mismatches = data["mamba_block_aligned_split"]["doc_table_mismatches"]
    if mismatches:
        print(f"doc split table mismatches: {mismatches}")


if __name__ == "__main__":
    main()

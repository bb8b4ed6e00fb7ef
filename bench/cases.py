"""The benchmarks' cases, in one place: the anchor shapes, the varlen mix, the checkpoint settings and the inputs.

Inputs as the anchors (../shared/anchors/peer_probe.py): q, k L2-normalised, v, g log decay (per head for GDN, per
key channel / 8 for KDA), beta in (0, 1), an fp32 initial state per row; SSD with P = 64, N = 128, G = 1. Every
runner casts them to its dtype (bf16 on the GPU). Checkpoint settings: `none`, `per_row` (the row's last 512-token
boundary) and `every_1024` (one per 1024 tokens).
"""

from __future__ import annotations

import numpy as np

DELTA_SHAPES = [(1, 8192, 16), (1, 32768, 16), (8, 4096, 32)]    # GDN / KDA anchors (B, T, H), K = V = 128
VARLEN_MIX = [1024, 2048, 7168, 3072, 512, 9216, 4096, 5632]      # the varlen mix: 8 rows, 32768 tokens, H = 16
SSD_SHAPES = [(8192, 128), (32768, 32)]                           # (T, H) with P = 64, N = 128, G = 1
LONG_SHAPES = [(1, 32768, 16), (1, 131072, 16), (8, 4096, 32)]    # sequence_parallel's (B, T, H)
TINY_DELTA = [(1, 256, 2), (2, 128, 2)]                           # the CPU smoke runs'
TINY_SSD = [(256, 4)]
MODES = ["none", "per_row", "every_1024"]
# issue #20's held-out calls of the default entries, (label, lengths, H, HV, D): the varlen mix, K = V = 64, value heads
# twice the key heads (GVA) and a short row
HELD_OUT = [("varlen", VARLEN_MIX, 16, 16, 128), ("K=V=64", [8192], 16, 16, 64), ("HV=2H", [8192], 16, 32, 128),
            ("T=2048", [2048], 16, 16, 128)]


def checkpoint_lists(lengths, mode):
    """CSR checkpoints: none, the last 512-token boundary per row, or one every 1024 tokens."""
    rows = []
    for length in lengths:
        if mode == "none":
            rows.append([])
        elif mode == "per_row":
            pos = (length - 1) // 512 * 512
            rows.append([pos] if pos > 0 else [])
        else:
            rows.append(list(range(1024, length, 1024)))
    ccu = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    offsets = np.asarray([o for r in rows for o in r], np.int32)
    return ccu, offsets


def delta_inputs(lengths, H, D, kind, seed=0, *, HV=None, raw=False):
    """fp32 numpy (q, k, v, g, beta, h0, cu_seqlens) of packed rows of `lengths` tokens, H key heads, HV value heads
    (default H), K = V = D; q, k L2-normalised, or with `raw` as a projection gives them (norms near sqrt(D), for a
    call with use_qk_l2norm=True)."""
    rng = np.random.default_rng(seed)
    T = int(sum(lengths))
    HV = HV or H
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((T, H, D)).astype(np.float32)
    if not raw:
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, HV, D)).astype(np.float32)
    shape = (T, HV) if kind == "gdn" else (T, HV, D)
    g = -np.log1p(np.exp(-rng.standard_normal(shape))).astype(np.float32)
    if kind == "kda":
        g /= 8
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, HV))))).astype(np.float32)
    h0 = (rng.standard_normal((len(lengths), HV, D, D)) * 0.1).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return q, k, v, g, beta, h0, cu


def ssd_inputs(T, H, N, P, seed=0):
    """fp32 numpy (x, dt, A, B, C, h0) of one row of T tokens, H heads of P, one group of state size N."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H, P)).astype(np.float32)
    dt = (rng.standard_normal((T, H)) - 2).astype(np.float32)
    A = -np.exp(rng.uniform(0, 2.7, (H,))).astype(np.float32)
    B = (rng.standard_normal((T, 1, N)) * 0.1).astype(np.float32)
    C = (rng.standard_normal((T, 1, N)) * 0.1).astype(np.float32)
    h0 = (rng.standard_normal((1, H, P, N)) * 0.1).astype(np.float32)
    return x, dt, A, B, C, h0

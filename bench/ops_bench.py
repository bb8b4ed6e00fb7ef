"""Times jaxckpt's op implementations and the peers (FLA, FlashQLA, jla, a token-by-token scan) in the same run.

GPU: `python -m bench.ops_bench --ops gdn --impls default --modes per_row --peers jla fla --device-time --name NAME`
(writes bench/results/<name>.json and .md, or under $OUT when set). CPU smoke run: `--tiny`. The cases (anchor
shapes, the varlen mix, checkpoint settings, inputs) are `bench.cases`'; the method is in bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.cases import (  # noqa: E402
    DELTA_SHAPES,
    HELD_OUT,
    MODES,
    SSD_SHAPES,
    TINY_DELTA,
    TINY_SSD,
    VARLEN_MIX,
    checkpoint_lists,
    delta_inputs,
    ssd_inputs,
)
from bench.common import Recorder, attempt, implementation_spec, jax_device_fields, jax_time, out_dir, torch_time  # noqa: E402

DEVICE_TIME = False  # --device-time


def timed(f, *args, reps: int = 20, device_time: bool | None = None) -> dict:
    """A JAX row's timing fields: first_call_ms and compile_ms, `jax_time`'s, and with --device-time (or
    `device_time`) the device and pipelined times.

    `f` is a fresh `jax.jit`: its first call traces (the implementation choice included), lowers, compiles, loads
    and runs once. compile_ms = first_call_ms - median_ms is what a user waits for once, on top of a call's time.
    """
    import jax

    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    first_call_ms = (time.perf_counter() - start) * 1e3
    t = jax_time(f, *args, reps=reps)
    t.update(first_call_ms=first_call_ms, compile_ms=first_call_ms - t["median_ms"])
    if DEVICE_TIME if device_time is None else device_time:
        t.update(jax_device_fields(f, *args))
    return t


def bench_ours_delta(rec, kind, impl, lengths, H, D, shape_label, modes, *, HV=None, raw=False, paged=False):
    """Our entry on bf16 inputs with an fp32 initial state per row; `raw` q, k with use_qk_l2norm=True; `paged` the
    `*_paged` entry as the layers call it (a bf16 pool, not donated)."""
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops

    q, k, v, g, beta, h0, cu = delta_inputs(lengths, H, D, kind, HV=HV, raw=raw)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    args = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0), jnp.asarray(cu))
    impl, config = implementation_spec(spec := impl, kind)
    options = dict(use_qk_l2norm=raw, implementation=impl, config=config)
    num_rows = len(lengths)
    for mode in modes:
        ccu, offsets = checkpoint_lists(lengths, mode)
        if paged:
            fn = ops.gated_delta_rule_paged if kind == "gdn" else ops.kda_paged
            rows = jnp.arange(1, num_rows + 1, dtype=jnp.int32)
            slots = dict(initial_state_indices=rows, has_initial_state=jnp.ones(num_rows, bool),
                         final_state_indices=rows, checkpoint_state_indices=jnp.arange(
                             num_rows + 1, num_rows + 1 + offsets.size, dtype=jnp.int32))

            def f(q, k, v, g, beta, h0, cu, ccu, off):
                pool = jnp.zeros((num_rows + 1 + offsets.size, *h0.shape[1:]), jnp.bfloat16)
                pool = pool.at[1:num_rows + 1].set(h0.astype(jnp.bfloat16))
                return fn(q, k, v, g, beta, pool, **slots, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=off,
                          donate=False, **options)
            f = jax.jit(f)
        else:
            fn = ops.gated_delta_rule if kind == "gdn" else ops.kda
            f = jax.jit(lambda q, k, v, g, beta, h0, cu, ccu, off: fn(
                q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=off,
                **options))
        row = dict(op=kind, implementation=spec + ("_paged" if paged else "") + ("_raw_l2norm" if raw else ""),
                   shape=shape_label, checkpoints=mode)
        attempt(rec, lambda: rec.add(
            **row, rows=list(lengths), num_checkpoints=int(offsets.size), dtype="bf16",
            **timed(f, *args, jnp.asarray(ccu), jnp.asarray(offsets))), **row)


def torch_delta_args(lengths, H, D, kind, batched, *, HV=None):
    """The torch peers' arguments on the op's inputs: dense [B, T, ...] for equal rows, else [1, T, ...] with
    cu_seqlens (FLA's and FlashQLA's calling convention)."""
    import torch

    q, k, v, g, beta, h0, cu = delta_inputs(lengths, H, D, kind, HV=HV)
    t = lambda x, dt=torch.float32: torch.from_numpy(x).to("cuda", dt)  # noqa: E731
    if batched:
        B, L = len(lengths), lengths[0]
        shp = lambda x: x.reshape(B, L, *x.shape[1:])  # noqa: E731
        args = [t(shp(q), torch.bfloat16), t(shp(k), torch.bfloat16), t(shp(v), torch.bfloat16), t(shp(g)),
                t(shp(beta))]
        return args, dict(initial_state=t(h0), output_final_state=True)
    args = [t(q, torch.bfloat16)[None], t(k, torch.bfloat16)[None], t(v, torch.bfloat16)[None], t(g)[None],
            t(beta)[None]]
    return args, dict(initial_state=t(h0), output_final_state=True, cu_seqlens=torch.from_numpy(cu).long().cuda())


def bench_flashqla_delta(rec, kind, lengths, H, D, shape_label, batched, *, HV=None):
    """FlashQLA's default call (its intra-card context parallelism on, `auto_cp=True`); GDN only. It compiles its
    kernels on the first call of a shape, inside `do_bench`'s warm-up."""
    import torch

    if kind != "gdn":
        rec.add(op=kind, implementation="flashqla", shape=shape_label, checkpoints="none", median_ms=None,
                note="FlashQLA 0.1.3 has no KDA")
        return
    from flash_qla import chunk_gated_delta_rule

    args, kwargs = torch_delta_args(lengths, H, D, kind, batched, HV=HV)
    with torch.inference_mode():
        start = time.perf_counter()
        chunk_gated_delta_rule(*args, **kwargs)
        torch.cuda.synchronize()
        first_call_ms = (time.perf_counter() - start) * 1e3
        rec.add(op=kind, implementation="flashqla", shape=shape_label, rows=list(lengths), checkpoints="none",
                dtype="bf16", first_call_ms=first_call_ms,
                **torch_time(lambda: chunk_gated_delta_rule(*args, **kwargs)))


def bench_fla_delta(rec, kind, lengths, H, D, shape_label, batched, *, HV=None):
    import importlib.util

    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    if kind == "gdn" and importlib.util.find_spec("flash_qla") is not None:
        # FLA 0.6.0 hands GDN to FlashQLA whenever it can import it: that row would time FlashQLA
        raise RuntimeError("FLA's GDN not timed: flash_qla is importable (run FLA and FlashQLA in two processes)")
    fn = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    args, kwargs = torch_delta_args(lengths, H, D, kind, batched, HV=HV)
    _, _, _, _, _, h0, cu = delta_inputs(lengths, H, D, kind, HV=HV)
    with torch.inference_mode():
        rec.add(op=kind, implementation="fla", shape=shape_label, rows=list(lengths), checkpoints="none",
                dtype="bf16", **torch_time(lambda: fn(*args, **kwargs)))
        # the vLLM way for kernels that only return final states: one call over head/tail segments, tails rerun
        ccu, offsets = checkpoint_lists(lengths, "per_row")
        flat = [a.reshape(1, -1, *a.shape[2:]) for a in args]
        cu_split, tails, tail_cu, heads = [0], [], [0], []
        for n, length in enumerate(lengths):
            start = int(cu[n])
            offs = offsets[ccu[n]:ccu[n + 1]].tolist()
            for cut in [*offs, length]:
                cu_split.append(start + cut)
            if offs:
                heads.append(len(cu_split) - 3)
                tails.append(np.arange(start + offs[-1], start + length))
                tail_cu.append(tail_cu[-1] + length - offs[-1])
        cu_split_t = torch.tensor(cu_split, device="cuda", dtype=torch.long)
        tail_idx = torch.from_numpy(np.concatenate(tails)).cuda()
        tail_cu_t = torch.tensor(tail_cu, device="cuda", dtype=torch.long)
        h0_split = torch.zeros(len(cu_split) - 1, *h0.shape[1:], device="cuda")

        def split():
            o, finals = fn(*flat, initial_state=h0_split, output_final_state=True, cu_seqlens=cu_split_t)
            ckpt = finals[heads]
            o2, f2 = fn(*[a[:, tail_idx] for a in flat], initial_state=ckpt, output_final_state=True,
                        cu_seqlens=tail_cu_t)
            o[:, tail_idx] = o2
            return o, f2, ckpt
        rec.add(op=kind, implementation="fla_split", shape=shape_label, rows=list(lengths), checkpoints="per_row",
                dtype="bf16", **torch_time(split))


def bench_jla_delta(rec, kind, impl, lengths, H, D, shape_label, *, HV=None):
    import jax
    import jax.numpy as jnp
    from jla.ops import linear_attention

    if len(set(lengths)) != 1:
        rec.add(op=kind, implementation=f"jla_{impl}", shape=shape_label, checkpoints="none", median_ms=None,
                note="jla has no per-row initial states with varlen rows")
        return
    q, k, v, g, beta, h0, _ = delta_inputs(lengths, H, D, kind, HV=HV)
    B, L = len(lengths), lengths[0]
    shp = lambda x: x.reshape(B, L, *x.shape[1:])  # noqa: E731
    bf = lambda x: jnp.asarray(shp(x), jnp.bfloat16)  # noqa: E731
    name = "gated_deltanet" if kind == "gdn" else "kda"
    f = jax.jit(lambda q, k, v, g, beta, h0: linear_attention(name, q, k, v, g=g, beta=beta, impl=impl,
                                                              initial_state=h0, output_final_state=True))
    args = (bf(q), bf(k), bf(v), jnp.asarray(shp(g)), jnp.asarray(shp(beta)), jnp.asarray(h0))
    rec.add(op=kind, implementation=f"jla_{impl}", shape=shape_label, rows=list(lengths), checkpoints="none",
            dtype="bf16", **timed(f, *args))


def bench_scan_gdn(rec, lengths, H, D, shape_label):
    """The naive JAX choice: a token-by-token lax.scan in fp32."""
    import jax
    import jax.numpy as jnp

    q, k, v, g, beta, h0, _ = delta_inputs(lengths, H, D, "gdn")

    @jax.jit
    def scan(q, k, v, g, beta, h0):
        def step(S, x):
            qt, kt, vt, gt, bt = x
            S = S * jnp.exp(gt)[:, None, None]
            u = bt[:, None] * (vt - jnp.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            return S, jnp.einsum("hkv,hk->hv", S, qt * D ** -0.5)
        return jax.lax.scan(step, h0[0], (q, k, v, g, beta))

    rec.add(op="gdn", implementation="lax_scan_fp32", shape=shape_label, rows=list(lengths), checkpoints="none",
            dtype="fp32", **timed(scan, *(jnp.asarray(a) for a in (q, k, v, g, beta, h0)), reps=5, device_time=False))


def bench_ours_ssd(rec, impl, T, H, modes, N=128, P=64):
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops

    x, dt, A, B, C, h0 = ssd_inputs(T, H, N, P)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    cu = jnp.asarray([0, T], jnp.int32)
    shape = {"T": T, "H": H, "P": P, "N": N, "G": 1}
    impl, config = implementation_spec(spec := impl, "ssd")
    # the core alone, then as Mamba2's layer calls it (issue #21's SSD goal): the skip D, the gate z and dt_bias given
    rng = np.random.default_rng(1)
    layer = dict(D=jnp.asarray(rng.standard_normal(H), jnp.float32), z=bf(rng.standard_normal(x.shape)),
                 dt_bias=jnp.asarray(rng.standard_normal(H) * 0.1, jnp.float32))
    for extra, label in (({}, {}), (layer, {"layer": "D, z, dt_bias"})):
        for mode in modes:
            ccu, offsets = checkpoint_lists([T], mode)
            f = jax.jit(lambda x, dt, A, B, C, h0, cu, ccu, off, extra: ops.ssd(
                x, dt, A, B, C, **extra, initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=off,
                implementation=impl, config=config))
            args = (bf(x), bf(dt), jnp.asarray(A), bf(B), bf(C), jnp.asarray(h0), cu, jnp.asarray(ccu),
                    jnp.asarray(offsets), extra)
            row = dict(op="ssd", implementation=spec, shape=shape | label, checkpoints=mode)
            attempt(rec, lambda: rec.add(**row, num_checkpoints=int(offsets.size), dtype="bf16", **timed(f, *args)),
                    **row)
    # the same row as a batch [1, T, ...] (cu_seqlens None), as the peers take it: rows known to lie on the chunk
    # grid let a kernel skip its varlen gathers
    f = jax.jit(lambda x, dt, A, B, C, h0: ops.ssd(x[None], dt[None], A, B[None], C[None], initial_state=h0,
                                                    implementation=impl, config=config))
    args = (bf(x), bf(dt), jnp.asarray(A), bf(B), bf(C), jnp.asarray(h0))
    row = dict(op="ssd", implementation=spec, shape=shape | {"batched": True}, checkpoints="none")
    attempt(rec, lambda: rec.add(**row, dtype="bf16", **timed(f, *args)), **row)


def bench_peers_ssd(rec, peers, T, H, N=128, P=64):
    """SSD's core as simple GLA (q = C, k = B, v = dt * x, g = dt * A), as the anchors measured it."""
    x, dt, A, B, C, h0 = ssd_inputs(T, H, N, P)
    delta = np.log1p(np.exp(dt))
    v = (x * delta[..., None]).astype(np.float32)
    g = (delta * A).astype(np.float32)
    Cq = np.broadcast_to(C, (T, H, N)).copy()
    Bk = np.broadcast_to(B, (T, H, N)).copy()
    h0_kv = np.swapaxes(h0, -1, -2).copy()
    shape = {"T": T, "H": H, "P": P, "N": N, "G": 1}
    if "fla" in peers:
        import torch
        from fla.ops.simple_gla import chunk_simple_gla

        t = lambda a, d=torch.float32: torch.from_numpy(a).to("cuda", d)  # noqa: E731
        args = (t(Cq, torch.bfloat16)[None], t(Bk, torch.bfloat16)[None], t(v, torch.bfloat16)[None], t(g)[None])
        with torch.inference_mode():
            rec.add(op="ssd", implementation="fla_simple_gla", shape=shape, checkpoints="none", dtype="bf16",
                    **torch_time(lambda: chunk_simple_gla(*args, scale=1.0, initial_state=t(h0_kv),
                                                          output_final_state=True)))
    if "jla" in peers:
        import jax
        import jax.numpy as jnp
        from jla.ops import linear_attention

        bf = lambda a: jnp.asarray(a[None], jnp.bfloat16)  # noqa: E731
        f = jax.jit(lambda q, k, v, g, h0: linear_attention("simple_gla", q, k, v, g=g, impl="mosaic_gpu", scale=1.0,
                                                            initial_state=h0, output_final_state=True))
        args = (bf(Cq), bf(Bk), bf(v), jnp.asarray(g[None]), jnp.asarray(h0_kv))
        rec.add(op="ssd", implementation="jla_mosaic_gpu_simple_gla", shape=shape, checkpoints="none", dtype="bf16",
                **timed(f, *args))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="+", default=["gdn", "kda", "ssd"])
    parser.add_argument("--impls", nargs="*", default=["xla"],
                        help="implementation specs: 'default' (the call with no implementation and no tuning), "
                             "xla, pallas_mosaic_gpu@intra=mosaic_gpu, pallas_triton@block_v=32, ...; none given: "
                             "the peers alone")
    parser.add_argument("--peers", nargs="*", default=[],
                        help="fla flashqla jla jla_chunked scan (fla and flashqla in two processes: FLA hands GDN to "
                             "an importable FlashQLA)")
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--impl-modes", nargs="*", default=[],
                        help="per-implementation checkpoint modes, e.g. xla=none,every_1024")
    parser.add_argument("--name", default="ops")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at tiny shapes")
    parser.add_argument("--no-varlen", action="store_true")
    parser.add_argument("--device-time", action="store_true",
                        help="also, for the JAX rows, the summed GPU kernel time per call (profiler trace), the "
                             "largest kernels and the pipelined time per call (bench.common.jax_device_fields)")
    parser.add_argument("--held-out", action="store_true",
                        help="the held-out delta cases (bench.cases.HELD_OUT) in place of the anchors and varlen mix")
    parser.add_argument("--raw", action="store_true", help="our delta rows on raw q, k with use_qk_l2norm=True")
    parser.add_argument("--paged", action="store_true", help="our delta rows through the *_paged entries")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="only these delta shapes: B,T,H triples and/or 'varlen' (default: all)")
    args = parser.parse_args(argv)
    global DEVICE_TIME
    DEVICE_TIME = args.device_time
    rec = Recorder(args.name, out_dir())
    impl_modes = {impl: args.modes for impl in args.impls}
    impl_modes.update({k: v.split(",") for k, v in (item.rsplit("=", 1) for item in args.impl_modes)})
    D = 16 if args.tiny else 128
    shapes = [(B, T, H) for (B, T, H) in (TINY_DELTA if args.tiny else DELTA_SHAPES)]
    cases = [([T] * B, H, H, D, {"B": B, "T": T, "H": H, "K": D, "V": D}, True) for B, T, H in shapes]
    if not args.no_varlen and not args.tiny:
        cases.append((VARLEN_MIX, 16, 16, D, {"varlen": "8 rows, 32768 tokens", "H": 16, "K": D, "V": D}, False))
    if args.held_out:
        cases = [(lengths, H, HV, D, {"case": label, "rows": len(lengths), "T": sum(lengths), "H": H, "HV": HV, "K": D,
                                      "V": D}, len(set(lengths)) == 1) for label, lengths, H, HV, D in HELD_OUT]
    if args.shapes is not None:
        keep = {s if s == "varlen" else tuple(int(x) for x in s.split(",")) for s in args.shapes}
        cases = [c for c in cases if ("varlen" if "varlen" in c[4] else (c[4]["B"], c[4]["T"], c[4]["H"])) in keep]
    for kind in [op for op in args.ops if op in ("gdn", "kda")]:
        for lengths, H, HV, D, label, batched in cases:
            print(f"== {kind} {label}", flush=True)
            for impl in args.impls:
                bench_ours_delta(rec, kind, impl, lengths, H, D, label, impl_modes[impl], HV=HV, raw=args.raw,
                                 paged=args.paged)
            for peer, runner in (("fla", lambda: bench_fla_delta(rec, kind, lengths, H, D, label, batched, HV=HV)),
                                 ("flashqla", lambda: bench_flashqla_delta(rec, kind, lengths, H, D, label, batched,
                                                                           HV=HV)),
                                 ("jla", lambda: bench_jla_delta(rec, kind, "mosaic_gpu", lengths, H, D, label, HV=HV)),
                                 ("jla_chunked", lambda: bench_jla_delta(rec, kind, "chunked", lengths, H, D, label,
                                                                         HV=HV)),
                                 ("scan", lambda: bench_scan_gdn(rec, lengths, H, D, label)
                                  if kind == "gdn" and lengths == [8192] or args.tiny and kind == "gdn" else None)):
                if peer in args.peers:
                    attempt(rec, runner, op=kind, implementation=peer, shape=label, checkpoints="none")
            rec.write()
    if "ssd" in args.ops:
        for T, H in (TINY_SSD if args.tiny else SSD_SHAPES):
            print(f"== ssd T={T} H={H}", flush=True)
            for impl in args.impls:
                bench_ours_ssd(rec, impl, T, H, impl_modes[impl], N=16 if args.tiny else 128, P=8 if args.tiny else 64)
            attempt(rec, lambda: bench_peers_ssd(rec, args.peers, T, H), op="ssd", implementation="peers",
                    shape={"T": T, "H": H}, checkpoints="none")
            rec.write()
    print(f"wrote {rec.write()}")


if __name__ == "__main__":
    main()

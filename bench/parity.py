"""Parity of every checkpointed-prefill path on the same bf16 inputs, and FLA checkpoint overheads (GPU).

`python -m bench.parity [--name NAME] [--only parity|timing]` on the GPU machine writes `<name>.json` / `.md` (rel-RMS
table) and `<name>_timing.json` / `.md` (Recorder schema) under $OUT, else bench/results. Under 5 minutes on one H200.

Parity: GDN, KDA (K = V = 128, H = 2, HV = 4, varlen rows with 1-token and checkpoint-free rows) and SSD (H = 8,
P = 64, N = 128, G = 2) through jaxckpt (xla, pallas_triton, pallas_mosaic_gpu: its defaults and options,
`MOSAIC_GPU_ROWS`), torch_bridge (FLA split, FLA KDA intermediate states, the Triton SSD at ieee and
tf32 dots, the DLPack bridge onto jaxckpt's xla path) against the float64 reference run on exactly the bf16-rounded
inputs; rel-RMS of the output, the final states and every checkpoint on its own. KDA offsets lie on the 64 grid so
the native path sees the same checkpoints. A failing path is recorded with its error.

Timing: FLA 0.6.0 plain (final states only), split with one checkpoint per row (the row's last 512-token boundary;
host planning and gathers included), and KDA with intermediate states, at the anchor shapes (B, T, H) = (1, 8192, 16),
(1, 32768, 16), (8, 4096, 32), K = V = 128, all as packed varlen rows (B = 1, cu_seqlens) with fp32 initial states.
The checkpoint exporter on its own (`torch_bridge.ops.exporter.export_checkpoints`: conv windows of a GDN layer's
q|k|v channels, W = 4, read as a column band of a fused projection, plus the fp32 recurrent states into paged
pools) at the same shapes, one checkpoint per row and one per 1024 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from bench.cases import DELTA_SHAPES, checkpoint_lists, delta_inputs  # noqa: E402
from bench.common import Recorder, environment, implementation_spec, out_dir, rel_rms, torch_time  # noqa: E402


def bf16_round(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def delta_problem(op, seed):
    rng = np.random.default_rng(seed)
    lengths, heads, v_heads, dim = [1000, 1, 513, 300], 2, 4, 128
    T = sum(lengths)
    q = rng.standard_normal((T, heads, dim))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k = rng.standard_normal((T, heads, dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.log1p(np.exp(-rng.standard_normal((T, v_heads) if op == "gdn" else (T, v_heads, dim))))
    if op == "kda":
        g /= 8
    beta = 1 / (1 + np.exp(-rng.standard_normal((T, v_heads))))
    arrays = dict(q=bf16_round(q), k=bf16_round(k), v=bf16_round(rng.standard_normal((T, v_heads, dim))),
                  g=g.astype(np.float32), beta=beta.astype(np.float32))
    h0 = (rng.standard_normal((len(lengths), v_heads, dim, dim)) * 0.1).astype(np.float32)
    offsets = {"gdn": [[1, 64, 999], [], [256, 300], [100]], "kda": [[64, 960], [], [256, 512], [192]]}[op]
    return arrays, h0, lengths, offsets


def ssd_problem(seed):
    rng = np.random.default_rng(seed)
    lengths, H, P, G, N = [1500, 1, 400, 130], 8, 64, 2, 128
    T = sum(lengths)
    arrays = dict(x=bf16_round(rng.standard_normal((T, H, P))), dt=bf16_round(rng.standard_normal((T, H)) - 2),
                  A=-np.exp(rng.uniform(0, 2, H)).astype(np.float32), B=bf16_round(rng.standard_normal((T, G, N))),
                  C=bf16_round(rng.standard_normal((T, G, N))))
    options = dict(D=rng.standard_normal(H).astype(np.float32),
                   dt_bias=(rng.standard_normal(H) * 0.5).astype(np.float32),
                   z=bf16_round(rng.standard_normal((T, H, P))))
    h0 = (rng.standard_normal((len(lengths), H, P, N)) * 0.1).astype(np.float32)
    return arrays, options, h0, lengths, [[1, 777, 1499], [], [64, 399], []]


def csr(lengths, offsets):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ccu = np.concatenate([[0], np.cumsum([len(o) for o in offsets])]).astype(np.int32)
    flat = np.asarray([p for row in offsets for p in row], np.int32)
    return cu, ccu, flat


def compare(results, op, path, outputs, expected, ccu, offsets, started):
    rows = np.repeat(np.arange(ccu.size - 1), np.diff(ccu))
    entry = {"op": op, "path": path, "seconds": round(time.perf_counter() - started, 2),
             "output": rel_rms(outputs[0], expected[0]), "final_state": rel_rms(outputs[1], expected[1]),
             "checkpoints": [{"row": int(rows[m]), "offset": int(offsets[m]),
                              "rel_rms": rel_rms(outputs[2][m], expected[2][m])} for m in range(offsets.size)]}
    results.append(entry)
    worst = max([c["rel_rms"] for c in entry["checkpoints"]], default=0.0)
    print(f"  {op:<4} {path:<32} o {entry['output']:.2e}  final {entry['final_state']:.2e}  "
          f"worst checkpoint {worst:.2e}", flush=True)


def attempt(results, op, path, run, expected, ccu, offsets):
    started = time.perf_counter()
    try:
        compare(results, op, path, run(), expected, ccu, offsets, started)
    except Exception as error:  # noqa: BLE001 - a failing path is a result, the others still run
        traceback.print_exc()
        results.append({"op": op, "path": path, "error": f"{type(error).__name__}: {str(error)[:300]}"})
        print(f"  {op:<4} {path:<32} FAILED {type(error).__name__}", flush=True)


# the Mosaic GPU backend's defaults (`delta_rule.pallas_mosaic_gpu.pipeline.default_tuning`) and its options
MOSAIC_GPU_ROWS = {
    "gdn": ("pallas_mosaic_gpu", "pallas_mosaic_gpu@state_terms=2", "pallas_mosaic_gpu@state=fused",
            "pallas_mosaic_gpu@state=fused,pieces=2", "pallas_mosaic_gpu@state=fused,state_terms=2"),
    "kda": ("pallas_mosaic_gpu", "pallas_mosaic_gpu@state_terms=2", "pallas_mosaic_gpu@kda_score_parts=2",
            "pallas_mosaic_gpu@kda_score_parts=2,state_terms=2"),
}


def parity(ops_to_run=("gdn", "kda", "ssd"), mosaic_rows=None) -> list[dict]:
    """The rel-RMS rows of every path on each parity problem; `mosaic_rows` (implementation specs) replaces
    `MOSAIC_GPU_ROWS`' GDN and KDA rows."""
    import jax.numpy as jnp
    import torch

    from jaxckpt import ops
    from jaxckpt.ops.delta_rule.reference import gated_delta_rule as gdn_reference
    from jaxckpt.ops.delta_rule.reference import kda as kda_reference
    from jaxckpt.ops.ssd.reference import ssd as ssd_reference
    from torch_bridge import interop
    from torch_bridge.ops import fla_prefill
    from torch_bridge.ops.ssd import ssd as triton_ssd

    cuda = lambda a, dtype=torch.float32: torch.tensor(a, device="cuda").to(dtype)  # noqa: E731
    results = []
    for op, seed in (("gdn", 11), ("kda", 12)):
        if op not in ops_to_run:
            continue
        arrays, h0, lengths, offset_rows = delta_problem(op, seed)
        cu, ccu, offsets = csr(lengths, offset_rows)
        meta = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
        expected = (gdn_reference if op == "gdn" else kda_reference)(**arrays, initial_state=h0, **meta)
        entry = ops.gated_delta_rule if op == "gdn" else ops.kda
        bridge = interop.gated_delta_rule if op == "gdn" else interop.kda
        jax_args = [jnp.asarray(arrays[n], jnp.bfloat16) for n in ("q", "k", "v")] + [jnp.asarray(arrays["g"]),
                                                                                      jnp.asarray(arrays["beta"])]
        torch_args = dict(q=cuda(arrays["q"], torch.bfloat16), k=cuda(arrays["k"], torch.bfloat16),
                          v=cuda(arrays["v"], torch.bfloat16), g=cuda(arrays["g"]), beta=cuda(arrays["beta"]))
        for spec in ("xla", "pallas_triton", *(MOSAIC_GPU_ROWS[op] if mosaic_rows is None else mosaic_rows)):
            impl, config = implementation_spec(spec, op)
            name = f"jaxckpt.{spec}"
            attempt(results, op, name,
                    lambda impl=impl, config=config: entry(*jax_args, initial_state=jnp.asarray(h0),
                                                           implementation=impl, config=config, **meta),
                    expected, ccu, offsets)
        split = fla_prefill.chunk_gated_delta_rule_split if op == "gdn" else fla_prefill.chunk_kda_split
        attempt(results, op, "torch_bridge.fla_split",
                lambda: split(**torch_args, initial_state=cuda(h0), **meta), expected, ccu, offsets)
        if op == "kda":
            attempt(results, op, "torch_bridge.fla_kda_native_64",
                    lambda: fla_prefill.chunk_kda_native(**torch_args, initial_state=cuda(h0), **meta), expected, ccu,
                    offsets)
        attempt(results, op, "torch_bridge.bridge(jaxckpt.xla)",
                lambda: bridge(*torch_args.values(), initial_state=cuda(h0), implementation="xla", **meta),
                expected, ccu, offsets)

    if "ssd" not in ops_to_run:
        return results
    arrays, options, h0, lengths, offset_rows = ssd_problem(13)
    cu, ccu, offsets = csr(lengths, offset_rows)
    meta = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    expected = ssd_reference(**arrays, **options, initial_state=h0, **meta)
    bf_names = ("x", "dt", "B", "C", "z")
    jax_arrays = {n: jnp.asarray(a, jnp.bfloat16 if n in bf_names else jnp.float32)
                  for n, a in {**arrays, **options}.items()}
    torch_arrays = {n: cuda(a, torch.bfloat16 if n in bf_names else torch.float32)
                    for n, a in {**arrays, **options}.items()}
    for impl in ("xla", "pallas_triton", "pallas_mosaic_gpu"):
        attempt(results, "ssd", f"jaxckpt.{impl}",
                lambda impl=impl: ops.ssd(**jax_arrays, initial_state=jnp.asarray(h0), implementation=impl, **meta),
                expected, ccu, offsets)
    for precision in ("ieee", "tf32"):
        attempt(results, "ssd", f"torch_bridge.triton_ssd({precision})",
                lambda precision=precision: triton_ssd(**torch_arrays, initial_state=cuda(h0),
                                                       dot_precision=precision, **meta),
                expected, ccu, offsets)
    attempt(results, "ssd", "torch_bridge.bridge(jaxckpt.xla)",
            lambda: interop.ssd(**torch_arrays, initial_state=cuda(h0), implementation="xla", **meta),
            expected, ccu, offsets)
    no_checkpoints = np.zeros_like(ccu), np.zeros(0, np.int32)
    attempt(results, "ssd", "fla.chunk_simple_gla (core; no checkpoints)",
            lambda: fla_ssd(arrays, options, h0, cu), expected[:2] + (expected[2][:0],), *no_checkpoints)
    return results


def fla_ssd(arrays, options, h0, cu):
    """SSD through FLA's simple GLA as a user would run it: q = C, k = B per head, v = delta x (rounded to bf16: FLA
    takes v in the input dtype), g = delta A, then D x and the z gate in fp32."""
    import torch
    from fla.ops.simple_gla import chunk_simple_gla

    x, dt, A, B, C = (np.asarray(arrays[n], np.float64) for n in ("x", "dt", "A", "B", "C"))
    heads, groups = x.shape[1], B.shape[1]
    raw = dt + options["dt_bias"]
    delta = np.where(raw > 20, raw, np.log1p(np.exp(np.minimum(raw, 20))))
    per_head = lambda a: np.repeat(a, heads // groups, axis=1)  # noqa: E731
    cuda = lambda a, dtype=torch.float32: torch.tensor(np.ascontiguousarray(a), device="cuda").to(dtype)  # noqa: E731
    y, final = chunk_simple_gla(cuda(per_head(C), torch.bfloat16)[None], cuda(per_head(B), torch.bfloat16)[None],
                                cuda(x * delta[..., None], torch.bfloat16)[None], cuda(delta * A)[None], scale=1.0,
                                initial_state=cuda(np.swapaxes(h0, -1, -2)), output_final_state=True,
                                cu_seqlens=cuda(cu, torch.long))
    y = y[0].float().cpu().numpy() + options["D"][None, :, None] * x
    z = np.asarray(options["z"], np.float64)
    return y * z / (1 + np.exp(-z)), np.swapaxes(final.float().cpu().numpy(), -1, -2), np.zeros((0,) + h0.shape[1:])


def parity_markdown(payload: dict) -> str:
    lines = [f"# {payload['name']}", "", f"device: {payload['device']}", f"versions: {payload['versions']}",
             f"command: `{payload['command']}`", "",
             "rel-RMS against the float64 reference on the same bf16-rounded inputs (bf16 class bound 6e-3).", "",
             "| op | path | output | final states | worst checkpoint | every checkpoint (row, offset: rel-RMS) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in payload["results"]:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['path']} | FAILED: {r['error']} | | | |")
            continue
        ckpts = r["checkpoints"]
        worst = max((c["rel_rms"] for c in ckpts), default=0.0)
        each = "; ".join(f"({c['row']}, {c['offset']}): {c['rel_rms']:.2e}" for c in ckpts)
        lines.append(f"| {r['op']} | {r['path']} | {r['output']:.2e} | {r['final_state']:.2e} | {worst:.2e} | "
                     f"{each} |")
    return "\n".join(lines) + "\n"


def timing(recorder: Recorder) -> None:
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    from torch_bridge.ops import fla_prefill

    for kind in ("gdn", "kda"):
        fla = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
        split = fla_prefill.chunk_gated_delta_rule_split if kind == "gdn" else fla_prefill.chunk_kda_split
        for B, T, H in DELTA_SHAPES:
            lengths = [T] * B
            shape = {"B": B, "T": T, "H": H, "K": 128, "V": 128}
            print(f"== {kind} {shape}", flush=True)
            q, k, v, g, beta, h0, cu = delta_inputs(lengths, H, 128, kind)
            bf = lambda a: torch.from_numpy(a).to("cuda", torch.bfloat16)  # noqa: E731
            f32 = lambda a: torch.from_numpy(a).to("cuda")  # noqa: E731
            args = dict(q=bf(q), k=bf(k), v=bf(v), g=f32(g), beta=f32(beta))
            batched = {n: t[None] for n, t in args.items()}
            initial = f32(h0)
            cu_t, cu_cpu = torch.from_numpy(cu).long().cuda(), torch.from_numpy(cu).long()
            ccu, offsets = checkpoint_lists(lengths, "per_row")
            meta = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
            runs = [("fla", "none", lambda: fla(**batched, initial_state=initial, output_final_state=True,
                                                cu_seqlens=cu_t, cu_seqlens_cpu=cu_cpu)),
                    ("fla_split", "per_row", lambda: split(**args, initial_state=initial, **meta))]
            if kind == "kda":
                runs.append(("fla_kda_native_64", "per_row",
                             lambda: fla_prefill.chunk_kda_native(**args, initial_state=initial, **meta)))
            for name, mode, fn in runs:
                row = dict(op=kind, implementation=name, shape=shape, checkpoints=mode)
                with torch.inference_mode():
                    attempt(recorder, lambda: recorder.add(
                        **row, rows=lengths, num_checkpoints=int(offsets.size) if mode != "none" else 0,
                        dtype="bf16", note="host planning included" if mode != "none" else "", **torch_time(fn)),
                        **row)
            recorder.write()


def export_timing(recorder: Recorder) -> None:
    import torch

    from torch_bridge.ops.exporter import export_checkpoints

    width, head = 4, 128
    for B, T, H in DELTA_SHAPES:
        lengths = [T] * B
        shape = {"B": B, "T": T, "H": H, "K": head, "V": head, "conv_width": width}
        channels = 3 * H * head
        # a fused projection [T, q|k|v|z|b|a]: the conv input is a column band, stride(0) > D
        fused = torch.randn(B * T, channels + H * head + 2 * H, device="cuda", dtype=torch.bfloat16)
        x = fused[:, :channels]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        for mode in ("per_row", "every_1024"):
            ccu, offsets = checkpoint_lists(lengths, mode)
            M = int(offsets.size)
            slots = np.arange(1, M + 1, dtype=np.int32)
            conv_pool = torch.zeros(M + 1, channels, width - 1, device="cuda", dtype=torch.bfloat16)
            state_pool = torch.zeros(M + 1, H, head, head, device="cuda")
            states = torch.randn(M, H, head, head, device="cuda")
            args = (x, conv_pool, cu, ccu, offsets, slots)
            row = dict(op="exporter", implementation="torch_bridge.triton", shape=shape, checkpoints=mode)
            attempt(recorder, lambda: recorder.add(
                **row, rows=lengths, num_checkpoints=M, dtype="bf16 conv, fp32 state", note="host checks included",
                **torch_time(lambda: export_checkpoints(*args, conv_width=width, recurrent_checkpoints=states,
                                                        recurrent_state_pool=state_pool))), **row)
        recorder.write()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="parity")
    parser.add_argument("--only", choices=("parity", "timing", "export"))
    parser.add_argument("--ops", nargs="+", default=["gdn", "kda", "ssd"], help="the parity problems to run")
    parser.add_argument("--mosaic-rows", nargs="+", default=None,
                        help="implementation specs run instead of MOSAIC_GPU_ROWS on the GDN and KDA problems")
    args = parser.parse_args(argv)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "parity"):
        print("== parity", flush=True)
        payload = {"schema": 1, "name": args.name, **environment(), "results": parity(args.ops, args.mosaic_rows)}
        (out / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
        (out / f"{args.name}.md").write_text(parity_markdown(payload))
        print(f"wrote {out / args.name}.json/.md", flush=True)
    if args.only != "parity":
        recorder = Recorder(f"{args.name}_{args.only or 'timing'}", out)
        if args.only != "export":
            timing(recorder)
        export_timing(recorder)
        print(f"wrote {recorder.write()}", flush=True)


if __name__ == "__main__":
    main()

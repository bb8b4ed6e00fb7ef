"""Where a jitted call's wall time goes beyond its kernels: host dispatch, launch gaps, device span.

GPU: `python -m bench.latency_probe [--impls SPEC ...] [--peers jla] [--tokens 8192 varlen] [--name NAME]` writes
`<name>.json` / `.md` under $OUT, else bench/results. For each case (GDN, one row of the given tokens or `varlen`,
ops_bench's 8-row mix, 16 heads, K = V = 128, bf16, an fp32 initial state per row, one checkpoint per row for ours;
jla without checkpoints, its contract, and one row only) it reports:
- wall: median of synced calls (what `ops_bench` reports),
- dispatch: how long the Python call takes to return (host work before the launches are queued),
- pipelined: per-call time of 20 calls queued back to back, then one sync (host overhead hidden behind the GPU),
- span / kernels / busy: from a profiler trace of synced calls, per call: first kernel start to last kernel end, the
  number of GPU events, and the sum of their durations; the largest gaps between consecutive events and what follows.
wall - span is host latency before the first kernel plus the sync; span - busy is launch gaps on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import device, implementation_spec, jax_time, trace_events, versions  # noqa: E402
from bench.ops_bench import VARLEN_MIX, checkpoint_lists, delta_inputs  # noqa: E402


def _split_events(events):
    """(GPU events, the probe's per-call marks, other host events) of `trace_events`' list."""
    gpu = [(ts, dur, name) for ts, dur, name, _, on_gpu in events if on_gpu]
    marks = [(ts, dur) for ts, dur, name, _, on_gpu in events if not on_gpu and name.startswith("probe_call_")]
    host = [(ts, dur, name, where[-40:]) for ts, dur, name, where, on_gpu in events
            if not on_gpu and not name.startswith("probe_call_")]
    return gpu, marks, host


def probe(fn, args, *, reps=10):
    import jax

    result = {"wall": jax_time(fn, *args)}
    dispatch = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn(*args)
        dispatch.append((time.perf_counter() - start) * 1e3)
        jax.block_until_ready(out)
    result["dispatch_ms"] = float(np.median(dispatch))
    queued = 20
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(queued)]
        jax.block_until_ready(outs)
        timings.append((time.perf_counter() - start) * 1e3 / queued)
    result["pipelined_ms"] = float(min(timings))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for i in range(reps):
                with jax.profiler.TraceAnnotation(f"probe_call_{i}"):
                    jax.block_until_ready(fn(*args))
        gpu, marks, host = _split_events(trace_events(trace_dir))
    spans, busy, counts, gaps = [], [], [], []
    for ts, dur in marks:
        inside = [e for e in gpu if ts <= e[0] <= ts + dur]
        if not inside:
            continue
        spans.append((max(e[0] + e[1] for e in inside) - inside[0][0]) / 1e3)
        busy.append(sum(e[1] for e in inside) / 1e3)
        counts.append(len(inside))
        gaps += [((b[0] - (a[0] + a[1])) / 1e3, a[2][:50], b[2][:50]) for a, b in zip(inside, inside[1:])]
    gaps.sort(reverse=True)
    if marks:  # the last call's events, host and device, as offsets from its start (us): where the host time goes
        ts, dur = marks[-1]
        result["timeline"] = sorted(
            [(round(e[0] - ts, 1), round(e[1], 1), "gpu", e[2][:60]) for e in gpu if ts <= e[0] <= ts + dur]
            + [(round(e[0] - ts, 1), round(e[1], 1), e[3], e[2][:60]) for e in host
               if ts <= e[0] <= ts + dur and e[1] >= 2.0])
    result.update(span_ms=float(np.median(spans)) if spans else None, busy_ms=float(np.median(busy)) if busy else None,
                  events_per_call=float(np.median(counts)) if counts else None,
                  top_gaps=[{"ms": g, "after": a, "before": b} for g, a, b in gaps[:6]])
    return result


def _lengths(tokens):
    return list(VARLEN_MIX) if tokens == "varlen" else [int(tokens)]


def ours(spec, tokens, heads):
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops

    impl, kernel_options = implementation_spec(spec)
    q, k, v, g, beta, h0, cu = delta_inputs(_lengths(tokens), heads, 128, "gdn")
    ccu, offsets = checkpoint_lists(_lengths(tokens), "per_row")
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    f = jax.jit(lambda q, k, v, g, beta, h0, cu, ccu, off: ops.gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=off,
        implementation=impl, kernel_options=kernel_options))
    return f, (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0), jnp.asarray(cu),
               jnp.asarray(ccu), jnp.asarray(offsets))


def jla(tokens, heads):
    import jax
    import jax.numpy as jnp
    from jla.ops import linear_attention

    q, k, v, g, beta, h0, _ = delta_inputs([int(tokens)], heads, 128, "gdn")
    bf = lambda x: jnp.asarray(x[None], jnp.bfloat16)  # noqa: E731
    f = jax.jit(lambda q, k, v, g, beta, h0: linear_attention("gated_deltanet", q, k, v, g=g, beta=beta,
                                                              impl="mosaic_gpu", initial_state=h0,
                                                              output_final_state=True))
    return f, (bf(q), bf(k), bf(v), jnp.asarray(g[None]), jnp.asarray(beta[None]), jnp.asarray(h0))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", nargs="+", default=["pallas_mosaic_gpu@intra=mosaic_gpu"])
    parser.add_argument("--peers", nargs="*", default=["jla"])
    parser.add_argument("--tokens", nargs="+", default=["8192"], help="row lengths, or 'varlen' (ops_bench's mix)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--name", default="latency_probe")
    args = parser.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    rows = []
    cases = [(spec, lambda t, spec=spec: ours(spec, t, args.heads)) for spec in args.impls]
    cases += [("jla_mosaic_gpu", lambda t: jla(t, args.heads))] if "jla" in args.peers else []
    for tokens in args.tokens:
        for name, build in cases:
            if tokens == "varlen" and name == "jla_mosaic_gpu":
                continue  # no per-row initial states with varlen rows
            try:
                r = probe(*build(tokens))
                rows.append({"implementation": name, "tokens": tokens, "heads": args.heads, **r})
                print(f"{name} T={tokens}: wall {r['wall']['median_ms']:.3f} dispatch {r['dispatch_ms']:.3f} "
                      f"pipelined {r['pipelined_ms']:.3f} span {r['span_ms']} busy {r['busy_ms']} "
                      f"events {r['events_per_call']} gaps {r['top_gaps'][:3]}", flush=True)
            except Exception as error:  # noqa: BLE001 - record the failure and go on
                traceback.print_exc()
                rows.append({"implementation": name, "tokens": tokens, "error": f"{type(error).__name__}: {error}"[:300]})
            write(out_dir, args, rows)


def write(out_dir, args, rows):
    out_dir.mkdir(parents=True, exist_ok=True)
    command = (f"python -m bench.latency_probe --impls {' '.join(args.impls)} --peers {' '.join(args.peers)} "
               f"--tokens {' '.join(map(str, args.tokens))}")
    payload = {"schema": 1, "name": args.name, "device": device(), "versions": versions(), "command": command,
               "results": rows}
    (out_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    lines = [f"# {args.name}", "", f"device: {payload['device']}", f"versions: {payload['versions']}",
             f"command: `{command}`", "",
             "| implementation | T | wall ms | dispatch ms | pipelined ms | device span ms | kernel busy ms | events "
             "| largest gaps (ms: before kernel) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['implementation']} | {r['tokens']} | FAIL {r['error']} | | | | | | |")
            continue
        gaps = "; ".join(f"{g['ms']:.3f}: {g['before']}" for g in r["top_gaps"][:3])
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        lines.append(f"| {r['implementation']} | {r['tokens']} | {r['wall']['median_ms']:.3f} | {r['dispatch_ms']:.3f} "
                     f"| {r['pipelined_ms']:.3f} | {fmt(r['span_ms'])} | {fmt(r['busy_ms'])} | "
                     f"{fmt(r['events_per_call'])} | {gaps} |")
    (out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

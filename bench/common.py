"""Shared by every benchmark: one result schema, timers for JAX and torch, the environment record, table output.

A result file is one JSON object: {"schema": 1, "device", "versions", "command", "started", "results": [...]};
each result row: {op, implementation, shape: {B, T, H, HV, K, V, ...}, rows, checkpoints, dtype, median_ms, p20_ms,
p80_ms, n, note}. Peers timed in the same run are rows like any other (implementation "fla", "jla_mosaic_gpu", ...).
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

SCHEMA = 1


def implementation_spec(spec: str, op: str):
    """"pallas_mosaic_gpu@state=fused,pieces=2" -> ("pallas_mosaic_gpu", DeltaPallasMosaicGpuConfig(state="fused",
    pieces=2)) for op "gdn" or "kda" (SSD's configs for "ssd"): one implementation with its config, so tuning variants
    are timed in the same run as the peers. "default" -> (None, None): the call a user makes, with neither argument."""
    from jaxckpt.ops.common.configs import DELTA_CONFIGS, SSD_CONFIGS

    if spec == "default":
        return None, None
    impl, _, rest = spec.partition("@")
    if not rest:
        return impl, None
    options = {}
    for item in rest.split(","):
        key, value = item.split("=")
        try:
            options[key] = ast.literal_eval(value)  # numbers, True / False / None
        except (ValueError, SyntaxError):
            options[key] = value
    configs = SSD_CONFIGS if op == "ssd" else DELTA_CONFIGS
    if impl not in configs:
        raise ValueError(f"implementation spec {spec!r}: tuning is for one of {sorted(configs)}, got {impl!r}")
    return impl, configs[impl](**options)


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "torch", "triton", "fla", "jla", "numpy"):
        try:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "?")
        except Exception:  # noqa: BLE001 - a missing or broken peer is recorded, not fatal
            continue
    return found


def device() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """The fields every result file starts with: where it ran, on what, and the command that ran it."""
    return {"device": device(), "versions": versions(), "command": " ".join([Path(sys.executable).name, *sys.argv])}


def out_dir() -> Path:
    """Where results go: $OUT when set (the GPU machine's returned folder), else bench/results."""
    return Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")


def attempt(rec: "Recorder", run, **row) -> None:
    """Runs `run()`; a failure becomes a row (`row` plus the error) and the benchmark goes on to its next case."""
    try:
        run()
    except Exception as error:  # noqa: BLE001 - a failing case is a result, the others still run
        traceback.print_exc()
        rec.add(**row, median_ms=None, note=f"FAIL {type(error).__name__}: {str(error)[:200]}")


def cli_main(parser, run, argv=None) -> int:
    """The entry of a runner: parse, run, and turn a bad argument's ValueError into exit status 2."""
    args = parser.parse_args(argv)
    try:
        status = run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0


def jax_time(fn, *args, warmup: int = 3, reps: int = 20) -> dict:
    """Median wall time of a jitted call after `block_until_ready` (compile and warmup excluded)."""
    import jax

    jax.block_until_ready(fn(*args))
    for _ in range(warmup - 1):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return stats(times)


def trace_events(trace_dir) -> list[tuple[float, float, str, str, bool]]:
    """The complete events of the perfetto trace `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` wrote:
    (start us, duration us, name, "process thread" name, on a GPU stream), by start time."""
    import glob
    import gzip

    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not path:
        raise RuntimeError(f"no perfetto trace under {trace_dir}")
    with gzip.open(path[0], "rt") as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {e.get("pid"): e.get("args", {}).get("name", "")
                 for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        where = f"{processes.get(e.get('pid'), '')} {threads.get((e.get('pid'), e.get('tid')), '')}".lower()
        # device rows of the trace are the GPU streams; host rows (python, XLA ops launched) are not
        out.append((float(e["ts"]), float(e["dur"]), e["name"], where, "/device:gpu" in where or "stream" in where))
    return sorted(out)


def kernel_times(fn, args, *, reps: int) -> tuple[dict, float]:
    """({kernel name: ms per call}, summed kernel ms per call) from a perfetto trace of `reps` calls: the device time,
    without the host's dispatch and sync that `jax_time` includes."""
    import collections
    import tempfile

    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
        events = trace_events(trace_dir)
    totals = collections.Counter()
    for _, duration, name, _, on_gpu in events:
        if on_gpu:
            totals[name] += duration / 1e3 / reps
    return dict(totals.most_common()), float(sum(totals.values()))


def jax_pipelined(fn, *args, calls: int = 20, rounds: int = 5) -> float:
    """Time per call (ms, median over `rounds`) of `calls` jitted calls enqueued back to back and synced once: the
    host's dispatch overlaps the device's work, as in a model's forward and as `triton.testing.do_bench` times the
    torch peers (CUDA events around calls the CPU runs ahead of), unlike `jax_time`'s one synced call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return float(np.median(times))


def jax_device_fields(fn, *args, reps: int = 10, top: int = 8) -> dict:
    """device_ms (`kernel_times`' total per call), the `top` kernels by time and pipelined_ms (`jax_pipelined`): the
    fields a benchmark row of a JAX implementation carries besides its wall time."""
    kernels, device_ms = kernel_times(fn, args, reps=reps)
    largest = dict(sorted(kernels.items(), key=lambda item: -item[1])[:top])
    return {"device_ms": device_ms, "kernels": largest, "pipelined_ms": jax_pipelined(fn, *args)}


def rel_rms(actual, expected) -> float:
    """||a - b|| / ||b|| in float64 (torch tensors too); ||a|| where b is all zeros, 0 for empty arrays."""
    actual, expected = (np.asarray(x.detach().float().cpu().numpy() if hasattr(x, "detach") else x, np.float64)
                        for x in (actual, expected))
    if actual.shape != expected.shape:
        raise ValueError(f"actual: shape {actual.shape} != expected {expected.shape}")
    if not expected.size:
        return 0.0
    norm = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / norm) if norm else float(np.linalg.norm(actual))


def torch_time(fn, *, warmup_ms: int = 50, rep_ms: int = 300) -> dict:
    """triton.testing.do_bench (events, L2 flushed between runs)."""
    import triton

    median, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return {"median_ms": float(median), "p20_ms": float(p20), "p80_ms": float(p80), "n": None}


def stats(times) -> dict:
    """median, p20 and p80 (ms) and the count of a list of times in ms: the timing fields of a result row."""
    times = np.asarray(times)
    return {"median_ms": float(np.median(times)), "p20_ms": float(np.percentile(times, 20)),
            "p80_ms": float(np.percentile(times, 80)), "n": int(times.size)}


class Recorder:
    """Collects result rows and writes them (JSON + a markdown table) under `out_dir`."""

    def __init__(self, name: str, out_dir: str | os.PathLike):
        self.name = name
        self.out_dir = Path(out_dir)
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.results: list[dict] = []

    def add(self, **row):
        self.results.append(row)
        timing = f"{row['median_ms']:.3f} ms" if row.get("median_ms") is not None else row.get("note", "")
        print(f"  {row['op']:<6} {row['implementation']:<22} {json.dumps(row.get('shape'))} "
              f"ckpt={row.get('checkpoints')} {timing}", flush=True)

    def write(self) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"schema": SCHEMA, "name": self.name, **environment(), "started": self.started,
                   "results": self.results}
        path = self.out_dir / f"{self.name}.json"
        path.write_text(json.dumps(payload, indent=1))
        (self.out_dir / f"{self.name}.md").write_text(table(payload))
        return path


def table(payload: dict) -> str:
    lines = [f"# {payload['name']}", "", f"device: {payload['device']}", f"versions: {payload['versions']}",
             f"command: `{payload['command']}`", f"started: {payload['started']}", "",
             "| op | implementation | shape | checkpoints | median ms | p20 | p80 | device ms | pipelined ms "
             "| compile ms | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in payload["results"]:
        fmt = (lambda v: "" if v is None else f"{v:.3f}")
        lines.append(f"| {r['op']} | {r['implementation']} | {json.dumps(r.get('shape'))} | {r.get('checkpoints')} | "
                     f"{fmt(r.get('median_ms'))} | {fmt(r.get('p20_ms'))} | {fmt(r.get('p80_ms'))} | "
                     f"{fmt(r.get('device_ms'))} | {fmt(r.get('pipelined_ms'))} | {fmt(r.get('compile_ms'))} | "
                     f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def one_prompt_step(config, prompt, offsets: list[int]):
    """(tokens, meta, num_kv_pages, num_state_slots) of one fresh prompt in one step: KV pages 1..n, the initial state
    from slot 0, the final state to slot 1, the checkpoints at the query-relative `offsets` to slots 2, 3, ..."""
    from jaxckpt.layers import StepMetadata, pack_tokens

    num_tokens = len(prompt)
    pages = -(-num_tokens // config.block_size)
    meta = StepMetadata.build([num_tokens], context_lens=[0], block_tables=[list(range(1, pages + 1))],
                              initial_state_indices=[0], final_state_indices=[1], checkpoint_cu=[0, len(offsets)],
                              checkpoint_offsets=offsets, checkpoint_state_indices=list(range(2, 2 + len(offsets))),
                              block_size=config.block_size, num_kv_pages=pages + 1,
                              num_state_slots=len(offsets) + 2, max_model_len=config.max_model_len,
                              num_tokens=num_tokens)
    return pack_tokens([prompt], num_tokens), meta, pages + 1, len(offsets) + 2

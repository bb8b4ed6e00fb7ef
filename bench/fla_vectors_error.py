"""FLA 0.6.0's error on the shared bf16 vectors, beside ours: the measurement that settles the bf16 tolerance class.

GPU: `python -m bench.fla_vectors_error [--impls xla "pallas_mosaic_gpu@state_terms=1" ...] [--name NAME]` (writes
NAME.json, default fla_vectors_error.json, under $OUT or bench/results; `--impls` takes `bench.common`
implementation specs, `impl@option=value,...`; the JAXCKPT_IMPLS variable, comma-separated names, works too). For every
bf16 case of gdn and kda: FLA's chunk kernels on exactly the stored inputs (the KDA gate evaluated beforehand in
float64 and fed as the log decay), checkpoints through FLA the only way it can give them (a prefix-only run per
checkpoint), and jaxckpt's implementations on the same inputs; rel-RMS per tensor against the float64 expectations.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from bench.common import environment, out_dir
from tests.vectors.loader import TOLERANCES, load_cases, measure_case


def _fla_outputs(op, case):
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    from jaxckpt.ops.delta_rule.reference import kda_gate

    a = case.arguments
    cu = np.asarray(a["cu_seqlens"]) if a.get("cu_seqlens") is not None else np.array([0, a["q"].shape[0]])
    layout = a.get("state_layout", "kv")
    g = np.asarray(a["g"], np.float64)
    if op == "kda":
        g = kda_gate(a["g"], A_log=a.get("A_log"), dt_bias=a.get("dt_bias"), lower_bound=a.get("lower_bound"))
    fn = chunk_gated_delta_rule if op == "gdn" else chunk_kda
    dev = lambda x, dt: torch.from_numpy(np.ascontiguousarray(np.asarray(x, np.float32))).to("cuda", dt)  # noqa: E731
    num_rows = cu.size - 1
    num_v_heads, head_k, head_v = a["v"].shape[1], a["q"].shape[-1], a["v"].shape[-1]
    h0 = a.get("initial_state")
    h0 = np.zeros((num_rows, num_v_heads, head_k, head_v), np.float32) if h0 is None else np.asarray(h0, np.float32)
    if layout == "vk":
        h0 = np.swapaxes(h0, -1, -2)

    def call(tokens, row_cu, states):
        with torch.inference_mode():
            o, final = fn(dev(a["q"][tokens], torch.bfloat16)[None], dev(a["k"][tokens], torch.bfloat16)[None],
                          dev(a["v"][tokens], torch.bfloat16)[None], dev(g[tokens], torch.float32)[None],
                          dev(a["beta"][tokens], torch.float32)[None], scale=a.get("scale"),
                          initial_state=dev(states, torch.float32), output_final_state=True,
                          use_qk_l2norm_in_kernel=bool(a.get("use_qk_l2norm", False)),
                          cu_seqlens=torch.tensor(row_cu, device="cuda", dtype=torch.long))
        return o[0].float().cpu().numpy(), final.float().cpu().numpy()

    out = np.zeros(a["v"].shape, np.float32)
    final = h0.copy()
    rows = [n for n in range(num_rows) if cu[n + 1] > cu[n]]
    if rows:
        tokens = np.concatenate([np.arange(cu[n], cu[n + 1]) for n in rows])
        row_cu = np.concatenate([[0], np.cumsum([cu[n + 1] - cu[n] for n in rows])])
        o, f = call(tokens, row_cu, h0[rows])
        out[tokens] = o
        final[rows] = f
    ccu = np.asarray(a.get("checkpoint_cu", np.zeros(num_rows + 1, np.int32)))
    offsets = np.asarray(a.get("checkpoint_offsets", np.zeros(0, np.int32)))
    ckpt = np.zeros((offsets.size, *final.shape[1:]), np.float32)
    for n in range(num_rows):
        for j in range(ccu[n], ccu[n + 1]):
            _, f = call(np.arange(cu[n], cu[n] + offsets[j]), [0, int(offsets[j])], h0[n:n + 1])
            ckpt[j] = f[0]
    if layout == "vk":
        final, ckpt = np.swapaxes(final, -1, -2), np.swapaxes(ckpt, -1, -2)
    return out, final, ckpt


def _ours(op, case, spec):
    from bench.common import implementation_spec
    from jaxckpt import ops

    implementation, config = implementation_spec(spec, op)
    fn = ops.gated_delta_rule if op == "gdn" else ops.kda
    return [np.asarray(x, np.float32) for x in fn(**case.arguments, implementation=implementation, config=config)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", nargs="+", default=os.environ.get("JAXCKPT_IMPLS", "xla").split(","))
    parser.add_argument("--name", default="fla_vectors_error")
    args = parser.parse_args(argv)
    implementations = args.impls
    results = {**environment(), "tolerances": TOLERANCES, "cases": []}
    for op in ("gdn", "kda"):
        for case in load_cases(op):
            if case.tolerance_class != "bf16":
                continue
            entry = {"op": op, "case": case.name}
            for name, produce in [("fla", lambda: _fla_outputs(op, case))] + [
                    (impl, lambda impl=impl: _ours(op, case, impl)) for impl in implementations]:
                try:
                    report = measure_case(case, produce(), tolerance_class="bf16")
                    entry[name] = {r["tensor"]: r["rel_rms"] for r in report}
                except Exception as error:  # noqa: BLE001 - one failure must not lose the rest
                    entry[name] = f"FAIL {type(error).__name__}: {str(error)[:300]}"
            results["cases"].append(entry)
            print(json.dumps(entry), flush=True)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

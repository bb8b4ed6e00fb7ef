"""bench/ops_bench.py in its tiny CPU mode: the default call of GDN and SSD (SSD also as Mamba2's layer calls it)
and the scan peer, each row with the compile time of its first call beside its run time, in the JSON and the
table."""

import json

import pytest

from bench import ops_bench


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("ops_bench")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OUT", str(out))
        ops_bench.main(["--tiny", "--ops", "gdn", "ssd", "--impls", "default", "--modes", "none", "--peers", "scan",
                        "--shapes", "2,128,2", "--name", "ops_test"])
    return json.loads((out / "ops_test.json").read_text()), (out / "ops_test.md").read_text()


def test_every_jax_row_carries_its_compile_time(written):
    payload, _ = written
    rows = payload["results"]
    assert sorted((r["op"], r["implementation"]) for r in rows) == [
        ("gdn", "default"), ("gdn", "lax_scan_fp32"), ("ssd", "default"), ("ssd", "default"), ("ssd", "default")]
    assert sum(r["shape"].get("layer") == "D, z, dt_bias" for r in rows) == 1  # SSD as Mamba2's layer calls it
    for r in rows:
        assert not str(r.get("note", "")).startswith("FAIL"), r
        assert r["compile_ms"] == pytest.approx(r["first_call_ms"] - r["median_ms"])
        # on the CPU a compile takes 100s of ms and a tiny call a few: the first call is the compile
        assert r["compile_ms"] > 10 * r["median_ms"] > 0


def test_the_table_has_the_compile_column(written):
    payload, table = written
    header = next(line for line in table.splitlines() if line.startswith("| op |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    body = [line for line in table.splitlines() if line.startswith("| gdn |") or line.startswith("| ssd |")]
    assert len(body) == len(payload["results"])
    for line, r in zip(body, payload["results"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[columns.index("compile ms")] == f"{r['compile_ms']:.3f}"
        assert cells[columns.index("median ms")] == f"{r['median_ms']:.3f}"

"""`jaxckpt demo`, the README's main job, end to end at a small workload: parity holds and the numbers come out."""

import json

from jaxckpt.cli import main


def test_demo_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["demo", "--no-progress", "--families", "1", "--members", "2", "--conversations", "1", "--turns", "2",
                 "--unique-tails", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "parity:" in printed and "two_step" in printed and "several" in printed
    numbers = json.loads(out.read_text())
    assert numbers["parity_failures"] == 0 and numbers["max_rel_err"] < numbers["tolerance"]
    assert list(numbers["modes"]) == ["two_step", "one_checkpoint", "several"] and numbers["prompts"] == 6


def test_demo_help_and_plan_without_arguments(capsys):
    try:
        main(["demo", "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert "--plot" in capsys.readouterr().out
    assert main(["plan"]) == 0

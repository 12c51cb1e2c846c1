"""`mutualrl demo`'s command line runs what the demo declares, and refuses bad arms before writing."""

from __future__ import annotations

from mutualrl.cli import build_parser, main
from mutualrl.demo import DEMO_ARMS


def test_the_demo_command_runs_the_demo_arms_by_default():
    args = build_parser().parse_args(["demo"])
    assert args.arms.split(",") == DEMO_ARMS
    assert "imitate" in DEMO_ARMS and "independent" in DEMO_ARMS


def test_an_unknown_arm_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out), "--arms", "independent,imitat"]) == 2
    assert not out.exists()
    assert "imitat" in capsys.readouterr().err

"""``tracerl calc`` prints readable tables and JSON."""

from __future__ import annotations

import json

import pytest

from tracerl.cli import main


def test_table_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calc", "table", "--p", "0.02,0.2", "--group-sizes", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [round(row["mixed"], 3) for row in rows] == [0.149, 0.832]


def test_table_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calc", "table", "--p", "0.98", "--group-sizes", "8"]) == 0
    assert "14.9%" in capsys.readouterr().out


def test_group_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calc", "group-size", "--p", "0.2", "--fraction", "0.8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["group_size"] == 8


def test_gae_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "calc",
        "gae",
        "--rewards",
        "0,0,1",
        "--values",
        "0.9,0.3,0.8",
        "--next-values",
        "0.3,0.8,0",
        "--terminated",
        "0,0,1",
        "--trace-decay",
        "0.5",
    ]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["advantages"] == pytest.approx([-0.3, 0.6, 0.2])
    assert main(argv) == 0
    assert "-0.300" in capsys.readouterr().out


def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calc", "gae", "--rewards", "0,x", "--values", "1,1", "--next-values", "0,0"]) == 2
    assert main(["calc", "group-size", "--p", "1.5", "--fraction", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--rewards" in err[0] and "success_probability" in err[1]

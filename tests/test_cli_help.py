"""`fedsim <command> --help` prints that command's usage and exits 0, for every command and subcommand; a command
whose reader leaves the pipe ends quietly."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from jobs.cli import build_parser, main
from tests.conftest import ROOT


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the CLI, nested ones included (`results show`)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append(prefix + (name,))
                out += _commands(sub, prefix + (name,))
    return out


COMMANDS = _commands(build_parser())


def test_the_cli_has_its_commands():
    assert {("run",), ("stress",), ("sweep",), ("results", "show"), ("config-reference",)} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    assert out.out.startswith(f"usage: fedsim {' '.join(command)}") and out.err == ""


def test_stress_arguments_reach_its_own_parser(capsys):
    with pytest.raises(SystemExit) as done:
        main(["stress", "--clients", "10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and err == ["fedsim stress: error: the following arguments are required: config"]


@pytest.mark.parametrize("command", [["config-reference"], ["mechanism-reference"]])
def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(command):
    """`fedsim config-reference | head -1`: the reader closes the pipe before fedsim writes; no traceback follows."""
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", *command], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before anything is written: every write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and err == "", err

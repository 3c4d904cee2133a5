"""`fedsim <command> --help` prints that command's usage and exits 0, for every command and subcommand."""

from __future__ import annotations

import argparse

import pytest

from jobs.cli import build_parser, main


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

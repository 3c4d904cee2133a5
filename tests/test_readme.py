"""Every config key, file, command and config file that README.md and the docs pages name exists and loads: a
renamed key or a moved file fails here instead of in front of a user. (tests/test_docs.py runs their code blocks.)"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from fedsim.config.knobs import describe
from fedsim.config.schema import RunConfig
from fedsim.configure import load_config
from fedsim.errors import FedsimError
from fedsim.method.contract import algorithm_names
from jobs.cli import build_parser
from jobs.readme_blocks import doc_pages
from tests.conftest import ROOT

REPO = Path(ROOT)
GENERATED = {"config.md", "mechanism.md"}  # written from the code itself: every key there exists
TEXT = "\n".join(p.read_text(encoding="utf-8") for p in doc_pages(REPO) if p.name not in GENERATED)
SPANS = re.findall(r"`([^`\n]+)`", TEXT)
BLOCK_LINES = [line.strip() for block in re.findall(r"```[a-z]*\n(.*?)```", TEXT, re.S) for line in block.splitlines()]
SECTIONS = {f.name for f in dataclasses.fields(RunConfig)}


def _config_spans() -> list[tuple[str, str | None]]:
    out = []
    for span in SPANS:
        m = re.fullmatch(r"([a-z_]+(?:\.[a-z_0-9]+)+)(?:\s*[:=]\s*(.+))?", span)
        if m and m.group(1).split(".")[0] in SECTIONS and not re.search(r"\.(parquet|yaml|json|py|png|pt|md)$", span):
            out.append((m.group(1), m.group(2)))
    return sorted(set(out), key=str)


def _known_keys() -> set[str]:
    keys = {row[0] for row in describe(RunConfig)}
    from fedsim.method.contract import get_algorithm

    for name in algorithm_names():
        keys |= {f"algorithm.{row[0]}" for row in describe(get_algorithm(name).Params)}
    return keys


COMPANIONS = [["algorithm.name=fedasync"], ["data.name=synthetic"],
              ["data.options={path: data, preset: flwrlabs/femnist}"], ["data.partition.kind=natural_id"]]


def _loads(key: str, value: str) -> bool:
    """Whether `key=value` loads, for some algorithm (or model) when the key is an algorithm's (a model's)."""
    from fedsim.models.registry import model_names

    if key.startswith("algorithm.") and key != "algorithm.name":
        contexts = [[f"algorithm.name={name}"] for name in algorithm_names()]
    elif key.startswith("model.options"):
        contexts = [[f"model.name={name}"] for name in model_names()]
    else:  # the values that only load beside another key the docs name with them
        contexts = [[], *COMPANIONS]
    for context in contexts:
        try:
            load_config(None, context + [f"{key}={value}"])
            return True
        except FedsimError:
            continue
    return False


@pytest.mark.parametrize("key,value", _config_spans(), ids=lambda v: str(v))
def test_every_config_key_named_exists_and_its_value_loads(key, value) -> None:
    known = _known_keys()
    free = ("data.options.", "model.options.")  # loader/builder options: checked by loading them below
    assert key in known or any(k.startswith(key + ".") for k in known) or key.startswith(free), \
        f"the docs name unknown key {key!r}"
    if value is not None:
        assert _loads(key, value), f"the docs' `{key}: {value}` does not load"


def _commands() -> list[str]:
    # every `python ...` span: a script path (`python bench/x.py`) fails where the folder is not an installed package
    inline = [s for s in SPANS if re.match(r"(python |fedsim |make |OMP_NUM_THREADS=1 python )", s)]
    block = [line.split("  #")[0].split(" # ")[0].strip() for line in BLOCK_LINES
             if re.match(r"(python -m |fedsim |make )", line)]
    return sorted(set(inline + block))


COMMANDS = _commands()


def test_the_readme_names_commands() -> None:
    assert any(c.startswith("make run") for c in COMMANDS) and any(c.startswith("fedsim run") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_names_a_real_entry_point_and_real_files(command, isolated) -> None:
    words = shlex.split(command.replace("\\", " "))
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # environment assignments
    if words[0] == "make":
        targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
        assert all(t in targets for t in words[1:]), f"{command}: no such make target"
        return
    if words[0] == "fedsim":
        sub = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse keeps them here)
        assert words[1] in sub, f"{command}: no such fedsim command"
        args = words[2:]
    else:
        assert words[:2] == ["python", "-m"], f"{command}: run it as `python -m <module>`, which works from the clone"
        assert importlib.util.find_spec(words[2]) is not None, f"{command}: no module {words[2]}"
        args = words[3:]
    overrides = [a for prev, a in zip(args, args[1:]) if prev == "-o"]
    sweep = words[:2] == ["fedsim", "sweep"] or words[2:3] == ["jobs.sweep"]
    for arg in args:
        if "<" in arg or arg.startswith("results/") or arg.startswith("/"):
            continue  # a placeholder, or an output the command writes
        if arg.endswith((".yaml", ".yml")):
            assert glob.glob(str(REPO / arg)), f"{command}: {arg} does not exist"
            if "*" in arg or "reproduce" in arg:
                continue
            if sweep:  # every run the sweep plans loads
                from jobs.sweep import load_sweep, plan

                for run in plan(load_sweep(REPO / arg), REPO / arg):
                    load_config(run["config"], run["overrides"])
            else:
                load_config(REPO / arg, overrides)  # the config and its -o overrides load


def test_every_file_the_docs_name_exists() -> None:
    named = {s for s in SPANS if re.match(r"(configs|bench|jobs|fedsim|docs|tests|actors|examples|results)/\S*$", s)
             and not re.match(r"results/(?!README|bench/|reproduce/)", s)}  # results/<run>: what a run writes
    assert len(named) > 20  # the pages' paths were found: the check below has something to check
    missing = [p for p in named if "<" not in p and not glob.glob(str(REPO / p))]
    assert not missing, f"the docs name missing files: {missing}"


def test_every_link_between_pages_finds_its_page() -> None:
    """The README's links into docs/ (the site's own links are checked by `mkdocs build --strict`)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) > 10
    assert not [link for link in links if not (REPO / link).is_file()], links

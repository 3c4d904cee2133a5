"""README.md and the docs pages: every code block runs here or is marked `<!-- not run -->` on the line before it;
the generated reference pages stay in step with the code; the method guide quotes FedAvg as it is."""

from __future__ import annotations

import glob
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from jobs.readme_blocks import doc_pages
from tests.conftest import ROOT
from tests.forked import run_module

REPO = Path(ROOT)
NOT_RUN = "<!-- not run -->"
FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, from 1
    lang: str
    text: str
    marked: bool  # `<!-- not run -->` on the line before the fence

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def code_blocks(page: Path, root: Path = REPO) -> list[Block]:
    """Every fenced code block of a page, with its language and whether it is marked as not run."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == m[2]), None)
        assert end is not None, f"{page}:{i + 1}: a code block that is never closed"
        body = "\n".join(line[len(m[1]):] for line in lines[i + 1:end])
        marked = i > 0 and lines[i - 1].strip() == NOT_RUN
        out.append(Block(str(page.relative_to(root)), i + 1, m[3].strip().split(" ")[0], body + "\n", marked))
        i = end + 1
    return out


BLOCKS = [b for page in doc_pages(REPO) for b in code_blocks(page)]
RUN = [b for b in BLOCKS if not b.marked]
CHECKABLE = ("fedsim ", "python -m ", "make ")


def commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and environment assignments dropped."""
    text = block.text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
        line = re.sub(r"^(?:[A-Z_]+=\S*\s+)+", "", line)
        if line:
            out.append(line)
    return out


def test_the_pages_have_blocks_of_every_kind_checked() -> None:
    assert len(BLOCKS) > 20 and {"bash", "python"} <= {b.lang for b in RUN}
    assert any(b.marked for b in BLOCKS)
    assert any(b.page == "README.md" for b in RUN)


def unrunnable(blocks: list[Block]) -> list[str]:
    """The unmarked blocks this file cannot exercise: another language than Python or shell, or a shell line that is
    not a fedsim, `python -m` or make command."""
    problems = []
    for b in blocks:
        if b.marked:
            continue
        if b.lang == "python":
            continue
        if b.lang not in ("bash", "sh", "shell"):
            problems.append(f"{b}: a {b.lang or 'plain'} block")
            continue
        problems += [f"{b}: `{c}` is not a fedsim, `python -m` or make command" for c in commands(b)
                     if not c.startswith(CHECKABLE)]
    return problems


def test_every_block_runs_here_or_is_marked_not_run() -> None:
    problems = unrunnable(BLOCKS)
    assert not problems, f"mark these blocks `{NOT_RUN}` on the line before them, or make them runnable: {problems}"


def test_the_check_catches_an_unmarked_block_it_cannot_run(tmp_path) -> None:
    page = tmp_path / "docs" / "_probe.md"
    page.parent.mkdir()
    page.write_text("text\n\n```bash\nray up ray_cluster.yaml\n```\n\n<!-- not run -->\n```yaml\na: 1\n```\n")
    blocks = code_blocks(page, tmp_path)
    assert [(b.lang, b.marked, b.line) for b in blocks] == [("bash", False, 3), ("yaml", True, 8)]
    assert unrunnable(blocks) == ["docs/_probe.md:3: `ray up ray_cluster.yaml` is not a fedsim, `python -m` or make "
                                  "command"]


COMMANDS = sorted({c: str(b) for b in reversed(RUN) if b.lang in ("bash", "sh", "shell") for c in commands(b)
                   if c.startswith(CHECKABLE)}.items())  # each command once, with the first place it is shown


@pytest.mark.parametrize("command,where", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_every_command_parses_and_names_real_files(command, where, isolated) -> None:
    """make: the target exists. fedsim and `python -m`: the command's own parser accepts its arguments (the
    command stops there: tests/parse_only.py), and every config it names loads with its `-o` overrides."""
    words = shlex.split(command)
    if words[0] == "make":
        targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
        assert all(w in targets or re.fullmatch(r"[A-Z_]+=\S*", w) for w in words[1:]), f"{where}: {command}"
        return
    module, args = ("jobs.cli", words[1:]) if words[0] == "fedsim" else (words[2], words[3:])
    proc = run_module("tests.parse_only", [module, *args], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("parsed"), \
        f"{where}: `{command}` does not parse: {proc.stderr.strip()[-500:]}"
    _configs_load(command, words, args, where)


def _configs_load(command: str, words: list[str], args: list[str], where: str) -> None:
    from fedsim.configure import load_config

    overrides = [a for prev, a in zip(args, args[1:]) if prev == "-o"]
    sweep = words[:2] == ["fedsim", "sweep"] or words[2:3] == ["jobs.sweep"]
    for arg in args:
        if not arg.endswith((".yaml", ".yml")) or arg.startswith(("results/", "/")) or "<" in arg:
            continue
        assert glob.glob(str(REPO / arg)), f"{where}: `{command}`: {arg} does not exist"
        if "*" in arg or arg == "ray_cluster.yaml":
            continue
        if sweep:  # every run the sweep plans loads
            from jobs.sweep import load_sweep, plan

            for run in plan(load_sweep(REPO / arg), REPO / arg):
                load_config(run["config"], run["overrides"])
        elif words[2:3] != ["jobs.dosfl_compare"] and "reproduce" not in arg:
            load_config(REPO / arg, overrides)


def test_a_command_with_a_bad_argument_fails_the_check() -> None:
    with pytest.raises(AssertionError, match="does not parse"):
        test_every_command_parses_and_names_real_files("fedsim run configs/demo.yaml --no-such-flag", "probe", None)
    with pytest.raises(AssertionError, match="does not parse"):
        test_every_command_parses_and_names_real_files("python -m bench.report --repeat 3", "probe", None)


PYTHON = [b for b in RUN if b.lang == "python"]


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_every_python_block_runs(block, isolated, tmp_path, monkeypatch) -> None:
    """Each block as a user runs it from a clone: in a folder with the repository's configs beside it (a plugin it
    imports, the example method's, is gone again after)."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, str(block), "exec"), {"__name__": "__docs__"})


def test_the_readme_stays_a_front_page() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail into the docs pages"


def test_config_reference_is_current():
    proc = run_module("jobs.cli", ["config-reference"])
    assert proc.returncode == 0, proc.stderr
    assert "train.lr" in proc.stdout and "data.partition.alpha" in proc.stdout  # a reference, not an empty page
    doc = (REPO / "docs" / "config.md").read_text()
    assert proc.stdout.strip() in doc, "docs/config.md is stale: regenerate it with `make docs`"


def _python_blocks(page: str) -> list[str]:
    return [b.split("\n", 1)[1] for b in page.split("```")[1::2] if b.startswith("python")]


def test_the_method_page_quotes_fedavg_as_it_is_and_names_real_handlers():
    """docs/writing-a-method.md: every statement of its FedAvg excerpt is in fedavg.py, and every handler its
    several-phase example names is a method of FedMD, whose phases it shows."""
    from fedsim.algorithms.fedmd import FedMD

    page = (REPO / "docs" / "writing-a-method.md").read_text()
    blocks = _python_blocks(page)
    fedavg_block = next(b for b in blocks if "class FedAvg(Algorithm)" in b)
    phases_block = next(b for b in blocks if "def phases(self, round)" in b and "share" in b)
    source = " ".join((REPO / "fedsim" / "algorithms" / "fedavg.py").read_text().split())
    for line in fedavg_block.splitlines():
        code = line.split("#")[0].strip()
        if code and not code.startswith(("def ", "@", "class ")):
            assert " ".join(code.split()) in source, f"docs/writing-a-method.md quotes a line fedavg.py lacks: {code}"
    handlers = re.findall(r'(?:broadcast|client|server)="(\w+)"', phases_block)
    assert len(handlers) >= 6 and all(callable(getattr(FedMD, h, None)) for h in handlers), handlers
    assert "def phases(self, round)" in phases_block
    fedmd = " ".join((REPO / "fedsim" / "algorithms" / "fedmd.py").read_text().split())
    assert all(f'"{h}"' in fedmd for h in handlers)

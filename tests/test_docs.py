"""The generated config reference stays in step with the code."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT
from tests.forked import run_module


def test_config_reference_is_current():
    proc = run_module("jobs.cli", ["config-reference"])
    assert proc.returncode == 0, proc.stderr
    assert "train.lr" in proc.stdout and "runtime.exact_sum" in proc.stdout  # a reference, not an empty page
    doc = (Path(ROOT) / "docs" / "config.md").read_text()
    assert proc.stdout.strip() in doc, "docs/config.md is stale: regenerate it with `fedsim config-reference`"


def _python_blocks(page: str) -> list[str]:
    return [b.split("\n", 1)[1] for b in page.split("```")[1::2] if b.startswith("python")]


def test_the_method_page_quotes_fedavg_as_it_is_and_names_real_handlers():
    """docs/writing-a-method.md: every statement of its FedAvg excerpt is in fedavg.py, and every handler its
    several-phase example names is a method of FedMD, whose phases it shows."""
    import re

    from fedsim.algorithms.fedmd import FedMD

    page = (Path(ROOT) / "docs" / "writing-a-method.md").read_text()
    fedavg_block, phases_block = _python_blocks(page)[:2]
    source = " ".join((Path(ROOT) / "fedsim" / "algorithms" / "fedavg.py").read_text().split())
    for line in fedavg_block.splitlines():
        code = line.split("#")[0].strip()
        if code and not code.startswith(("def ", "@", "class ")):
            assert " ".join(code.split()) in source, f"docs/writing-a-method.md quotes a line fedavg.py lacks: {code}"
    handlers = re.findall(r'(?:broadcast|client|server)="(\w+)"', phases_block)
    assert len(handlers) >= 6 and all(callable(getattr(FedMD, h, None)) for h in handlers), handlers
    assert "def phases(self, round)" in phases_block
    fedmd = " ".join((Path(ROOT) / "fedsim" / "algorithms" / "fedmd.py").read_text().split())
    assert all(f'"{h}"' in fedmd for h in handlers)

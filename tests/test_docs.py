"""The generated config reference stays in step with the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_config_reference_is_current():
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "config-reference"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = (Path(ROOT) / "docs" / "config.md").read_text()
    assert proc.stdout.strip() in doc, "docs/config.md is stale: regenerate it with `fedsim config-reference`"

"""Installs: fedsim imports and runs without its optional FAISS and MedMNIST, what needs one names the extra to
install, and the extras of setup.cfg resolve against the package index (the GPU one without installing it)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from configparser import ConfigParser
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from fedsim.errors import MissingExtraError
from fedsim.extras import DISTRIBUTION, install_hint
from jobs.cli import main
from tests.conftest import ROOT

WITHOUT_EXTRAS = """
import sys
sys.modules["faiss"] = None      # as if faiss-cpu were not installed: `import faiss` fails, find_spec says None
sys.modules["medmnist"] = None
import fedsim, fedsim.algorithms, fedsim.data.datasets, fedsim.algorithms._selection
from fedsim.configure import load_config
from fedsim.data.registry import dataset_names
cfg = load_config(None, ["rounds=1"])
print(cfg.algorithm.name, "pathmnist" in dataset_names(), "faiss" in sys.modules and sys.modules["faiss"] is not None)
try:
    load_config(None, ["data.name=pathmnist"])
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_fedsim_imports_without_faiss_and_medmnist_and_names_the_extra():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = proc.stdout.strip().splitlines()
    assert first == "fedavg True False"  # the default config loads; MedMNIST names stay known; faiss never imported
    assert second == ('MissingExtraError data.name: pathmnist needs medmnist, which is not installed: '
                      f'pip install "{DISTRIBUTION}[medmnist]"')


def test_kmeans_without_faiss_names_the_extra(monkeypatch):
    from fedsim.algorithms._selection import kmeans_distances

    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(MissingExtraError, match=r'algorithm.selection.kmeans\) needs faiss, which is not installed: '
                                                r'pip install "fedsim-ray\[faiss\]"'):
        kmeans_distances(np.zeros((8, 2), dtype=np.float32), 2, 5, 0)


def test_a_method_that_needs_faiss_stops_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "faiss", None)
    config = Path(ROOT) / "configs" / "single_image" / "embedded.base.yaml"
    code = main(["run", str(config), "--backend", "local", "--quiet", "-o", "rounds=1", "-o",
                 f"results.root={tmp_path}", "-o", "data.num_clients=4", "-o", "participation.clients_per_round=2",
                 "-o", "algorithm.pool_size=200", "-o", "algorithm.selection.n=20", "-o", "algorithm.selection.k=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"fedsim: error: KMeans selection (algorithm.selection.kmeans) needs faiss, which is "
                                 f"not installed: {install_hint('faiss')}"]


def test_a_broken_optional_package_is_not_called_missing(monkeypatch, tmp_path):
    from fedsim.extras import require

    package = tmp_path / "halfbroken"
    package.mkdir()
    (package / "__init__.py").write_text("import a_dependency_that_is_gone\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtraError, match="installed but fails to import .*a_dependency_that_is_gone"):
        require("halfbroken", "faiss", "x")


def _extras() -> dict[str, list[str]]:
    parser = ConfigParser()
    parser.read(Path(ROOT) / "setup.cfg")
    raw = parser["options.extras_require"]
    return {k: [line.strip() for line in raw[k].splitlines() if line.strip()] for k in raw}


def test_extras_declare_the_optional_dependencies():
    parser = ConfigParser()
    parser.read(Path(ROOT) / "setup.cfg")
    assert parser["metadata"]["name"] == DISTRIBUTION
    required = parser["options"]["install_requires"]
    assert "faiss" not in required and "medmnist" not in required
    extras = _extras()
    assert extras["faiss"] == ["faiss-cpu>=1.8"] and extras["medmnist"] == ["medmnist>=3.0"]
    assert set(extras["faiss"] + extras["medmnist"]) <= set(extras["all"])
    assert extras["tff"] == ["h5py>=3.8"] and {"h5py>=3.8"} <= set(extras["all"]) & set(extras["dev"])
    assert "h5py" not in required
    # faiss-gpu and faiss-cpu install the same `faiss` module: [gpu] must not bring faiss-cpu, nor [all] faiss-gpu
    assert not any("faiss-cpu" in r for r in extras["gpu"]) and not any("gpu" in r for r in extras["all"])
    makefile = (Path(ROOT) / "Makefile").read_text()
    assert '-e ".[all,dev,docs]"' in makefile


@pytest.mark.slow
def test_the_gpu_extra_resolves_against_the_index_without_installing(tmp_path):
    """`pip install --dry-run` of the project with [gpu], against this environment: it resolves, takes faiss-gpu and
    no faiss-cpu, and does not replace the installed torch (no GPU wheel is installed). ([all] is what `make`
    installs, so every setup resolves it.)"""
    probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "faiss-gpu"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("the package index is not reachable from here")
    project = tmp_path / "project"
    (project / "fedsim").mkdir(parents=True)
    for name in ("setup.cfg", "pyproject.toml", "README.md", "fedsim/__init__.py"):
        shutil.copy(Path(ROOT) / name, project / name)
    report = tmp_path / "report.json"
    # the installed setuptools builds the project's metadata when there is one (Python 3.12's venvs have none)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", *isolation,
                           "--report", str(report), f"{project}[gpu]"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    items = json.loads(report.read_text())["install"]
    names = {item["metadata"]["name"].lower() for item in items}
    assert DISTRIBUTION in names and "torch" not in names
    ours = next(item["metadata"] for item in items if item["metadata"]["name"].lower() == DISTRIBUTION)
    wanted = {Requirement(r).name.lower() for r in ours.get("requires_dist", [])
              if Requirement(r).marker is None or Requirement(r).marker.evaluate({"extra": "gpu"})}
    # faiss-gpu comes from the index; faiss-cpu is not asked for (it is installed here anyway)
    assert "faiss-gpu" in names and "faiss-gpu" in wanted and "faiss-cpu" not in wanted

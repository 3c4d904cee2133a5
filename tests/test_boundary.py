"""The library boundary: fedsim/ never imports ray, every module imports cleanly, the public API is fixed."""

from __future__ import annotations

import subprocess
import sys

import fedsim
from tests.conftest import ROOT

IMPORT_ALL = """
import importlib, pkgutil, sys
sys.modules["ray"] = None  # any `import ray` inside fedsim now fails
import fedsim
mods = [m.name for m in pkgutil.walk_packages(fedsim.__path__, "fedsim.")]
for name in mods:
    importlib.import_module(name)
from fedsim import registry
for kind in registry.KINDS:
    registry.load_builtins(kind)
assert not registry.import_failures, registry.import_failures
print(len(mods))
"""


def test_fedsim_never_imports_ray():
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip()) > 20


def test_public_api():
    assert sorted(fedsim.__all__) == sorted(["RunConfig", "load_config", "run", "load", "collect",
                                             "partition_report", "FedsimError", "ConfigError", "DataError",
                                             "__version__"])
    for name in fedsim.__all__:
        assert hasattr(fedsim, name)


WORKER_IMPORTS = """
import sys
import actors.client_worker
from fedsim.method.contract import get_algorithm
for name in ("fedavg", "fedprox", "feddf", "single_image", "dafkd", "fedgdkd", "dosfl"):
    get_algorithm(name)
print(" ".join(m for m in ("pandas", "pyarrow", "torchvision", "sklearn", "faiss", "matplotlib") if m in sys.modules))
"""


def test_client_workers_import_no_driver_libraries():
    # every worker process pays for what it imports (torchvision alone is ~170 MB RSS, pandas ~100 MB)
    proc = subprocess.run([sys.executable, "-c", WORKER_IMPORTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ""

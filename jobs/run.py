"""Entry point that `ray job submit --working-dir . -- python -m jobs.run CONFIG` runs on a cluster.

Same arguments as `fedsim run`; inside a Ray job it joins the job's cluster (RAY_ADDRESS). The job's driver runs on
the head with the head's Python, so a head without fedsim's dependencies gets one line naming the fix, not a
traceback from deep inside the first import.
"""

from __future__ import annotations

import importlib.util
import sys

REQUIRED = ("yaml", "numpy", "pandas", "pyarrow", "torch", "ray")
"""The modules every run imports (pyproject's core dependencies), checked before anything is imported."""

NOT_INSTALLED = ("fedsim: error: this Python ({python}) cannot import {module}: a job's driver runs on the head with "
                 "the head's Python; install fedsim there (`pip install fedsim-ray`, as ray_cluster.yaml's "
                 "setup_commands do), or add it to the job: --runtime-env-json '{{\"pip\": [\"fedsim-ray\"]}}'")


def missing_module() -> str | None:
    """The first of REQUIRED this Python cannot import (None when it has them all)."""
    for name in REQUIRED:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            return name
    return None


if __name__ == "__main__":
    module = missing_module()
    if module is not None:
        print(NOT_INSTALLED.format(python=sys.executable, module=module), file=sys.stderr)
        sys.exit(2)
    from jobs.cli import main

    sys.exit(main(["run", *sys.argv[1:]], own_process=True))

"""Ships a run's plugins (fedsim.plugins) to its Ray workers through the job's runtime environment.

Each plugin file or package folder goes in the job's `py_modules`, the way Ray carries local code to
workers on every node; the actors then import it by module name before they build anything. Ray takes
local paths at the job level only, so this is passed to `ray.init` where fedsim starts or joins Ray. Modules
a submitted job already ships (`ray job submit --py-modules`) are kept beside them.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from fedsim.plugins import shipped_paths

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job manager in a submitted job's driver
OVERRIDE_VAR = "RAY_OVERRIDE_JOB_RUNTIME_ENV"  # lets ray.init's py_modules replace the job's (we pass both)


def job_runtime_env(*configs: RunConfig) -> dict[str, Any] | None:
    """The runtime_env for `ray.init` that carries the plugins of these runs to every worker, or None without any."""
    paths = list(dict.fromkeys(p for cfg in configs for p in shipped_paths(cfg.plugins)))
    if not paths:
        return None
    inherited = list(_submitted_job_env().get("py_modules") or [])
    if inherited:
        os.environ[OVERRIDE_VAR] = "1"  # Ray refuses two py_modules lists unless told to take ours, which has both
    return {"py_modules": inherited + paths}


def _submitted_job_env() -> dict[str, Any]:
    """The runtime_env `ray job submit` gave this driver ({} outside a submitted job)."""
    try:
        return json.loads(os.environ.get(JOB_CONFIG_VAR, "{}")).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return {}

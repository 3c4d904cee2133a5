"""Waiting for the autoscaler: a run on a cluster joined by address that asks for more workers than fit now requests
the missing resources (`ray.autoscaler.sdk.request_resources`) and waits up to runtime.autoscale_timeout_s,
printing a progress line, before it fails with one line. A Ray that this driver started itself has no autoscaler,
so there the run fails at once.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import ray

from actors.placement import cluster_nodes, size_pool, worker_bundle
from fedsim.errors import ResourceError

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

log = logging.getLogger("fedsim.cluster")

PROGRESS_EVERY_S = 10.0


def joined_cluster() -> bool:
    """Whether this driver runs on a Ray that fedsim did not start for it (a cluster an autoscaler may grow)."""
    from actors.boot import started_here

    return not started_here()


def fitting_workers(cfg: RunConfig) -> tuple[int, str]:
    """How many client workers fit on the alive nodes now, and why none does (empty when some do)."""
    try:
        return size_pool(cfg, cluster_nodes()), ""
    except ResourceError as exc:
        return 0, str(exc)


def await_workers(cfg: RunConfig, wanted: int | None, poll_s: float = 1.0) -> int:
    """The number of workers that fit once at least `wanted` (else runtime.num_workers, else one) do, after asking
    the autoscaler for them; a ResourceError naming the knobs when they do not come in time. Inside a placement
    group (0 is returned) the group is the run's share and nothing is asked for."""
    rt = cfg.runtime
    if ray.util.get_current_placement_group() is not None:  # a Tune trial's share: sized by its group alone
        return 0
    need = min(wanted or rt.num_workers or 1, cfg.data.num_clients)
    fits, why = fitting_workers(cfg)
    if fits >= need:
        return fits
    limit = rt.autoscale_timeout_s if joined_cluster() else 0.0
    if limit > 0:
        bundles = [worker_bundle(rt)] * need
        if rt.server_cpus > 0 or rt.server_gpus > 0:
            bundles.append({k: float(v) for k, v in (("CPU", rt.server_cpus), ("GPU", rt.server_gpus)) if v > 0})
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
        start = last = time.monotonic()
        log.warning("waiting up to runtime.autoscale_timeout_s=%s for the autoscaler: %d client workers fit, "
                    "%d asked for", limit, fits, need)
        try:
            while fits < need and time.monotonic() - start < limit:
                time.sleep(min(poll_s, max(0.0, limit - (time.monotonic() - start))))
                fits, why = fitting_workers(cfg)
                if fits < need and time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    log.warning("still waiting for the autoscaler (%.0f of %s s): %d of %d client workers fit",
                                last - start, limit, fits, need)
        finally:
            request_resources(bundles=[])  # the request stands until withdrawn: a run never holds more than it uses
        if fits >= need:
            log.warning("the cluster holds %d client workers after %.0f s", fits, time.monotonic() - start)
            return fits
    waited = f" after waiting runtime.autoscale_timeout_s={limit}" if limit > 0 else ""
    if why:
        raise ResourceError(f"{why}{waited}")
    capped = need < (wanted or rt.num_workers or 1)
    used = f" ({need} of them used: one per client, data.num_clients={need})" if capped else ""
    raise ResourceError(f"{asked_for(cfg, wanted)}{used} but only {fits} workers fit with runtime.client_cpus="
                        f"{rt.client_cpus} and runtime.client_gpus={rt.client_gpus}{waited}")


def asked_for(cfg: RunConfig, wanted: int | None) -> str:
    """The worker count as the user asked for it: the --workers flag (fedsim.run's workers=) over the config's key."""
    if wanted:
        return f"--workers {wanted}"
    return f"runtime.num_workers={cfg.runtime.num_workers}" if cfg.runtime.num_workers else "one client worker"

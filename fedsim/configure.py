"""From YAML to a validated RunConfig: the one place that resolves names (algorithms, datasets, models, plugins).

fedsim.config.schema holds the schema, a leaf that the trainers read; this module sits on top and may import the
registry, the plugins and the data and model checks.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from fedsim.config import yaml_dialect
from fedsim.config.knobs import from_dict
from fedsim.config.schema import (
    RETIRED,
    AlgorithmConfig,
    RunConfig,
    apply_overrides,
    check_folder_name,
    check_overrides,
    config_to_dict,
    read_yaml,
)
from fedsim.errors import ConfigError
from fedsim.persist.io import atomic_write_text
from fedsim.persist.storage import StorePath, location
from fedsim.plugins import load_plugins

log = logging.getLogger("fedsim.config.schema")


def build_config(raw: dict) -> RunConfig:
    """Validate a raw dict into a RunConfig, including the algorithm's own params. The common sections come first:
    they need no registry, so a typo there is reported before the methods (and torch) are imported."""

    raw = copy.deepcopy(raw)
    for section, keys in RETIRED.items():
        for key in keys:
            if isinstance(raw.get(section), dict) and key in raw[section]:
                del raw[section][key]
                log.warning("%s.%s is retired (see the performance docs) and is ignored", section, key)
    load_plugins(raw.get("plugins"))  # before anything looks a name up in a registry
    algo_raw = raw.pop("algorithm", {}) or {}
    if not isinstance(algo_raw, dict):
        raise ConfigError("algorithm: expected a mapping with a name and the method's parameters")
    name = algo_raw.pop("name", "fedavg")
    if not isinstance(name, str):
        raise ConfigError(f"algorithm.name: expected a string, got {name!r}"[:200])
    cfg = from_dict(RunConfig, raw)
    from fedsim.method.contract import get_algorithm  # imports torch: after the sections that need no registry

    algo_cls = get_algorithm(name)
    params = from_dict(algo_cls.Params, algo_raw, prefix="algorithm")
    cfg.algorithm = AlgorithmConfig(name=name, params=params)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults), apply overrides, validate."""
    check_overrides(overrides or [])
    raw = apply_overrides(read_yaml(path) if path is not None else {}, overrides or [])
    return build_with_plugins(raw, _config_folder(path))


def build_with_plugins(raw: dict[str, Any], base: Path) -> RunConfig:
    """build_config after the `plugins` entries are resolved against `base` (where relative paths start), so the
    config names each plugin by its absolute path and a Ray job or a resume elsewhere finds it."""
    if raw.get("plugins") is not None:
        from fedsim.plugins import resolve

        raw["plugins"] = resolve(raw["plugins"], base)
    return build_config(raw)


def _config_folder(path: str | Path | None) -> Path:
    """The folder a config's relative plugin paths start from: the file's own, else the working directory."""
    if path is None or "://" in str(path):
        return Path.cwd()
    return Path(path).resolve().parent


def validate(cfg: RunConfig) -> None:
    """Cross-section checks that a single dataclass cannot see; converts data and model options in place."""
    n = cfg.data.num_clients
    k = cfg.participation.clients_per_round
    if k is not None and k > n:
        raise ConfigError(f"participation.clients_per_round: {k} exceeds data.num_clients={n}")
    if cfg.model.mix and sum(cfg.model.mix.values()) != n:
        raise ConfigError(f"model.mix: counts sum to {sum(cfg.model.mix.values())}, "
                          f"but data.num_clients is {n}")
    s = cfg.stragglers
    if s.deadline == "quantile" and not 0 < s.deadline_value <= 1:
        raise ConfigError(f"stragglers.deadline_value: with deadline: quantile it is a quantile in (0, 1], "
                          f"got {s.deadline_value}")
    if cfg.participation.sampling == "poisson" and s.enabled and s.over_select > 0:
        raise ConfigError("stragglers.over_select: with participation.sampling: poisson the cohort is kept whole; "
                          "set it to 0")
    from fedsim.method.asynchronous import check_mode

    check_mode(cfg)  # a method built for one participation.mode refuses the other
    check_folder_name("name", cfg.name, max_len=200)  # the run folder is <name>-<timestamp>
    if cfg.results.run_id is not None:
        check_folder_name("results.run_id", cfg.results.run_id, max_len=255)
    from fedsim.data.flower_partition import check_partition
    from fedsim.data.generated import check_generated  # imports torch: after the checks that need no registry
    from fedsim.data.registry import check_options
    from fedsim.models.registry import check_model_options

    check_generated(cfg)  # first: with generated shards the options are the synthetic set's
    check_partition(cfg)
    if cfg.data.partition.kind == "generated":
        from fedsim.method.contract import get_algorithm

        key = get_algorithm(cfg.algorithm.name).pooled_data_key(cfg)
        if key is not None:
            raise ConfigError(f"{key}: with it {cfg.algorithm.name}'s server reads the clients' pooled training data, "
                              "which generated shards (data.partition.kind: generated) do not hold; change it or use "
                              "a fixed dataset")
    if cfg.privacy.level != "none" or cfg.privacy.secure_aggregation != "none" or cfg.attack.kind != "none" or \
            cfg.aggregator.name != "mean" or cfg.compression.kind != "none" or cfg.compression.error_feedback or \
            cfg.compression.download != "none":
        from fedsim.transforms import check_chain

        check_chain(cfg, uploads_model_update(cfg))
    cfg.data.options = check_options(cfg.data.name, cfg.data.options)
    for arch, key in ([(a, "model.mix") for a in cfg.model.mix] or [(cfg.model.name, "model.name")]):
        cfg.model.options = check_model_options(arch, cfg.model.options, key=key)


def uploads_model_update(cfg: RunConfig) -> bool | None:
    """Whether the method's round 0 is one phase that sums a model update (None when its phases cannot be read
    before the run builds its environment; fedsim.transforms.check_round checks every round then)."""
    from fedsim.method.contract import get_algorithm

    try:
        phases = get_algorithm(cfg.algorithm.name)(cfg.algorithm.params, None).phases(0)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a method whose phases need its environment: checked when it runs
        return None
    return len(phases) == 1 and phases[0].reduce == "sum" and phases[0].model_update


def save_config(cfg: RunConfig, path: str | Path | StorePath) -> None:
    """Write the resolved config as YAML, atomically (in a run folder, local or in a store)."""
    atomic_write_text(location(path), yaml_dialect.dump(config_to_dict(cfg)))



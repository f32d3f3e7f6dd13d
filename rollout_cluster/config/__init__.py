"""Cluster configuration: YAML (or a mapping) loaded into the pydantic models of models.py.

`load_config` refuses unknown keys, wrong types and impossible values with a ConfigError that
names the key path and the value (errors.py). A file is read with parsing.ConfigLoader: a key
given twice, aliases that expand past parsing.MAX_YAML_NODES values and integers past 64 bits are
refused too; a file that does not parse is one ConfigError naming the file.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from ..parsing import load_yaml
from ..policy.base import PolicySettings
from ..policy.registry import DEFAULT_POLICY, POLICY_NAMES
from .errors import ConfigError, config_error
from .models import (URGENT_REPORT_GAP_FRAC, ClusterConfig, EngineConfig, LimitsConfig, MetricsConfig, PolicyUnion,
                     ReplicaResources, RouterConfig, SamplingDefaults, SecurityConfig, from_mapping)

__all__ = ["ClusterConfig", "ConfigError", "EngineConfig", "LimitsConfig", "MetricsConfig", "POLICY_NAMES", "PolicyConfig",
           "PolicySettings", "ReplicaResources", "RouterConfig", "SamplingDefaults", "SecurityConfig", "URGENT_REPORT_GAP_FRAC",
           "load_config", "to_dict"]

_POLICY = TypeAdapter(PolicyUnion)


def PolicyConfig(name: str = DEFAULT_POLICY, **settings) -> PolicySettings:  # noqa: N802 (builds a model)
    """The settings model of policy `name` (StealConfig, ChunkedConfig, ...) with `settings`,
    checked as the config's `policy:` mapping is."""
    try:
        return _POLICY.validate_python({"name": name, **settings})
    except ValidationError as e:
        raise config_error(e, ClusterConfig, ("policy",)) from None


def load_config(source) -> ClusterConfig:
    """Load a ClusterConfig from a YAML path, a YAML string's dict, or check one again."""
    if isinstance(source, ClusterConfig):
        return source.validate()
    base = ""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = load_yaml(path.read_text())
        except RecursionError:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: nested too deeply") from None
        except (yaml.YAMLError, ValueError) as e:  # ValueError: not UTF-8, a timestamp no date has
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
        data = {} if data is None else data  # an empty file: every default
        # A file in `configs/` or one folder below it (configs/experiments/) resolves paths
        # against the project root above it; any other file against its own folder.
        here = path.resolve().parent
        root = next((d.parent for d in (here, here.parent) if d.name == "configs"), None)
        base = str(root or here)
    else:
        data = source
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    data = dict(data)
    if data.get("base_dir", "") == "":
        data["base_dir"] = base
    return from_mapping(data)


def to_dict(cfg: ClusterConfig) -> dict:
    """`cfg` as plain data (Serve deployments receive this); load_config(to_dict(cfg)) == cfg."""
    return cfg.model_dump()

"""rollout_cluster: the rollout tier under an RL trainer (vLLM engines on Ray Serve, a
per-sequence router that migrates running sequences, and a driver API)."""
from .config import ClusterConfig, ConfigError, load_config
from .protocol import BatchLostError, Completion, InputError, Partial, SamplingSpec, partials


def __getattr__(name):  # RolloutClient imports ray: only on use
    if name == "RolloutClient":
        from .client.client import RolloutClient

        return RolloutClient
    raise AttributeError(name)


__all__ = ["BatchLostError", "ClusterConfig", "Completion", "ConfigError", "InputError", "Partial", "RolloutClient",
           "SamplingSpec", "load_config", "partials"]

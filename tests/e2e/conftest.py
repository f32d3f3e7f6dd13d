import os

# `ray start --head` turns token auth on; Ray reads RAY_AUTH_MODE when it is imported, so it
# must be set before any test module imports ray.
os.environ["RAY_AUTH_MODE"] = "token"

from e2e_support import client, cluster_config, fresh_policy, ray_head  # noqa: E402,F401  (fixtures)

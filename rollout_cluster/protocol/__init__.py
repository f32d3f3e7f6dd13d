"""Messages between driver, router, policy and replicas (being split into modules by family)."""
from .orders import *  # noqa: F401,F403

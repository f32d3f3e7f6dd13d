"""The Serve app a deployment's replica belongs to: control orders are bound to it (signing.py)."""
from __future__ import annotations

from typing import Optional


def serve_app_name() -> Optional[str]:
    """The Serve app of the running replica; None outside a Serve replica (a class built directly)."""
    from ray import serve

    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 (RayServeException: no replica context)
        return None

"""Whether the Router is there to answer a call: the Gateway's routes answer 503 with
Retry-After when it is not (a client retries), as they do when it is full, not a 500.

A Serve handle's call finds no router when its process died under the call or is restarting
(RayActorError: ActorDiedError, ActorUnavailableError), when Serve holds no replica of it
(ReplicaUnavailableError, DeploymentUnavailableError), or goes unanswered while Serve restarts it:
bounded by call_timeout_s, such a call counts as no router too. The list is
client/loops.router_absent_errors, the one a driver's follower waits on for a new router."""
from __future__ import annotations

import asyncio

from ..client.loops import router_absent_errors


class RouterAbsent(RuntimeError):
    """The router did not answer: its process is gone or restarting. The message says which error."""


async def router_call(router, method: str, timeout_s: float, *args):
    """router.<method>(*args), within `timeout_s`; RouterAbsent when no router answers."""
    try:
        return await asyncio.wait_for(getattr(router, method).remote(*args), timeout_s)
    except TimeoutError:
        raise RouterAbsent(f"the router is not reachable: no answer to {method} in {timeout_s:g} s") from None
    except router_absent_errors() as e:
        raise RouterAbsent(f"the router is not reachable ({type(e).__name__}: {e})") from None


async def router_status(router, timeout_s: float) -> dict:
    """router.status(), within `timeout_s`; RouterAbsent when no router answers."""
    return await router_call(router, "status", timeout_s)

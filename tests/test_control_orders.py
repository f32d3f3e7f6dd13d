"""Signed control orders at the Serve router (serve/router.py, security/signing.py)."""
import asyncio

import pytest

from rollout_cluster.config import ClusterConfig, to_dict
from rollout_cluster.protocol import InputError
from rollout_cluster.serve.router import Router
from router_support import order


def _router() -> Router:
    router = Router.func_or_class(to_dict(ClusterConfig(replicas=2, engine={"kind": "sim"})))
    router._reaper.cancel()
    return router


@pytest.mark.parametrize("bad", [None, 0, -3, "4", 2.5, True])
def test_set_fleet_target_refuses_a_count_that_is_no_count_naming_the_field(bad):
    """set_fleet_target is a signed router method of its own (the CLI, another language's
    signer): a `replicas` that is no integer >= 1 must be refused naming it, and the fleet's
    expected count left alone. Today None raises int()'s TypeError, 0 and -3 become 1, "4"
    becomes 4, 2.5 becomes 2 and True becomes 1."""
    async def go():
        router = _router()
        with pytest.raises(InputError, match=rf"replicas={bad!r}"):
            await router.set_fleet_target(order("set_fleet_target", replicas=bad))
        return router.core.fleet.expected

    assert asyncio.run(go()) == 2

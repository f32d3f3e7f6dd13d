"""Calling the Serve Router's methods in-process, as its callers do: signed, with a credential."""
import asyncio
import time as real_time

from rollout_cluster.config import SecurityConfig
from rollout_cluster.security.secrets import read_keys
from rollout_cluster.security.signing import Signer

SIGNER = Signer(read_keys(SecurityConfig()))  # the tests' key (conftest.TEST_CONTROL_KEYS)


async def pull(router, report):
    """router.pull(report) as a registered replica sends it: registered on its first report."""
    if report.replica_id not in router.credentials:
        await router.register(SIGNER.sign("register", {"replica_id": report.replica_id,
                                                       "incarnation": report.incarnation}))
    report.credential = router.credentials[report.replica_id]
    return await router.pull(report)


def order(op: str, **args):
    """A signed control order for one of the Router's control methods."""
    return SIGNER.sign(op, args)


class Clock:
    """The router module's `time`: monotonic() runs `offset` seconds ahead when a test says so."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self):
        return real_time.monotonic() + self.offset

    def time(self):
        return real_time.time()

    def perf_counter(self):
        return real_time.perf_counter()


class FastAsyncio:
    """The router module's `asyncio`, its reaper's 1 s sleep cut to 10 ms (everything else as is)."""

    def __getattr__(self, name):
        return getattr(asyncio, name)

    @staticmethod
    async def sleep(s):
        await asyncio.sleep(min(s, 0.01))

"""A trainer's lease: a tiny actor that lives exactly as long as the trainer's process, so that the
router can tell a streamed push whose trainer died from one whose trainer is still putting.

A streamed push's order goes out with its first bucket (push.py); the rest follow from the
trainer. A trainer that fails tells the router (push_abort), but one that dies (killed, out of
memory, its node gone) tells nobody, and each replica would wait bucket_stream.STALL_S for the
next bucket. The lease closes that gap with Ray's own fate sharing: an actor that is not detached
dies with the process that created it (its owner), and one pinned to the owner's node dies with
that node too. The router pings the lease of the push it waits on (serve/push_watch.py); Ray
answers ActorDiedError within about a second of the trainer's death, and the router aborts the push
as if the trainer had (the fleet goes back to the weights it held).

One lease per trainer process and Ray session, made at its first streamed push: the actor needs
no CPU, and its worker process is the only cost (started once, in the background). At every
later push the lease is pinged first (a millisecond): one that died while the trainer lives (its
worker killed by Ray's memory monitor, `ray.kill`) is replaced, so that it never aborts a push of
a live trainer. A lease that could not be made at all (Ray Client, a placement refused) leaves the
push unwatched: the replicas' bucket_stream.STALL_S still ends it.
"""
from __future__ import annotations

import logging
import threading
import time

CHECK_S = 10.0  # a lease made before answers its ping within this, or it is used unchecked (not replaced)
RETRY_S = 0.1  # between pings of a lease Ray calls unreachable (a killed actor is that before it is dead)

_leases: dict = {}  # (session, GCS address, job id, worker id) -> the lease's actor handle
_lock = threading.Lock()
log = logging.getLogger(__name__)


class TrainerLease:
    """The actor: no state, one method. Its death is the message."""

    def alive(self) -> bool:
        return True


def lease_of_this_process():
    """This process's lease (an actor handle), made at the first call in this Ray session: created
    by this process (which owns it: it dies with it) on this node (it dies with the node). A lease
    made before that no longer answers is replaced. None: no lease can be made here (said)."""
    import ray

    try:
        ctx = ray.get_runtime_context()
        key = (ctx.get_session_name(), ctx.gcs_address, ctx.get_job_id(), ctx.get_worker_id())
    except Exception as e:  # (no Ray here, or a Ray Client: no node of this process's own)
        log.warning("push_weights: no trainer lease (%s: %s): a streamed push this process dies in is "
                    "ended by the replicas' stall limit, not at once", type(e).__name__, e)
        return None
    with _lock:
        for stale in [k for k in _leases if k[0] != key[0]]:  # (handles of an earlier session)
            del _leases[stale]
        lease = _leases.get(key)
        if lease is not None:
            if _answers(lease):
                return lease
        try:
            lease = _leases[key] = _make(ctx)
        except Exception as e:
            log.warning("push_weights: no trainer lease (%s: %s): a streamed push this process dies in is "
                        "ended by the replicas' stall limit, not at once", type(e).__name__, e)
            _leases.pop(key, None)
            return None
        return lease


def _answers(lease) -> bool:
    """False once Ray says the lease died. Unreachable (ActorUnavailableError) is asked again until
    CHECK_S: a lease just killed is first unreachable, then dead, and a kept dead lease would abort the
    live trainer's next push. Unreachable or silent all that while: kept (a busy node is not dead)."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    deadline = time.monotonic() + CHECK_S
    while True:
        try:
            ray.get(lease.alive.remote(), timeout=max(0.01, deadline - time.monotonic()))
            return True
        except GetTimeoutError:
            return True  # (slow to start, or a busy node: as the watch takes it)
        except ActorUnavailableError:
            if time.monotonic() >= deadline:
                return True
            time.sleep(RETRY_S)
        except RayActorError as e:
            log.warning("push_weights: this trainer's lease died (%s); a new one is made", type(e).__name__)
            return False


def _make(ctx):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(TrainerLease)
    return actor.options(
        lifetime="non_detached",  # fate-shared with this process, whatever the job's default
        scheduling_strategy=NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=False)).remote()

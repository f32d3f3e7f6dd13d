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
no CPU, and its worker process is the only cost (started once, in the background).
"""
from __future__ import annotations

import threading

_leases: dict = {}  # (GCS address, job id, worker id) -> the lease's actor handle
_lock = threading.Lock()


class TrainerLease:
    """The actor: no state, one method. Its death is the message."""

    def alive(self) -> bool:
        return True


def lease_of_this_process():
    """This process's lease (an actor handle), made at the first call in this Ray session: created
    by this process (which owns it: it dies with it) on this node (it dies with the node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ctx = ray.get_runtime_context()
    key = (ctx.gcs_address, ctx.get_job_id(), ctx.get_worker_id())
    with _lock:
        lease = _leases.get(key)
        if lease is None:
            actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(TrainerLease)
            lease = actor.options(
                lifetime="non_detached",  # fate-shared with this process, whatever the job's default
                scheduling_strategy=NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=False)).remote()
            _leases[key] = lease
        return lease

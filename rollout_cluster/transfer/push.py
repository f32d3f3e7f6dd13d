"""push_weights, the trainer's side: tensors into buckets in Ray's object store, one signed order
to the router naming them, then the same wait as update_weights.

The design (docs/architecture.md, "Weights without a filesystem"): the trainer `ray.put`s each
bucket once (and its manifest ahead of them: buckets.py), sending the order once the first bucket
is in and the later ones as they come (`push`); the router sends the buckets' handles
with every LoadWeights of the version, to the replicas that hold the fleet now and to any that
join later; each replica fetches the buckets
(Ray's object manager moves each one to its node once, from any node that has it) and loads them
in place, one bucket while the next travels (engines/weight_loader.py). The trainer holds no
communicator of fixed size: the fleet may grow and shrink during a push. The trainer's process
owns the objects (Ray's ownership): they live while it does and the router still names them.
"""
from __future__ import annotations

import logging
import os
import uuid
from time import monotonic
from typing import Callable, Iterable, Optional

from .buckets import DEFAULT_BUCKET_BYTES, bucket_bytes_of, header, manifest, pack, pack_group, plan, planned_header
from . import staging
from .staging import one_bucket_at_a_time
from .trace import mark

PUSH_SCHEME = "push://"  # a pushed version's path: "push://<id>" (no checkpoint directory)
# Streamed (the default; "0": off): the order goes out with the first bucket and the rest follow
# (push_more), so that the replicas load while the trainer puts. A streamed push that fails in
# the trainer is aborted (push_abort: the fleet goes back, each replica reloads the weights it
# held); one whose trainer dies is aborted by the router, which watches the trainer's lease
# (lease.py, serve/push_watch.py); one whose trainer hangs leaves each replica waiting
# bucket_stream.STALL_S first. Off, a push waits for every bucket and fails before any replica is
# touched. Streaming saved 22 % of a 7B push on an H100 and 8 % on the CPU cluster
# (docs/benchmarks.md, section 11).
STREAM_ENV = "ROLLOUT_PUSH_STREAM"
# A streamed push's later buckets go out at least this often, however few the doubling batch has
# so far: a replica fails a push whose next object comes more than bucket_stream.STALL_S (60 s)
# after the one before, and the last doubling batch of a large model (half its buckets) can take
# the trainer longer than that to put.
PUSH_MORE_EVERY_S = 10.0
# "0": the trainer's tensors are copied to host memory each into fresh memory (`tensor.to("cpu")`),
# not through the process's reused staging buffer (transfer/staging.py; pinned for GPU tensors)
STAGING_ENV = "ROLLOUT_PUSH_STAGING"

log = logging.getLogger(__name__)


def put_buckets(named_tensors: Iterable, bucket_bytes: int = DEFAULT_BUCKET_BYTES, ipc=None,
                staging=None) -> tuple:
    """(object refs of the push's manifest and then its buckets, tensors, bytes): all in the object
    store. With `ipc` (an ipc.IpcHold), the buckets hold CUDA IPC handles of the tensors, not their
    bytes. The manifest goes first, so that a replica checks every tensor before it loads one.
    `staging` (staging.Staging): where the tensors are copied to host memory, bucket by bucket."""
    import ray

    refs, headers, tensors, nbytes = [], [], 0, 0
    mark("put_start")
    source = iter(ipc.buckets(named_tensors, bucket_bytes) if ipc is not None
                  else pack(named_tensors, bucket_bytes, staging))
    while True:
        with one_bucket_at_a_time(staging):
            bucket = next(source, None)
            if bucket is None:
                break
            mark("bucket_packed", i=len(refs))
            refs.append(ray.put(bucket))  # (a copy: the staging buffer is free again)
        mark("put_bucket", i=len(refs) - 1, bytes=bucket_bytes_of(bucket))
        headers.append(header(bucket))  # (not the bucket: its bytes go once they are in the store)
        tensors += len(bucket["names"])
        nbytes += bucket_bytes_of(bucket)
    if not refs:
        raise ValueError("named_tensors: no tensors to push")
    return [ray.put(manifest(headers))] + refs, tensors, nbytes


def push(router, signer, named_tensors: Iterable, version: Optional[int], bucket_bytes: int,
         call_timeout_s: float, running: str = "finish", ipc=None,
         until_numbered: Optional[Callable[[Callable[[], int]], int]] = None,
         lease: Optional[Callable[[], object]] = None, stream: Optional[bool] = None) -> tuple:
    """Send the tensors and the signed order; returns (version, source, refs). The caller keeps
    `refs` until every replica holds the version (its process owns them anyway), and `ipc` (an
    ipc.IpcHold: push by CUDA IPC) until then too. `until_numbered(send)`: calls send() again while
    a new router refuses the order for now (client/fleet_ops.numbered); each send signs anew.
    `lease()`: the trainer's lease (lease.lease_of_this_process), sent with a streamed push's order
    so that the router aborts the push if the trainer dies before its last bucket. `stream`: True,
    False, or None for STREAM_ENV's choice (on unless "0").

    Streamed (unless ROLLOUT_PUSH_STREAM=0, STREAM_ENV), through the object store the order goes out once the
    manifest and the first bucket are in the store, and the later buckets follow (`push_more`)
    while the replicas fetch and load (transfer/bucket_stream.py): each time as many are in as were
    sent before, the rest at the end, and at least every PUSH_MORE_EVERY_S while the trainer puts. The router orders every
    replica the push again at each `push_more`, naming every object so far: doubling keeps that to
    about twice the push's objects per replica however many buckets there are (one call per bucket
    would be quadratic), and the trainer, which puts faster than an engine loads, stays ahead of
    the replicas. `named_tensors` is gone through once first,
    names and sizes only, to plan the buckets: the manifest goes ahead of them. (By CUDA IPC the
    buckets are handles, put at once: one order names them all.)"""
    import ray

    stage = staging.shared() if os.environ.get(STAGING_ENV, "1") != "0" else None
    source = f"{PUSH_SCHEME}{uuid.uuid4().hex}"
    streamed = stream if stream is not None else os.environ.get(STREAM_ENV, "1") != "0"
    if ipc is not None or not streamed:
        # every bucket in before the order, each packed as the tensors come (no more than a bucket
        # of them held at once): a trainer that fails here has touched no replica
        refs, tensors, nbytes = put_buckets(named_tensors, bucket_bytes, ipc, stage if ipc is None else None)
        later = []
    else:  # streamed: planned first (every (name, tensor) held until packed), the manifest ahead
        groups = plan(named_tensors, bucket_bytes)
        if not groups:
            raise ValueError("named_tensors: no tensors to push")
        tensors = sum(len(g) for g in groups)
        nbytes = sum(t.numel() * t.element_size() for g in groups for _, t in g)
        mark("put_start")
        refs = [ray.put(manifest([planned_header(g) for g in groups])), _put(groups[0], 0, stage, bucket_bytes)]
        later = groups[1:]

    objects = len(refs) + len(later)  # the manifest and every bucket
    # streamed: the router watches the trainer's lease while the later buckets come (lease.py)
    held = lease() if later and lease is not None else None  # (None: no lease could be made: unwatched)
    leased = (held,) if held is not None else ()

    def send() -> int:  # (a signed order is taken once: its nonce)
        order = signer.sign("push_weights", {"source": source, "version": version, "buckets": [r.hex() for r in refs],
                                             "tensors": tensors, "bytes": nbytes, "running": running,
                                             "objects": objects})
        return router.push_weights.remote(order, refs, *leased).result(timeout_s=call_timeout_s)

    refs, ready = list(refs), []
    sending = None  # the last push_more, answered while the next buckets are put
    v = None  # the version the router numbered the push, once it answered the order
    try:
        v = until_numbered(send) if until_numbered is not None else send()
        mark("router_ack", version=v)
        sent_t = monotonic()  # when the last order or push_more went out
        for n, g in enumerate(later, start=1):
            ready.append(_put(g, len(refs) + len(ready) - 1, stage, bucket_bytes))
            if len(ready) < len(refs) - 1 and n < len(later) and monotonic() - sent_t < PUSH_MORE_EVERY_S:
                continue  # (fewer than the buckets sent so far, and sent lately: more first)
            if sending is not None:
                sending.result(timeout_s=call_timeout_s)
            more = signer.sign("push_more", {"source": source, "start": len(refs), "buckets": [r.hex() for r in ready]})
            sending = router.push_more.remote(more, ready)
            refs, ready, sent_t = refs + ready, [], monotonic()
        if sending is not None:
            sending.result(timeout_s=call_timeout_s)
            mark("push_more_ack", objects=len(refs))
    except BaseException as e:  # (interrupted too) the replicas may load a push that will not complete
        if later:  # (a push whose order named every object is whole, or was not taken)
            out = abort(router, signer, source, e, call_timeout_s)
            if (isinstance(e, Exception) and v is not None and len(refs) == objects and out is not None
                    and out.get("aborted") is None and out.get("version") == v):
                # every object was sent and only an answer was lost (the last push_more's): the
                # router had them all (nothing to abort) and is at this push, so it stands; raising
                # would have the trainer push again, as another version
                log.warning("push_weights: %s: %s, but the router holds every object of it as version %s: the push "
                            "stands", source, e, v)
                return v, source, refs
        raise
    return v, source, refs


def check_stream(stream) -> None:
    """push_weights' `stream`: True, False or None (STREAM_ENV decides)."""
    if stream is not None and not isinstance(stream, bool):
        raise ValueError(f"stream={stream!r}: must be True, False or None (None: streamed unless "
                         f"{STREAM_ENV}=0)")


def abort(router, signer, source: str, error: BaseException, call_timeout_s: float) -> Optional[dict]:
    """Tell the router the streamed push `source` ends here (push_abort): the fleet goes back to the
    weights it held before at once, instead of each replica waiting bucket_stream.STALL_S for the
    next object and restarting. Best effort: the trainer's own error is what its caller gets.
    Returns the router's answer ({"aborted": version or None, "version": the fleet's}), None when
    it gave none."""
    reason = f"the trainer's push failed: {type(error).__name__}: {error}"[:1000]
    try:
        order = signer.sign("push_abort", {"source": source, "reason": reason})
        out = router.push_abort.remote(order).result(timeout_s=min(call_timeout_s, 30.0))
        if out.get("aborted") is not None:
            log.warning("push_weights: %s aborted (%s); the fleet is back at version %s", source, reason,
                        out.get("version"))
        else:  # its order was not taken, or its last objects came after all (a reply lost): nothing to abort
            log.warning("push_weights: %s failed (%s); the router had nothing to abort (the fleet's weights are "
                        "version %s)", source, reason, out.get("version"))
        return out
    except Exception as e:  # (the router is gone too: each replica's load fails after STALL_S)
        log.warning("push_weights: telling the router that %s was aborted failed: %s", source, e)
        return None


def _put(group: list, i: int, stage, bucket_bytes: int):
    import ray

    with one_bucket_at_a_time(stage):
        bucket = pack_group(group, stage, bucket_bytes)
        mark("bucket_packed", i=i)
        ref = ray.put(bucket)
    mark("put_bucket", i=i, bytes=bucket_bytes_of(bucket))
    return ref

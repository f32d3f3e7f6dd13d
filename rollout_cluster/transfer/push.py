"""push_weights, the trainer's side: tensors into buckets in Ray's object store, one signed order
to the router naming them, then the same wait as update_weights.

The design (docs/architecture.md, "Weights without a filesystem"): the trainer `ray.put`s each
bucket once (and its manifest ahead of them: buckets.py); the router sends the buckets' handles
with every LoadWeights of the version, to the replicas that hold the fleet now and to any that
join later; each replica fetches the buckets
(Ray's object manager moves each one to its node once, from any node that has it) and loads them
in place, one bucket while the next travels (engines/weight_loader.py). The trainer holds no
communicator of fixed size: the fleet may grow and shrink during a push. The trainer's process
owns the objects (Ray's ownership): they live while it does and the router still names them.
"""
from __future__ import annotations

import uuid
from typing import Callable, Iterable, Optional

from .buckets import DEFAULT_BUCKET_BYTES, bucket_bytes_of, header, manifest, pack
from .trace import mark

PUSH_SCHEME = "push://"  # a pushed version's path: "push://<id>" (no checkpoint directory)


def put_buckets(named_tensors: Iterable, bucket_bytes: int = DEFAULT_BUCKET_BYTES, ipc=None) -> tuple:
    """(object refs of the push's manifest and then its buckets, tensors, bytes): all in the object
    store. With `ipc` (an ipc.IpcHold), the buckets hold CUDA IPC handles of the tensors, not their
    bytes. The manifest goes first, so that a replica checks every tensor before it loads one."""
    import ray

    refs, headers, tensors, nbytes = [], [], 0, 0
    mark("put_start")
    for bucket in (ipc.buckets(named_tensors, bucket_bytes) if ipc is not None else pack(named_tensors, bucket_bytes)):
        refs.append(ray.put(bucket))
        mark("put_bucket", i=len(refs) - 1, bytes=bucket_bytes_of(bucket))
        headers.append(header(bucket))  # (not the bucket: its bytes go once they are in the store)
        tensors += len(bucket["names"])
        nbytes += bucket_bytes_of(bucket)
    if not refs:
        raise ValueError("named_tensors: no tensors to push")
    return [ray.put(manifest(headers))] + refs, tensors, nbytes


def push(router, signer, named_tensors: Iterable, version: Optional[int], bucket_bytes: int,
         call_timeout_s: float, running: str = "finish", ipc=None,
         until_numbered: Optional[Callable[[Callable[[], int]], int]] = None) -> tuple:
    """Send the tensors and the signed order; returns (version, source, refs). The caller keeps
    `refs` until every replica holds the version (its process owns them anyway), and `ipc` (an
    ipc.IpcHold: push by CUDA IPC) until then too. `until_numbered(send)`: calls send() again while
    a new router refuses the order for now (client/fleet_ops.numbered); each send signs anew."""
    refs, tensors, nbytes = put_buckets(named_tensors, bucket_bytes, ipc)
    source = f"{PUSH_SCHEME}{uuid.uuid4().hex}"

    def send() -> int:  # (a signed order is taken once: its nonce)
        order = signer.sign("push_weights", {"source": source, "version": version, "buckets": [r.hex() for r in refs],
                                             "tensors": tensors, "bytes": nbytes, "running": running})
        return router.push_weights.remote(order, refs).result(timeout_s=call_timeout_s)

    v = until_numbered(send) if until_numbered is not None else send()
    mark("router_ack", version=v)
    return v, source, refs

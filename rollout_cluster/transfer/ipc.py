"""push_weights(transport="ipc"): the trainer's tensors reach an engine on the same GPU by CUDA IPC
(co-location, as TRL's external launcher and verl's hybrid engine run it), not as bytes.

A bucket is buckets.py's dict with, instead of `data`:
  ipc:      pickled bytes of a list, one {gpu uuid: rebuild_cuda_tensor args} per tensor (from
            torch's reduce_tensor: a handle to the trainer's CUDA memory, no byte of the weights);
  gpu_uuid: the trainer's GPU (every tensor of a push lies on it);
  nbytes:   the tensors' bytes (what the bucket would weigh as data);
  lease:    the path of the push's lease file (below); host: the trainer's host name.
The handles travel as bytes because the EngineCore's msgpack cannot carry tensors or torch's
classes; the replica passes them on untouched, and vLLM's worker (engines/worker_loader.py,
TensorLoader.rc_tensors_load_ipc) rebuilds each tensor on its own device and loads from it.

A handle is good only while the trainer holds the tensor: `IpcHold` keeps strong references to
every tensor it sent until client/fleet_ops.push_weights has seen every replica load the
version, then releases them and calls torch.cuda.ipc_collect(). The lease file says whether a
push's handles may still be opened: a replica holds a shared flock on it while it loads
(`hold_lease`); the trainer takes the exclusive lock (waiting for loads under way), unlinks the
file, and only then lets the tensors go. A replica that comes later (a joiner, a level-2 wake)
finds no lease and fails with a clear error, instead of opening memory that may hold other data.
"""
from __future__ import annotations

import fcntl
import os
import pickle
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

TRANSPORTS = ("object_store", "ipc")
LEASE_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
DEVICE_ARG = 6  # the index of the device in rebuild_cuda_tensor's args (overwritten by the receiver)


def check_transport(transport, running: str) -> None:
    """push_weights' `transport` and the `running` modes it goes with."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: must be one of {', '.join(TRANSPORTS)}")
    if transport == "ipc" and running == "keep":
        raise ValueError("transport='ipc' with running='keep': the keep swap stages a copy of every bucket "
                         "while the engine runs on; push by IPC with running='finish', 'recompute' or 'abort', "
                         "or with transport='object_store'")


def device_uuid(index: int) -> str:
    """The physical GPU's UUID (the same on both sides whatever CUDA_VISIBLE_DEVICES says)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


@dataclass
class IpcHold:
    """The trainer's side of one IPC push: what it must keep until the fleet loaded it."""

    lease: str  # the lease file's path (replicas hold a shared flock on it while they load)
    fd: int  # the trainer's open descriptor of it (its exclusive lock at release)
    host: str = field(default_factory=socket.gethostname)  # where the handles can be opened
    tensors: list = field(default_factory=list)  # strong refs to every tensor whose handle went out

    @classmethod
    def start(cls, directory: str = LEASE_DIR) -> "IpcHold":
        path = os.path.join(directory, f"rollout-ipc-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(lease=path, fd=os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))

    def buckets(self, named_tensors: Iterable, bucket_bytes: int) -> Iterator[dict]:
        """IPC buckets of the (name, CUDA tensor) pairs, about `bucket_bytes` of tensors each."""
        from torch.multiprocessing.reductions import reduce_tensor

        from .buckets import checked

        bucket, handles, size, gpu = None, [], 0, None
        for name, tensor in checked(named_tensors, bucket_bytes):
            if tensor.device.type != "cuda":
                raise ValueError(f"named_tensors[{name!r}]: on device {tensor.device}; transport='ipc' sends "
                                 "CUDA tensors only (push from the GPU, or with transport='object_store')")
            if gpu is None:
                gpu = (tensor.device, device_uuid(tensor.device.index))
            elif tensor.device != gpu[0]:
                raise ValueError(f"named_tensors[{name!r}]: on {tensor.device}, the push's first tensor on "
                                 f"{gpu[0]}: an IPC push comes from one GPU (an engine loads every tensor)")
            t = tensor.detach().contiguous()  # the parameter itself where it is contiguous: no copy
            nbytes = t.numel() * t.element_size()
            if bucket is not None and bucket["names"] and size + nbytes > bucket_bytes:
                yield self._seal(bucket, handles, size)
                bucket = None
            if bucket is None:
                bucket, handles, size = {"names": [], "dtypes": [], "shapes": [], "gpu_uuid": gpu[1]}, [], 0
            self.tensors.append(t)
            handles.append({gpu[1]: reduce_tensor(t)[1]})
            bucket["names"].append(name)
            bucket["dtypes"].append(str(t.dtype).removeprefix("torch."))
            bucket["shapes"].append(list(t.shape))
            size += nbytes
        if bucket is not None and bucket["names"]:
            yield self._seal(bucket, handles, size)

    def _seal(self, bucket: dict, handles: list, size: int) -> dict:
        return {**bucket, "ipc": pickle.dumps(handles), "nbytes": size, "lease": self.lease, "host": self.host}

    def release(self, timeout_s: float) -> bool:
        """Close the lease once no replica loads from it (within `timeout_s`), then let the tensors
        go. Returns False where a load still held it: the tensors are then kept (leaked to this
        process's end) rather than freed under a reader, and the lease is unlinked all the same so
        that no later replica opens them."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    _KEPT.append(self.tensors)
                    try:  # no replica may start on tensors the trainer changes from now on
                        os.unlink(self.lease)
                    except FileNotFoundError:
                        pass
                    return False  # (the descriptor stays open for a later release(); abandon() closes it)
                time.sleep(0.05)
        try:
            os.unlink(self.lease)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1
        self.tensors = []
        import torch

        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # frees what the engines released (torch keeps sent blocks till then)
        return True

    def abandon(self) -> None:
        """After a release() that timed out, no other comes: close the lease's descriptor (its
        file is unlinked already; the tensors stay kept, as release() left them)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_KEPT: list = []  # tensors of pushes whose lease a load still held at release (never freed)


@dataclass
class IpcBucket(list):
    """An IPC bucket at the replica: (name, meta tensor) pairs that BucketCheck checks like any
    bucket's, plus what the worker needs to open the tensors themselves."""

    header: dict = field(default_factory=dict)  # names, dtypes, shapes, nbytes (the worker's header)
    handles: bytes = b""  # the pickled handles, passed on to the worker untouched
    gpu_uuid: str = ""  # the trainer's GPU
    lease: str = ""  # the push's lease file
    host: str = ""  # the trainer's host

    def __post_init__(self) -> None:
        import torch

        self.extend((n, torch.empty(s, dtype=getattr(torch, d), device="meta"))
                    for n, d, s in zip(self.header["names"], self.header["dtypes"], self.header["shapes"]))


def is_ipc(bucket) -> bool:
    return isinstance(bucket, IpcBucket)


def unpack_ipc(bucket: dict) -> IpcBucket:
    """An IPC bucket as the replica checks and loads it (buckets.unpack calls it)."""
    import torch

    from .buckets import check_lists

    check_lists(bucket)
    for name, dtype in zip(bucket["names"], bucket["dtypes"]):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    header = {k: bucket[k] for k in ("names", "dtypes", "shapes", "nbytes")}
    return IpcBucket(header=header, handles=bucket["ipc"], gpu_uuid=bucket["gpu_uuid"], lease=bucket["lease"],
                     host=bucket["host"])


def hold_lease(bucket: IpcBucket) -> int:
    """A shared lock on the push's lease (the replica, before the worker opens the handles); the
    caller closes the returned descriptor once the load is over. Raises where the handles may be
    gone: another host, or a push the trainer released."""
    here = socket.gethostname()
    if bucket.host != here:
        raise RuntimeError(f"this push came by CUDA IPC from host {bucket.host!r}; this replica runs on {here!r}: "
                           "IPC reaches only an engine on the trainer's GPU (push with transport='object_store')")
    gone = RuntimeError(f"this push came by CUDA IPC and the trainer has released its tensors (lease "
                        f"{bucket.lease!r} closed): a replica that joined or reloaded after the push returned "
                        "cannot load it; it gets the next push")
    try:
        fd = os.open(bucket.lease, os.O_RDONLY)
    except FileNotFoundError:
        raise gone from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while the trainer releases
        if os.fstat(fd).st_nlink == 0:  # released between our open and our lock
            raise gone
    except BaseException as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise gone from None
        raise
    return fd


def open_handles(header: dict, handles: bytes, device_index: int, gpu: str,
                 rebuild: Optional[Callable] = None) -> list:
    """The worker's side: (name, tensor) pairs of an IPC bucket, each a view of the trainer's memory
    rebuilt on this worker's device `device_index` (physical GPU `gpu`). Raises, naming both GPUs,
    where the trainer's tensors lie on another GPU. `rebuild`: torch's rebuild_cuda_tensor."""
    if rebuild is None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor as rebuild
    per_tensor = pickle.loads(handles)  # from a bucket the signed order named, made by the trainer
    names = header["names"]
    if not isinstance(per_tensor, list) or len(per_tensor) != len(names):
        raise ValueError(f"IPC bucket: {len(names)} names but handles of another form "
                         f"({type(per_tensor).__name__} of {len(per_tensor) if isinstance(per_tensor, list) else '?'})")
    out = []
    for name, dtype, shape, by_gpu in zip(names, header["dtypes"], header["shapes"], per_tensor):
        if gpu not in by_gpu:
            raise ValueError(f"tensor {name!r}: pushed by CUDA IPC from GPU {', '.join(sorted(by_gpu))}, but this "
                             f"replica's engine runs on GPU {gpu}: IPC reaches only an engine on the trainer's "
                             "GPU (push to the others with transport='object_store')")
        args = list(by_gpu[gpu])
        args[DEVICE_ARG] = device_index  # the same GPU, as this process numbers it
        t = rebuild(*args)
        if list(t.shape) != list(shape) or str(t.dtype).removeprefix("torch.") != dtype:
            raise ValueError(f"tensor {name!r}: its handle opens a {t.dtype} {tuple(t.shape)} tensor, the header "
                             f"says {dtype} {tuple(shape)}")
        out.append((name, t))
    return out

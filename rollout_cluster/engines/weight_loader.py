"""Named tensors into a running vLLM engine, in place: the replica's end of push_weights.

`load_into(engine, buckets, spec)` (VllmEngine.load_tensors calls it) checks the tensors against
the served checkpoint (weight_checks.py), copies each bucket into a /dev/shm slot
(bucket_files.py's layout), and has the worker load it (worker_loader.py's TensorLoader, reached
with `collective_rpc`).

How a bucket travels: vLLM runs the model in a worker process behind the EngineCore process.
A pushed bucket that lies in Ray's object store is read there: the worker maps the store's memory
once (store_views.py) and the collective_rpc names where the tensors lie in it: no copy. Otherwise
the replica copies the bucket's tensors into a reusable /dev/shm slot (shm_slots.py: memory both
processes mapped before, so the one copy touches no fresh page), sends the slot's id in the
collective_rpc, and the worker loads from its mapping. Tensors cannot ride the call: the
EngineCore's generic msgpack decoder turns a tensor into a plain list. Bytes can, at several copies
more (experiments/weights-in-place/README.md); they are the fallback where /dev/shm cannot take a
bucket. The next bucket is copied while the worker loads the previous one. Buckets pushed by CUDA
IPC (transfer/ipc.py) skip the staging: their handles ride the collective_rpc as bytes and the
worker opens the trainer's tensors on its GPU (`rc_tensors_load_ipc`).

`load_into` counts how it handed each bucket to the worker (`handed`: WAYS -> buckets), so that a
fallback from the store to slots shows in the replica's report (WeightsState.handed) and status.
"""
from __future__ import annotations

import asyncio
import os
import weakref
from contextlib import aclosing

from ..transfer.trace import mark
from .bucket_files import SHM_DIR, layout, pack_bucket, write_bucket
from .store_views import StoreViews
from .weight_checks import BucketCheck, check_ahead

_SLOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> its shm_slots.Slots
_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> its store_views.StoreViews
# How a bucket reaches the worker: where it lies in Ray's object store (no copy), a reused /dev/shm
# slot, a /dev/shm file of its own, bytes inside the collective_rpc, CUDA IPC handles.
WAYS = ("store", "slot", "file", "bytes", "ipc")


async def _each(buckets):
    """The buckets of a list, an iterator or an async iterator. An iterator's next bucket is made
    in a thread: a checkpoint's (weight_keep.checkpoint_buckets) reads up to a bucket of tensors
    from disk, which on the event loop held the replica's pulls and reports for each bucket.
    Closed early (its caller stopped: `async with aclosing(...)`), it closes an async source too,
    which then stops fetching ahead (transfer/bucket_stream.fetched)."""
    if hasattr(buckets, "__aiter__"):
        try:
            async for b in buckets:
                yield b
        finally:
            if hasattr(buckets, "aclose"):
                await buckets.aclose()
    elif isinstance(buckets, (list, tuple)):
        for b in buckets:
            yield b
    else:
        it, end = iter(buckets), object()
        while (b := await asyncio.to_thread(next, it, end)) is not end:
            yield b


async def load_into(engine, buckets, spec: dict | None, transport: str = "shm", handed: dict | None = None) -> int:
    """`_load_into`, holding the lease of a push by CUDA IPC (transfer/ipc.py) while it loads.
    `handed` (a dict, optional): set to {way: 0 for each of WAYS}, then counts each bucket the
    worker loaded under the way it was handed (a store bucket the worker could not map: "slot")."""
    leases: list = []
    if handed is None:
        handed = {}
    handed.clear()
    handed.update(dict.fromkeys(WAYS, 0))
    try:
        return await _load_into(engine, buckets, spec, transport, leases, handed)
    finally:
        for fd in leases:
            os.close(fd)


async def _load_into(engine, buckets, spec: dict | None, transport: str, leases: list, handed: dict) -> int:
    """Load `buckets` into the running AsyncLLM `engine` (started with worker_extension_cls=weight_keep.EXTENSION).

    A list of buckets is checked whole before the engine is touched: a refusal leaves the old
    weights. So is an iterator (buckets still arriving) that brings a push's manifest first
    (transfer/buckets.Manifest); without one it is checked bucket by bucket: a refusal after the
    first bucket went in, like any failure inside vLLM, leaves a mix and raises WeightsLoadBroken.
    `transport`: "shm" (reused /dev/shm slots, shm_slots.py, falling back to "bytes" where /dev/shm
    cannot take a bucket), "file" (a new /dev/shm file per bucket) or "bytes" (the buffer inside
    the collective_rpc). A bucket pushed by CUDA IPC (ipc.IpcBucket) goes as its handles: the
    worker opens the trainer's tensors on its GPU. Returns the number of tensors."""
    import asyncio

    from ..transfer.buckets import is_manifest
    from ..transfer.ipc import hold_lease, is_ipc
    from .base import WeightsLoadBroken

    check = BucketCheck(spec)
    if isinstance(buckets, (list, tuple)):
        for b in buckets:
            check.bucket(b)
        check.finish()
        checked = True
    else:
        checked = False
    started, inflight, staged = False, None, None
    slots = _slots_of(engine) if transport == "shm" else None
    views = _views_of(engine) if transport == "shm" else None
    mark("load_start")
    try:
        async with aclosing(_each(buckets)) as source:  # stopped early, the source stops its fetch ahead
            async for bucket in source:
                if is_manifest(bucket):  # the whole push, ahead of its buckets: refused before any goes in
                    if not started:
                        check_ahead(bucket, spec)
                    continue
                mark("bucket_here")
                if not checked:
                    check.bucket(bucket)
                if is_ipc(bucket):  # handles only: nothing to stage; the trainer's tensors live while the lease does
                    if not leases:
                        leases.append(hold_lease(bucket))
                    staged = (bucket.header, None, bucket, None, None)
                else:  # read where it lies, or written while the worker loads the previous bucket (two at most)
                    staged = _in_store(bucket, views) or await _stage_in_thread(bucket, transport, slots)
                mark("bucket_staged")
                if inflight is not None:  # (kept until it is done: a load stopped meanwhile waits for its end)
                    await inflight
                    inflight = None
                if not started:
                    await engine.collective_rpc("rc_tensors_begin")
                    started = True
                inflight, staged = asyncio.ensure_future(_send(engine, staged, handed, slots, views)), None
        if inflight is not None:
            await inflight
            inflight = None
        if not checked:
            check.finish()
    except BaseException as e:  # (cancelled too: the replica stops; what it staged goes back)
        if inflight is not None:
            if not isinstance(e, Exception):
                inflight.cancel()
            await asyncio.gather(inflight, return_exceptions=True)
        if staged is not None:  # written, never sent: its slot (and file) back, not kept by a load that is over
            _unstage(staged, slots, ok=True)
        if not started or not isinstance(e, Exception):
            raise  # the engine was not touched (its weights are the old ones), or the load was cancelled
        await _end(engine, WeightsLoadBroken, slots, views)
        raise WeightsLoadBroken(f"loading tensors failed after the engine began replacing its weights, "
                                f"which are now a mix of old and new: {type(e).__name__}: {e}") from e
    mark("loads_sent")
    missing = await _end(engine, WeightsLoadBroken, slots, views)
    mark("load_end")
    if missing:
        raise WeightsLoadBroken(f"{len(missing)} of the model's parameters got no tensor, e.g. {missing[:3]}: "
                                "its weights are now a mix of old and new")
    return len(check.seen)


def _slots_of(engine):
    """The engine's shm slots (made at its first load; they go with the engine object)."""
    from .shm_slots import Slots

    slots = _SLOTS.get(engine)
    if slots is None:
        slots = _SLOTS[engine] = Slots(SHM_DIR)
    return slots


def _views_of(engine) -> StoreViews:
    views = _VIEWS.get(engine)
    if views is None:
        views = _VIEWS[engine] = StoreViews()
    return views


def _in_store(bucket: list, views) -> tuple | None:
    """A bucket whose tensors lie in Ray's object store, staged as where they lie there (nothing
    copied; the bucket is held, and so its object pinned, until the worker loaded it); None
    where store_views cannot give them to the worker."""
    if views is None:
        return None
    header, flats = layout(bucket)
    found = views.region(flats)
    if found is None:
        return None
    region, header["offsets"] = found
    return header, None, None, None, (region, bucket)


def _stage(bucket: list, transport: str, slots=None) -> tuple:
    """(header, /dev/shm path or None, buffer or None, slot or None, None): a bucket ready to send
    (the last element: `_in_store`'s region and bucket)."""
    if transport in ("shm", "file"):
        try:
            if transport == "file":
                header, path = write_bucket(bucket)
                return header, path, None, None, None
            header, flats = layout(bucket)
            slot = slots.take(header["nbytes"])
            try:
                slot.write(header["offsets"], flats)
            except BaseException:
                slots.give(slot, ok=False)
                raise
            return header, slot.path, None, slot, None
        except OSError:  # no /dev/shm, or one too small for the bucket (Docker's default is 64 MiB)
            pass
    elif transport != "bytes":
        raise ValueError(f"transport={transport!r}: shm, file or bytes")
    header, buf = pack_bucket(bucket)
    return header, None, buf, None, None


async def _stage_in_thread(bucket: list, transport: str, slots=None) -> tuple:
    """`_stage` in a thread (the copy holds no pull up). A load cancelled meanwhile gives the
    slot the thread takes back once the thread is done with it."""
    job = asyncio.ensure_future(asyncio.to_thread(_stage, bucket, transport, slots))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(lambda j: j.cancelled() or j.exception() or _unstage(j.result(), slots, ok=True))
        raise


def _unstage(staged: tuple, slots, ok: bool) -> None:
    path, slot = staged[1], staged[3]
    if slot is not None:
        slots.give(slot, ok)
    elif path is not None:
        os.unlink(path)


async def _send(engine, staged: tuple, handed: dict, slots=None, views=None) -> None:
    """Have the worker load the `staged` bucket; counted in `handed` (way -> buckets) once loaded."""
    from ..transfer.ipc import is_ipc

    if staged[4] is not None:
        region, bucket = staged[4]
        if region["key"] not in views.mapped:  # once per mapping: every worker maps it, or none loads from it
            errors = ["refused before"]
            if views.usable:  # (a bucket staged before a refusal is not asked again)
                try:
                    errors = [e for e in await engine.collective_rpc("rc_map_region", args=(region,)) if e]
                except Exception as e:  # (nothing was loaded: the bucket goes through a slot)
                    errors = [f"{type(e).__name__}: {e}"]
                if errors:
                    views.refused(errors[0])
            if errors:
                staged = await _stage_in_thread(bucket, "shm", slots)
            else:
                views.mapped.add(region["key"])
        if staged[4] is not None:
            views.used.add(region["key"])
            await engine.collective_rpc("rc_tensors_load", args=(staged[0], None, None, None, region["key"]))
            handed["store"] += 1
            return
    header, path, buf, slot, _ = staged
    if is_ipc(buf):
        await engine.collective_rpc("rc_tensors_load_ipc", args=(header, buf.handles))
        handed["ipc"] += 1
        return
    if path is None:
        await engine.collective_rpc("rc_tensors_load", args=(header, None, buf.numpy().data))
        handed["bytes"] += 1
        return
    ok = False
    try:
        if slot is None:
            await engine.collective_rpc("rc_tensors_load", args=(header, path))
        else:
            await engine.collective_rpc("rc_tensors_load", args=(header, path, None, (slot.id, slot.nbytes)))
            slot.worker_has_it()
        handed["file" if slot is None else "slot"] += 1
        ok = True
    finally:
        _unstage(staged, slots, ok)


async def _end(engine, broken, slots=None, views=None) -> list:
    """rc_tensors_end on every worker: the parameters that got no tensor (any worker's). The
    workers keep the maps of the engine's pooled slots: a load by bytes or file used none (`slots`
    None), and unmapping them all broke the next load by shm."""
    if slots is None:
        slots = _SLOTS.get(engine)
    try:
        per_worker = await engine.collective_rpc("rc_tensors_end", args=(slots.ids() if slots else [],
                                                                         views.end_load() if views else None))
    except Exception as e:
        raise broken(f"vLLM failed finishing the load, its weights are now unknown: {e}") from e
    return sorted({n for missing in per_worker for n in (missing or ())})

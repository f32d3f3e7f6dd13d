"""How fast can a replica's worker copy a pushed bucket from Ray's object store to the GPU?

A streamed push of a 7B model is now the replica's load (README, "Staged pushes against streamed
ones"), and in it vLLM's `load_weights` reads each bucket where it lies in the store: pageable,
file-backed shared memory (the plasma store maps a file in /dev/shm), about 5 GB/s. This measures,
on the same bytes in a /dev/shm mapping like the store's, side by side and alternating:
  pageable  each 256 MiB chunk copied to the GPU as it is (what the worker does now)
  register  the mapping page-locked once (cudaHostRegister), then asynchronous copies; the
            registration's own cost reported apart (a replica would pay it once per store)
  ring      each chunk copied by the CPU into one of two page-locked buffers, the GPU copying the
            other one meanwhile (no registration of the store)
Every way's GPU bytes are checked against the source (a sample of each chunk). Torch only.

    python3 experiments/weights-colocated/h2d_bench.py --gib 15 --rounds 3 --out $OUT

`--worker`: the replica's own ring (engines/device_staging.py) instead, bucket by bucket (256 MiB),
reading the file as the worker reads the store (store_views.open_region: a private mapping of
its own, whose page tables each new object's pages first fill), torch at one thread outside the copies
and the ring's threads 1, 4, 8 and 16 (results/h100-h2d-worker; the worker's own numbers:
results/h100-ring-threads).

    PYTHONPATH=$PWD python3 experiments/weights-colocated/h2d_bench.py --worker --gib 15 --rounds 2 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import time

import numpy as np
import torch

CHUNK = 256 << 20


def shm_mapping(nbytes: int, path: str):
    """A file in /dev/shm of `nbytes` random-ish bytes, mapped shared (as plasma maps its store)."""
    with open(path, "wb") as f:
        f.truncate(nbytes)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 255, size=CHUNK, dtype=np.uint8)
    for off in range(0, nbytes, CHUNK):  # (every page touched once, as ray.put's copy does)
        n = min(CHUNK, nbytes - off)
        arr[off:off + n] = block[:n]
        arr[off] = (off // CHUNK) % 251  # each chunk different
    return mm, arr


def chunks(nbytes: int):
    return [(off, min(CHUNK, nbytes - off)) for off in range(0, nbytes, CHUNK)]


def pageable(src: torch.Tensor, dst: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for off, n in chunks(src.numel()):
        dst[off:off + n].copy_(src[off:off + n])
    torch.cuda.synchronize()
    return time.perf_counter() - t


def registered(src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, float]:
    """(register s, copy s, unregister s)."""
    cudart = torch.cuda.cudart()
    t = time.perf_counter()
    err = cudart.cudaHostRegister(src.data_ptr(), src.numel(), 0)
    reg = time.perf_counter() - t
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for off, n in chunks(src.numel()):
            dst[off:off + n].copy_(src[off:off + n], non_blocking=True)
        torch.cuda.synchronize()
        copy = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        cudart.cudaHostUnregister(src.data_ptr())
        unreg = time.perf_counter() - t
    return reg, copy, unreg


def ring(src: torch.Tensor, dst: torch.Tensor, bufs: list, stream) -> float:
    done = [torch.cuda.Event(), torch.cuda.Event()]
    used = [False, False]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i, (off, n) in enumerate(chunks(src.numel())):
        k = i % 2
        if used[k]:
            done[k].synchronize()  # the GPU has read this buffer: it may be written again
        bufs[k][:n].copy_(src[off:off + n])
        with torch.cuda.stream(stream):
            dst[off:off + n].copy_(bufs[k][:n], non_blocking=True)
            done[k].record(stream)
        used[k] = True
    torch.cuda.synchronize()
    return time.perf_counter() - t


def check(src: torch.Tensor, dst: torch.Tensor) -> bool:
    for off, n in chunks(src.numel()):
        idx = torch.tensor([off + (n - 1) * k // 63 for k in range(64)], dtype=torch.long)
        if not torch.equal(src[idx], dst[idx.cuda()].cpu()):
            return False
    return True


def worker_view(path: str, nbytes: int):
    """The file mapped as store_views.open_region maps the store: private, read and write."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def staged_buckets(staging, src: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """(seconds, every sampled byte equal): src to the device bucket by bucket through the ring."""
    t, equal = 0.0, True
    for off, n in chunks(src.numel()):
        t0 = time.perf_counter()
        out = staging.to_device(src[off:off + n])
        torch.cuda.synchronize()
        t += time.perf_counter() - t0
        idx = torch.tensor([(n - 1) * k // 63 for k in range(64)], dtype=torch.long)
        equal = equal and torch.equal(out[idx.cuda()].cpu(), ref[off:off + n][idx])
    return t, equal


WAYS = [(1, False), (4, False), (8, False), (16, False), (8, True)]  # (DeviceStaging's threads, a warm mapping)


def worker_mode(a, path: str, nbytes: int, ref: torch.Tensor) -> list:
    """The ring as the worker reads: torch at one thread outside the copies (so that each way's
    threads are the ring's own; the worker's torch had 16), the
    ring raising torch's threads to 1, 4, 8, 16 for its copies (device_staging.copy_threads), on a
    fresh private mapping of the file (its page tables filled by the copy, as a new object's are)
    or, "-warm", on one read once before."""
    from rollout_cluster.engines.device_staging import DeviceStaging

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    rows = []
    for r in range(a.rounds):
        for threads, warm in WAYS:
            row = {"round": r, "way": f"ring-{threads}t" + ("-warm" * warm), "threads": threads,
                   "torch_threads": torch.get_num_threads()}
            staging = DeviceStaging(dev, threads=threads)
            try:
                mm, src = worker_view(path, nbytes)
                if warm:  # (the mapping's page tables filled by a first pass, not counted)
                    staged_buckets(staging, src, ref)
                copy_s, row["equal"] = staged_buckets(staging, src, ref)
                row["copy_s"] = copy_s
                row["gb_per_s"] = nbytes / copy_s / 1e9
                del src
                try:
                    mm.close()
                except BufferError:  # (a view still alive: the mapping goes with it)
                    pass
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help="the replica's ring (device_staging.py), as the worker reads")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    nbytes = int(a.gib * (1 << 30)) // CHUNK * CHUNK
    import shutil

    where = "/dev/shm" if shutil.disk_usage("/dev/shm").free > nbytes * 1.1 else "/tmp"  # (a small /dev/shm)
    path = f"{where}/h2d-bench-{os.getpid()}"
    t = time.perf_counter()
    mm, arr = shm_mapping(nbytes, path)
    src = torch.from_numpy(arr)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "bytes": nbytes, "file": path,
                      "fill_s": round(time.perf_counter() - t, 2)}), flush=True)
    if a.worker:
        rows = worker_mode(a, path, nbytes, src)
        with open(os.path.join(a.out, "h2d_bench_worker.json"), "w") as f:
            json.dump({"rows": rows, "bytes": nbytes, "gpu": torch.cuda.get_device_name()}, f, indent=1)
        os.unlink(path)
        return
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    bufs = [torch.empty(CHUNK, dtype=torch.uint8).pin_memory() for _ in range(2)]
    stream = torch.cuda.Stream()
    rows = []
    ways = ["pageable", "register", "ring"]
    for r in range(a.rounds):
        order = ways[r % 3:] + ways[:r % 3]
        for way in order:
            dst.zero_()
            row = {"round": r, "way": way}
            try:
                if way == "pageable":
                    row["copy_s"] = pageable(src, dst)
                elif way == "register":
                    row["register_s"], row["copy_s"], row["unregister_s"] = registered(src, dst)
                else:
                    row["copy_s"] = ring(src, dst, bufs, stream)
                row["gb_per_s"] = nbytes / row["copy_s"] / 1e9
                row["equal"] = check(src, dst)
            except Exception as e:  # (a way the platform refuses: said, the others go on)
                row["error"] = f"{type(e).__name__}: {e}"
            row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {w: sorted(x["copy_s"] for x in rows if x["way"] == w and "copy_s" in x) for w in ways}
    summary["register_s"] = sorted(x["register_s"] for x in rows if "register_s" in x)
    print(json.dumps({"summary": summary}), flush=True)
    with open(os.path.join(a.out, "h2d_bench.json"), "w") as f:
        json.dump({"rows": rows, "summary": summary, "bytes": nbytes, "gpu": torch.cuda.get_device_name()}, f, indent=1)
    os.unlink(path)  # (the mapping goes with the process)


if __name__ == "__main__":
    main()

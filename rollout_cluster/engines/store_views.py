"""A pushed bucket read where it lies: vLLM's worker maps the memory of Ray's object store that the
replica's `ray.get` gave, instead of the replica copying the bucket into a /dev/shm slot
(shm_slots.py; the copy was 0.19 s of a 437 MB push on the CPU cluster, experiments/weights-sync).

Ray's object store on a node is a file in /dev/shm (unlinked) that every Ray process there maps
shared; `ray.get` of a bucket gives numpy arrays that view it. vLLM's worker is no Ray process,
but it can open the same file: as /proc/<replica>/map_files/<start>-<end> (needs CAP_SYS_ADMIN or
CAP_CHECKPOINT_RESTORE), or through a descriptor the replica's parent (Ray's raylet, which serves
the store) keeps open, /proc/<parent>/fd/<n>, which needs only the same user. The replica looks
the file up once per mapping (`StoreViews.region`), the worker maps it read-only once and keeps
the mapping (worker_loader.TensorLoader.rc_map_region), so a push touches no fresh page.

Safety, and where it does not apply:
- The worker checks that what it opened is the file the replica mapped (device and inode) and
  maps the same range of it; the replica holds the bucket (Ray pins the object, which is
  immutable once sealed) until the worker's load of it returned; a layerwise reload's views of
  the bucket are copied before that (worker_loader._copy_kept_views).
- A bucket whose tensors do not lie in one shared file mapping (an object Ray kept in the
  process's heap, a bucket given as torch tensors), or a worker that cannot open the file (no
  capability, another host, no /proc), goes through a slot as before: the first failure to map
  switches the engine to slots for good, before any tensor of that bucket is loaded.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger(__name__)

KNOWN_KEPT = 8  # mappings remembered (the store is one; Ray's fallback allocations add others)
ENV = "ROLLOUT_STORE_VIEWS"  # "0": always copy into slots (the measurement's baseline)


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/self/maps: a file mapped shared."""

    start: int  # its first address in this process
    end: int  # one past its last
    offset: int  # where it starts in its file
    dev: int  # the file's device (os.stat's st_dev)
    ino: int  # the file's inode


@dataclass
class StoreViews:
    """A replica's knowledge of which object-store mappings its engine's worker has mapped."""

    usable: bool = field(default_factory=lambda: os.environ.get(ENV, "1") != "0")  # false once the worker could not map one
    paths: dict = field(default_factory=dict)  # Mapping -> a path the worker may open it by (None: none)
    # Mapping -> the file it maps as /proc/self/map_files names it: a mapping found before is
    # taken again while that name is the same (one readlink, not a read of every mapping's line)
    known: dict = field(default_factory=dict)
    mapped: set = field(default_factory=set)  # region keys the worker has mapped now
    used: set = field(default_factory=set)  # region keys this load sent (kept mapped at its end)

    def region(self, flats: list) -> Optional[tuple]:
        """(region, offsets): where a bucket's flat uint8 tensors lie, as the region the worker maps
        (a dict: path, device, inode, offset, length, key) and each tensor's offset in it; None
        when they do not all lie in one shared file mapping that the worker may open."""
        if not self.usable:
            return None
        spans = [(f.data_ptr(), f.numel()) for f in flats if f.numel()]
        if not spans:
            return None
        m = self._mapping(spans[0][0])
        if m is None or any(not (m.start <= a and a + n <= m.end) for a, n in spans):
            return None
        if m not in self.paths:
            self.paths[m] = opener_path(m)
        path = self.paths[m]
        if path is None:
            return None
        key = f"{m.dev}:{m.ino}:{m.offset}:{m.end - m.start}"
        region = {"path": path, "dev": m.dev, "ino": m.ino, "offset": m.offset, "length": m.end - m.start, "key": key}
        return region, [f.data_ptr() - m.start if f.numel() else 0 for f in flats]

    def _mapping(self, addr: int) -> Optional[Mapping]:
        for m, name in self.known.items():
            if m.start <= addr < m.end and _linked(m) == name:
                return m
        m = mapping_of(addr)
        if m is not None and (name := _linked(m)) is not None:
            self.known[m] = name
            while len(self.known) > KNOWN_KEPT:
                self.known.pop(next(iter(self.known)))
        return m

    def refused(self, why: str) -> None:
        self.usable = False
        log.warning("the vLLM worker cannot map Ray's object store (%s): buckets are copied into /dev/shm "
                    "slots instead", why)

    def end_load(self) -> list:
        """The region keys to keep mapped after a load: the ones it used."""
        self.mapped &= self.used
        keep, self.used = sorted(self.used), set()
        return keep


def mapping_of(addr: int) -> Optional[Mapping]:
    """The shared file mapping of this process that holds `addr` (None: a private one, or none)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    if parts[1][3] != "s" or parts[4] == "0":
                        return None
                    return Mapping(lo, hi, int(parts[2], 16), _dev_of(parts[3]), int(parts[4]))
    except (OSError, ValueError, IndexError):
        return None
    return None


def opener_path(m: Mapping) -> Optional[str]:
    """A path by which another process of this user may open the file of `m`: this process's
    map_files entry where it can be opened, else a descriptor of the file that the parent (Ray's
    raylet) holds. None: neither."""
    own = f"/proc/{os.getpid()}/map_files/{m.start:x}-{m.end:x}"
    if _same_file(own, m):
        return own
    fds = f"/proc/{os.getppid()}/fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return None
    for name in names:
        path = os.path.join(fds, name)
        if _same_file(path, m, open_it=False):
            return path
    return None


def open_region(region: dict) -> "torch.Tensor":
    """The worker's side: the region mapped read-only, as a flat uint8 tensor; or OSError naming
    why (not the file the replica mapped, no access)."""
    import mmap
    import warnings

    import torch

    fd = os.open(region["path"], os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (region["dev"], region["ino"]):
            raise OSError(f"{region['path']} is device {st.st_dev} inode {st.st_ino}, not the object store's "
                          f"{region['dev']}:{region['ino']}")
        # private and writable: a loader that writes into its input gets its own copy of the page
        # (copy on write), never a fault, and never writes into the store
        mm = mmap.mmap(fd, region["length"], flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=region["offset"])
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # (no warning on a writable buffer; kept for older torch)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


def _linked(m: Mapping) -> Optional[str]:
    """The name of the file at the range of `m` now (readlink needs no capability, unlike open)."""
    try:
        return os.readlink(f"/proc/self/map_files/{m.start:x}-{m.end:x}")
    except OSError:
        return None


def _same_file(path: str, m: Mapping, open_it: bool = True) -> bool:
    """`path` is the file `m` maps. `open_it`: checked by opening it (a map_files entry: stat alone
    may pass where open needs a capability); else by stat, which opens nothing (a descriptor of the
    raylet may be a FIFO, a socket or a terminal)."""
    try:
        if not open_it:
            st = os.stat(path)
            return (st.st_dev, st.st_ino) == (m.dev, m.ino)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (m.dev, m.ino)
    finally:
        os.close(fd)


def _dev_of(majmin: str) -> int:
    """The device of a maps line ("major:minor" in hex) as os.stat's st_dev."""
    major, minor = (int(x, 16) for x in majmin.split(":"))
    return os.makedev(major, minor)

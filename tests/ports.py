"""A TCP port for a test's listener (a TCPStore the test or the relay hosts).

Binding port 0 and handing the number on races with the kernel: the port it freed is an
ephemeral port, and any outgoing connection on the box (Ray's, another test worker's) may get it
before the listener binds it. This picks ports below the ephemeral range, where the kernel never
hands ports out by itself, checks that nothing listens there, and never gives the same port twice
in one process.
"""
from __future__ import annotations

import random
import socket

_GIVEN: set = set()  # ports this process handed out already


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(rng: random.Random = random.Random()) -> int:
    """A port that nothing listens on, outside the ephemeral range."""
    low = ephemeral_low()
    lo, hi = (20000, low - 1) if low > 21000 else (low // 2, low - 1)
    for _ in range(500):
        port = rng.randint(lo, hi)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every interface, as a TCPStore listens
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{hi} after 500 tries")

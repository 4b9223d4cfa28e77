"""A free TCP port for a rendezvous (MASTER_PORT), chosen below the kernel's ephemeral range.

``bind(("127.0.0.1", 0))`` hands out a port from the ephemeral range (32768-60999 on Linux) and the
port is free again once the probe socket closes; until the launched process listens on it, any
outgoing connection on the host (gloo opens many) may take it as its source port, and the launch
fails with EADDRINUSE. Ports below the ephemeral range are never given to outgoing connections, so a
probe there stays free unless another listener picks the same number (random choice, re-probed).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 20000  # above the well-known and most registered service ports
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing source ports (Linux; the IANA range elsewhere)."""
    try:
        lo, hi = (int(x) for x in RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "", attempts: int = 64) -> int:
    """A port that is free now and outside the ephemeral range (random in [LOW, start of that
    range)); falls back to one the kernel picks when that range is too small or all tries are taken.
    host "" probes every interface, as the rendezvous store listens: a port another process holds on a
    non-loopback address only fails there."""
    start, _ = ephemeral_range()
    rng = random.Random()  # system entropy: concurrent callers do not share a sequence
    if start - LOW >= 1000:
        for _ in range(attempts):
            port = rng.randrange(LOW, start)
            if _bindable(port, host):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

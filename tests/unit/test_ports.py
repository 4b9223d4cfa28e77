"""Rendezvous ports: free, and outside the range the kernel hands to outgoing connections."""

import socket

from ascender_dist import ports


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    start, _ = ports.ephemeral_range()
    picked = {ports.free_port() for _ in range(20)}
    assert all(ports.LOW <= p < start for p in picked)
    assert len(picked) > 1  # random, so concurrent launches rarely pick the same number
    for port in picked:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_returned(monkeypatch):
    """Every random probe lands on a port another socket holds: each is refused, and the port comes
    from the kernel instead (the probe loop runs: the preferred range is 1000 ports wide)."""
    probes = []
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1000, 60999))
        monkeypatch.setattr(ports, "LOW", taken)
        monkeypatch.setattr(ports.random.Random, "randrange", lambda self, lo, hi: probes.append(lo) or taken)
        port = ports.free_port(attempts=5)
    assert probes == [taken] * 5
    assert port != taken

"""Loopback ports for the servers and rendezvous that tests start in subprocesses.

A port the kernel hands out for port 0 comes from the ephemeral range, the same range from which every outgoing
connection (health checks, zmq, torch.distributed) takes its local port. Between the moment a test picks such a port
and the moment its server binds it, another connection can take it: "address already in use" at start-up, a flake
that grows with the number of servers a test starts at once. So ports come from below the ephemeral range, which no
connection takes on its own, and none is handed out twice in one test process.
"""

from __future__ import annotations

import os
import random
import socket

_given: set[int] = set()
_pick = random.Random(os.getpid())


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default start of the range


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing listens on now, outside the ephemeral range, not given before in this process."""
    low = _ephemeral_low()
    if low > 11000:
        for _ in range(200):
            port = _pick.randrange(10000, low - 1)  # (a server may also use port + 1)
            if port not in _given and port + 1 not in _given and _bindable(port):
                _given.add(port)
                return port
    while True:  # no room below the ephemeral range: the kernel's choice, still never given twice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port


def free_address() -> str:
    return f"127.0.0.1:{free_port()}"

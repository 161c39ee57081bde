"""Aimed dials: an agent chooses which worker of a proxy-server with several (``--workers``) its next
tunnel reaches, instead of finding the one it lacks by chance.

The workers share the agent port through ``SO_REUSEPORT``, one listening socket each, worker i's the
i-th of the port's group. By default the kernel picks a socket by a hash of the connection's addresses,
so an agent lacking one of N workers needed N·H(N) dials on average to hold all N (2 workers: 3; 16:
54), each a TLS handshake, the surplus answered ``409`` (docs/benchmarks.md, "Open problems"). The
server attaches a classic BPF program to the group that picks the socket from the TCP source port
alone (:func:`worker_of_port`), and tells each agent its worker's index and the count in
``cluster-proxy-server-worker: I/N``. An agent that lacks worker I binds its next dial to a source
port the program maps to I (:func:`source_port_for`), and reaches it with its first dial.

Where something between the two rewrites source ports (a NAT that does not keep them, a forward
proxy or a load balancer that opens its own connections), the port the server sees is as good as
random: the program then spreads connections as evenly as the kernel's hash did, and the agents'
replica search (a ``409``, then a new dial) finds the rest as before. The port is mixed by a
multiplication before it is reduced, because Linux gives outgoing connections even ports first: a
plain ``port % N`` would send every unaimed connection to the even workers.

Pure functions and one ``setsockopt``: no trio here.
"""

from __future__ import annotations

import ctypes
import random
import socket
import struct
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "attach_steering",
    "format_worker",
    "parse_worker",
    "source_port_for",
    "steering_program",
    "worker_of_port",
]

SO_ATTACH_REUSEPORT_CBPF = 51  # <asm-generic/socket.h>; Linux 4.5+
_MULTIPLIER = 0x9E3779B1  # Knuth's multiplicative hash: every bit of the port reaches the top half
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_RANGE = (32768, 60999)

# Classic BPF (linux/filter.h): the packet's network header is at SKF_NET_OFF whatever the program's
# own view of the packet starts with (for TCP: past the TCP header).
_SKF_NET_OFF = -0x100000
_LD, _LDX, _ALU, _JMP, _RET = 0x00, 0x01, 0x04, 0x05, 0x06
_W, _H, _B = 0x00, 0x08, 0x10
_ABS, _IND, _MSH = 0x20, 0x40, 0xA0
_MUL, _RSH, _MOD = 0x20, 0x70, 0x90
_JA, _JEQ = 0x00, 0x10
_K, _A = 0x00, 0x10


def worker_of_port(port: int, workers: int) -> int:
    """The worker (0..workers-1) a connection from source ``port`` reaches: what the program computes."""
    return (((port * _MULTIPLIER) & 0xFFFFFFFF) >> 16) % workers


def source_port_for(
    worker: int,
    workers: int,
    rng: Callable[[], float] = random.random,
    port_range: tuple[int, int] | None = None,
) -> int:
    """A random local port in the range Linux gives outgoing connections that reaches ``worker``."""
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} is not one of {workers}")
    low, high = port_range or local_port_range()
    while True:
        port = low + int(rng() * (high - low + 1))
        if worker_of_port(port, workers) == worker:
            return port


def local_port_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_RANGE
    return (low, high) if 1024 <= low < high <= 65535 else _DEFAULT_RANGE


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def steering_program(workers: int) -> bytes:
    """The classic BPF program (``struct sock_filter`` array) that returns
    :func:`worker_of_port` of a TCP connection's source port, over IPv4 (any header length) or IPv6."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    return b"".join(
        [
            _insn(_LD | _B | _ABS, _SKF_NET_OFF),  # A = the IP header's first byte
            _insn(_ALU | _RSH | _K, 4),  # A = the IP version
            _insn(_JMP | _JEQ | _K, 6, jt=0, jf=2),  # IPv6: the next instruction; IPv4: two on
            _insn(_LD | _H | _ABS, _SKF_NET_OFF + 40),  # A = source port, after the 40-byte IPv6 header
            _insn(_JMP | _JA | _K, 2),
            _insn(_LDX | _B | _MSH, _SKF_NET_OFF),  # X = the IPv4 header's length
            _insn(_LD | _H | _IND, _SKF_NET_OFF),  # A = source port, after it
            _insn(_ALU | _MUL | _K, _MULTIPLIER),
            _insn(_ALU | _RSH | _K, 16),
            _insn(_ALU | _MOD | _K, workers),
            _insn(_RET | _A, 0),
        ]
    )


def attach_steering(sock: socket.socket, workers: int) -> None:
    """Make the ``SO_REUSEPORT`` group ``sock`` belongs to pick its i-th socket for a connection
    whose source port maps to i (a result past the group's end: the kernel's own hash)."""
    program = steering_program(workers)
    filters = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HL", len(program) // 8, ctypes.addressof(filters))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


def format_worker(index: int, workers: int) -> str:
    return f"{index}/{workers}"


def parse_worker(value: str | None) -> tuple[int, int] | None:
    """``I/N`` as told by a worker; None when absent or not a worker index below its count."""
    if not value:
        return None
    index, _, count = value.strip().partition("/")
    try:
        worker, workers = int(index), int(count)
    except ValueError:
        return None
    return (worker, workers) if 0 <= worker < workers <= 1024 else None

"""The sockets of ``--workers N`` and how a worker inherits them (clusterproxy_server.workers).

For each of the agent, client and WebSocket ports the parent opens N listening sockets on the same
address with ``SO_REUSEPORT`` and hands worker i the i-th (``pass_fds``): the kernel spreads new
connections over the N accept queues by a hash of the connection's addresses, so a dial lands on each
worker with the same chance whatever their load (an agent missing one of two workers finds it in two
dials on average). The parent keeps its copy of every socket: a worker that dies leaves its queue to
its successor (connections queued meanwhile wait for the restart instead of being reset, which is what
closing the last descriptor of a listening socket does to them). On SIGTERM the parent closes its
copies first, so that each worker's drain closes its queue for good, as a single process does.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import trio

__all__ = ["LISTEN_BACKLOG", "WORKER_ENV", "WorkerSpec", "listeners_from_fds", "reuseport_sockets"]

WORKER_ENV = "_CLUSTER_PROXY_SERVER_WORKER"  # set by the parent for its workers only: what they inherit
LISTEN_BACKLOG = 0xFFFF  # the kernel caps it at net.core.somaxconn


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process inherits from its parent (in :data:`WORKER_ENV`, as JSON)."""

    index: int
    workers: int
    server_id: str
    server_count: int  # told to agents: replicas x workers
    agent: tuple[int, ...]  # inherited listening descriptors
    client: tuple[int, ...]
    websocket: tuple[int, ...]
    admin: int  # the private admin socket (loopback) the parent asks
    parent_alive: int  # read end of a pipe: EOF when the parent is gone

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        for name in ("agent", "client", "websocket"):
            raw[name] = tuple(raw[name])
        return cls(**raw)

    def fds(self) -> tuple[int, ...]:
        return (*self.agent, *self.client, *self.websocket, self.admin, self.parent_alive)


def listeners_from_fds(fds: Iterable[int]) -> list[trio.SocketListener]:
    return [trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=fd))) for fd in fds]


def reuseport_sockets(host: str, port: int, count: int) -> list[list[socket.socket]]:
    """``count`` groups of listening sockets on ``host:port`` (one socket per address it resolves to,
    as ``trio.open_tcp_listeners`` binds), all sharing the port through ``SO_REUSEPORT``; port 0 takes
    the port the first bind got."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    groups: list[list[socket.socket]] = [[] for _ in range(count)]
    try:
        for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], i[3], i[4]) for i in infos):
            for group in groups:
                sock = socket.socket(family, kind, proto)
                group.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0:
                    sock.bind(address)
                    port = sock.getsockname()[1]
                else:
                    sock.bind((address[0], port, *address[2:]))
                sock.listen(LISTEN_BACKLOG)
    except OSError:
        for group in groups:
            for sock in group:
                sock.close()
        raise
    return groups

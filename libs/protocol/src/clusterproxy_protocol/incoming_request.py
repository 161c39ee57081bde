"""A stream the peer opened toward us (the acceptor's side of the tunnel), and the ways a handler answers
it: accept it as a byte stream, refuse it with a status and a reason, or respond with a whole body.
:class:`~clusterproxy_protocol.driver.Mux` makes one per request and hands it to its ``handler``; this
module is the handler's side of that contract, apart from the connection's machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from clusterproxy_protocol.errors import error_reply

if TYPE_CHECKING:
    from clusterproxy_protocol.driver import Mux
    from clusterproxy_protocol.tunnel_stream import TunnelStream


@dataclass
class IncomingRequest:
    """A stream the peer opened toward us (acceptor role)."""

    method: str
    authority: str
    path: str
    headers: dict[str, str]
    stream: TunnelStream
    mux: Mux

    async def accept(self, headers: Sequence[tuple[str, str]] = ()) -> TunnelStream:
        # The peer may have reset the stream, or the connection died, while we were working on it.
        self.stream.raise_unless_answerable()
        self.stream.unanswered_work = None
        self.mux.core.respond(self.stream.stream_id, 200, list(headers))
        self.mux.kick()
        await trio.lowlevel.checkpoint()
        return self.stream

    async def refuse(self, status: int, reason: str) -> None:
        """Answer with an error status and the reason. The body waits for the peer's window (a short
        body with END_STREAM would be a malformed reply), up to the stall timeout, which resets it."""
        head, body = error_reply(reason)
        try:
            await self.respond(status, body, head)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # gone, or reset for stalling: nobody is left to tell
        finally:
            await self.stream.aclose()

    async def respond(self, status: int, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> None:
        head = [("content-length", str(len(body))), *headers]
        self.stream.raise_unless_answerable()
        self.stream.unanswered_work = None
        self.mux.core.respond(self.stream.stream_id, status, head)
        self.mux.kick()
        await self.stream.send_all(body)
        await self.stream.send_eof()
        await self.stream.aclose()

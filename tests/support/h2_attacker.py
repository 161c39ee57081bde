"""A raw HTTP/2 attacker over mTLS: frames built with hyperframe and hpack, so it can break every rule
an h2 client keeps (issue 10's abuse tests)."""

from __future__ import annotations

import hpack
import trio
from hyperframe.frame import Frame, HeadersFrame, SettingsFrame

from clusterproxy_protocol import tls
from clusterproxy_protocol.framing import PREFACE
from clusterproxy_protocol.pki import PemPair
from tests.support.pki import PkiFiles


class Attacker:
    """A raw HTTP/2 client over mTLS."""

    def __init__(self, stream: trio.SSLStream) -> None:
        self.stream = stream
        host, port = stream.transport_stream.socket.getsockname()[:2]
        self.local_address = f"{host}:{port}"  # the ``peer`` the server logs for this connection
        self.encoder = hpack.Encoder()
        self._buffer = b""

    @classmethod
    async def connect(
        cls,
        port: int,
        pki: PkiFiles,
        *,
        certificate: PemPair | None = None,
        preface: bool = True,
        **settings: int,
    ) -> Attacker:
        """An attacker with a finished TLS handshake to ``port``, presenting ``certificate`` (the hub
        client certificate unless given: an agent's, say, to try roles); with ``preface``, the HTTP/2
        preface and a SETTINGS frame of ``settings`` (``_4=0``: SETTINGS_INITIAL_WINDOW_SIZE 0) sent."""
        pair = certificate or pki.client
        context = tls.client_context(pair.cert, pair.key, pki.ca, alpn=["h2"])
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = trio.SSLStream(tcp, context, server_hostname="localhost")
        await stream.do_handshake()
        attacker = cls(stream)
        if preface:
            codes = {int(name[1:]): value for name, value in settings.items()}
            await attacker.send(PREFACE + SettingsFrame(0, settings=codes).serialize())
        return attacker

    def connect_frame(self, stream_id: int, authority: str, *, end_stream: bool = False) -> bytes:
        headers = [(":method", "CONNECT"), (":authority", authority), ("cluster-proxy-cluster", "cluster1")]
        frame = HeadersFrame(stream_id, data=self.encoder.encode(headers))
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame.serialize()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    async def next_frame(self) -> Frame | None:
        """The server's next frame; None at the end of the connection."""
        while True:
            if len(self._buffer) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(self._buffer[:9]))
                if len(self._buffer) >= 9 + length:
                    frame.parse_body(memoryview(self._buffer[9 : 9 + length]))
                    self._buffer = self._buffer[9 + length :]
                    return frame
            try:
                data = await self.stream.receive_some(1 << 16)
            except trio.BrokenResourceError:
                return None
            if not data:
                return None
            self._buffer += data

    async def until(self, kind: type[Frame], stream_id: int | None = None) -> Frame:
        while (frame := await self.next_frame()) is not None:
            if isinstance(frame, kind) and (stream_id is None or frame.stream_id == stream_id):
                return frame
        raise AssertionError(f"connection ended before a {kind.__name__}")

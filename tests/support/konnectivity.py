"""A konnectivity gRPC client for tests, as Go's ``konnectivity-client`` behaves: one ``ProxyService/Proxy``
stream over mTLS HTTP/2 (the h2 library, with real flow control both ways, so it moves megabytes), a
``DIAL_REQ`` answered by a ``DIAL_RSP``, ``DATA`` packets both ways, and ``CLOSE_REQ`` at the end.

The raw-frame helpers of tests/integration/test_konnectivity_frontend.py break the rules on purpose and
send no WINDOW_UPDATE; this one keeps them."""

from __future__ import annotations

import ssl

import h2.config
import h2.connection
import h2.events
import trio

from clusterproxy_server.frontends import konnectivity_pb2 as pb
from clusterproxy_server.frontends.konnectivity import PATH, MessageReader, frame

CHUNK = 64 << 10


class KonnectivityClient:
    """One gRPC ``Proxy`` stream and its packets. Use :func:`open_konnectivity`."""

    def __init__(self, stream: trio.SSLStream, metadata: list[tuple[str, str]]) -> None:
        self._tls = stream
        self._conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self._metadata = metadata
        self._send_lock = trio.Lock()
        self._window = trio.Event()  # set when the peer opens a window
        self._reader = MessageReader()
        self._packets_in, self.packets = trio.open_memory_channel[pb.Packet | None](1024)
        self.stream_id = 0
        self.trailers: dict[str, str] = {}

    async def _flush(self) -> None:
        async with self._send_lock:  # taken under the lock: bytes go out in the order h2 made them
            data = self._conn.data_to_send()
            if data:
                await self._tls.send_all(data)

    async def start(self) -> None:
        self._conn.initiate_connection()
        self.stream_id = self._conn.get_next_available_stream_id()
        self._conn.send_headers(
            self.stream_id,
            [
                (":method", "POST"),
                (":scheme", "https"),
                (":authority", "hub"),
                (":path", PATH),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *self._metadata,
            ],
        )
        await self._flush()

    async def read_frames(self) -> None:
        """Until the connection ends: frames in, packets to :attr:`packets` (None at the stream's end)."""
        try:
            while data := await self._tls.receive_some(CHUNK):
                for event in self._conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        self._reader.feed(event.data)
                        while (message := self._reader.next()) is not None:
                            packet = pb.Packet()
                            packet.ParseFromString(message)
                            await self._packets_in.send(packet)
                    elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                        self._window.set()
                    elif isinstance(event, h2.events.TrailersReceived):
                        self.trailers = {k.decode(): v.decode() for k, v in event.headers}
                    elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                        await self._packets_in.send(None)
                await self._flush()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._packets_in.close()

    async def send(self, packet: pb.Packet) -> None:
        """One packet, within the peer's flow-control windows (waiting for them to open)."""
        data = frame(packet)
        while data:
            room = min(
                self._conn.local_flow_control_window(self.stream_id), self._conn.max_outbound_frame_size
            )
            if room <= 0:
                self._window = trio.Event()
                await self._window.wait()
                continue
            self._conn.send_data(self.stream_id, data[:room])
            data = data[room:]
            await self._flush()

    async def next_packet(self) -> pb.Packet:
        packet = await self.packets.receive()
        assert packet is not None, f"the gRPC stream ended (trailers {self.trailers})"
        return packet

    async def end(self) -> None:
        """End our side of the gRPC stream (gRPC's half-close)."""
        self._conn.end_stream(self.stream_id)
        await self._flush()


async def open_konnectivity(
    nursery: trio.Nursery, port: int, context: ssl.SSLContext, metadata: list[tuple[str, str]] = ()
) -> KonnectivityClient:  # type: ignore[assignment]
    """A client on 127.0.0.1:``port`` (``context``: the hub client's, ALPN h2) with its frame reader
    running in ``nursery``."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="localhost")
    client = KonnectivityClient(stream, list(metadata))
    await client.start()
    nursery.start_soon(client.read_frames)
    return client


async def dial(client: KonnectivityClient, address: str, random: int = 1) -> pb.DialResponse:
    """``DIAL_REQ`` for ``address``; its ``DIAL_RSP`` (``error`` set when refused)."""
    await client.send(
        pb.Packet(
            type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="tcp", address=address, random=random)
        )
    )
    while True:
        packet = await client.next_packet()
        if packet.type == pb.DIAL_RSP and packet.dialResponse.random == random:
            return packet.dialResponse


async def send_data(client: KonnectivityClient, connect_id: int, data: bytes) -> None:
    for start in range(0, len(data), CHUNK):
        chunk = data[start : start + CHUNK]
        await client.send(pb.Packet(type=pb.DATA, data=pb.Data(connectID=connect_id, data=chunk)))


async def close(client: KonnectivityClient, connect_id: int) -> None:
    await client.send(pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=connect_id)))

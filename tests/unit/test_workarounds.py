"""The third-party internals the tunnel relies on for speed are there, with the shape it relies on, in
the installed (pinned) versions; a change fails loudly, naming the library, version and attribute."""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import inspect
import ssl
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator

import h2.connection
import h2.events
import h2.stream
import hyperframe.frame
import pytest
import trio
import trio._ssl
import trio.testing

from clusterproxy_protocol import h2_connection, tls, transport, workarounds
from clusterproxy_protocol.core import Role, TunnelCore
from clusterproxy_protocol.workarounds import InternalChanged
from tests.support.cores import connected, pump
from tests.support.pki import PkiFiles
from tests.support.tls_streams import tls_pair

CHECKS: dict[str, Callable[[], None]] = {
    "hyperframe": workarounds.check_hyperframe_body_repr,
    "h2": h2_connection.check_h2_open_streams,
    "h2-data": h2_connection.check_h2_data_frames,
    "trio": workarounds.check_trio_ssl_object,
    "trio-ssl-internals": workarounds.check_trio_ssl_internals,
    "trio-handshake": workarounds.check_trio_handshake_once,
}


@pytest.mark.parametrize("library", CHECKS)
def test_the_installed_version_has_the_internal_with_the_expected_shape(library: str) -> None:
    # When this fails after a version bump, the message names what moved: adapt the workaround (or
    # drop it, if the library fixed the slowness) before raising the bound in libs/protocol/pyproject.toml.
    CHECKS[library]()


@pytest.fixture
def h2_check_not_cached() -> Iterator[None]:
    h2_connection.check_h2_internals.cache_clear()
    yield
    h2_connection.check_h2_internals.cache_clear()


@pytest.fixture
def hyperframe_unpatched() -> Iterator[None]:
    """Run with hyperframe as shipped, and leave it as the test found it."""
    data_frame = hyperframe.frame.DataFrame
    found = data_frame.__dict__.get("_body_repr")
    if found is not None:
        del data_frame._body_repr
    yield
    if "_body_repr" in data_frame.__dict__:
        del data_frame._body_repr
    if found is not None:
        data_frame._body_repr = found  # type: ignore[method-assign]


@pytest.fixture
def trio_handshake_as_shipped() -> Iterator[None]:
    """Run with trio's SSLStream handshake as shipped, and leave it as the test found it."""
    once = trio._ssl._Once
    found = once.__dict__["ensure"]
    once.ensure = inspect.unwrap(found)  # type: ignore[method-assign]
    yield
    once.ensure = found  # type: ignore[method-assign]


def _assert_names(error: InternalChanged, library: str, attribute: str) -> None:
    text = str(error)
    assert error.library == library and error.attribute == attribute
    assert f"{library} {importlib.metadata.version(library)}: {attribute}" in text
    assert f"declares {library}<" in text  # the range this package was checked with


def test_a_missing_h2_internal_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, h2_check_not_cached: None
) -> None:
    monkeypatch.delattr(h2.connection.H2Connection, "_open_streams")
    with pytest.raises(InternalChanged) as info:
        h2_connection.check_h2_open_streams()
    _assert_names(info.value, "h2", "H2Connection._open_streams")
    with pytest.raises(InternalChanged):
        TunnelCore(Role.OPENER)  # at use: the first connection made


def test_an_h2_internal_of_another_shape_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h2.connection.H2Connection, "_open_streams", lambda self: 0)
    with pytest.raises(InternalChanged) as info:
        h2_connection.check_h2_open_streams()
    _assert_names(info.value, "h2", "H2Connection._open_streams")


def test_h2_counting_streams_another_way_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h2.connection.H2Connection, "open_outbound_streams", property(lambda self: 0))
    with pytest.raises(InternalChanged) as info:
        h2_connection.check_h2_open_streams()
    _assert_names(info.value, "h2", "H2Connection.open_outbound_streams")


def test_hyperframe_showing_another_text_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, hyperframe_unpatched: None
) -> None:
    monkeypatch.setattr(
        hyperframe.frame.Frame, "_body_repr", lambda self: f"length={len(self.serialize_body())}"
    )
    with pytest.raises(InternalChanged) as info:
        workarounds.apply()
    _assert_names(info.value, "hyperframe", "Frame._body_repr")
    assert "_body_repr" not in hyperframe.frame.DataFrame.__dict__  # nothing patched


def test_hyperframe_without_the_helper_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, hyperframe_unpatched: None
) -> None:
    monkeypatch.delattr(hyperframe.frame, "_raw_data_repr")
    with pytest.raises(InternalChanged) as info:
        workarounds.check_hyperframe_body_repr()
    _assert_names(info.value, "hyperframe", "frame._raw_data_repr")


async def test_a_tls_stream_without_its_ssl_object_fails_loudly() -> None:
    left, _ = trio.testing.memory_stream_pair()
    stream = trio.SSLStream(left, ssl.create_default_context(), server_hostname="x")
    assert isinstance(workarounds.ssl_object_of(stream), ssl.SSLObject)
    stream._ssl_object = None  # type: ignore[attr-defined]  # as if trio renamed it
    with pytest.raises(InternalChanged) as info:
        workarounds.ssl_object_of(stream)
    _assert_names(info.value, "trio", "SSLStream._ssl_object")


@pytest.mark.parametrize("size", [0, 1, 5, 10, 11, 12, 100, 16384])
@pytest.mark.parametrize("padded", [False, True])
def test_the_cheap_data_frame_repr_is_hyperframes_text(
    size: int, padded: bool, hyperframe_unpatched: None
) -> None:
    options = {"flags": ["PADDED"], "pad_length": 7} if padded else {}
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    expected = repr(hyperframe.frame.DataFrame(3, data, **options))
    workarounds.apply()
    assert repr(hyperframe.frame.DataFrame(3, data, **options)) == expected
    assert repr(hyperframe.frame.DataFrame(3, memoryview(data), **options)) == expected


def test_apply_patches_only_the_data_frame_and_is_idempotent(hyperframe_unpatched: None) -> None:
    frame_body_repr = hyperframe.frame.Frame.__dict__["_body_repr"]
    headers_body_repr = hyperframe.frame.HeadersFrame.__dict__["_body_repr"]
    workarounds.apply()
    patched = hyperframe.frame.DataFrame.__dict__["_body_repr"]
    workarounds.apply()
    assert hyperframe.frame.DataFrame.__dict__["_body_repr"] is patched
    assert hyperframe.frame.Frame.__dict__["_body_repr"] is frame_body_repr
    assert hyperframe.frame.HeadersFrame.__dict__["_body_repr"] is headers_body_repr


def test_importing_the_protocol_patches_nothing() -> None:
    program = (
        "import clusterproxy_protocol.driver, clusterproxy_protocol.relay, hyperframe.frame\n"
        "assert '_body_repr' not in hyperframe.frame.DataFrame.__dict__\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True)


@pytest.mark.parametrize("entry_point", ["clusterproxy_server.main", "clusterproxy_agent.main"])
def test_the_services_apply_them_first_thing(entry_point: str) -> None:
    program = (
        f"import hyperframe.frame, {entry_point} as service\n"
        "try:\n"
        "    service.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert '_body_repr' in hyperframe.frame.DataFrame.__dict__\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, stdout=subprocess.DEVNULL)


def test_h2_taking_headers_without_its_stream_limit_check_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The core refuses excess streams itself only because h2's check goes through open_inbound_streams."""
    monkeypatch.setattr(h2.connection.H2Connection, "_receive_headers_frame", lambda self, frame: ([], []))
    with pytest.raises(InternalChanged) as info:
        h2_connection.check_h2_open_streams()
    _assert_names(info.value, "h2", "H2Connection._receive_headers_frame")


def test_h2_charging_its_windows_another_way_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """send_data_frames charges h2's windows itself: an h2 that charges differently is refused."""
    original = h2.stream.H2Stream.send_data

    def send_data(self: h2.stream.H2Stream, *args: object, **kwargs: object) -> list[object]:
        frames = original(self, *args, **kwargs)
        self.outbound_flow_control_window -= 1
        return frames

    monkeypatch.setattr(h2.stream.H2Stream, "send_data", send_data)
    with pytest.raises(InternalChanged) as info:
        h2_connection.check_h2_data_frames()
    _assert_names(info.value, "h2", "H2Connection.send_data")


def test_h2_growing_its_receive_windows_another_way_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """grant_received grows h2's inbound windows itself: an h2 that grows them differently is refused."""
    original = h2.stream.H2Stream.increase_flow_control_window

    def increase(self: h2.stream.H2Stream, increment: int) -> list[object]:
        frames = original(self, increment)
        self._inbound_window_manager.window_opened(1)
        return frames

    monkeypatch.setattr(h2.stream.H2Stream, "increase_flow_control_window", increase)
    with pytest.raises(InternalChanged) as info:
        h2_connection.check_h2_data_frames()
    _assert_names(info.value, "h2", "H2Connection.increment_flow_control_window")


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_data_frames_are_h2s_frames_and_a_mutable_buffer_is_copied(kind: type) -> None:
    payload = kind(bytes(range(256)) * 300)
    expected = bytes(payload)
    connection = h2_connection.TunnelH2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.send_headers(1, [(":method", "CONNECT"), (":authority", "x:1")])
    connection.send_data_frames(1, memoryview(payload)[:40000])
    connection.ping(b"12345678")  # a control frame queued after the DATA stays after it
    if isinstance(payload, bytearray):
        payload[:] = bytes(len(payload))  # the caller reuses its buffer before the writer sends
    queued = connection.queued_output
    wire = connection.data_to_send()
    assert len(wire) == queued and connection.queued_output == 0
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    peer.initiate_connection()
    received = b""
    pinged = False
    for event in peer.receive_data(wire):
        if isinstance(event, h2.events.DataReceived):
            assert not pinged
            received += event.data
        pinged = pinged or isinstance(event, h2.events.PingReceived)
    assert hashlib.sha256(received).digest() == hashlib.sha256(expected[:40000]).digest() and pinged


@pytest.mark.parametrize("internal", ["_inner_send_lock", "_incoming", "_handshook"])
def test_a_tls_stream_without_a_part_the_direct_path_uses_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, internal: str
) -> None:
    shipped = trio.SSLStream.__init__

    def renamed(self: trio.SSLStream, *args: object, **kwargs: object) -> None:
        shipped(self, *args, **kwargs)  # type: ignore[arg-type]
        setattr(self, internal + "_renamed", getattr(self, internal))
        delattr(self, internal)  # as if trio renamed it

    monkeypatch.setattr(trio.SSLStream, "__init__", renamed)
    with pytest.raises(InternalChanged) as info:
        workarounds.check_trio_ssl_internals()
    _assert_names(info.value, "trio", f"SSLStream.{internal}")


@pytest.mark.parametrize("module", ["clusterproxy_protocol.transport", "clusterproxy_sdk"])
def test_trios_tls_internals_are_checked_on_import_of_what_uses_them(module: str) -> None:
    """Not only by apply(), which the SDK never calls: importing the transport (the SDK does, through
    the driver) fails at once, naming what trio moved."""
    program = (
        "import trio\n"
        "shipped = trio.SSLStream.__init__\n"
        "def renamed(self, *args, **kwargs):\n"
        "    shipped(self, *args, **kwargs)\n"
        "    del self._inner_send_lock\n"
        "trio.SSLStream.__init__ = renamed\n"
        f"import {module}\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode != 0
    assert "InternalChanged: trio" in done.stderr and "SSLStream._inner_send_lock" in done.stderr
    assert transport.check_trio_ssl_internals is workarounds.check_trio_ssl_internals  # the same check


async def _closed_tls_pair(pki: PkiFiles) -> list[weakref.ref[trio.SSLStream]]:
    server, client = await tls_pair(pki)
    await client.send_all(b"ping")
    assert await server.receive_some(4) == b"ping"
    for stream in (client, server):
        await stream.aclose()  # a cancelled close leaves a young cycle of its own (the exception's)
    return [weakref.ref(server), weakref.ref(client)]


async def test_a_closed_tls_stream_goes_with_its_last_reference_once_applied(
    pki: PkiFiles, trio_handshake_as_shipped: None
) -> None:
    gc.disable()  # what is freed now is freed by its last reference going, not by a collection
    try:
        as_shipped = await _closed_tls_pair(pki)
        workarounds.apply()
        applied = await _closed_tls_pair(pki)
        kept_as_shipped = [ref() is not None for ref in as_shipped]
        kept_applied = [ref() is not None for ref in applied]
    finally:
        gc.enable()
    assert kept_as_shipped == [True, True]  # trio's own: a cycle through the stream's handshake
    assert kept_applied == [False, False]
    gc.collect()
    assert not any(ref() for ref in as_shipped)  # the collector finds them: garbage, only later


async def test_a_handshake_that_failed_lets_go_too(pki: PkiFiles, trio_handshake_as_shipped: None) -> None:
    workarounds.apply()
    a, b = trio.socket.socketpair()
    server = trio.SSLStream(
        trio.SocketStream(a),
        tls.server_context(pki.server.cert, pki.server.key, pki.ca, alpn=["h2"]),
        server_side=True,
    )
    b.close()  # the peer is gone before saying anything
    with pytest.raises(trio.BrokenResourceError):
        await server.do_handshake()
    handshook = server._handshook  # type: ignore[attr-defined]
    assert handshook.started and getattr(handshook._afn, "__self__", None) is not server
    with pytest.raises(trio.BrokenResourceError):  # trio still says what happened, and never re-runs it
        await server.send_all(b"x")
    await trio.aclose_forcefully(server)


def test_apply_wraps_trios_handshake_once(trio_handshake_as_shipped: None) -> None:
    shipped = trio._ssl._Once.ensure
    workarounds.apply()
    wrapped = trio._ssl._Once.ensure
    workarounds.apply()
    assert trio._ssl._Once.ensure is wrapped and wrapped is not shipped
    assert inspect.unwrap(wrapped) is shipped


def test_a_handshake_once_of_another_shape_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, trio_handshake_as_shipped: None
) -> None:
    async def ensure(self: object) -> None:  # as if trio dropped the checkpoint argument
        pass

    monkeypatch.setattr(trio._ssl._Once, "ensure", ensure)
    with pytest.raises(InternalChanged) as info:
        workarounds.apply()
    _assert_names(info.value, "trio", "_ssl._Once.ensure")


def test_a_stream_without_its_handshake_once_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(trio._ssl, "_Once")
    with pytest.raises(InternalChanged) as info:
        workarounds.check_trio_handshake_once()
    _assert_names(info.value, "trio", "_ssl._Once")


def test_a_tunnel_h2_connection_goes_with_its_last_reference() -> None:
    opener, acceptor = connected()  # the preface and SETTINGS, through h2's handlers
    opener.ping(b"12345678")
    pump(opener, acceptor)
    connections = [weakref.ref(core._conn) for core in (opener, acceptor)]
    gc.disable()  # freed by its last reference going, not by a collection
    try:
        del opener, acceptor
        gone = [ref() is None for ref in connections]
    finally:
        gc.enable()
    assert gone == [True, True]


def test_h2_dispatching_frames_another_way_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, h2_check_not_cached: None
) -> None:
    shipped = h2.connection.H2Connection.__init__

    def init(self: h2.connection.H2Connection, *args: object, **kwargs: object) -> None:
        shipped(self, *args, **kwargs)  # type: ignore[arg-type]
        del self._frame_dispatch_table  # as if h2 dispatched with a match statement

    monkeypatch.setattr(h2.connection.H2Connection, "__init__", init)
    with pytest.raises(InternalChanged) as info:
        h2_connection.check_h2_open_streams()
    _assert_names(info.value, "h2", "H2Connection._frame_dispatch_table")

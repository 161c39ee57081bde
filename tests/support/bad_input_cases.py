"""The bad-input battery's cases (issue 10): every class of hostile input, one :class:`BadInput` each in
``CASES``, and the server and agent flags they are run with (``SERVER_OPTIONS``, ``AGENT_OPTIONS``).
The battery (tests/e2e/test_bad_input_battery.py) runs each once against a real proxy-server; the soak
(bench/soak.py) runs every one of them in each of its battery rounds. The harness that runs a case is
:mod:`tests.support.battery`.

Adding a class is one entry: ``BadInput(name, "client" | "agent", attack)``, where ``attack`` is an
async function of an :class:`AttackContext` (the hub, the PKI, the port, an echo target in cluster1)
that returns how the server ended the connection and raises when the server's answer is wrong. Raw
HTTP/2 frames over mTLS: ``tests.support.h2_attacker.Attacker``, the attacks themselves
``tests.support.h2_attacks``. A class that needs a server flag (say a shorter frame deadline) adds it
to ``SERVER_OPTIONS``.
"""

from __future__ import annotations

import trio
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, PingFrame, RstStreamFrame, SettingsFrame

from clusterproxy_protocol.core import CANCEL, ENHANCE_YOUR_CALM, FRAME_SIZE_ERROR, REFUSED_STREAM
from clusterproxy_protocol.pki import PemPair
from tests.support.battery import CLUSTER, Attack, AttackContext, BadInput
from tests.support.clients import client_context
from tests.support.h2_attacker import Attacker
from tests.support.h2_attacks import (
    flood_until_goaway,
    oversized_frame_start,
    ping_until_closed,
    rapid_reset_burst,
    refusal_through_tiny_window,
    resets_of,
    send_half_frame,
    stall_streams,
)
from tests.support.hostile_connections import attack as hostile_connection
from tests.support.pki import PkiFiles
from tests.support.waiting import wait_until

# The slow classes wait for a server deadline; these keep each within a few seconds. The legitimate
# traffic beside them runs in this test's process, beside the attacker: on a loaded machine that
# process can stall for over a second, and a 2 s stall or handshake deadline would rightly cut it
# (a stream that reads nothing, a handshake that comes late), so those two are 5 s. A frame's rest
# that arrived while the server was busy is never cut (tests/integration/test_late_reader.py).
FRAME_TIMEOUT = 1.0  # a frame must arrive whole within this of its first byte
STALL_TIMEOUT = 5.0  # a stream blocked on flow control with no byte either way is reset after this
HANDSHAKE_TIMEOUT = 5.0  # TLS handshake, and then the first request head, each within this
CLIENT_MAX_STREAMS = 16  # advertised and enforced per client connection
RESET_BUDGET = 500  # the server's default: resets per connection per 10 s
SERVER_OPTIONS = (
    "--dial-timeout",
    "10s",
    "--frame-timeout",
    f"{FRAME_TIMEOUT:g}s",
    "--stream-stall-timeout",
    f"{STALL_TIMEOUT:g}s",
    "--handshake-timeout",
    f"{HANDSHAKE_TIMEOUT:g}s",
    "--client-max-streams",
    str(CLIENT_MAX_STREAMS),
)
AGENT_OPTIONS = ("--allow", "127.0.0.0/8", "--dial-timeout", "2s")


def refused_before_any_answer(kind: str) -> Attack:
    """The hostile connections of tests/support/hostile_connections.py: 64 KiB of random bytes, an HTTP/1.1
    CONNECT without TLS, TLS without a client certificate, a client certificate from another CA. The
    server must refuse or close, never answer with data (``hostile_connections.attack`` asserts that)."""

    async def attack(context: AttackContext) -> str:
        outcome = await hostile_connection(context.port, kind, context.pki)
        assert outcome == "closed" or outcome.startswith("refused"), outcome
        return outcome

    return attack


async def limit_logged(context: AttackContext, attacker: Attacker, limit: str) -> None:
    """The server logged ``limit`` for this very connection, naming the client."""
    record = await context.server_event("http2_limit_exceeded", limit=limit, peer=attacker.local_address)
    assert record["client"] == "test-admin", record


async def rapid_reset(context: AttackContext) -> str:
    """Finding 2: 50,000 HEADERS+RST_STREAM pairs on one connection. GOAWAY ENHANCE_YOUR_CALM, and
    the agent dialed at most the reset budget for streams already gone."""
    attacker = await Attacker.connect(context.port, context.pki)
    burst = rapid_reset_burst(attacker, context.target.address)
    try:
        goaway = await flood_until_goaway(attacker, burst)
    finally:
        await attacker.aclose()
    assert goaway.error_code == ENHANCE_YOUR_CALM, goaway
    assert b"reset" in goaway.additional_data, goaway.additional_data
    await limit_logged(context, attacker, "reset_budget")
    dials = context.target.connections
    assert dials <= RESET_BUDGET, dials
    return f"GOAWAY ENHANCE_YOUR_CALM, {dials} target dials"


async def unread_pings(context: AttackContext) -> str:
    """Finding 3: PINGs whose ACKs are never read. The server cannot even write its GOAWAY to a peer
    that reads nothing, so the answer seen is the close, and the log says why."""
    attacker = await Attacker.connect(context.port, context.pki)
    try:
        sent = await ping_until_closed(attacker)
    finally:
        await attacker.aclose()
    await limit_logged(context, attacker, "reply_backlog")
    return f"closed (reply_backlog) after {sent >> 10} KiB of PINGs"


async def half_sent_frame(context: AttackContext) -> str:
    """Finding 5: a 60,000-byte DATA frame sent but for its last 10 bytes is held no longer than the
    frame timeout: GOAWAY ENHANCE_YOUR_CALM."""
    attacker = await Attacker.connect(context.port, context.pki)
    try:
        started = trio.current_time()
        await send_half_frame(attacker, context.target.address)
        goaway = await attacker.until(GoAwayFrame)
        held = trio.current_time() - started
    finally:
        await attacker.aclose()
    assert goaway.error_code == ENHANCE_YOUR_CALM, goaway
    assert held >= FRAME_TIMEOUT * 0.9, f"cut after {held:.3f}s, before the frame timeout"
    await limit_logged(context, attacker, "frame_timeout")
    return f"GOAWAY ENHANCE_YOUR_CALM after {held:.2f}s"


async def huge_frame(context: AttackContext) -> str:
    """Finding 5: a 16 MiB frame announced is refused at its header, before it is buffered."""
    attacker = await Attacker.connect(context.port, context.pki)
    try:
        goaway = await flood_until_goaway(attacker, oversized_frame_start())
    finally:
        await attacker.aclose()
    assert goaway.error_code == FRAME_SIZE_ERROR, goaway
    await limit_logged(context, attacker, "frame_size")
    return "GOAWAY FRAME_SIZE_ERROR"


async def stalled_streams(context: AttackContext) -> str:
    """Finding 4: 8 CONNECT streams with data posted and the receive window held at 0 are reset
    (RST_STREAM CANCEL) after the stall timeout; the connection itself lives on."""
    attacker = await Attacker.connect(context.port, context.pki, _4=0)  # SETTINGS_INITIAL_WINDOW_SIZE 0
    stream_ids = list(range(1, 16, 2))
    try:
        started = trio.current_time()
        await stall_streams(attacker, context.target.address, stream_ids)
        codes = await resets_of(attacker, stream_ids)
        held = trio.current_time() - started
        await attacker.send(PingFrame(0, opaque_data=b"alive???").serialize())
        pong = await attacker.until(PingFrame)
    finally:
        await attacker.aclose()
    assert set(codes.values()) == {CANCEL}, codes
    assert held >= STALL_TIMEOUT * 0.9, f"reset after {held:.3f}s, before the stall timeout"
    assert pong.opaque_data == b"alive???" and "ACK" in pong.flags
    await limit_logged(context, attacker, "stream_stall")
    return f"{len(codes)} streams RST_STREAM CANCEL after {held:.2f}s, the connection kept"


async def streams_beyond_the_limit(context: AttackContext) -> str:
    """h2spec 5.1.2: one stream more than the advertised limit gets RST_STREAM REFUSED_STREAM, the
    others are served (one echoes) and the connection lives."""
    attacker = await Attacker.connect(context.port, context.pki)
    try:
        settings = await attacker.until(SettingsFrame)
        limit = settings.settings[SettingsFrame.MAX_CONCURRENT_STREAMS]
        assert limit == CLIENT_MAX_STREAMS, settings
        stream_ids = list(range(1, 2 * (limit + 1), 2))
        await attacker.send(
            b"".join(attacker.connect_frame(sid, context.target.address) for sid in stream_ids)
        )
        await attacker.send(DataFrame(1, b"still here", flags=["END_STREAM"]).serialize())
        resets: dict[int, int] = {}
        echoed = b""
        while stream_ids[-1] not in resets or echoed != b"still here":
            frame: Frame | None = await attacker.next_frame()
            if frame is None:
                raise AssertionError(f"connection ended; resets {resets}, echoed {echoed!r}")
            if isinstance(frame, RstStreamFrame):
                resets[frame.stream_id] = frame.error_code
            elif isinstance(frame, DataFrame) and frame.stream_id == 1:
                echoed += frame.data
    finally:
        await attacker.aclose()
    assert resets == {stream_ids[-1]: REFUSED_STREAM}, resets
    await limit_logged(context, attacker, "concurrent_streams")
    return f"stream {len(stream_ids)} of {len(stream_ids)} RST_STREAM REFUSED_STREAM, the first echoed"


async def refusal_into_a_tiny_window(context: AttackContext) -> str:
    """Finding 6: a refusal into a 3-byte stream window sends 3 bytes, waits for window, and then
    the rest of its body: never a short body with END_STREAM."""
    attacker = await Attacker.connect(context.port, context.pki, _4=3)
    try:
        refusal = await refusal_through_tiny_window(attacker)
    finally:
        await attacker.aclose()
    status = int(refusal.fields[":status"])
    assert status >= 400, refusal.fields
    assert len(refusal.first_chunk) == 3 and not refusal.first_ended, refusal
    assert len(refusal.body) == refusal.length > 3, refusal
    return f"{status}: 3 bytes, then the rest of its {refusal.length}-byte body once the window opened"


async def invalid_preface(context: AttackContext) -> str:
    """h2spec 3.5: bytes that are neither the HTTP/2 preface nor an HTTP/1.x request line, over mTLS:
    closed with close_notify and nothing sent (an HTTP/1.1 400 would be a reply an h2 client cannot
    read)."""
    attacker = await Attacker.connect(context.port, context.pki, preface=False)
    try:
        await attacker.send(b"INVALID CONNECTION PREFACE\r\n\r\n")
        received = b""
        while data := await attacker.stream.receive_some(1 << 16):  # EOF without close_notify raises
            received += data
    finally:
        await attacker.aclose()
    assert received == b"", f"the server answered {received[:100]!r}"
    await context.server_event("client_protocol_unknown", peer=attacker.local_address)
    return "closed with close_notify, nothing sent"


async def slow_request_head(context: AttackContext) -> str:
    """Slowloris: an HTTP/1.1 CONNECT whose request line comes at once and whose headers then come
    one byte every 0.1 s, never ending. Answered 408 at the handshake timeout, then closed."""
    tcp = await trio.open_tcp_stream("127.0.0.1", context.port)
    stream = trio.SSLStream(tcp, client_context(context.pki, alpn=["http/1.1"]), server_hostname="localhost")
    received = b""

    async def trickle() -> None:
        try:
            await stream.send_all(f"CONNECT {context.target.address} HTTP/1.1\r\n".encode())
            while True:
                await stream.send_all(b"x")
                await trio.sleep(0.1)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # closed by the server

    try:
        started = trio.current_time()
        async with trio.open_nursery() as slow:
            slow.start_soon(trickle)
            try:
                while data := await stream.receive_some(1 << 16):
                    received += data
            except trio.BrokenResourceError:
                pass  # the server may close without close_notify after its 408
            answered = trio.current_time() - started
            slow.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(stream)
    assert received.startswith(b"HTTP/1.1 408 "), received[:200]
    assert answered >= HANDSHAKE_TIMEOUT * 0.9, f"answered after {answered:.3f}s, before the timeout"
    return f"408 after {answered:.2f}s, then closed"


def wrong_certificate(certificate: str, accepted: str, event: str, error_has: str, **fields: str) -> Attack:
    """Certificate roles (finding 1): a valid certificate of our CA that is not for the port. One with
    a role URI of the wrong role (agent, client) is refused right after the TLS handshake, logged
    ``tls_peer_refused`` with the role found; the hub's server certificate fails the handshake itself
    (its extended key usage is serverAuth only), logged ``tls_handshake_failed``. Either way nothing
    is answered, the connection is closed, and the log says why, once."""

    def pair(pki: PkiFiles) -> PemPair:
        pairs = {"agent": pki.agent(CLUSTER, "agent-a"), "server": pki.server, "client": pki.client}
        return pairs[certificate]

    def logged(context: AttackContext) -> int:
        records = context.server_events(event, port=accepted, **fields)
        return sum(error_has in str(record.get("error")) for record in records)

    async def attack(context: AttackContext) -> str:
        before = logged(context)
        try:
            attacker = await Attacker.connect(context.port, context.pki, certificate=pair(context.pki))
        except trio.BrokenResourceError as exc:
            outcome = f"refused in the handshake: {exc.__cause__!r}"
        else:
            try:
                frame = await attacker.next_frame()
            finally:
                await attacker.aclose()
            assert frame is None, f"the {accepted} port answered a {certificate} certificate with {frame}"
            outcome = "closed after the handshake, nothing sent"
        await wait_until(
            lambda: logged(context) > before, timeout=5, interval=0.05, what=f"{event} with {error_has!r}"
        )
        assert logged(context) == before + 1
        return f"{outcome} ({event}: {error_has})"

    return attack


CASES: list[BadInput] = [
    *(
        BadInput(f"{port}-{kind}", port, refused_before_any_answer(kind))
        for port in ("client", "agent")
        for kind in ("garbage", "plain-http", "tls-no-cert", "tls-foreign-ca")
    ),
    BadInput("client-rapid-reset", "client", rapid_reset, bound=2.0),
    BadInput("client-unread-pings", "client", unread_pings, bound=5.0),
    BadInput("client-half-sent-frame", "client", half_sent_frame, bound=FRAME_TIMEOUT + 2.0),
    BadInput("client-16mib-frame", "client", huge_frame, bound=2.0),
    BadInput("client-stalled-streams", "client", stalled_streams, bound=STALL_TIMEOUT + 2.0),
    BadInput("client-streams-beyond-limit", "client", streams_beyond_the_limit, bound=5.0),
    BadInput("client-refusal-tiny-window", "client", refusal_into_a_tiny_window, bound=2.0),
    BadInput("client-invalid-preface", "client", invalid_preface, bound=2.0),
    BadInput("client-slow-request-head", "client", slow_request_head, bound=HANDSHAKE_TIMEOUT + 2.0),
    BadInput(
        "client-agent-certificate",
        "client",
        wrong_certificate("agent", "client", "tls_peer_refused", "role agent is refused", role="agent"),
        bound=2.0,
    ),
    BadInput(
        "client-server-certificate",
        "client",
        wrong_certificate("server", "client", "tls_handshake_failed", "unsuitable certificate purpose"),
        bound=2.0,
    ),
    BadInput(
        "agent-client-certificate",
        "agent",
        wrong_certificate("client", "agent", "tls_peer_refused", "role client is refused", role="client"),
        bound=2.0,
    ),
]

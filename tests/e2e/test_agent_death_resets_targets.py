"""A killed proxy-agent resets its connections to targets (issue 32, point 2).

The kernel ends the sockets of a SIGKILLed process with a FIN unless they are armed (``SO_LINGER 0``):
a plain TCP target would then read a truncated upload as a complete one. The agent arms each socket it
dials toward a target (``closing.reset_if_process_dies``) and disarms it only in the relay's clean end,
so a target sees exactly one of: a clean EOF after every byte of a finished upload (and can still
answer: half-close), or a reset.

The same holds for a client process that dies (tested last): the proxy-server reads its connection's
end as the end of every HTTP/2 stream still open on it, the agent resets the target's side.

Twenty uploads run at once through real processes (the SDK -> proxy-server -> proxy-agent -> a target in
this process) when the agent is SIGKILLed: four have finished (EOF sent, the target's answer read), eight
are held after their first MiB, eight are still sending as fast as they can. The target records, per
connection, how it ended and the sha256 of every byte it got, checked against the bytes sent.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from clusterproxy_sdk import TLSFiles, Tunnel, open_tunnel
from tests.support.pki import PkiFiles
from tests.support.procs import Hub
from tests.support.targets import CHUNK, Target, pattern, pattern_digest, serve
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
KiB, MiB = 1 << 10, 1 << 20
WHOLE = [(f"whole-{i}", 512 * KiB) for i in range(4)]  # finished before the kill
HELD = [(f"held-{i}", 4 * MiB) for i in range(8)]  # sent HELD_AT bytes, then wait: short for sure
FLOWING = [(f"flowing-{i}", 32 * MiB) for i in range(8)]  # sending when the kill comes (or finished)
HELD_AT = 1 * MiB
UPLOADS = dict(WHOLE + HELD + FLOWING)


@dataclass
class Upload:
    """What the target got on one connection."""

    length: int = 0
    sha256: hashlib._Hash = field(default_factory=hashlib.sha256)
    end: str | None = None  # "eof" (a clean end), "reset" (ConnectionResetError) or another error


async def serve_uploads(nursery: trio.Nursery, uploads: dict[str, Upload]) -> Target:
    """A plain TCP service: a line ``<token>\\n``, then the upload until its end. After a clean EOF it
    answers ``<length> <sha256>\\n`` (the client, having half-closed, still reads it); a reset is
    recorded as such."""

    async def record(stream: trio.SocketStream, target: Target) -> None:
        head = b""
        while b"\n" not in head:
            data = await stream.receive_some(256)
            if not data:
                raise ValueError("no token line")
            head += data
        token, _, rest = head.partition(b"\n")
        upload = uploads[token.decode()] = Upload(len(rest))
        upload.sha256.update(rest)
        try:
            while data := await stream.receive_some(CHUNK):
                upload.length += len(data)
                upload.sha256.update(data)
        except trio.BrokenResourceError as exc:
            cause = exc.__cause__
            upload.end = "reset" if isinstance(cause, ConnectionResetError) else f"error: {cause!r}"
            return
        upload.end = "eof"
        await stream.send_all(f"{upload.length} {upload.sha256.hexdigest()}\n".encode())

    return await serve(nursery, record)


def prefix_digest(token: str, size: int, length: int) -> str:
    """sha256 of the first ``length`` bytes of ``token``'s ``size``-byte upload."""
    digest = hashlib.sha256()
    for chunk in pattern(token, size):
        digest.update(chunk[: max(0, length)])
        length -= len(chunk)
    return digest.hexdigest()


@pytest.fixture
async def own_hub(pki: PkiFiles, tmp_path: Path) -> AsyncIterator[Hub]:
    """A hub of its own: the test kills its agent."""
    hub = Hub(pki, tmp_path)
    try:
        await hub.start_server()
        hub.start_agent("cluster1", "agent-a", "--allow", "127.0.0.0/8")
        await hub.wait_agent("cluster1", "agent-a")
        yield hub
    finally:
        hub.stop()


async def test_sigkill_of_the_agent_resets_every_unfinished_upload_at_the_target(
    own_hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    hub = own_hub
    uploads: dict[str, Upload] = {}
    target = await serve_uploads(nursery, uploads)
    resume = trio.Event()  # set after the kill: the held uploads try to send the rest
    answers: dict[str, bytes] = {}  # token -> what the target answered after the client's EOF
    client_ends: dict[str, str] = {}  # token -> "answered" or the error the client saw

    async def upload(tunnel: Tunnel, token: str, size: int) -> None:
        stream = await tunnel.connect("cluster1", target.host, target.port)
        try:
            await stream.send_all(f"{token}\n".encode())
            sent = 0
            for chunk in pattern(token, size):
                if token.startswith("held") and sent == HELD_AT:
                    await resume.wait()
                await stream.send_all(chunk)
                sent += len(chunk)
            await stream.send_eof()
            answer = b""
            while data := await stream.receive_some():
                answer += data
            answers[token] = answer
            client_ends[token] = "answered"
        except trio.BrokenResourceError as exc:
            client_ends[token] = f"broken: {exc}"
        finally:
            await stream.aclose()

    files = TLSFiles(pki.ca, pki.client.cert, pki.client.key)
    address = f"127.0.0.1:{hub.client_port}"
    async with (
        open_tunnel(address, files, server_hostname="localhost") as tunnel,
        trio.open_nursery() as clients,
    ):
        for token, size in UPLOADS.items():
            clients.start_soon(upload, tunnel, token, size)

        def in_flight() -> bool:
            got = {token: uploads[token].length for token in UPLOADS if token in uploads}
            return (
                all(client_ends.get(token) == "answered" for token, _ in WHOLE)
                and all(got.get(token) == HELD_AT for token, _ in HELD)
                and all(got.get(token, 0) >= MiB for token, _ in FLOWING)
            )

        await wait_until(in_flight, timeout=60, what="4 uploads finished, 16 in flight")
        agent = hub.agents["agent-cluster1-agent-a"]
        agent.kill(signal.SIGKILL)
        assert await agent.wait_exit() == -signal.SIGKILL
        resume.set()
        await wait_until(
            lambda: len(uploads) == len(UPLOADS) and all(u.end for u in uploads.values()),
            timeout=30,
            what="every upload's end at the target",
        )
        # each client's stream breaks (or has its answer): they all return
        await wait_until(lambda: len(client_ends) == len(UPLOADS), timeout=30, what="every client's end")

    summary = {t: (u.end, u.length, client_ends[t].split(":")[0]) for t, u in sorted(uploads.items())}
    print(f"\nat the target (end, bytes, client): {summary}")
    for token, size in UPLOADS.items():
        got = uploads[token]
        if got.end == "eof":  # a clean end: the whole upload, byte for byte
            assert got.length == size, f"{token}: a clean EOF after {got.length} of {size} bytes: {summary}"
            assert got.sha256.hexdigest() == pattern_digest(token, size), token
            if token in answers:  # (the kill may have cut the answer of one that had just finished)
                assert answers[token] == f"{size} {got.sha256.hexdigest()}\n".encode(), token
        else:  # never a clean end for an upload the agent died in: a reset, after a true prefix
            assert got.end == "reset", (token, summary)
            assert got.sha256.hexdigest() == prefix_digest(token, size, got.length), token
            assert client_ends[token].startswith("broken"), (token, client_ends[token])
    for token, _ in WHOLE:  # half-close through the armed socket: EOF sent, the target's answer read
        assert uploads[token].end == "eof" and token in answers, (token, summary)
    for token, _ in HELD:  # short for certain: the kill came while they waited
        assert (uploads[token].end, uploads[token].length) == ("reset", HELD_AT), (token, summary)
    short = [t for t, u in uploads.items() if u.length < UPLOADS[t]]
    assert len(short) >= len(HELD) and all(uploads[t].end == "reset" for t in short), summary


# An SDK client in a process of its own: one upload to the target, stopped after HELD_AT bytes.
CLIENT = """
import sys, trio
from clusterproxy_sdk import TLSFiles, open_tunnel
from tests.support.targets import pattern

async def main(proxy: str, ca: str, cert: str, key: str, target_port: int, size: int) -> None:
    async with open_tunnel(proxy, TLSFiles(ca, cert, key), server_hostname="localhost") as tunnel:
        stream = await tunnel.connect("cluster1", "127.0.0.1", target_port)
        await stream.send_all(b"client-killed\\n")
        for chunk in pattern("client-killed", size):
            await stream.send_all(chunk)
        await trio.sleep_forever()

trio.run(main, *sys.argv[1:5], int(sys.argv[5]), int(sys.argv[6]))
"""


async def test_sigkill_of_a_client_resets_its_upload_at_the_target(
    own_hub: Hub, pki: PkiFiles, nursery: trio.Nursery
) -> None:
    """The client's socket to the proxy-server is not armed: its end (a FIN without close_notify) leaves
    the HTTP/2 streams open on it without END_STREAM, so the proxy-server resets each one's stream to
    the agent, and the agent its target."""
    uploads: dict[str, Upload] = {}
    target = await serve_uploads(nursery, uploads)
    argv = [
        *(sys.executable, "-c", CLIENT, f"127.0.0.1:{own_hub.client_port}"),
        *(str(pki.ca), str(pki.client.cert), str(pki.client.key), str(target.port), str(HELD_AT)),
    ]
    repository = Path(__file__).resolve().parents[2]  # for tests.support in the client
    client = await trio.lowlevel.open_process(argv, cwd=repository, env={**os.environ})
    try:
        await wait_until(
            lambda: "client-killed" in uploads and uploads["client-killed"].length == HELD_AT,
            timeout=30,
            what="the client's upload in flight",
        )
    finally:
        client.kill()
    with trio.fail_after(10):
        assert await client.wait() == -signal.SIGKILL
    await wait_until(lambda: uploads["client-killed"].end, timeout=30, what="the upload's end at the target")
    got = uploads["client-killed"]
    assert (got.end, got.length) == ("reset", HELD_AT)
    assert got.sha256.hexdigest() == pattern_digest("client-killed", HELD_AT)

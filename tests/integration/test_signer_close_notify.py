"""The cert-signer's HTTPS answers end with close_notify (issue 10, finding 9): a client that
requires it (trio's default, https_compatible=False) sees the end of an answer as clean, whether
the answer is a success or a refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from clusterproxy_certsigner.testing import RunningSigner, start_signer
from clusterproxy_protocol.tls import client_context


@pytest.fixture
async def signer(nursery: trio.Nursery, tmp_path: Path) -> RunningSigner:
    return await start_signer(nursery, tmp_path / "signer")


async def _exchange(signer: RunningSigner, request: bytes) -> tuple[bytes, str]:
    """Send ``request``; everything answered, and how the answer ended: "clean" or the error."""
    host, port = signer.address
    tcp = await trio.open_tcp_stream(host, port)
    stream = trio.SSLStream(
        tcp, client_context(None, None, signer.bundle, alpn=["http/1.1"]), server_hostname="localhost"
    )
    answer = bytearray()
    try:
        await stream.send_all(request)
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                answer += chunk
    except trio.BrokenResourceError as exc:
        return bytes(answer), f"error: {exc.__cause__!r}"
    finally:
        await stream.aclose()
    return bytes(answer), "clean"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\nhost: signer\r\n\r\n", b"200"),
        (b"GET /no-such-path HTTP/1.1\r\nhost: signer\r\n\r\n", b"404"),
        (b"NOT HTTP AT ALL\r\n\r\n", b"400"),
    ],
    ids=["answer", "not-found", "malformed"],
)
async def test_signer_answers_end_with_close_notify(
    signer: RunningSigner, request_bytes: bytes, status: bytes
) -> None:
    answer, end = await _exchange(signer, request_bytes)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert end == "clean"

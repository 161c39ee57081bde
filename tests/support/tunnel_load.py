"""Continuous traffic through the tunnel, as a user's client on the hub sends it, for the disruption
tests of the real clusters (``tests/real_platform/test_disruption.py``).

Runs as its own process inside the hub node's network namespace (``nsenter --net``: the client
port's Service address routes through the hub's kube-proxy, as for a client in a hub pod):

- ``load``: ``--workers`` clients, each the SDK's shared tunnel (one connection, re-dialed when it
  dies or drains, as a user's long-lived client holds it), each sending short requests back to back:
  ``GET /version`` of the managed cluster's real kube-apiserver by its bare name, TLS to the API
  server end to end inside the stream. One JSON line per request in ``--out`` (start and end on the
  machine's monotonic clock, which every process shares), until SIGTERM.
- ``once``: one such request through ``--address`` (a proxy-server pod's own address: is the
  cluster routable through that replica?); exit status 0 when it answered 200.
"""

from __future__ import annotations

import argparse
import json
import signal
import ssl
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from clusterproxy_sdk import TLSFiles, open_shared_tunnel, open_tunnel

REQUEST_TIMEOUT = 30.0  # the proxy-server's default --dial-timeout: its answer comes first
PAUSE = 0.05  # between one worker's requests: many short requests, without spinning two shared cores


def _kube_context(args: argparse.Namespace) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=args.kube_ca)
    context.load_cert_chain(args.kube_cert, args.kube_key)
    return context


async def version_over_tls(stream: trio.abc.Stream, kube: ssl.SSLContext) -> tuple[int, str]:
    """``GET /version`` of a kube-apiserver over TLS inside ``stream`` (a tunnel stream to it):
    the status and the body."""
    wrapped = trio.SSLStream(stream, kube, server_hostname="kubernetes.default.svc")
    await wrapped.send_all(b"GET /version HTTP/1.1\r\nHost: kubernetes\r\nConnection: close\r\n\r\n")
    answer = b""
    try:
        while data := await wrapped.receive_some(65536):
            answer += data
    except trio.BrokenResourceError:
        pass  # a close without TLS close_notify after Connection: close
    finally:
        await trio.aclose_forcefully(wrapped)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = head.split()[1] if len(head.split()) > 1 else b"0"
    return int(status) if status.isdigit() else 0, body.decode(errors="replace")


async def _version(stream: trio.abc.Stream, kube: ssl.SSLContext) -> str:
    """'' when ``GET /version`` answered 200 with a version, else what it answered."""
    status, body = await version_over_tls(stream, kube)
    if status != 200 or '"gitVersion"' not in body:
        return f"answer {status} {body[:80]!r}"
    return ""


async def _worker(index: int, args: argparse.Namespace, out: Path, stop: trio.Event) -> None:
    tls = TLSFiles(ca=args.ca, cert=args.cert, key=args.key)
    kube = _kube_context(args)
    async with open_shared_tunnel(args.address, tls, server_hostname=args.server_hostname) as shared:
        with out.open("a", buffering=1) as log:
            while not stop.is_set():
                started = time.monotonic()
                error = ""
                try:
                    with trio.fail_after(REQUEST_TIMEOUT):
                        stream = await shared.connect_kube_apiserver(args.cluster)
                        error = await _version(stream, kube)
                except Exception as exc:  # every failure is a result to report, not a crash
                    error = f"{type(exc).__name__}: {exc}"
                record = {"worker": index, "start": started, "end": time.monotonic(), "error": error}
                log.write(json.dumps(record) + "\n")
                await trio.sleep(PAUSE)


async def _load(args: argparse.Namespace) -> None:
    stop = trio.Event()
    out = Path(args.out)
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            for index in range(args.workers):
                nursery.start_soon(_worker, index, args, out, stop)
            async for _ in signals:
                stop.set()  # each worker ends its request in flight, then leaves
                break


async def _once(args: argparse.Namespace) -> str:
    tls = TLSFiles(ca=args.ca, cert=args.cert, key=args.key)
    try:
        with trio.fail_after(REQUEST_TIMEOUT):
            async with open_tunnel(args.address, tls, server_hostname=args.server_hostname) as tunnel:
                stream = await tunnel.connect_kube_apiserver(args.cluster)
                return await _version(stream, _kube_context(args))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.tunnel_load", description=__doc__)
    parser.add_argument("mode", choices=("load", "once"))
    parser.add_argument("--address", required=True, help="HOST:PORT of the client port")
    parser.add_argument("--server-hostname", required=True)
    parser.add_argument("--cluster", required=True)
    for name in ("ca", "cert", "key", "kube-ca", "kube-cert", "kube-key"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="-")
    args = parser.parse_args(argv)
    if args.mode == "load":
        trio.run(_load, args)
        return 0
    error = trio.run(_once, args)
    print(error or "ok")
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())

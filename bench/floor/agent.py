"""The floor's proxy-agent: dials the server (mutual TLS, HTTP/2 server side), answers every CONNECT
stream by dialing its target and relaying both ways with half-close; dials again when the tunnel ends.
``--fleet FILE`` runs many agents in this process (the fan-in workload): a line per agent, its
certificate and key."""

from __future__ import annotations

import argparse
import random
import socket
from pathlib import Path

import trio

from bench.floor import net


async def handle(tunnel: net.Tunnel, st: net.Stream, authority: str) -> None:
    host, _, port = authority.rpartition(":")
    try:
        sock = await net.dial(host.strip("[]"), int(port))
    except (OSError, ValueError):
        tunnel.respond(st, 502)
        return
    ok = False
    try:
        tunnel.respond(st, 200)

        async def down() -> None:
            while chunks := await tunnel.recv(st):
                await net.sendv(sock, chunks)
            sock.shutdown(socket.SHUT_WR)  # the half-close the client made

        async with trio.open_nursery() as nursery:
            nursery.start_soon(down)
            while data := await net.recv(sock):
                await tunnel.send(st, memoryview(data))
            tunnel.end(st)
        ok = True
    except Exception:
        pass  # a reset stream or a broken target connection: both ends aborted below
    finally:
        if not ok:
            tunnel.reset(st)
        sock.close() if ok else net.abort(sock)


async def agent(args: argparse.Namespace, cert: str, key: str) -> None:
    host, _, port = args.server.rpartition(":")
    ctx = net.context(argparse.Namespace(ca=args.ca, cert=cert, key=key), server=False, alpn="h2")
    failures = 0
    while True:
        sock, started = None, trio.current_time()
        try:
            sock = await net.dial(host, int(port))
            tls = net.Tls(sock, ctx, server_side=False, name=host)
            await tls.handshake()
            await net.Tunnel(tls, client_side=False, on_request=handle).run()
        except Exception:
            pass  # the server is down or restarting: dial again
        finally:
            if sock is not None:
                sock.close()
        # Ours' backoff, so that a restart is measured the same: full jitter, from 0.5 s doubling up to
        # 30 s, back to the start after a tunnel that lived 10 s.
        failures = 0 if trio.current_time() - started > 10 else failures
        await trio.sleep(random.uniform(0, min(30.0, 0.5 * 2**failures)))
        failures = min(failures + 1, 10)


async def run(args: argparse.Namespace) -> None:
    pairs = [(args.cert, args.key)]
    if args.fleet:
        pairs = [tuple(line.split()) for line in Path(args.fleet).read_text().splitlines() if line.strip()]
    async with trio.open_nursery() as nursery:
        for cert, key in pairs:
            nursery.start_soon(agent, args, cert, key)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor.agent", description=__doc__)
    p.add_argument("--server", required=True, help="HOST:PORT of the server's agent port")
    p.add_argument("--ca", required=True, help="CA bundle that verifies the server")
    p.add_argument("--cert", help="this agent's certificate (its URI SAN names the cluster)")
    p.add_argument("--key")
    p.add_argument("--cluster", help="ignored: the server reads the cluster from the certificate, as ours")
    p.add_argument("--fleet", help="a file of 'CERT KEY' lines: one agent each, in this process")
    args = p.parse_args()
    if not args.fleet and not (args.cert and args.key):
        p.error("--cert and --key, or --fleet")
    trio.run(run, args)


if __name__ == "__main__":
    main()

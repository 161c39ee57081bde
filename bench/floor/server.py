"""The floor's proxy-server: HTTP/1.1 CONNECT (h11) over mutual TLS from clients, a CONNECT stream on
the tunnel of the cluster the ``cluster-proxy-cluster`` header names, the bytes relayed both ways."""

from __future__ import annotations

import argparse

import h11
import trio

from bench.floor import net

CLUSTER_URI = "cluster-proxy://cluster/"  # an agent certificate's URI SAN: .../<cluster>/agent/<id>


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.client_ctx = net.context(args, server=True, alpn="http/1.1")
        self.agent_ctx = net.context(args, server=True, alpn="h2")
        self.tunnels: dict[str, net.Tunnel] = {}  # the latest tunnel of each cluster

    async def agent(self, sock) -> None:
        tls, tunnel, cluster = net.Tls(sock, self.agent_ctx, server_side=True), None, ""
        try:
            await tls.handshake()
            for kind, value in tls.obj.getpeercert().get("subjectAltName", ()):
                if kind == "URI" and value.startswith(CLUSTER_URI):
                    cluster = value[len(CLUSTER_URI) :].split("/")[0]
            tunnel = self.tunnels[cluster] = net.Tunnel(tls, client_side=True)
            await tunnel.run()
        except Exception:
            pass  # the tunnel is gone; its agent dials again
        finally:
            if tunnel is not None and self.tunnels.get(cluster) is tunnel:
                del self.tunnels[cluster]
            sock.close()

    async def client(self, sock) -> None:
        tls, st, ok = net.Tls(sock, self.client_ctx, server_side=True), None, False
        try:
            await tls.handshake()
            conn = h11.Connection(h11.SERVER)
            while (event := conn.next_event()) is h11.NEED_DATA:
                data = await tls.recv()
                conn.receive_data(bytes(data) if data is not None else b"")
            headers = dict(event.headers) if isinstance(event, h11.Request) else {}
            tunnel = self.tunnels.get(headers.get(b"cluster-proxy-cluster", b"").decode())
            if tunnel is None or event.method != b"CONNECT":
                await tls.send([conn.send(h11.Response(status_code=404, headers=[("content-length", "0")]))])
                return
            st = tunnel.open(event.target.decode())
            status = await tunnel.response(st)
            if status != 200:
                await tls.send([conn.send(h11.Response(status_code=502, headers=[("content-length", "0")]))])
                return
            await tls.send([conn.send(h11.Response(status_code=200, headers=[]))])
            early = conn.trailing_data[0]  # bytes the client sent right behind its CONNECT

            async def down() -> None:
                while chunks := await tunnel.recv(st):
                    await tls.send(chunks)
                await tls.send_eof()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(down)
                if early:
                    await tunnel.send(st, memoryview(early))
                while (data := await tls.recv()) is not None:
                    await tunnel.send(st, data)
                tunnel.end(st)
            ok = True
        except Exception:
            pass  # a reset stream or a broken connection: both ends aborted below
        finally:
            if st is not None and not ok:
                tunnel.reset(st)
            sock.close() if ok or st is None else net.abort(sock)

    async def run(self, args: argparse.Namespace) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(net.accept_loop, net.listener(args.agent_listen), self.agent, nursery)
            nursery.start_soon(net.accept_loop, net.listener(args.client_listen), self.client, nursery)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor.server", description=__doc__)
    p.add_argument("--agent-listen", required=True, help="HOST:PORT agents dial (mutual TLS, HTTP/2)")
    p.add_argument("--client-listen", required=True, help="HOST:PORT clients CONNECT through (mutual TLS)")
    p.add_argument("--ca", required=True, help="CA bundle that verifies agents and clients")
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    args = p.parse_args()
    trio.run(Server(args).run, args)


if __name__ == "__main__":
    main()

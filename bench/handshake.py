"""What one TLS 1.3 handshake costs the server, in CPython's ``ssl`` (OpenSSL) alone.

    python -m bench.handshake [--count 300] [--pki DIR] [--keys p256,ed25519,rsa2048]

Both ends run in this process over memory BIOs (no sockets, no event loop), with the bench's
certificates (ECDSA P-256; ``--keys`` times other key types too, every key of the PKI, the CA's
included, of that type); only the server's calls are timed. Three server set-ups: OpenSSL's
default (two session tickets after the handshake), no tickets (what our servers use since issue 17),
and no tickets without asking for a client certificate (what the client certificate's verification
costs). Prints the mean milliseconds per handshake of each.

``--pki DIR`` keeps the certificates there (issued on the first run, which needs ``cryptography``;
later runs read them): another python3 with only its standard library then times the same
handshakes against its own OpenSSL, e.g. Debian trixie's (OpenSSL 3.5) in a root filesystem made by
``mmdebstrap --variant=minbase --include=python3 trixie DIR`` (docs/benchmarks.md, tenth round).
"""

from __future__ import annotations

import argparse
import ssl
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

# bench.pki's key types (named here too: a python3 without cryptography times a kept --pki folder)
KEY_NAMES = {"p256": "ECDSA P-256", "ed25519": "Ed25519", "rsa2048": "RSA 2048"}
ROUNDS = 10  # flights back and forth: a TLS 1.3 handshake needs 2, the tickets and data one more


class Certificates(NamedTuple):
    """The files of a folder the bench's PKI issued into: ca.crt, server.{crt,key}, client.{crt,key}."""

    folder: Path

    @classmethod
    def in_folder(cls, folder: Path, key: str = "p256") -> Certificates:
        """The certificates in ``folder``, issued there first (with ``key`` keys) when it has none."""
        if not (folder / "ca.crt").exists():
            from bench.pki import BenchPKI  # needs cryptography: only to issue

            pki = BenchPKI(folder, key=key)
            pki.server()
            pki.client()
        return cls(folder)

    def pair(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}.crt", self.folder / f"{name}.key"


def _contexts(
    certificates: Certificates, *, tickets: bool, verify_client: bool
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = certificates.folder / "ca.crt"
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    server.load_cert_chain(*certificates.pair("server"))
    server.load_verify_locations(ca)
    server.verify_mode = ssl.CERT_REQUIRED if verify_client else ssl.CERT_NONE
    if not tickets:
        server.num_tickets = 0
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    client.load_cert_chain(*certificates.pair("client"))
    client.load_verify_locations(ca)
    client.check_hostname = False
    return server, client


def server_seconds(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> float:
    """One handshake and one byte of data; the seconds spent in the server's TLS calls."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_out, client_in = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(to_server, server_out, server_side=True)
    client = client_ctx.wrap_bio(client_in, to_client, server_hostname="localhost")
    spent = 0.0
    for _ in range(ROUNDS):
        for step in (client.do_handshake, server.do_handshake):
            start = time.perf_counter()
            try:
                step()
            except ssl.SSLWantReadError:
                pass
            if step == server.do_handshake:
                spent += time.perf_counter() - start
            to_server.write(to_client.read())
            client_in.write(server_out.read())
    client.write(b"x")
    to_server.write(to_client.read())
    start = time.perf_counter()
    if server.read(1) != b"x":
        raise RuntimeError("the byte after the handshake did not arrive")
    spent += time.perf_counter() - start
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=300, help="handshakes per set-up")
    parser.add_argument("--pki", type=Path, help="keep the certificates in this folder (reuse them if there)")
    parser.add_argument(
        "--keys",
        default="p256",
        help="comma-separated key types to time (p256, ed25519, rsa2048); each but p256 in its own "
        "subfolder of --pki",
    )
    args = parser.parse_args()
    if args.count < 1:
        parser.error("--count must be at least 1")
    keys = args.keys.split(",")
    unknown = [k for k in keys if k not in KEY_NAMES]
    if unknown:
        parser.error(f"unknown key types {unknown}; known: {', '.join(KEY_NAMES)}")
    with tempfile.TemporaryDirectory() as scratch:
        root = args.pki or Path(scratch)
        print(f"{ssl.OPENSSL_VERSION}; mean server CPU per handshake over {args.count}")
        for key in keys:
            folder = root if key == "p256" else root / key
            folder.mkdir(parents=True, exist_ok=True)
            certificates = Certificates.in_folder(folder, key)
            for label, tickets, verify in (
                ("OpenSSL's default (2 tickets), client certificate verified", True, True),
                ("no tickets (ours), client certificate verified", False, True),
                ("no tickets, no client certificate asked", False, False),
            ):
                server_ctx, client_ctx = _contexts(certificates, tickets=tickets, verify_client=verify)
                server_seconds(server_ctx, client_ctx)  # warm-up
                total = sum(server_seconds(server_ctx, client_ctx) for _ in range(args.count))
                print(f"{1000 * total / args.count:6.3f} ms  {KEY_NAMES[key]:10s} {label}")


if __name__ == "__main__":
    main()

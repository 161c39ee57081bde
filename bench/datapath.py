"""What moving bytes through the tunnel core costs, sending and receiving side, with no I/O at all.

    python -m bench.datapath [--mib 256] [--repeats 7] [--arrival 16384,65536,262144]

Two sans-IO cores (the proxy-server's and the agent's roles, the services' default settings) in one
process: the sender queues 256 KiB per call (one relay read) and takes the wire bytes out; the
receiver gets them in pieces of ``arrival`` bytes (how a TLS read hands them over), its stream
is read, and its WINDOW_UPDATEs go back. Only the cores' calls are timed (CPU time), and the best of
the repeats is kept, so a busy machine shows less than in the end-to-end rows. Prints milliseconds
of CPU per GiB for each side and arrival size, and checks the bytes by sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import time

from clusterproxy_protocol import Role, TunnelCore, workarounds

RELAY_READ = 256 << 10


def _connected() -> tuple[TunnelCore, TunnelCore, int]:
    sender, receiver = TunnelCore(Role.OPENER), TunnelCore(Role.ACCEPTOR)
    sender.initiate()
    receiver.initiate()
    receiver.receive_bytes(sender.data_to_send())
    sender.receive_bytes(receiver.data_to_send())
    stream_id = sender.open_connect("target:443")
    receiver.receive_bytes(sender.data_to_send())
    receiver.respond(stream_id, 200)
    sender.receive_bytes(receiver.data_to_send())
    return sender, receiver, stream_id


def seconds_per_gib(arrival: int, total: int) -> tuple[float, float]:
    """CPU seconds per GiB spent in the sender's and in the receiver's core calls."""
    sender, receiver, stream_id = _connected()
    payload = bytes(range(256)) * (RELAY_READ // 256)
    sent = hashlib.sha256()
    received = hashlib.sha256()
    send_s = receive_s = 0.0
    moved = 0
    while moved < total:
        start = time.process_time()
        taken = sender.send_data(stream_id, payload)
        wire = sender.data_to_send()
        queued = time.process_time()
        for offset in range(0, len(wire), arrival):
            receiver.receive_bytes(wire[offset : offset + arrival])
        data = receiver.read(stream_id, 4 * RELAY_READ)
        done = time.process_time()
        sender.receive_bytes(receiver.data_to_send())
        sent.update(payload[:taken])
        received.update(data)
        moved += len(data)
        send_s += queued - start
        receive_s += done - queued
    if sent.digest() != received.digest():
        raise AssertionError("the receiving core delivered other bytes than were sent")
    gib = moved / (1 << 30)
    return send_s / gib, receive_s / gib


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.datapath", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per repeat")
    parser.add_argument("--repeats", type=int, default=7, help="the best of this many counts")
    parser.add_argument(
        "--arrival", default="16384,65536,262144", help="bytes per receive call, comma-separated"
    )
    args = parser.parse_args()
    workarounds.apply()  # as the services run
    for arrival in (int(size) for size in args.arrival.split(",")):
        runs = [seconds_per_gib(arrival, args.mib << 20) for _ in range(args.repeats)]
        send, receive = (min(side) * 1000 for side in zip(*runs, strict=True))
        print(f"arrival {arrival:>7} B: send {send:5.0f} ms/GiB, receive {receive:5.0f} ms/GiB")


if __name__ == "__main__":
    main()

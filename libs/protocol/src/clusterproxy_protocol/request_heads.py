"""Request heads as the project's HTTP/1.1 servers read them: h11, held to RFC 9110/9112 where h11
is lenient, and one wording of the refusal.

h11 refuses a malformed request line (a NUL, a control byte or a space in the target, a bad version)
and most malformed field lines (a NUL or a bare CR, a name with a space, no colon, an over-long
head) with a :class:`h11.RemoteProtocolError` and a status hint, which every server answers with
that status and :func:`malformed_reason`. Two things it lets through in a field line:

- a control byte other than NUL, CR and LF in a value (``\\x01``, ``\\x1b``, DEL): no field-content
  (RFC 9110 §5.5);
- obs-fold, a field line starting with a space or a tab that continues the previous one: RFC 9112
  §5.2 lets a server either refuse it (400) or unfold it, and h11 unfolds it.

Both are what request smuggling through a laxer hop downstream is made of (the proxy-server's
plain-HTTP path forwards header values), and no client of ours sends either, so every server refuses
them, 400: :func:`next_event` raises them as h11 raises its own, so each server's one error path
answers all malformed requests alike.
"""

from __future__ import annotations

import re

import h11

from clusterproxy_protocol.errors import clean_reason

__all__ = ["malformed_reason", "next_event"]

# Bytes no field line may hold: the controls but HT (NUL, CR and LF are h11's already).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def next_event(connection: h11.Connection) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
    """``connection.next_event()`` for a server's connection, and a request head that h11 accepted
    but RFC 9110/9112 do not is an :class:`h11.RemoteProtocolError` (hint 400), like h11's own."""
    if connection.their_state is not h11.IDLE:
        return connection.next_event()
    # While the client is IDLE h11's buffer starts at the next request head: what the Request
    # event consumed of it is that head, byte for byte (h11 keeps no raw copy of it).
    before = connection.trailing_data[0]
    event = connection.next_event()
    if isinstance(event, h11.Request):
        problem = _field_lines_problem(before[: len(before) - len(connection.trailing_data[0])])
        if problem is not None:
            raise h11.RemoteProtocolError(problem, error_status_hint=400)
    return event


def _field_lines_problem(head: bytes) -> str | None:
    """What is wrong with the field lines of ``head`` (a request head h11 parsed), or None."""
    lines = head.split(b"\n")[1:]  # after the request line; h11 takes LF alone for a line end, too
    for line in lines:
        line = line.removesuffix(b"\r")
        if not line:
            break  # the empty line that ends the head
        if line[:1] in (b" ", b"\t"):
            return (
                "obsolete line folding (a header line starting with a space or a tab): "
                "send each header on one line"
            )
        control = _CONTROL.search(line)
        if control is not None:
            name = line.partition(b":")[0].decode("ascii", "replace")
            return f"control byte 0x{control.group()[0]:02x} in header {name!r}"
    return None


def malformed_reason(exc: h11.RemoteProtocolError) -> str:
    """The reason a server gives for a request h11 (or :func:`next_event`) refused: one line,
    printable ASCII, bounded (h11 quotes the offending line, up to the whole head)."""
    return clean_reason(f"malformed HTTP request: {exc}")

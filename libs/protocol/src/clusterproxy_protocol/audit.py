"""Audit records: one JSON line per proxied connection and per refused dial (schema ``cluster-proxy.audit/v1``).

Every way into a cluster writes them through this module: the proxy-server's client port (HTTP/1.1,
HTTP/2, konnectivity gRPC) and the hub HTTPS endpoint. The schema, its versioning rule and the sinks are
documented in docs/protocol.md, "Audit records"; :meth:`AuditRecord.to_json` is the one place a record
becomes a line.

Sinks (``--audit-log SPEC``, :func:`open_sink`):

- ``off`` or empty: nothing is written (the services' default);
- ``-`` or ``stdout``: standard output, one line per record;
- ``PATH`` or ``PATH:max=SIZE,keep=N``: the file, appended to, created with mode 0600; before a record
  would take it past ``max`` (default 64MiB) it is renamed ``PATH.1`` (``PATH.1`` to ``PATH.2``, ...,
  the oldest beyond ``keep``, default 5, deleted) and a new ``PATH`` is started, so a line is never
  split between two files.

A record is one ``write(2)`` of the whole line on a descriptor opened with ``O_APPEND``, nothing
buffered in the process: a process killed right after a record was written has lost none of it (the
kernel has it). It is synchronous, on the caller's thread (the trio loop): a record (making its JSON,
one ``write(2)`` into the page cache) costs a small fraction of what opening the stream it describes
costs the server (TLS and HTTP/2 alone), and less than handing it to a thread would (trio.to_thread: two
wake-ups); the figures are in docs/protocol.md, "Audit records". The rare rotation is a few
``rename(2)``. A disk that blocks for seconds (a hung network file system) would stall the loop: give
it a local disk, or standard output. A sink never
raises into the data path: a write that fails (a full disk) is counted, logged once until writes
succeed again, and the record is dropped.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, Protocol, TextIO

from clusterproxy_protocol.config import ConfigError, InvalidValue, parse_positive_int, parse_size
from clusterproxy_protocol.logs import get_logger
from clusterproxy_protocol.windows import format_size

__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_MAX_BYTES",
    "MIN_MAX_BYTES",
    "SCHEMA",
    "AuditRecord",
    "AuditSink",
    "CountingSink",
    "NullSink",
    "RotatingFileSink",
    "SinkSpec",
    "StreamSink",
    "add_audit_flag",
    "open_sink",
    "parse_audit_spec",
    "parse_sink_spec",
    "worker_spec",
]

SCHEMA = "cluster-proxy.audit/v1"
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_KEEP = 5
MIN_MAX_BYTES = 1 << 10  # a few records per file at least
FILE_MODE = 0o600  # who connected where is for the operator's eyes only
DIR_MODE = 0o700

_OFF = {"", "off"}
_STDOUT = {"-", "stdout"}
_OPTIONS = {"max", "keep"}
_SPEC_FORMS = (
    "off, - (standard output), PATH or PATH:max=SIZE,keep=N (e.g. /var/log/audit.jsonl:max=16MiB,keep=3)"
)


# --- the record ------------------------------------------------------------------------------------------


def _rfc3339(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class AuditRecord:
    """One proxied connection, or one refused dial (docs/protocol.md, "Audit records")."""

    start: float  # unix time the request arrived
    end: float  # unix time the connection ended (or the refusal was sent)
    client: str  # certificate subject, or the token's user name
    client_kind: str  # "certificate" | "token"
    cluster: str | None  # None when the request named none that could be read
    target: str  # host:port as asked; for the HTTPS endpoint, the request path
    frontend: str  # "http1" | "h2" | "konnectivity" | "service-proxy" ...
    outcome: str  # "ok" | "refused" | "failed"
    status: int | None  # the HTTP status answered: 200, 4xx, 5xx
    reason: str | None  # why refused or failed (the reason the client was told)
    bytes_to_target: int = 0
    bytes_to_client: int = 0
    agent_id: str | None = None  # the agent that carried it (or answered the refusal)
    server_id: str | None = None  # the proxy-server (or worker) that carried it
    groups: tuple[str, ...] = ()  # a token user's groups
    method: str | None = None  # the HTTP method, for the HTTPS endpoint

    def to_json(self) -> str:
        """One line (no newline at the end), every field present, ``null`` where there is none."""
        return json.dumps(
            {
                "schema": SCHEMA,
                "time": _rfc3339(self.start),
                "end": _rfc3339(self.end),
                "duration_seconds": round(max(self.end - self.start, 0.0), 6),
                "client": self.client,
                "client_kind": self.client_kind,
                "groups": list(self.groups),
                "cluster": self.cluster,
                "target": self.target,
                "method": self.method,
                "frontend": self.frontend,
                "outcome": self.outcome,
                "status": self.status,
                "reason": self.reason,
                "bytes_to_target": self.bytes_to_target,
                "bytes_to_client": self.bytes_to_client,
                "agent_id": self.agent_id,
                "server_id": self.server_id,
            },
            separators=(",", ":"),
            # ASCII only (json escapes the rest): a line can never hold a raw newline, and whatever reads
            # the file needs to know no encoding.
            ensure_ascii=True,
        )


# --- sinks -----------------------------------------------------------------------------------------------


class AuditSink(Protocol):
    def write(self, record: AuditRecord) -> None:
        """Write one record; never raises (a failure is counted and logged once)."""
        ...

    def close(self) -> None: ...


class CountingSink(AuditSink, Protocol):
    """What :func:`open_sink` returns: an :class:`AuditSink` that also says how it went."""

    written: int  # records written
    failures: int  # records lost to a failed write


class _Counted:
    """Counting, and the log-once rule, shared by the sinks."""

    def __init__(self, where: str) -> None:
        self.written = 0
        self.failures = 0
        self._where = where
        self._failing = False
        self._lock = threading.Lock()  # a service may write from threads too (trio's run_sync)

    def write(self, record: AuditRecord) -> None:
        try:
            line = record.to_json() + "\n"
        except (TypeError, ValueError) as exc:  # a field of a type json cannot write: a bug, not a crash
            self._failed(exc)
            return
        with self._lock:
            try:
                self._emit(line)
            except (OSError, ValueError) as exc:  # ValueError: a closed stream
                self._failed(exc)
                return
            self.written += 1
            if self._failing:
                self._failing = False
                get_logger("audit").warning(
                    "audit_write_recovered", sink=self._where, records_lost=self.failures
                )

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        if not self._failing:  # once per run of failures: a full disk must not flood the log too
            self._failing = True
            get_logger("audit").error(
                "audit_write_failed",
                sink=self._where,
                error=f"{type(exc).__name__}: {exc}",
                note="records are dropped (counted) until a write succeeds again",
            )

    def _emit(self, line: str) -> None:
        raise NotImplementedError


class NullSink(_Counted):
    """``off``: records go nowhere (and are not counted)."""

    def __init__(self) -> None:
        super().__init__("off")

    def write(self, record: AuditRecord) -> None:
        del record

    def close(self) -> None:
        pass


class StreamSink(_Counted):
    """A text stream (standard output): one line per record, flushed at once. Each line is one write of
    fewer than PIPE_BUF (4096) bytes for any ordinary record, so the lines of processes sharing a pipe
    (``--workers``) do not interleave."""

    def __init__(self, stream: TextIO, name: str = "stdout") -> None:
        super().__init__(name)
        self._stream = stream

    def _emit(self, line: str) -> None:
        self._stream.write(line)
        self._stream.flush()

    def close(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass


class RotatingFileSink(_Counted):
    """``PATH``: appended to, rotated before it would pass ``max_bytes``, ``keep`` old files kept."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        super().__init__(str(path))
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._fd: int | None = None
        self._size = 0
        self._torn = False  # a write failed part-way: the next record starts on a new line
        self._closed = False
        try:
            path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            self._open()
        except OSError as exc:
            raise ConfigError(f"audit log {str(path)!r} cannot be opened: {exc.strerror or exc}") from None

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # a file that existed keeps no wider mode
            self._size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return fd

    def _emit(self, line: str) -> None:
        data = line.encode("ascii")  # to_json writes ASCII only
        if self._torn:
            data = b"\n" + data
        if self._closed:
            raise ValueError("the audit log is closed")
        fd = self._fd
        if fd is None:  # the last rotation could not open the new file: try again
            fd = self._open()
        if self._size + len(data) > self.max_bytes and self._size > 0:
            # Our count, checked against the file itself (someone may have truncated it), before the
            # rename: rotation happens only between records, so no line is split between files.
            self._size = os.fstat(fd).st_size
            if self._size + len(data) > self.max_bytes and self._size > 0:
                fd = self._rotate()
        view = memoryview(data)
        while view:
            try:
                done = os.write(fd, view)
            except OSError:
                self._torn = len(view) != len(data)
                raise
            self._size += done
            view = view[done:]
        self._torn = False

    def _rotate(self) -> int:
        """The new file's descriptor, the old one closed and renamed."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        for index in range(self.keep - 1, 0, -1):
            older = self._rotated(index)
            if older.exists():
                os.replace(older, self._rotated(index + 1))  # the one at ``keep`` is overwritten: dropped
        os.replace(self.path, self._rotated(1))
        return self._open()

    def _rotated(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)


# --- the spec: flag, parsing, opening ---------------------------------------------------------------------


@dataclass(frozen=True)
class SinkSpec:
    kind: Literal["off", "stdout", "file"]
    path: Path | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    keep: int = DEFAULT_KEEP

    def __str__(self) -> str:
        if self.kind != "file":
            return "-" if self.kind == "stdout" else "off"
        options = []
        if self.max_bytes != DEFAULT_MAX_BYTES:
            options.append(f"max={format_size(self.max_bytes)}")
        if self.keep != DEFAULT_KEEP:
            options.append(f"keep={self.keep}")
        path = str(self.path)
        if path.lower() in _OFF | _STDOUT:
            path = f"./{path}"  # a file named like a keyword
        return path + (":" + ",".join(options) if options else "")


def _looks_like_options(text: str) -> bool:
    return bool(text) and all("=" in item for item in text.split(","))


def parse_sink_spec(text: str) -> SinkSpec:
    """``off``/empty, ``-``/``stdout``, ``PATH`` or ``PATH:max=SIZE,keep=N``; :class:`InvalidValue` naming
    the spec and what was expected otherwise. (A file literally named ``off``: ``./off``.)"""
    raw = text
    text = text.strip()
    if text.lower() in _OFF:
        return SinkSpec("off")
    if text.lower() in _STDOUT:
        return SinkSpec("stdout")
    path_text, sep, options_text = text.rpartition(":")
    if not (sep and _looks_like_options(options_text)):
        path_text, options_text = text, ""  # a colon inside a file name is part of the name
    if not path_text:
        raise InvalidValue(f"invalid audit log {raw!r}: no file before the options; expected {_SPEC_FORMS}")
    options: dict[str, str] = {}
    for item in filter(None, options_text.split(",")):
        key, _, value = item.partition("=")
        key = key.strip().lower()
        if key not in _OPTIONS:
            raise InvalidValue(
                f"invalid audit log {raw!r}: unknown option {key!r} (max=SIZE, keep=N); expected {_SPEC_FORMS}"
            )
        if key in options:
            raise InvalidValue(f"invalid audit log {raw!r}: option {key!r} given twice")
        options[key] = value.strip()
    try:
        max_bytes = parse_size(options["max"]) if "max" in options else DEFAULT_MAX_BYTES
        keep = parse_positive_int(options["keep"]) if "keep" in options else DEFAULT_KEEP
    except InvalidValue as exc:
        raise InvalidValue(f"invalid audit log {raw!r}: {exc}") from None
    if max_bytes < MIN_MAX_BYTES:
        raise InvalidValue(
            f"invalid audit log {raw!r}: max={options['max']} is below {format_size(MIN_MAX_BYTES)} "
            "(a few records per file at least)"
        )
    path = Path(path_text).expanduser()
    if path.is_dir():
        raise InvalidValue(f"invalid audit log {raw!r}: {path_text!r} is a directory, expected a file")
    return SinkSpec("file", path, max_bytes, keep)


def parse_audit_spec(text: str) -> str:
    """The ``--audit-log`` converter: the spec, checked (:func:`parse_sink_spec`), as text."""
    parse_sink_spec(text)
    return text.strip()


def worker_spec(spec: str, index: int) -> str:
    """The spec for worker ``index`` of ``--workers``: a file of its own (``audit.jsonl`` ->
    ``audit.w0.jsonl``), since two processes rotating one file would lose records; standard output and
    ``off`` as they are (a line is one small write: lines of processes sharing a pipe do not mix)."""
    parsed = parse_sink_spec(spec)
    if parsed.kind != "file" or parsed.path is None:
        return spec
    path = parsed.path
    name = f"{path.stem}.w{index}{path.suffix}" if path.suffix else f"{path.name}.w{index}"
    return str(SinkSpec("file", path.with_name(name), parsed.max_bytes, parsed.keep))


def open_sink(spec: str) -> CountingSink:
    """The sink ``spec`` names (:func:`parse_sink_spec`). A file that cannot be opened is a
    :class:`ConfigError` now, at start, naming it; later failures are the sink's (never raised)."""
    parsed = parse_sink_spec(spec)
    if parsed.kind == "off":
        return NullSink()
    if parsed.kind == "stdout":
        return StreamSink(sys.stdout)
    assert parsed.path is not None
    return RotatingFileSink(parsed.path, parsed.max_bytes, parsed.keep)


def add_audit_flag(flag: Callable[..., object], default: str = "off") -> None:
    """``--audit-log SPEC`` through a program's own ``flag(name, **kwargs)`` (which gives it its
    environment twin, e.g. ``CLUSTER_PROXY_SERVER_AUDIT_LOG``); the value is the checked spec text, for
    :func:`open_sink`."""
    flag(
        "--audit-log",
        type=parse_audit_spec,
        default=default,
        metavar="SPEC",
        help="audit records, one JSON line per proxied connection and per refused dial (schema "
        f"{SCHEMA}, docs/protocol.md): off; - for standard output; or a file PATH, mode 0600, rotated "
        f"before it passes {format_size(DEFAULT_MAX_BYTES)} with {DEFAULT_KEEP} old files kept "
        "(PATH:max=16MiB,keep=3 to choose)",
    )

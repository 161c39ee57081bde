"""Inside a worker of ``--workers N``: what ties it to its parent (clusterproxy_server.workers)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import trio

from clusterproxy_protocol import ConfigError, ReloadingContext, get_logger

__all__ = ["FILE_POLL", "follow_cert_files", "watch_parent"]

FILE_POLL = 2.0  # a worker notices the parent's renewal of the certificate files within this


async def watch_parent(fd: int, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone()`` when the parent's end of the pipe closes (the parent died: SIGKILL, a crash):
    an orphaned worker would keep its ports and take connections nobody supervises."""
    pipe = trio.lowlevel.FdStream(fd)
    while await pipe.receive_some(64):
        pass
    on_gone()


async def follow_cert_files(contexts: Sequence[ReloadingContext], files: Sequence[os.PathLike[str]]) -> None:
    """Reload ``contexts`` when the parent's renewer changes the certificate, key or trust bundle."""
    log = get_logger("proxy-server")

    def stamp() -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in files:
            try:
                info = os.stat(path)
                stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
            except OSError:
                stamps.append((0, 0, 0))
        return tuple(stamps)

    seen = stamp()
    while True:
        await trio.sleep(FILE_POLL)
        now = stamp()
        if now == seen:
            continue
        seen = now
        for context in contexts:
            try:
                outcome = context.reload()
            except ConfigError as exc:  # a half-written file: the next poll sees it whole
                log.warning("certificate_reload_failed", error=str(exc))
                seen = ()
                break
            else:
                log.info("certificate_reloaded", outcome=outcome, serial=context.presenting)

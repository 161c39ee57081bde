"""Processes of a benchmark run: start, watch (RSS, CPU), stop. Linux only (/proc)."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

CLK_TCK = os.sysconf("SC_CLK_TCK")


def raise_nofile() -> tuple[int, int]:
    """Lift the soft open-files limit to the hard one (children inherit it). Returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


_used_ports: set[int] = set()


def free_port(host: str = "127.0.0.1", lo: int = 20000, hi: int = 32000) -> int:
    """A free TCP port below Linux's ephemeral range (32768+).

    Upstream's proxy-server refuses ports above 49151 ("ephemeral"), and a listener below the
    ephemeral range can not collide with the many outgoing connections of the idle workload.
    """
    for _ in range(1000):
        port = random.randrange(lo, hi)
        if port in _used_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _used_ports.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def wait_port(host: str, port: int, timeout: float, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with {proc.popen.returncode} before listening on {port}; see {proc.log}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s") from None
            time.sleep(0.05)


def rss_kib(pid: int) -> int:
    """VmRSS of a process in KiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """user+system CPU time of a process (0.0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is the state (3rd field of stat); utime and stime are the 14th and 15th.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def with_descendants(pid: int) -> list[int]:
    """``pid`` and its live descendants (a proxy-server's ``--workers`` processes count as the server)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        # The kernel lists a child under the thread that started it (the proxy-server's parent starts
        # its workers from a worker thread), so every thread's list is read.
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in children.read_text().split())
            except OSError:
                continue
    return found


def start_logged(
    argv: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[bytes], BinaryIO]:
    """``argv`` started in a session of its own, its output appended to ``log`` after a ``###`` line
    with the command; returns the process and the open log file (the caller closes it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    logf = open(log, "ab")  # noqa: SIM115 - the caller closes it
    logf.write(f"\n### {shlex.join(argv)}\n".encode())
    logf.flush()
    popen = subprocess.Popen(
        argv,
        stdout=logf,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    return popen, logf


class Proc:
    """One child process with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.popen, self._logf = start_logged(argv, log, env)  # _logf closed in stop()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def rss_kib(self) -> int:
        return sum(rss_kib(pid) for pid in with_descendants(self.pid))

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in with_descendants(self.pid))

    def kill(self) -> None:
        """SIGKILL at once (a crash, for the restart measurements)."""
        if self.alive():
            self.popen.kill()
            self.popen.wait()
        self._logf.close()

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM (twice: upstream's agent drains on the first), then SIGKILL after `grace`."""
        if self.alive():
            for _ in range(2):
                with contextlib.suppress(ProcessLookupError):
                    self.popen.send_signal(signal.SIGTERM)
                try:
                    self.popen.wait(timeout=grace / 2)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if self.alive():
                self.popen.kill()
                self.popen.wait()
        self._logf.close()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

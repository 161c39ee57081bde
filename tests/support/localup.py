"""``cluster-proxy local up`` as a process, the way a user runs it: started, waited for (``local.json``
and the "Press Ctrl-C" line), read (its output, its children's logs) and stopped by a signal."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import trio

from clusterproxy_cli.state import LOCAL_JSON, read_local_json
from tests.support.procs import BIN, alive, json_records
from tests.support.waiting import wait_until

READY_LINE = "Press Ctrl-C"
POLL = 0.05


class LocalUp:
    def __init__(self, state: Path, output: Path, process: trio.Process) -> None:
        self.state, self.output, self.process = state, output, process

    @classmethod
    async def spawn(cls, state: Path, output: Path, *extra: str) -> LocalUp:
        """Start ``cluster-proxy local up --state-dir STATE EXTRA...``, its output (stdout and stderr,
        where the hub client's renewer logs) in ``output``."""
        with output.open("wb") as out:
            process = await trio.lowlevel.open_process(
                [str(BIN / "cluster-proxy"), "local", "up", "--state-dir", str(state), *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return cls(state, output, process)

    @classmethod
    async def start(cls, state: Path, output: Path, *extra: str, timeout: float = 60.0) -> LocalUp:
        """:meth:`spawn`, then wait until it is ready (AssertionError with its output if it exits)."""
        local = await cls.spawn(state, output, *extra)
        try:
            await wait_until(local.ready, timeout=timeout, what="local up to be ready", interval=POLL)
        except BaseException:
            local.dump()
            await local.stop()
            raise
        return local

    def ready(self) -> bool:
        if self.process.returncode is not None:
            raise AssertionError(f"local up exited {self.process.returncode}:\n{self.text()}")
        return (self.state / LOCAL_JSON).exists() and READY_LINE in self.text()

    def description(self) -> dict[str, Any]:
        """``local.json``."""
        return read_local_json(self.state)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def log(self, child: str) -> Path:
        return self.state / "logs" / f"{child}.log"

    def events(self, child: str, event: str) -> list[dict[str, Any]]:
        """``event`` records of a child's log."""
        return json_records(self.log(child), event)

    def dump(self) -> None:
        """The output and the children's last log lines (pytest shows them when the test fails)."""
        print(f"--- local up output\n{self.text()}")
        for log in sorted((self.state / "logs").glob("*.log")):
            print(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))

    async def wait_exit(self, timeout: float = 30.0) -> int:
        with trio.fail_after(timeout):
            return await self.process.wait()

    async def stop(self, signum: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Send ``signum`` (if it still runs) and wait for the exit status; SIGKILL after ``timeout``."""
        if self.process.returncode is None:
            self.process.send_signal(signum)
        with trio.move_on_after(timeout):
            return await self.process.wait()
        self.process.kill()
        await self.process.wait()
        raise AssertionError(f"local up did not stop within {timeout:g}s of {signal.Signals(signum).name}")


async def wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    await wait_until(lambda: not any(alive(pid) for pid in pids), timeout=timeout, what=f"{pids} to exit")

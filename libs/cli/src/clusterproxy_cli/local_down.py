"""``cluster-proxy local down``: stop what ``cluster-proxy local up`` started from a state folder.

It sends SIGTERM to the running ``local up`` (its pid is in ``local.json``), which stops every child in
order (haproxy and tinyproxy too) and removes ``local.json``; this waits until it has exited. If
``local up`` itself is gone but left children behind (it was SIGKILLed), their pids are in the same
file: each one still running and still one of local mode's programs is sent SIGTERM (SIGKILL after the
grace), and the file is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from clusterproxy_protocol import add_flag, parse_positive_duration

from .state import DEFAULT_STATE_DIR, LOCAL_JSON

LOCAL_UP = "cluster-proxy"  # local up's own entry in local.json's pids
POLL = 0.1
CHILD_GRACE = 10.0
# What a child of local up runs (argv[0]'s name, or the echo module): a pid that is now another
# program is never signalled.
CHILD_PROGRAMS = ("haproxy", "tinyproxy", "clusterproxy_cli.echo")
SERVICE_PREFIX = "cluster-proxy-"  # the services' console scripts (server, agent, cert-signer, ...)


def add_local_down_command(
    local_commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    down = local_commands.add_parser(
        "down",
        help="stop a running `local up` (from another terminal or a script)",
        description="Send SIGTERM to the `cluster-proxy local up` running from DIR (its pid is in "
        f"DIR/{LOCAL_JSON}) and wait until it has stopped every process it started. Without a running "
        "local up: nothing to do (exit 0); children a killed local up left behind are stopped.",
    )
    add_flag(down, "--state-dir", env="CLUSTER_PROXY_STATE_DIR", type=Path, default=str(DEFAULT_STATE_DIR),
             help="the state folder local up runs from")  # fmt: skip
    add_flag(down, "--timeout", env="CLUSTER_PROXY_DOWN_TIMEOUT", type=parse_positive_duration, default="60s",
             help="how long to wait for everything to stop")  # fmt: skip
    return down


def run_local_down(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return local_down(args.state_dir, args.timeout, sys.stdout)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)
    return state != "Z"


def runs_local_program(pid: int) -> bool:
    """Whether ``pid`` still runs one of local mode's programs (not a reused pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [os.path.basename(a.decode(errors="replace")) for a in argv[:3]]
    return any(word in CHILD_PROGRAMS or word.startswith(SERVICE_PREFIX) for word in words)


def _wait_gone(pids: list[int], deadline: float) -> list[int]:
    """Wait until none of ``pids`` runs or ``deadline`` (monotonic); the ones still running."""
    while True:
        running = [pid for pid in pids if alive(pid)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(POLL)


def local_down(state_dir: Path, timeout: float = 60.0, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    path = Path(state_dir) / LOCAL_JSON
    try:
        pids = {str(k): int(v) for k, v in json.loads(path.read_text()).get("pids", {}).items()}
    except FileNotFoundError:
        print(f"cluster-proxy local is not running from {state_dir} (no {path})", file=out, flush=True)
        return 0
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        print(f"error: cannot read {path}: {exc}", file=out, flush=True)
        return 1
    deadline = time.monotonic() + timeout
    local_up = pids.pop(LOCAL_UP, None)
    if local_up is not None and alive(local_up):
        print(f"stopping cluster-proxy local up (pid {local_up}) ...", file=out, flush=True)
        os.kill(local_up, signal.SIGTERM)
        if _wait_gone([local_up], deadline):
            print(
                f"error: local up (pid {local_up}) still runs after {timeout:g}s; its log and children's "
                f"are in {Path(state_dir) / 'logs'} (kill -9 {local_up} to force it)",
                file=out,
                flush=True,
            )
            return 1
    left = {name: pid for name, pid in pids.items() if alive(pid) and runs_local_program(pid)}
    if left:
        listed = ", ".join(f"{name} (pid {pid})" for name, pid in left.items())
        print(f"local up is gone; stopping what it left running: {listed}", file=out, flush=True)
        for pid in left.values():
            os.kill(pid, signal.SIGTERM)
        running = _wait_gone(list(left.values()), min(deadline, time.monotonic() + CHILD_GRACE))
        for pid in running:
            os.kill(pid, signal.SIGKILL)
        if _wait_gone(running, time.monotonic() + 5):
            print(f"error: still running after SIGKILL: {running}", file=out, flush=True)
            return 1
    path.unlink(missing_ok=True)
    print("stopped", file=out, flush=True)
    return 0

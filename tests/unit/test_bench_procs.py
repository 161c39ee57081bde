"""bench.procs counts a process with its descendants, wherever in it they were started."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from bench.procs import with_descendants

# A parent that starts one child from its main thread and one from another thread that lives on (as
# trio's open_process does for the proxy-server's workers, from its thread cache), prints both pids
# and waits to be stopped. The kernel lists a child under the thread that started it while that
# thread lives.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, threading
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    children = [subprocess.Popen(sleeper)]
    started, never = threading.Event(), threading.Event()
    def start_one():
        children.append(subprocess.Popen(sleeper))
        started.set()
        never.wait()  # the thread lives on
    threading.Thread(target=start_one, daemon=True).start()
    started.wait()
    print(" ".join(str(c.pid) for c in children), flush=True)
    try:
        sys.stdin.read()
    finally:
        for c in children:
            c.kill()
    """
)


def test_children_started_from_any_thread_are_found() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        children = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(children) == 2
        assert sorted(with_descendants(parent.pid)) == sorted([parent.pid, *children])
    finally:
        parent.communicate(timeout=10)  # its stdin closes: it kills its children and ends


def test_start_logged_appends_the_command_and_its_output_to_the_log(tmp_path: Path) -> None:
    from bench.procs import start_logged

    log = tmp_path / "logs" / "x.log"
    popen, logf = start_logged(["sh", "-c", "echo hello; echo oops >&2"], log)
    try:
        assert popen.wait(timeout=10) == 0
    finally:
        logf.close()
    assert log.read_text().splitlines()[-3:] == ["### sh -c 'echo hello; echo oops >&2'", "hello", "oops"]

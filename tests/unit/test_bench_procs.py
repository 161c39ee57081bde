"""bench.procs counts a process with its descendants, wherever in it they were started."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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

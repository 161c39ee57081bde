"""The health-collector's tests: a hub (a real proxy-server and agents as processes) whose clusters'
"kube-apiservers" are in-process targets of every kind a probe meets, and the collector as a process.

- ``ok``: answers every request ``200 ok``;
- ``hung``: accepts and never answers (a probe must be bounded by its own timeout);
- ``hostile``: answers ``500`` with HTML and script in its body (the page must show it as text).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from clusterproxy_protocol.pki import DevCA, PemPair
from tests.support.pki import PkiFiles
from tests.support.procs import BIN, Hub, Process
from tests.support.targets import Target, serve, serve_http
from tests.support.waiting import wait_until

HOSTILE_TEXT = "<img src=x onerror=\"document.title='pwned'\"><script>document.title='pwned'</script>"


async def _hang(stream: trio.SocketStream, target: Target) -> None:
    await trio.sleep_forever()


async def _hostile(stream: trio.SocketStream, target: Target) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        data = await stream.receive_some(4096)
        if not data:
            return
        head += data
    body = HOSTILE_TEXT.encode()
    await stream.send_all(
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/html\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (len(body), body)
    )


async def start_targets(nursery: trio.Nursery) -> dict[str, Target]:
    return {
        "ok": await serve_http(nursery, b"ok"),
        "hung": await serve(nursery, _hang),
        "hostile": await serve(nursery, _hostile),
    }


def agent_certificate(pki: PkiFiles, cluster: str, agent_id: str) -> PemPair:
    """An agent certificate of the tests' CA for any cluster (make_pki issues four)."""
    known = pki.agents.get(f"{cluster}/{agent_id}")
    if known is not None:
        return known
    ca = DevCA.create_or_load(pki.ca.parent)
    return ca.issue_agent(cluster, agent_id, pki.ca.parent.parent / "health-leaves")


def start_agent(hub: Hub, pki: PkiFiles, cluster: str, agent_id: str, kube_apiserver: Target) -> Process:
    """An agent of ``cluster`` whose kube-apiserver (the bare cluster name's target) is ``kube_apiserver``."""
    from clusterproxy_protocol.certclient import CertFiles

    pair = agent_certificate(pki, cluster, agent_id)
    argv = hub.agent_argv(
        CertFiles(pair.cert, pair.key, pki.ca),
        cluster,
        agent_id,
        allow=["127.0.0.0/8"],
        kube_apiserver=kube_apiserver.address,
        options=["--dial-timeout", "2s"],
    )
    return hub.launch_agent(f"agent-{cluster}-{agent_id}", argv)


def _log_name(log_dir: Path) -> str:
    """A log of its own for each collector of a test: a log is appended to, so a second collector
    writing into the first's would find the first's ``collector_started`` line (and its old port)."""
    name, n = "health-collector", 1
    while (log_dir / f"{name}.log").exists():
        n += 1
        name = f"health-collector-{n}"
    return name


@dataclass
class CollectorProcess:
    """``cluster-proxy-health-collector`` as a process, its URL from its ``collector_started`` line."""

    process: Process
    url: str = ""
    extra: list[str] = field(default_factory=list)

    @classmethod
    async def start(
        cls, hub: Hub, pki: PkiFiles, log_dir: Path, *extra: str, first_round: bool = True
    ) -> CollectorProcess:
        """Started and listening; with ``first_round``, also ready (its first round finished: quick
        for a few clusters; a thousand probes on a loaded machine take what they take, so the fleet
        test waits for its rounds itself)."""
        argv = [
            str(BIN / "cluster-proxy-health-collector"),
            "--listen=127.0.0.1:0",
            f"--admin-url=https://127.0.0.1:{hub.admin_port}",
            f"--proxy=127.0.0.1:{hub.client_port}",
            f"--ca={pki.ca}",
            f"--cert={pki.client.cert}",
            f"--key={pki.client.key}",
            "--server-name=localhost",
            "--log-format=json",
            "--log-level=info",
            *extra,
        ]
        process = Process(_log_name(log_dir), argv, log_dir)
        try:
            started = await process.wait_event("collector_started")
            collector = cls(process, str(started["url"]).rstrip("/"), list(extra))

            async def ready() -> bool:  # in a thread: the test's own targets must keep serving
                return await trio.to_thread.run_sync(collector.ready)

            if first_round:
                await wait_until(ready, timeout=60, what="the collector's first round", interval=0.1)
        except BaseException:
            process.stop()
            raise
        return collector

    @classmethod
    def launch(cls, log_dir: Path, *flags: str, timeout: float = 60.0) -> CollectorProcess:
        """The collector with ``flags`` (it listens on a free loopback port and logs JSON), waited for
        without trio (the tests on real API servers are synchronous): its ``collector_started`` line,
        then its first round."""
        from tests.support.waiting import poll_until

        argv = [
            str(BIN / "cluster-proxy-health-collector"),
            "--listen=127.0.0.1:0",
            "--log-format=json",
            "--log-level=info",
            *flags,
        ]
        process = Process(_log_name(log_dir), argv, log_dir)

        def started() -> dict[str, Any] | None:
            found = [r for r in process.events() if r.get("event") == "collector_started"]
            if not found and process.popen.poll() is not None:
                raise AssertionError(f"the collector exited ({process.popen.returncode}):\n{process.tail()}")
            return found[0] if found else None

        try:
            record = poll_until(started, timeout=timeout, what="the collector's collector_started line")
            collector = cls(process, str(record["url"]).rstrip("/"), list(flags))
            poll_until(collector.ready, timeout=timeout, what="the collector's first round", interval=0.1)
        except BaseException:
            process.stop()
            raise
        return collector

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def document(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/api/v1/clusters", timeout=5) as answer:
            return json.loads(answer.read())

    def cluster(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.document()["clusters"] if c["name"] == name), None)

    def stop(self) -> None:
        self.process.stop()

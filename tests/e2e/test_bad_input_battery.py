"""The bad-input battery (issue 10): every class of hostile input, one entry each in ``CASES``, against
one real proxy-server process with a real agent. For each entry (tests/support/battery.py):

- the hostile connection is answered or closed within the entry's ``bound`` (5 s unless it says);
- the server's RSS comes back within ``rss_margin_kib`` (16 MiB unless it says) of its baseline,
  taken after warm-up transfers, within ``rss_timeout`` (10 s);
- an SDK stream mid-transfer for the whole attack (8 MiB down, 1 MiB up) and fresh HTTP/2 and
  HTTP/1.1 transfers beside and after it arrive with the right sha256, and no agent tunnel is lost.

Adding a class is one entry: ``BadInput(name, "client" | "agent", attack)``, where ``attack`` is an
async function of an :class:`AttackContext` (the hub, the PKI, the port, an echo target in cluster1)
that returns how the server ended the connection and raises when the server's answer is wrong. Raw
HTTP/2 frames over mTLS: ``tests.support.h2_attacker.Attacker``. A class that needs a server flag
(say a shorter frame deadline) adds it to ``SERVER_OPTIONS``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.e2e.test_resilience import _attack as resilience_attack
from tests.support.battery import CLUSTER, AttackContext, BadInput, run_case
from tests.support.pki import PkiFiles
from tests.support.procs import Hub

pytestmark = pytest.mark.slow

SERVER_OPTIONS = ("--dial-timeout", "10s")
AGENT_OPTIONS = ("--allow", "127.0.0.0/8", "--dial-timeout", "2s")


def refused_before_any_answer(kind: str):
    """The hostile connections of tests/e2e/test_resilience.py: 64 KiB of random bytes, an HTTP/1.1
    CONNECT without TLS, TLS without a client certificate, a client certificate from another CA. The
    server must refuse or close, never answer with data (``_attack`` asserts that)."""

    async def attack(context: AttackContext) -> str:
        outcome = await resilience_attack(context.port, kind, context.pki)
        assert outcome == "closed" or outcome.startswith("refused"), outcome
        return outcome

    return attack


CASES: list[BadInput] = [
    BadInput(f"{port}-{kind}", port, refused_before_any_answer(kind))
    for port in ("client", "agent")
    for kind in ("garbage", "plain-http", "tls-no-cert", "tls-foreign-ca")
]


@pytest.fixture(scope="module")
def battery_hub(pki: PkiFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    hub = Hub(pki, Path(tmp_path_factory.mktemp("battery")))

    async def start() -> None:
        await hub.start_server(*SERVER_OPTIONS)
        hub.start_agent(CLUSTER, "agent-a", *AGENT_OPTIONS)
        await hub.wait_agent(CLUSTER, "agent-a")

    try:
        trio.run(start)
        yield hub
    finally:
        hub.stop()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_bad_input(case: BadInput, battery_hub: Hub, pki: PkiFiles, nursery: trio.Nursery) -> None:
    result = await run_case(case, battery_hub, pki, nursery)
    print(f"\n{result.line()}")
    assert result.seconds < case.bound
    assert result.after_kib - result.baseline_kib <= case.rss_margin_kib
    assert result.fresh_transfers >= 2

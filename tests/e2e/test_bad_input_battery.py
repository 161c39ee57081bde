"""The bad-input battery (issue 10): every class of hostile input, one entry each in ``CASES``, against
one real proxy-server process with a real agent. For each entry (tests/support/battery.py):

- the hostile connection is answered or closed (the time printed beside the entry's ``bound``, 5 s
  unless it says: never asserted, a loaded machine only delays it), and the answer is the one that
  class must get (the attack asserts it: a GOAWAY and its code, an
  RST_STREAM and its code, a 408, a close with nothing sent, a TLS refusal and the server's log line);
- the server's RSS comes back within ``rss_margin_kib`` (16 MiB unless it says) of its baseline,
  taken after warm-up transfers, within ``rss_timeout`` (10 s);
- an SDK stream mid-transfer for the whole attack (8 MiB down, 1 MiB up) and fresh HTTP/2 and
  HTTP/1.1 transfers beside and after it arrive with the right sha256, and no agent tunnel is lost.

The cases and the flags they need are in tests/support/bad_input_cases.py (adding a class is one
entry there); the soak (bench/soak.py) runs the same cases.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.support.bad_input_cases import AGENT_OPTIONS, CASES, SERVER_OPTIONS
from tests.support.battery import CLUSTER, BadInput, run_case
from tests.support.pki import PkiFiles
from tests.support.procs import Hub

pytestmark = pytest.mark.slow


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
    assert result.after_kib - result.baseline_kib <= case.rss_margin_kib
    assert result.fresh_transfers >= 2

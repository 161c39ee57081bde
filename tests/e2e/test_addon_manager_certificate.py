"""The addon-manager's own hub client certificate (clusterproxy_addon_manager.hubclient), with a real
cert-signer, proxy-server and agent (processes) and the manager's code in the test process, on the
signer's files store (the same CertStore contract as the Kubernetes Secrets one the manager uses in a
hub: tests/kube/test_addon_manager.py runs that).

- While the signer does not answer, the manager says so and mints no token (nothing is left unused in
  the store).
- Once it answers: a token bound to CN addon-manager is minted and used at once, the signer issues
  the certificate, and the availability poll reads the proxy-server's inventory with it over mutual
  TLS, checking the replica's certificate for the name it is given (the headless Service's pod IPs
  are named by no certificate), and failing when the certificate does not carry it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.x509.oid import NameOID

from clusterproxy_addon_manager.availability import AdminTarget, AdminTLS, poll_once
from clusterproxy_addon_manager.hubclient import CLIENT_NAME, TOKEN_GROUP, HubClientCertificate
from clusterproxy_addon_manager.identity import DESCRIPTION_PREFIX, Credentials
from clusterproxy_addon_manager.metrics import ManagerMetrics
from clusterproxy_castore.filestore import FileStore
from clusterproxy_protocol.logs import get_logger
from tests.support.certs import SignedHub, SignerProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "hub-ns"  # the proxy-servers' namespace: the files' folder


def own_tokens(store: FileStore) -> list[tuple[str, bool]]:
    """(description, used) of the tokens minted for the manager's own certificate."""
    return [
        (t.description, t.used_at is not None)
        for t in store.list_tokens()
        if t.description == DESCRIPTION_PREFIX + TOKEN_GROUP
    ]


async def test_the_manager_reads_the_inventory_with_a_certificate_from_the_signer(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    signer = await SignerProcess(tmp_path / "signer", tmp_path).start()  # its first start makes the CA
    hub = SignedHub(None, tmp_path, signer=signer)  # type: ignore[arg-type]
    try:
        store = signer.store
        credentials = Credentials(lambda namespace: FileStore(signer.store_dir))
        signer_url = ["https://127.0.0.1:1"]  # nothing listens there: the signer is not up yet

        def target() -> AdminTarget:
            return AdminTarget(NAMESPACE, 8092, "localhost", signer_url[0])

        certificate = HubClientCertificate(
            credentials, tmp_path / "manager", metrics=ManagerMetrics(), log=get_logger("test")
        )
        nursery.start_soon(certificate.follow, target, 0.05)
        await wait_until(
            lambda: "does not answer" in str(certificate.tls(NAMESPACE)),
            timeout=15,
            what="the manager to say the signer does not answer",
        )
        problem = certificate.tls(NAMESPACE)
        assert isinstance(problem, str) and "https://127.0.0.1:1" in problem, problem
        assert own_tokens(store) == [], "a token was minted for a signer that does not answer"
        verdict = poll_once(["https://127.0.0.1:1"], problem).of("cluster1")
        assert (verdict.status, verdict.reason) == ("Unknown", "NoClientCertificate")

        signer_url[0] = signer.url  # the signer answers now
        await wait_until(
            lambda: isinstance(certificate.tls(NAMESPACE), AdminTLS),
            timeout=15,
            what="the manager's certificate",
        )
        assert own_tokens(store) == [(DESCRIPTION_PREFIX + TOKEN_GROUP, True)]
        files = certificate.files(NAMESPACE)
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == CLIENT_NAME
        serial = format(cert.serial_number, "x")
        record = store.get_issued(serial)
        assert (
            record is not None
            and record.identity.key == f"client:{CLIENT_NAME}"
            and record.via == "bootstrap"
        )
        assert signer.issued()["bootstrap"] == 1

        await hub.start_server()
        hub.start_agent("cluster1", "agent-a")
        await hub.wait_agent("cluster1", "agent-a")
        admin = [f"https://127.0.0.1:{hub.admin_port}"]
        tls = certificate.tls(NAMESPACE)
        assert isinstance(tls, AdminTLS)

        # a pod IP is named by no certificate: the poll checks the name it is given
        answered = await trio.to_thread.run_sync(poll_once, admin, replace(tls, server_name="localhost"))
        assert answered.of("cluster1").status == "True", answered
        assert answered.of("cluster2").status == "False"
        wrong = await trio.to_thread.run_sync(
            poll_once, admin, replace(tls, server_name="proxy-entrypoint.elsewhere.svc")
        )
        refused = wrong.of("cluster1")
        assert (refused.status, refused.reason) == ("Unknown", "ProxyServerUnreachable")
        assert "certificate verify failed" in refused.message, refused.message
        # an --admin-url's own host is checked when no name is given
        by_url = await trio.to_thread.run_sync(poll_once, admin, tls)
        assert by_url.of("cluster1").status == "True"
    finally:
        hub.stop()

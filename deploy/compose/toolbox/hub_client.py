"""The toolbox's main process in compose: holds the hub client certificate that curl, the SDK and the
CLI use in the toolbox (``DIR/tls.crt``, ``tls.key``, ``ca.crt``).

It trades the client bootstrap token for a first certificate (only when ``DIR`` holds no valid one,
so a restart needs no new token), then renews it at 80% of its lifetime and follows the trust bundle,
forever, as every other party does (curl and the CLI read the files at each run, the SDK's
``ReloadingTLSFiles`` at each connection). Runs with the toolbox's Python (the cluster-proxy-cli install brings the protocol
library)::

    python hub_client.py --signer https://cert-signer:8443 --bootstrap-dir /etc/cluster-proxy/bootstrap \
        --name hub-admin --dir /var/lib/cluster-proxy
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import trio

from clusterproxy_protocol import certclient
from clusterproxy_protocol.bootstrap import bootstrap_with_retry
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint
from clusterproxy_protocol.logs import configure_logging, get_logger
from clusterproxy_protocol.renewer import CertRenewer, RenewalPolicy


async def hold(signer: str, bootstrap_dir: Path, name: str, folder: Path, trust_refresh: float) -> None:
    files = CertFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt")
    if not files.ca.exists():  # the first start: the hub's trust bundle from the bootstrap folder
        shutil.copyfile(bootstrap_dir / "ca.crt", files.ca)
    token_file = bootstrap_dir / f"{name}.token"
    token = token_file.read_text().strip() if token_file.exists() else None
    endpoint = SignerEndpoint.parse(signer, files.ca)
    log = get_logger("hub-client", client=name)
    await bootstrap_with_retry(endpoint, files, token, lambda key: certclient.client_csr(key, name), log)
    renewer = CertRenewer(endpoint, files, [], RenewalPolicy(trust_refresh=trust_refresh), log=log)
    log.info("hub_client_ready", cert=str(files.cert))
    await renewer.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--signer", required=True, help="the cert-signer, https://HOST:PORT")
    parser.add_argument("--bootstrap-dir", type=Path, required=True, help="holds ca.crt and NAME.token")
    parser.add_argument("--name", required=True, help="the client name the token is bound to")
    parser.add_argument("--dir", type=Path, required=True, help="where tls.crt, tls.key and ca.crt go")
    parser.add_argument("--trust-refresh", type=float, default=60.0, help="seconds between bundle fetches")
    args = parser.parse_args()
    configure_logging("info", json=True)
    trio.run(hold, args.signer, args.bootstrap_dir, args.name, args.dir, args.trust_refresh)


if __name__ == "__main__":
    main()

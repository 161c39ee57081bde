"""``cluster-proxy certs COMMAND ...``: the cert-signer's own administration command,
``cluster-proxy-cert-signer COMMAND ...``, run as a child process on the local mode's store unless
told another (``--store``, or ``CLUSTER_PROXY_CERT_SIGNER_STORE``); its output and exit status are
passed through."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from clusterproxy_protocol import ConfigError

from .commands import signer_command_argv
from .state import DEFAULT_STATE_DIR

COMMANDS = ("status", "rotate-ca", "token")
DEFAULT_STORE = DEFAULT_STATE_DIR / "pki" / "store"
STORE_FLAG = "--store"
STORE_ENV = "CLUSTER_PROXY_CERT_SIGNER_STORE"


def _names_store(arg: str) -> bool:
    """``--store``, ``--store=DIR``, or an abbreviation argparse accepts (``--sto DIR``)."""
    name = arg.split("=", 1)[0]
    return name.startswith("--s") and STORE_FLAG.startswith(name)


def certs_argv(command: str, args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The signer's command line: ``args`` as given, plus the local mode's store when no store is
    named. ConfigError when that store does not exist (unless only help is asked for)."""
    if environ.get(STORE_ENV) or any(_names_store(arg) for arg in args):
        return signer_command_argv([command, *args])
    if not DEFAULT_STORE.is_dir() and not {"-h", "--help"} & set(args):
        raise ConfigError(
            f"no store at {DEFAULT_STORE}: start `cluster-proxy local up` first, or name one with --store DIR"
        )
    return signer_command_argv([command, *args], DEFAULT_STORE)


def run_certs(command: str, args: Sequence[str], environ: Mapping[str, str] = os.environ) -> int:
    """Run the signer's command in the foreground; its exit status (128 + N when killed by signal N)."""
    with subprocess.Popen(certs_argv(command, args, environ)) as child:
        try:
            code = child.wait()
        except KeyboardInterrupt:  # the terminal's Ctrl-C reached the child too: let it finish
            code = child.wait()
    return 128 - code if code < 0 else code

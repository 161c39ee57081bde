"""Every program takes the same --log-level and --log-format (the proxy-agent and the addon-manager
took `critical`, the others refused it), each under its own environment variable."""

from __future__ import annotations

import argparse

import pytest

from clusterproxy_addon_manager.main import build_parser as addon_manager
from clusterproxy_agent.main import build_parser as proxy_agent
from clusterproxy_certsigner.main import build_parser as cert_signer
from clusterproxy_gateway.main import build_parser as cluster_gateway
from clusterproxy_health.main import build_parser as health_collector
from clusterproxy_protocol.logs import LOG_FORMATS, LOG_LEVELS
from clusterproxy_server.main import build_parser as proxy_server


def _serve(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The cert-signer's flags are those of its ``serve`` command."""
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["serve"]


PROGRAMS = {
    "proxy-server": (proxy_server, "CLUSTER_PROXY_SERVER_"),
    "proxy-agent": (proxy_agent, "CLUSTER_PROXY_AGENT_"),
    "cert-signer": (lambda: _serve(cert_signer()), "CLUSTER_PROXY_CERT_SIGNER_"),
    "addon-manager": (addon_manager, "CLUSTER_PROXY_ADDON_MANAGER_"),
    "health-collector": (health_collector, "CLUSTER_PROXY_HEALTH_"),
    "cluster-gateway": (cluster_gateway, "CLUSTER_PROXY_GATEWAY_"),
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_log_flags_are_the_same_everywhere(program: str) -> None:
    build, env_prefix = PROGRAMS[program]
    parser = build()
    flags = {option: action for action in parser._actions for option in action.option_strings}
    level, form = flags["--log-level"], flags["--log-format"]
    assert (tuple(level.choices), level.default) == (LOG_LEVELS, "info")
    assert (list(form.choices), form.default) == (list(LOG_FORMATS), "auto")
    help_text = parser.format_help()
    assert f"{env_prefix}LOG_LEVEL" in help_text and f"{env_prefix}LOG_FORMAT" in help_text

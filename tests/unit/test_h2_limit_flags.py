"""The HTTP/2 abuse limits' flags on the proxy-server and the agent: defaults, environment twins,
and values refused at start with a reason."""

from __future__ import annotations

import pytest

from clusterproxy_agent.main import parse_settings
from clusterproxy_protocol.config import ConfigError, parse_args_or_exit
from clusterproxy_server.main import build_parser, config_from_args
from tests.support.pki import PkiFiles


def server(pki: PkiFiles, *flags: str, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    argv = ["--ca", str(pki.ca), "--cert", str(pki.server.cert), "--key", str(pki.server.key), *flags]
    return config_from_args(parse_args_or_exit(build_parser(), argv, environ=environ or {}))


def agent(pki: PkiFiles, *flags: str, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    pair = pki.agent("cluster1", "agent-a")
    argv = ["--server", "127.0.0.1:8091", "--cluster", "cluster1", "--ca", str(pki.ca)]
    argv += ["--cert", str(pair.cert), "--key", str(pair.key), *flags]
    return parse_settings(argv, environ=environ or {})


def test_server_defaults(pki: PkiFiles) -> None:
    config = server(pki)
    client, tunnel = config.client_tunnel, config.tunnel
    assert (client.max_concurrent_streams, tunnel.max_concurrent_streams) == (256, 20_000)
    assert (client.idle_timeout, tunnel.idle_timeout) == (300.0, 0.0)
    for settings in (client, tunnel):
        assert settings.reset_budget == 500
        assert settings.max_reply_backlog == 256 << 10
        assert (settings.frame_timeout, settings.stall_timeout) == (30.0, 60.0)


def test_server_flags_and_their_environment_twins(pki: PkiFiles) -> None:
    config = server(
        pki,
        "--client-max-streams",
        "32",
        "--reset-budget",
        "0",
        environ={
            "CLUSTER_PROXY_SERVER_CLIENT_IDLE_TIMEOUT": "30s",
            "CLUSTER_PROXY_SERVER_MAX_REPLY_BACKLOG": "1MiB",
            "CLUSTER_PROXY_SERVER_FRAME_TIMEOUT": "5s",
            "CLUSTER_PROXY_SERVER_STREAM_STALL_TIMEOUT": "2m",
        },
    )
    client = config.client_tunnel
    assert (client.max_concurrent_streams, client.idle_timeout, client.reset_budget) == (32, 30.0, 0)
    assert (client.max_reply_backlog, client.frame_timeout, client.stall_timeout) == (1 << 20, 5.0, 120.0)
    assert (config.tunnel.frame_timeout, config.tunnel.stall_timeout) == (5.0, 120.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--client-max-streams", "0"), "integer >= 1"),
        (("--reset-budget", "-1"), "integer >= 0"),
        (("--frame-timeout", "soon"), "invalid duration"),
        (("--max-reply-backlog", "100"), "below 4096"),
    ],
)
def test_server_refuses_bad_values(
    pki: PkiFiles, flags: tuple[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises((ConfigError, SystemExit)) as info:
        server(pki, *flags)
    shown = str(info.value) if isinstance(info.value, ConfigError) else capsys.readouterr().err
    assert message in shown and flags[0].removeprefix("--").split("-")[0] in shown.lower()


def test_agent_defaults_and_twins(pki: PkiFiles) -> None:
    tunnel = agent(pki).tunnel
    assert (tunnel.reset_budget, tunnel.max_reply_backlog) == (0, 256 << 10)
    assert (tunnel.frame_timeout, tunnel.stall_timeout, tunnel.idle_timeout) == (30.0, 60.0, 0.0)
    tunnel = agent(
        pki, "--reset-budget", "10000", environ={"CLUSTER_PROXY_AGENT_STREAM_STALL_TIMEOUT": "0"}
    ).tunnel
    assert (tunnel.reset_budget, tunnel.stall_timeout) == (10_000, 0.0)
    with pytest.raises(SystemExit):
        agent(pki, "--max-reply-backlog", "10")

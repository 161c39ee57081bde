"""The proxy-server's flags for agent answers, ejection and pending dials: defaults, environment
twins, and values refused at start with a reason."""

from __future__ import annotations

import pytest

from clusterproxy_protocol.config import ConfigError, parse_args_or_exit
from clusterproxy_server.main import build_parser, config_from_args
from tests.support.pki import PkiFiles


def parse(pki: PkiFiles, *flags: str, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    argv = ["--ca", str(pki.ca), "--cert", str(pki.server.cert), "--key", str(pki.server.key), *flags]
    return config_from_args(parse_args_or_exit(build_parser(), argv, environ=environ or {}))


def test_defaults(pki: PkiFiles) -> None:
    config = parse(pki)
    assert (config.dial_timeout, config.agent_answer_timeout) == (30.0, 12.0)
    assert (config.ejection.cooldown, config.ejection.window) == (30.0, 60.0)
    assert (config.ejection.min_dials, config.ejection.failure_rate) == (5, 0.5)
    assert (config.max_pending_dials_per_connection, config.max_pending_dials_per_client) == (128, 512)


def test_the_answer_timeout_follows_a_shorter_dial_timeout(pki: PkiFiles) -> None:
    config = parse(pki, "--dial-timeout", "10s")
    assert (config.dial_timeout, config.agent_answer_timeout) == (10.0, 10.0)


def test_flags_and_their_environment_twins(pki: PkiFiles) -> None:
    config = parse(
        pki,
        "--agent-answer-timeout",
        "3s",
        "--max-pending-dials-per-connection",
        "8",
        environ={
            "CLUSTER_PROXY_SERVER_EJECTION_COOLDOWN": "2m",
            "CLUSTER_PROXY_SERVER_EJECTION_FAILURE_RATE": "0.8",
            "CLUSTER_PROXY_SERVER_MAX_PENDING_DIALS_PER_CLIENT": "64",
            "CLUSTER_PROXY_SERVER_MAX_PENDING_DIALS_PER_CONNECTION": "999",  # the flag wins
        },
    )
    assert config.agent_answer_timeout == 3.0
    assert (config.ejection.cooldown, config.ejection.failure_rate) == (120.0, 0.8)
    assert (config.max_pending_dials_per_connection, config.max_pending_dials_per_client) == (8, 64)


def test_an_answer_timeout_beyond_the_dial_timeout_is_refused(pki: PkiFiles) -> None:
    with pytest.raises(ConfigError, match=r"--agent-answer-timeout \(6s\) is longer than --dial-timeout"):
        parse(pki, "--dial-timeout", "5s", "--agent-answer-timeout", "6s")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--ejection-failure-rate", "0"),
        ("--ejection-failure-rate", "1.5"),
        ("--ejection-failure-rate", "half"),
        ("--ejection-min-dials", "0"),
        ("--ejection-cooldown", "0s"),
        ("--agent-answer-timeout", "0s"),
        ("--max-pending-dials-per-connection", "0"),
        ("--max-pending-dials-per-client", "-1"),
    ],
)
def test_bad_values_stop_the_start_naming_the_flag(
    pki: PkiFiles, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(pki, f"{flag}={value}")
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err

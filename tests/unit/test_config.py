"""Flags with environment twins, and the value converters."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from clusterproxy_protocol.config import (
    ConfigError,
    InvalidValue,
    add_flag,
    env_for,
    existing_dir,
    existing_file,
    parse_args_or_exit,
    parse_bool,
    parse_duration,
    parse_hostport,
    parse_port,
    parse_size,
)

# --- converters -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8091", ("127.0.0.1", 8091)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("localhost:443", ("localhost", 443)),
        ("proxy.example.com:65535", ("proxy.example.com", 65535)),
        ("[::1]:8090", ("::1", 8090)),
        ("[fe80::1%eth0]:22", ("fe80::1%eth0", 22)),
        (" cluster1:443 ", ("cluster1", 443)),
    ],
)
def test_parse_hostport_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "foo",
        "foo:",
        ":80",
        "host:http",
        "host:65536",
        "host:-1",
        "::1:80",
        "[::1]80",
        "[nothost]:80",
        "a b:1",
        "",
    ],
)
def test_parse_hostport_rejects_with_the_value_in_the_message(text: str) -> None:
    with pytest.raises(InvalidValue) as info:
        parse_hostport(text)
    assert repr(text) in str(info.value)


def test_invalid_value_is_catchable_as_all_three() -> None:
    for exc_type in (ConfigError, ValueError, argparse.ArgumentTypeError):
        with pytest.raises(exc_type):
            parse_port("x")


@given(st.integers(0, 65535), st.sampled_from(["localhost", "10.1.2.3", "a-b.example", "::1", "2001:db8::7"]))
def test_parse_hostport_roundtrip(port: int, host: str) -> None:
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    assert parse_hostport(text) == (host, port)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("5s", 5.0),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1m30s", 90.0),
        ("1.5s", 1.5),
        ("10", 10.0),
        ("0.25", 0.25),
        ("0", 0.0),
        (3, 3.0),
        (" 2S ", 2.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5x", "s", "-1", "-5s", "inf", "nan", "5 s s", "1s2", "ms"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(InvalidValue, match="invalid duration"):
        parse_duration(text)


@given(st.integers(0, 10**6))
def test_parse_duration_milliseconds(ms: int) -> None:
    assert parse_duration(f"{ms}ms") == pytest.approx(ms / 1000)


@pytest.mark.parametrize("text", ["-1", "65536", "80.5", "eighty", ""])
def test_parse_port_rejects(text: str) -> None:
    with pytest.raises(InvalidValue, match="invalid port"):
        parse_port(text)


def test_parse_size_and_bool() -> None:
    assert parse_size("4MiB") == 4 * 1024 * 1024
    assert parse_size("64KiB") == 65536
    assert parse_size("1GB") == 10**9
    assert parse_size("123") == 123
    with pytest.raises(InvalidValue, match="invalid size '4 parsecs'"):
        parse_size("4 parsecs")
    assert parse_bool("Yes") is True
    assert parse_bool("off") is False
    with pytest.raises(InvalidValue, match="invalid boolean 'maybe'"):
        parse_bool("maybe")


def test_existing_file_and_dir(tmp_path: Path) -> None:
    f = tmp_path / "a.pem"
    f.write_text("x")
    assert existing_file(str(f)) == f
    with pytest.raises(InvalidValue, match=r"file not found: .*missing\.pem"):
        existing_file(tmp_path / "missing.pem")
    with pytest.raises(InvalidValue, match="not a regular file"):
        existing_file(tmp_path)
    assert existing_dir(tmp_path) == tmp_path
    with pytest.raises(InvalidValue, match="directory not found"):
        existing_dir(f)


def test_env_for() -> None:
    assert env_for("--agent-port") == "CLUSTER_PROXY_AGENT_PORT"
    assert env_for("--listen", prefix="X_") == "X_LISTEN"


# --- flags with environment twins -------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="svc")
    add_flag(parser, "--listen", env="T_LISTEN", type=parse_hostport, default="127.0.0.1:8091", help="where")
    add_flag(parser, "--agent-port", env="T_AGENT_PORT", type=parse_port, default=8091, help="port")
    add_flag(parser, "--timeout", env="T_TIMEOUT", type=parse_duration, default="5s", help="dial timeout")
    add_flag(parser, "--json-logs", env="T_JSON", type=bool, default=False, help="JSON logs")
    add_flag(parser, "--server", env="T_SERVERS", type=parse_hostport, multiple=True, help="servers")
    add_flag(parser, "--level", env="T_LEVEL", default="info", choices=["debug", "info"], help="level")
    return parser


def test_defaults_are_converted() -> None:
    args = parse_args_or_exit(make_parser(), [], environ={})
    assert args.listen == ("127.0.0.1", 8091)
    assert args.agent_port == 8091
    assert args.timeout == 5.0
    assert args.json_logs is False
    assert args.server == []
    assert args.level == "info"
    assert not [k for k in vars(args) if k.startswith("_")]


def test_environment_supplies_values_through_the_converters() -> None:
    env = {
        "T_LISTEN": "[::1]:9000",
        "T_AGENT_PORT": "7000",
        "T_TIMEOUT": "250ms",
        "T_JSON": "true",
        "T_SERVERS": "a:1, b:2",
        "T_LEVEL": "debug",
    }
    args = parse_args_or_exit(make_parser(), [], environ=env)
    assert args.listen == ("::1", 9000)
    assert args.agent_port == 7000
    assert args.timeout == 0.25
    assert args.json_logs is True
    assert args.server == [("a", 1), ("b", 2)]
    assert args.level == "debug"


def test_command_line_beats_environment() -> None:
    env = {"T_AGENT_PORT": "7000", "T_JSON": "true", "T_SERVERS": "a:1"}
    args = parse_args_or_exit(
        make_parser(),
        ["--agent-port", "6000", "--no-json-logs", "--server", "c:3", "--server", "d:4"],
        environ=env,
    )
    assert args.agent_port == 6000
    assert args.json_logs is False
    assert args.server == [("c", 3), ("d", 4)]


def test_command_line_beats_a_bad_environment_value() -> None:
    args = parse_args_or_exit(make_parser(), ["--agent-port", "1"], environ={"T_AGENT_PORT": "nope"})
    assert args.agent_port == 1


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({"T_AGENT_PORT": "99999"}, ["T_AGENT_PORT", "--agent-port", "'99999'"]),
        ({"T_LISTEN": "foo"}, ["T_LISTEN", "--listen", "'foo'", "HOST:PORT"]),
        ({"T_TIMEOUT": "soon"}, ["T_TIMEOUT", "'soon'"]),
        ({"T_JSON": "maybe"}, ["T_JSON", "'maybe'"]),
        ({"T_SERVERS": "a:1,zzz"}, ["T_SERVERS", "'zzz'"]),
        ({"T_LEVEL": "loud"}, ["T_LEVEL", "'loud'"]),
    ],
)
def test_bad_environment_value_exits_naming_variable_and_value(
    env: dict[str, str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(make_parser(), [], environ=env)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err


def test_bad_flag_value_exits_naming_flag_and_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(make_parser(), ["--listen", "foo"], environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--listen" in err
    assert "'foo'" in err
    assert "HOST:PORT" in err


def test_required_is_satisfied_by_flag_or_environment(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="agent")
    add_flag(parser, "--cluster", env="T_CLUSTER", required=True, help="cluster name")
    assert parse_args_or_exit(parser, ["--cluster", "c1"], environ={}).cluster == "c1"
    assert parse_args_or_exit(parser, [], environ={"T_CLUSTER": "c2"}).cluster == "c2"
    with pytest.raises(SystemExit):
        parse_args_or_exit(parser, [], environ={})
    err = capsys.readouterr().err
    assert "--cluster" in err
    assert "T_CLUSTER" in err


def test_help_shows_environment_variable_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args_or_exit(make_parser(), ["--help"], environ={})
    out = capsys.readouterr().out
    assert "T_AGENT_PORT" in out
    assert "default 8091" in out
    assert "T_SERVERS" in out


def test_subcommand_flags_get_their_environment_twins(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="cli")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up")
    add_flag(up, "--port", env="T_UP_PORT", type=parse_port, default=1)
    other = sub.add_parser("down")
    add_flag(other, "--grace", env="T_GRACE", type=parse_duration, default="1s")
    args = parse_args_or_exit(parser, ["up"], environ={"T_UP_PORT": "8080"})
    assert args.port == 8080
    assert not hasattr(args, "grace")
    with pytest.raises(SystemExit):
        parse_args_or_exit(parser, ["up"], environ={"T_UP_PORT": "http"})
    assert "T_UP_PORT" in capsys.readouterr().err


def test_environment_is_read_at_parse_time(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = make_parser()
    monkeypatch.setenv("T_AGENT_PORT", "4242")
    assert parse_args_or_exit(parser, []).agent_port == 4242

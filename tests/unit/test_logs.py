"""structlog configuration: JSON lines off a terminal, readable console on one."""

from __future__ import annotations

import datetime as dt
import json
import logging

import pytest

from clusterproxy_protocol.config import ConfigError
from clusterproxy_protocol.logs import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    configure_logging("info", json=True)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_lines_with_stable_keys(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", json=True)
    log = get_logger("proxy-server")
    log.info("stream closed", cluster="c1", stream_id=3, bytes_in=10, bytes_out=20)
    log.debug("not shown")
    captured = capsys.readouterr()
    assert captured.out == ""
    (event,) = json_lines(captured.err)
    assert event["event"] == "stream closed"
    assert event["level"] == "info"
    assert event["logger"] == "proxy-server"
    assert event["cluster"] == "c1"
    assert event["stream_id"] == 3
    assert (event["bytes_in"], event["bytes_out"]) == (10, 20)
    assert dt.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).tzinfo is not None


def test_exceptions_stay_on_one_line_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("debug", json=True)
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        get_logger("t").exception("failed")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert "RuntimeError" in event["exception"]
    assert event["level"] == "error"


def test_standard_logging_goes_through_the_same_renderer(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("warning", json=True)
    logging.getLogger("somelib").warning("careful %s", "now")
    logging.getLogger("somelib").info("hidden")
    (event,) = json_lines(capsys.readouterr().err)
    assert event["event"] == "careful now"
    assert event["logger"] == "somelib"
    assert event["level"] == "warning"


def test_reconfiguring_does_not_duplicate_stdlib_output(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", json=True)
    configure_logging("info", json=True)
    logging.getLogger("x").warning("once")
    assert len(json_lines(capsys.readouterr().err)) == 1


def test_console_format_when_not_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", json=False)
    get_logger("agent").info("tunnel up", cluster="c1")
    err = capsys.readouterr().err
    assert "tunnel up" in err
    assert "cluster=c1" in err
    assert not err.lstrip().startswith("{")


def test_json_is_the_default_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info")  # pytest's captured stderr is not a TTY
    get_logger().info("hello")
    (event,) = json_lines(capsys.readouterr().err)
    assert event["event"] == "hello"


def test_bad_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="invalid log level 'loud'"):
        configure_logging("loud")

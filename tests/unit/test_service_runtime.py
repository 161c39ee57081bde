"""What every service's main shares (clusterproxy_protocol.service_runtime): the certificate and signer
flags with their one ``--signer`` check, "the first signal drains, the second cuts", exit codes."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

from clusterproxy_protocol.config import ConfigError, InvalidValue, flag_adder, parse_args_or_exit
from clusterproxy_protocol.logs import get_logger
from clusterproxy_protocol.service_runtime import (
    SignerSettings,
    add_certificate_flags,
    add_signer_flags,
    check_without_signer,
    failure_in_log,
    failure_on_stderr,
    leaves,
    run_service,
    serve_until_signalled,
    signer_url,
)

# --- flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("signer.ns.svc:8443", "https://signer.ns.svc:8443"),
        ("https://signer.hub:8443/", "https://signer.hub:8443"),
        (" https://10.0.0.1:8443 ", "https://10.0.0.1:8443"),
        ("[fd00::1]:8443", "https://[fd00::1]:8443"),
        ("https://[::1]:1", "https://[::1]:1"),
    ],
)
def test_a_signer_address_comes_back_as_one_https_url(text: str, url: str) -> None:
    assert signer_url(text) == url


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("http://signer:8443", "the signer speaks HTTPS"),
        ("ftp://signer:8443", "the signer speaks HTTPS"),
        ("https://signer", "invalid address"),
        ("signer", "invalid address"),
        ("signer:0", "port 0 cannot be dialed"),
        ("signer:99999", "invalid address"),
    ],
)
def test_a_bad_signer_address_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(InvalidValue, match=says):
        signer_url(text)


def _parser(*, trust_refresh: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="svc")
    flag = flag_adder(parser, "SVC_")
    add_certificate_flags(flag, ca_help="trust", cert_help="cert", key_help="key", required=False)
    add_signer_flags(flag, signer_help="the signer", token_help="a token", trust_refresh=trust_refresh)
    return parser


def test_the_signer_flag_names_itself_in_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args_or_exit(_parser(), ["--signer", "http://signer:8443"], environ={})
    assert exc.value.code == 2
    assert "argument --signer: invalid signer URL 'http://signer:8443'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        parse_args_or_exit(_parser(), [], environ={"SVC_SIGNER": "https://signer"})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "environment variable SVC_SIGNER (--signer): invalid value 'https://signer'" in err
    assert "invalid address 'signer': expected HOST:PORT" in err


def test_the_group_gives_every_flag_its_environment_twin() -> None:
    args = parse_args_or_exit(
        _parser(),
        ["--cert", "c.pem"],
        environ={
            "SVC_CA": "ca.pem",
            "SVC_KEY": "k.pem",
            "SVC_SIGNER": "signer:8443",
            "SVC_BOOTSTRAP_TOKEN": " tok \n",
            "SVC_TRUST_REFRESH": "2s",
        },
    )
    assert (args.ca, args.cert, args.key) == (Path("ca.pem"), Path("c.pem"), Path("k.pem"))
    assert SignerSettings.from_args(args) == SignerSettings("https://signer:8443", "tok", 2.0)
    help_text = " ".join(_parser().format_help().split())
    assert "the signer [env SVC_SIGNER]" in help_text and "[env SVC_TRUST_REFRESH; default 1m]" in help_text
    assert "--trust-refresh" not in _parser(trust_refresh=False).format_help()


def test_without_a_signer_there_are_no_signer_settings() -> None:
    args = parse_args_or_exit(_parser(), [], environ={"SVC_BOOTSTRAP_TOKEN": "tok"})
    assert SignerSettings.from_args(args) is None
    blank = parse_args_or_exit(_parser(), ["--signer=s:1", "--bootstrap-token= "], environ={})
    assert SignerSettings.from_args(blank) == SignerSettings("https://s:1", None, 60.0)


def test_the_certificate_flags_take_a_prefix_and_the_ca_check() -> None:
    parser = argparse.ArgumentParser(prog="svc")
    flag = flag_adder(parser, "SVC_")
    add_certificate_flags(flag, prefix="--proxy-", ca_help="", cert_help="", key_help="", metavar="FILE")
    with pytest.raises(SystemExit):
        parse_args_or_exit(parser, ["--proxy-ca=a"], environ={})  # the three are required
    args = parse_args_or_exit(parser, ["--proxy-ca=a", "--proxy-cert=b", "--proxy-key=c"], environ={})
    assert (args.proxy_ca, args.proxy_cert, args.proxy_key) == (Path("a"), Path("b"), Path("c"))


def _refuse(message: str) -> None:
    raise ConfigError(message)


def test_without_a_signer_a_token_is_refused_and_the_files_must_exist(tmp_path: Path) -> None:
    present = tmp_path / "tls.crt"
    present.write_text("x")
    with pytest.raises(ConfigError, match=r"^--bootstrap-token needs --signer \(the cert-signer that trades"):
        check_without_signer(_refuse, tokens=[("--bootstrap-token", "t")], files=[])
    with pytest.raises(ConfigError, match=r"^argument --key: file not found: .* \(or use --signer to get"):
        check_without_signer(
            _refuse,
            tokens=[("--bootstrap-token", None)],
            files=[("--cert", present), ("--key", tmp_path / "k")],
        )
    check_without_signer(_refuse, tokens=[("--tls-host", [])], files=[("--cert", present), ("--ca", None)])
    with pytest.raises(ConfigError, match=r"^--tls-host needs --signer$"):
        check_without_signer(_refuse, tokens=[("--tls-host", ["h"])], files=[], needs="--signer")
    with pytest.raises(ConfigError, match=r"^--key: file not found: .* \(or use --signer to get one\)$"):
        check_without_signer(
            _refuse,
            tokens=[],
            files=[("--key", tmp_path / "k")],
            missing="{flag}: {error} (or use --signer to get one)",
        )


# --- signals ------------------------------------------------------------------------------------------


class FakeService:
    """A service that serves until cancelled, and a drain that waits until it is cut."""

    def __init__(self, drains_itself: bool = False) -> None:
        self.drains_itself = drains_itself
        self.stop = trio.Event()
        self.drained = trio.Event()
        self.cut_at = trio.Event()
        self.draining = False
        self.cancelled = False
        self.returned = False
        self.stopped = trio.Event()  # run() has returned by itself

    async def run(self, *, task_status: trio.TaskStatus[FakeService] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        try:
            if self.drains_itself:
                await self.stop.wait()
                await self.drain()
                self.returned = True
                self.stopped.set()
                return
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled = True
            raise

    async def drain(self) -> None:
        self.draining = True
        await self.cut_at.wait()
        self.drained.set()

    def cut(self) -> None:
        self.cut_at.set()


async def _signal_self(signum: int = signal.SIGTERM) -> None:
    os.kill(os.getpid(), signum)
    await trio.sleep(0)


async def test_the_first_signal_drains_and_the_second_cuts_the_drain(nursery: trio.Nursery) -> None:
    service = FakeService()
    done = trio.Event()

    async def serve(task_status: trio.TaskStatus[FakeService]) -> None:
        log = get_logger("test")
        await serve_until_signalled(
            service.run, log, drain=service.drain, cut=service.cut, task_status=task_status
        )
        done.set()

    with capture_logs() as logs:
        assert await nursery.start(serve) is service  # what the service reported on start
        await _signal_self(signal.SIGTERM)
        with trio.fail_after(5):
            while not service.draining:
                await trio.sleep(0.01)
        await trio.sleep(0.05)
        assert not service.cancelled and not done.is_set()  # the drain holds the service up
        await _signal_self(signal.SIGINT)
        with trio.fail_after(5):
            await done.wait()
    assert service.drained.is_set() and service.cancelled  # drained, then what was left cancelled
    events = [(e["event"], e.get("signal")) for e in logs]
    assert events == [("signal_received", "SIGTERM"), ("drain_cut_by_signal", "SIGINT")]


async def test_without_a_drain_the_first_signal_stops_at_once(nursery: trio.Nursery) -> None:
    service = FakeService()
    done = trio.Event()

    async def serve(task_status: trio.TaskStatus[None]) -> None:
        await serve_until_signalled(
            service.run, get_logger("test"), first_event="stopping", task_status=task_status
        )
        done.set()

    with capture_logs() as logs:
        await nursery.start(serve)
        await _signal_self(signal.SIGINT)
        with trio.fail_after(5):
            await done.wait()
    assert service.cancelled and not service.draining
    assert [e["event"] for e in logs] == ["stopping"]


async def test_a_service_that_drains_itself_is_waited_for(nursery: trio.Nursery) -> None:
    """The agent's way: the stop event is the service's own, which drains and returns by itself."""
    service = FakeService(drains_itself=True)
    done = trio.Event()

    async def serve(task_status: trio.TaskStatus[None]) -> None:
        await serve_until_signalled(
            service.run,
            get_logger("test"),
            stop=service.stop,
            drain=service.stopped.wait,  # the drain is the service's own: wait for its end
            cut=service.cut,
            task_status=task_status,
        )
        done.set()

    await nursery.start(serve)
    service.stop.set()  # e.g. a test, or the parent gone: no signal needed
    with trio.fail_after(5):
        while not service.draining:
            await trio.sleep(0.01)
    await _signal_self(signal.SIGTERM)  # now the first signal: the drain is already on, nothing to cut
    await trio.sleep(0.05)
    assert not service.cut_at.is_set()
    await _signal_self(signal.SIGTERM)  # the second cuts it
    with trio.fail_after(5):
        await done.wait()
    assert service.returned and not service.cancelled


async def test_a_service_that_ends_by_itself_ends_the_wait() -> None:
    async def brief(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    with trio.fail_after(5):
        await serve_until_signalled(brief, get_logger("test"), drain=trio.sleep_forever)


# --- exit codes ---------------------------------------------------------------------------------------


def test_leaves_walk_nested_groups() -> None:
    a, b, c = ConfigError("a"), OSError("b"), ValueError("c")
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [a, b]), c])
    assert leaves(group) == [a, b, c]
    assert leaves(a) == [a]


async def _raise(*errors: BaseException) -> None:
    async with trio.open_nursery() as nursery:
        for error in errors:

            async def fail(error: BaseException = error) -> None:
                raise error

            nursery.start_soon(fail)


def _recorder(status: int) -> tuple[list[list[str]], object]:
    seen: list[list[str]] = []

    def on_failure(errors: list[BaseException]) -> int:
        seen.append([str(e) for e in errors])
        return status

    return seen, on_failure


def test_a_service_that_returns_exits_0() -> None:
    seen, on_failure = _recorder(1)
    assert run_service(trio.sleep, 0, on_failure=on_failure) == 0  # type: ignore[arg-type]
    assert seen == []


def test_known_errors_in_groups_give_the_failure_status() -> None:
    seen, on_failure = _recorder(7)
    status = run_service(_raise, ConfigError("bad token"), OSError("address in use"), on_failure=on_failure)  # type: ignore[arg-type]
    assert status == 7
    assert sorted(seen[0]) == ["address in use", "bad token"]


def test_known_is_chosen_per_service() -> None:
    seen, on_failure = _recorder(1)
    with pytest.raises(BaseExceptionGroup):
        run_service(_raise, OSError("x"), on_failure=on_failure, known=(ConfigError,))  # type: ignore[arg-type]
    assert seen == []


def test_an_unknown_error_keeps_its_traceback() -> None:
    seen, on_failure = _recorder(1)
    with pytest.raises(BaseExceptionGroup) as info:
        run_service(_raise, ConfigError("bad"), ValueError("a bug"), on_failure=on_failure)  # type: ignore[arg-type]
    assert any(isinstance(e, ValueError) for e in leaves(info.value))
    assert seen == []


def test_the_reports_on_stderr_and_in_the_log(capsys: pytest.CaptureFixture[str]) -> None:
    errors: list[BaseException] = [ConfigError("first"), OSError("second")]
    assert failure_on_stderr("svc")(errors) == 1
    assert capsys.readouterr().err == "svc: error: first\n"
    assert failure_on_stderr("svc", 3, what="worker 2")(errors) == 3
    assert capsys.readouterr().err == "svc: error: worker 2: first\n"
    with capture_logs() as logs:
        assert failure_in_log(get_logger("test"), "svc_failed")(errors) == 1
    assert [(e["event"], e["error"], e["log_level"]) for e in logs] == [
        ("svc_failed", "first; second", "error")
    ]

"""What every service's ``main`` shares: the certificate flags, the certificate's life, signals, exit codes.

One of each, so the six services cannot drift apart (they had: three ``--signer`` validators, six
signal loops, two walks of exception groups)::

    add_certificate_flags(flag, ca_help=..., cert_help=..., key_help=...)
    add_signer_flags(flag, signer_help=..., token_help=..., trust_refresh=True)
    args = parse_args_or_exit(parser, argv)
    signer = SignerSettings.from_args(args)          # None without --signer
    ...
    async def serve(config):
        if signer:
            await signer.bootstrap(files, make_csr, log)  # a first certificate from the token, if needed
        service = Service(config, renewer=signer and signer.renewer(files, contexts))
        await serve_until_signalled(service.run, log, drain=service.shutdown, cut=service.cut_drain)

    sys.exit(run_service(serve, config, on_failure=failure_on_stderr(PROG)))

- :func:`serve_until_signalled`: the first SIGTERM/SIGINT drains (or stops at once when there is
  nothing to drain), a second one cuts the drain short.
- :func:`run_service`: ``trio.run`` and the exit status: 0 when the service returned, the
  ``on_failure`` status when only known errors (a bad setting, an address in use) stopped it, however
  deep in exception groups they are; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from clusterproxy_protocol import certclient
from clusterproxy_protocol.bootstrap import bootstrap_with_retry
from clusterproxy_protocol.certclient import CertFiles, Issued, SignerEndpoint
from clusterproxy_protocol.config import ConfigError, InvalidValue, existing_file, parse_duration
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.renewer import CertRenewer, RenewalPolicy
from clusterproxy_protocol.wire import format_authority

__all__ = [
    "KNOWN_FAILURES",
    "SIGNER_HELP",
    "SignerSettings",
    "add_certificate_flags",
    "add_signer_flags",
    "check_without_signer",
    "failure_in_log",
    "failure_on_stderr",
    "leaves",
    "listen_on",
    "run_service",
    "serve_until_signalled",
    "signer_url",
    "watch_signals",
]

Flag = Callable[..., object]  # a program's ``flag(name, **kwargs)`` (config.flag_adder)

TRUST_REFRESH_HELP = (
    "with --signer: how often the trust bundle is fetched (a CA rotation is noticed within it; while one "
    "is under way the signer asks for sooner refreshes); 0: never (no CA rotation)"
)
# the proxy-server's and the agent's --signer, ended by what they keep (a restart, the tunnel)
SIGNER_HELP = (
    "cert-signer (https://HOST:PORT, verified with --ca): bootstrap --cert/--key with --bootstrap-token "
    "when they hold no valid certificate, renew them at 80% of their lifetime and follow the trust "
    "bundle, all without "
)
DEFAULT_TRUST_REFRESH = 60.0  # RenewalPolicy's, and the flag's default "1m"

# --- listening ----------------------------------------------------------------------------------------


async def listen_on(flag: str, address: tuple[str, int]) -> tuple[list[trio.SocketListener], str]:
    """trio's TCP listeners on ``address`` (host ``""``: every address) and the address they got, as
    HOST:PORT (port 0 picks one); a port that cannot be had is a ConfigError naming ``flag``."""
    host, port = address
    try:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
    except OSError as exc:
        where = format_authority(host, port)
        raise ConfigError(f"cannot listen on {flag} {where}: {exc.strerror or exc}") from None
    bound = listeners[0].socket.getsockname()
    return listeners, format_authority(str(bound[0]), int(bound[1]))


# --- the certificate and signer flags ---------------------------------------------------------------


def signer_url(text: str) -> str:
    """The cert-signer's address, ``https://HOST:PORT`` or ``HOST:PORT`` (the signer speaks HTTPS
    only), as ``https://HOST:PORT``: the one form every service passes on and logs."""
    value = text.strip().rstrip("/")
    try:
        endpoint = SignerEndpoint.parse(value, Path("."))  # the form only; the CA is checked on its own
    except ConfigError as exc:
        raise InvalidValue(str(exc)) from None
    if endpoint.port == 0:
        raise InvalidValue(f"invalid signer URL {text!r}: port 0 cannot be dialed")
    return endpoint.url


def add_certificate_flags(
    flag: Flag,
    *,
    ca_help: str,
    cert_help: str,
    key_help: str,
    prefix: str = "--",
    required: bool = True,
    ca_type: Callable[[str], Any] = Path,
    metavar: str | None = None,
) -> None:
    """``--ca``, ``--cert``, ``--key`` (``prefix`` ``--proxy-`` gives ``--proxy-ca`` ...). The
    certificate and key are plain paths: with ``--signer`` they may not exist yet (the first start
    writes them), without it :func:`check_without_signer` wants them."""
    kwargs: dict[str, Any] = {"required": required}
    if metavar is not None:
        kwargs["metavar"] = metavar
    flag(f"{prefix}ca", type=ca_type, help=ca_help, **kwargs)
    flag(f"{prefix}cert", type=Path, help=cert_help, **kwargs)
    flag(f"{prefix}key", type=Path, help=key_help, **kwargs)


def add_signer_flags(
    flag: Flag,
    *,
    signer_help: str,
    token_help: str,
    trust_refresh: bool = False,
    trust_refresh_metavar: str | None = None,
) -> None:
    """``--signer URL`` (checked by :func:`signer_url`), ``--bootstrap-token TOKEN`` and, with
    ``trust_refresh``, ``--trust-refresh`` (how often the trust bundle is fetched)."""
    flag("--signer", type=signer_url, metavar="URL", help=signer_help)
    flag("--bootstrap-token", metavar="TOKEN", help=token_help)
    if trust_refresh:
        extra = {"metavar": trust_refresh_metavar} if trust_refresh_metavar else {}
        flag("--trust-refresh", type=parse_duration, default="1m", help=TRUST_REFRESH_HELP, **extra)


def check_without_signer(
    error: Callable[[str], object],
    *,
    tokens: Sequence[tuple[str, object]],
    files: Sequence[tuple[str, Path | str | None]],
    needs: str = "--signer (the cert-signer that trades the token)",
    missing: str = "argument {flag}: {error} (or use --signer to get the certificate)",
) -> None:
    """Without ``--signer``: a token flag given is an ``error`` (``--bootstrap-token needs --signer``),
    and each certificate file must exist (nothing would write it). ``tokens`` and ``files`` are
    ``(flag, value)`` pairs; ``error`` does not return (``parser.error``) or raises."""
    for name, value in tokens:
        if value:
            error(f"{name} needs {needs}")
    for name, path in files:
        if path is None:
            continue
        try:
            existing_file(path)
        except ConfigError as exc:
            error(missing.format(flag=name, error=exc))


# --- bootstrap, then renew -------------------------------------------------------------------------


@dataclass(frozen=True)
class SignerSettings:
    """``--signer``, ``--bootstrap-token`` (stripped; None when empty) and ``--trust-refresh``."""

    url: str
    bootstrap_token: str | None = None
    trust_refresh: float = DEFAULT_TRUST_REFRESH

    @classmethod
    def from_args(cls, args: Any) -> SignerSettings | None:
        """From parsed flags (:func:`add_signer_flags`); None without ``--signer``."""
        if not getattr(args, "signer", None):
            return None
        token = (getattr(args, "bootstrap_token", None) or "").strip() or None
        refresh = getattr(args, "trust_refresh", DEFAULT_TRUST_REFRESH)
        return cls(args.signer, token, DEFAULT_TRUST_REFRESH if refresh is None else refresh)

    def endpoint(self, ca: Path, proxy: Any = None) -> SignerEndpoint:
        """The signer, verified with the trust bundle ``ca``; through the forward proxy ``proxy``."""
        return SignerEndpoint.parse(self.url, ca, proxy=proxy)

    async def bootstrap(
        self,
        files: CertFiles,
        make_csr: Callable[[Any], str],
        log: Any,
        *,
        endpoint: SignerEndpoint | None = None,
    ) -> Issued | None:
        """A first certificate for ``files`` from the token when they hold no valid one (None: they
        do). A refused token is final (:class:`ConfigError`); a signer not up yet is waited for."""
        return await bootstrap_with_retry(
            endpoint or self.endpoint(files.ca), files, self.bootstrap_token, make_csr, log
        )

    def needs_bootstrap(self, files: CertFiles) -> bool:
        """Whether the next :meth:`bootstrap` spends the token (the files hold no valid certificate)."""
        return certclient.usable_credentials(files) is None and self.bootstrap_token is not None

    def renewer(
        self,
        files: CertFiles,
        contexts: Sequence[ReloadingContext] = (),
        *,
        endpoint: SignerEndpoint | None = None,
    ) -> CertRenewer:
        """What keeps ``files`` renewed and ``contexts`` loaded with them, to run in the service's
        nursery (``await nursery.start(renewer.run)``)."""
        return CertRenewer(
            endpoint or self.endpoint(files.ca),
            files,
            contexts,
            RenewalPolicy(trust_refresh=self.trust_refresh),
        )


# --- signals -----------------------------------------------------------------------------------------

SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def watch_signals(
    log: Any,
    stop: Callable[[], object],
    cut: Callable[[], object] | None = None,
    *,
    first_event: str = "signal_received",
    cut_event: str = "drain_cut_by_signal",
    signals: Sequence[int] = SIGNALS,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """At the first SIGTERM/SIGINT call ``stop()``, at each later one ``cut()`` (when given); each
    logged (``first_event``, ``cut_event``). Started (``nursery.start``) once the signals are caught: none sent after
    is lost, and none kills the process before its drain."""
    with trio.open_signal_receiver(*signals) as received:
        task_status.started()
        first = True
        async for signum in received:
            name = signal.Signals(signum).name
            if first:
                first = False
                log.info(first_event, signal=name)
                stop()
            elif cut is not None:
                log.warning(cut_event, signal=name)
                cut()


async def serve_until_signalled(
    run: Callable[..., Awaitable[Any]],
    log: Any,
    *,
    drain: Callable[[], Awaitable[object]] | None = None,
    cut: Callable[[], object] | None = None,
    stop: trio.Event | None = None,
    first_event: str = "signal_received",
    cut_event: str = "drain_cut_by_signal",
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start ``run`` (``nursery.start``: what it reports is reported on) and serve until the first
    SIGTERM/SIGINT or ``stop``: then ``await drain()`` (a second signal calls ``cut()`` to cut it
    short), and everything left is cancelled. Without ``drain`` the first signal cancels at once.
    Returns as well when ``run`` returns by itself."""
    stop = stop if stop is not None else trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(watch_signals, log, stop.set, cut, first_event=first_event, cut_event=cut_event)
        )
        ended = trio.Event()

        async def service(task_status: trio.TaskStatus[Any]) -> None:
            try:
                await run(task_status=task_status)
            finally:
                ended.set()

        task_status.started(await nursery.start(service))
        async with trio.open_nursery() as waiting:  # the first of: a stop, the service's own end
            waiting.start_soon(_set_then_cancel, stop.wait, waiting.cancel_scope)
            waiting.start_soon(_set_then_cancel, ended.wait, waiting.cancel_scope)
        if drain is not None and not ended.is_set():
            await drain()
        nursery.cancel_scope.cancel()


async def _set_then_cancel(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()


# --- exit codes --------------------------------------------------------------------------------------

KNOWN_FAILURES: tuple[type[BaseException], ...] = (ConfigError, OSError)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, however deep in (trio's) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def failure_on_stderr(prog: str, status: int = 1, *, what: str = "") -> Callable[[list[BaseException]], int]:
    """An ``on_failure`` that prints ``PROG: error: [WHAT: ]FIRST ERROR`` on stderr: ``status``."""

    def report(errors: list[BaseException]) -> int:
        print(f"{prog}: error: {what + ': ' if what else ''}{errors[0]}", file=sys.stderr)
        return status

    return report


def failure_in_log(log: Any, event: str, status: int = 1) -> Callable[[list[BaseException]], int]:
    """An ``on_failure`` that logs every error in one ``event`` line (``error="a; b"``): ``status``."""

    def report(errors: list[BaseException]) -> int:
        log.error(event, error="; ".join(str(e) for e in errors))
        return status

    return report


def run_service(
    async_fn: Callable[..., Awaitable[Any]],
    *args: Any,
    on_failure: Callable[[list[BaseException]], int],
    known: tuple[type[BaseException], ...] = KNOWN_FAILURES,
) -> int:
    """``trio.run(async_fn, *args)`` and the process's exit status: 0 when it returned (or SIGINT
    ended it before its signals were caught), ``on_failure(errors)`` when every error that stopped
    it is ``known`` (a message, not a traceback). Anything else propagates: a bug shows its traceback."""
    try:
        trio.run(async_fn, *args)
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:
        errors = leaves(exc)
        if not errors or not all(isinstance(e, known) for e in errors):
            raise
        return on_failure(errors)
    return 0

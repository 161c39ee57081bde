"""Command-line flags with environment-variable twins, validated at start.

Every service flag has an environment twin (``--agent-port`` / ``CLUSTER_PROXY_AGENT_PORT``). The
command line wins over the environment, the environment over the built-in default, and *every* source
goes through the same converter, so a bad value stops the process at start with a message naming the
flag (or the environment variable) and the value::

    parser = argparse.ArgumentParser(prog="cluster-proxy-server")
    add_flag(parser, "--agent-listen", env="CLUSTER_PROXY_AGENT_LISTEN", type=parse_hostport,
             default="0.0.0.0:8091", help="address the agents dial")
    args = parse_args_or_exit(parser, argv)

Converters raise :class:`InvalidValue`, which is at once an :class:`argparse.ArgumentTypeError` (so
argparse prints its message as is), a :class:`ValueError` and a :class:`ConfigError` (so code calling
the converters directly can catch either).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from clusterproxy_protocol.windows import format_size
from clusterproxy_protocol.wire import MalformedAddress, split_hostport

__all__ = [
    "ConfigError",
    "InvalidValue",
    "add_flag",
    "env_for",
    "existing_dir",
    "existing_file",
    "flag_adder",
    "format_size",  # re-exported: the inverse of parse_size, for flags' defaults
    "parse_args_or_exit",
    "parse_bool",
    "parse_duration",
    "parse_hostport",
    "parse_port",
    "parse_positive_int",
    "parse_size",
]

ENV_PREFIX = "CLUSTER_PROXY_"

_NOT_GIVEN: Any = object()  # marks "not on the command line" while parsing


class ConfigError(Exception):
    """Configuration that cannot be used: a bad flag or environment value, a missing or unreadable file."""


class InvalidValue(ConfigError, argparse.ArgumentTypeError, ValueError):
    """A value a converter rejected; the message names the value and says what was expected."""


# --- converters ---------------------------------------------------------------------------------------


def parse_port(text: str | int) -> int:
    """A TCP port, 0-65535 (0 asks the OS for a free port when listening)."""
    try:
        port = int(str(text).strip(), 10)
    except ValueError:
        raise InvalidValue(f"invalid port {text!r}: expected an integer 0-65535") from None
    if not 0 <= port <= 65535:
        raise InvalidValue(f"invalid port {text!r}: expected an integer 0-65535")
    return port


_HOST_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")


def parse_hostport(text: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` -> ``(host, port)``; IPv6 hosts come back without brackets."""
    expected = "expected HOST:PORT, e.g. 127.0.0.1:8091, proxy.example.com:443 or [::1]:8091"
    raw = text
    text = text.strip()
    try:
        host, port_text = split_hostport(text)
    except MalformedAddress as exc:
        raise InvalidValue(f"invalid address {raw!r}: {exc}") from None
    if text.startswith("["):
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise InvalidValue(f"invalid address {raw!r}: {host!r} is not an IPv6 address") from None
    elif not _HOST_CHARS.match(host):
        raise InvalidValue(f"invalid address {raw!r}: {host!r} is not a host name or IP address")
    if not port_text:
        raise InvalidValue(f"invalid address {raw!r}: {expected}")
    try:
        port = parse_port(port_text)
    except InvalidValue:
        raise InvalidValue(f"invalid address {raw!r}: port {port_text!r} is not an integer 0-65535") from None
    return host, port


def parse_dialable_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of something to dial: port 0 is refused."""
    host, port = parse_hostport(text)
    if port == 0:
        raise InvalidValue(f"invalid address {text!r}: port 0 cannot be dialed")
    return host, port


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | float) -> float:
    """A non-negative duration in seconds: ``"500ms"``, ``"5s"``, ``"2m"``, ``"1h"``, ``"1m30s"``, ``"2.5"``."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower()
        expected = "expected a duration such as 500ms, 5s, 2m, 1h30m or a number of seconds"
        try:
            value = float(s)
        except ValueError:
            pos, value = 0, 0.0
            for match in _DURATION_PART.finditer(s):
                if match.start() != pos:
                    break
                value += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
                pos = match.end()
            if pos != len(s) or not s:
                raise InvalidValue(f"invalid duration {text!r}: {expected}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise InvalidValue(f"invalid duration {text!r}: must be a finite number of seconds >= 0")
    return value


def parse_positive_duration(text: str | float) -> float:
    """A duration in seconds greater than 0 (see :func:`parse_duration`)."""
    value = parse_duration(text)
    if value <= 0:
        raise InvalidValue(f"invalid duration {text!r}: must be greater than 0")
    return value


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
}
_SIZE = re.compile(r"^(\d+(?:\.\d*)?)\s*([a-z]*)$")


def parse_size(text: str | int) -> int:
    """A byte count: ``"65536"``, ``"64KiB"``, ``"4MiB"``, ``"1GB"`` (SI and binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidValue(f"invalid size {text!r}: must be >= 0")
        return text
    match = _SIZE.match(str(text).strip().lower())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise InvalidValue(f"invalid size {text!r}: expected bytes such as 65536, 64KiB, 4MiB or 1GB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def parse_positive_int(text: str | int) -> int:
    """An integer >= 1."""
    try:
        value = int(str(text).strip(), 10)
    except ValueError:
        raise InvalidValue(f"invalid number {text!r}: expected an integer >= 1") from None
    if value < 1:
        raise InvalidValue(f"invalid number {text!r}: expected an integer >= 1")
    return value


def parse_count(text: str | int) -> int:
    """An integer >= 0 (0 often meaning "no limit")."""
    try:
        value = int(str(text).strip(), 10)
    except ValueError:
        raise InvalidValue(f"invalid number {text!r}: expected an integer >= 0") from None
    if value < 0:
        raise InvalidValue(f"invalid number {text!r}: expected an integer >= 0")
    return value


def parse_positive_float(text: str) -> float:
    """A number greater than 0 (a rate, a burst)."""
    try:
        value = float(text)
    except ValueError:
        raise InvalidValue(f"invalid number {text!r}: expected a number > 0") from None
    if not value > 0:
        raise InvalidValue(f"invalid number {text!r}: expected a number > 0")
    return value


def parse_non_negative_float(text: str) -> float:
    """A finite number >= 0 (0 often meaning "no limit")."""
    try:
        value = float(text)
    except ValueError:
        raise InvalidValue(f"invalid number {text!r}: expected a number >= 0, e.g. 500") from None
    if not (math.isfinite(value) and value >= 0):
        raise InvalidValue(f"invalid number {text!r}: must be a finite number >= 0")
    return value


def parse_fraction(text: str) -> float:
    """A share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise InvalidValue(f"invalid fraction {text!r}: expected a number in (0, 1], e.g. 0.5") from None
    if not 0 < value <= 1:
        raise InvalidValue(f"invalid fraction {text!r}: must be greater than 0 and at most 1")
    return value


_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def parse_bool(text: str | bool) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (case-insensitive)."""
    if isinstance(text, bool):
        return text
    s = str(text).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise InvalidValue(f"invalid boolean {text!r}: expected true/false, yes/no, on/off or 1/0")


def existing_file(path: str | os.PathLike[str]) -> Path:
    """A path to an existing, readable regular file."""
    p = Path(path).expanduser()
    if not str(path):
        raise InvalidValue("invalid file '': the path is empty")
    if not p.exists():
        raise InvalidValue(f"file not found: {str(path)!r}")
    if not p.is_file():
        raise InvalidValue(f"not a regular file: {str(path)!r}")
    if not os.access(p, os.R_OK):
        raise InvalidValue(f"file not readable: {str(path)!r}")
    return p


def existing_dir(path: str | os.PathLike[str]) -> Path:
    """A path to an existing directory."""
    p = Path(path).expanduser()
    if not str(path):
        raise InvalidValue("invalid directory '': the path is empty")
    if not p.is_dir():
        raise InvalidValue(f"directory not found: {str(path)!r}")
    return p


# --- flags with environment twins ---------------------------------------------------------------------


def env_for(flag: str, prefix: str = ENV_PREFIX) -> str:
    """The conventional environment twin of a flag: ``--agent-port`` -> ``CLUSTER_PROXY_AGENT_PORT``."""
    return prefix + flag.lstrip("-").upper().replace("-", "_")


@dataclasses.dataclass(frozen=True)
class _Twin:
    """What :func:`add_flag` knows of a flag beyond argparse: its environment twin and how to read it."""

    env: str
    default: Any
    convert: Callable[[str], Any]
    multiple: bool
    required: bool


# Kept beside the parser's actions rather than on them: argparse.Action has no place for them.
_TWINS: weakref.WeakKeyDictionary[argparse.Action, _Twin] = weakref.WeakKeyDictionary()


def _given_marker(dest: str) -> str:
    return f"_cluster_proxy_given_{dest}"


class _MarksGiven(argparse.Action):
    """An action that marks its flag as given on the command line, so its environment twin does not
    apply (:func:`parse_args_or_exit`); mixed in before argparse's own action."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        self._first_use(namespace)
        super().__call__(parser, namespace, values, option_string)
        setattr(namespace, _given_marker(self.dest), True)

    def _first_use(self, namespace: argparse.Namespace) -> None:
        pass


class _Store(_MarksGiven, argparse._StoreAction):
    pass


class _Append(_MarksGiven, argparse._AppendAction):
    def _first_use(self, namespace: argparse.Namespace) -> None:
        if not getattr(namespace, _given_marker(self.dest), False):
            setattr(namespace, self.dest, None)  # never append to the default list


class _Switch(_MarksGiven, argparse.BooleanOptionalAction):
    pass


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    *,
    env: str,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    required: bool = False,
    multiple: bool = False,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    dest: str | None = None,
    aliases: Sequence[str] = (),
) -> argparse.Action:
    """Add the long option ``name`` (e.g. ``--agent-port``) with the environment twin ``env``.

    - ``type`` converts and validates every source: the command line, the environment variable and a
      string ``default``. Use ``type=bool`` for a switch: ``--name``/``--no-name``, and in the
      environment ``true``/``false``/``1``/``0``/``yes``/``no``.
    - ``multiple=True``: the flag may repeat (``--server a --server b``); its environment twin is a
      comma-separated list; the value is a list (``default`` or ``[]`` when unset).
    - ``required=True`` is satisfied by either the flag or the environment variable.
    - The help text shows the environment variable and the default.

    The environment is read, and ``required`` enforced, by :func:`parse_args_or_exit`; parse with it
    (a plain ``parser.parse_args()`` sees only the command line and the defaults).
    """
    if not name.startswith("--"):
        raise ValueError(f"add_flag is for long options like --listen, not {name!r}")
    if multiple and type is bool:
        raise ValueError("a switch (type=bool) cannot be multiple")
    if default is None and multiple:
        default = []
    extras = [f"env {env}"]
    if type is not bool and default not in (None, [], (), ""):
        shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else default
        extras.append(f"default {shown}")
    elif type is bool and default is not None:
        extras.append(f"default {'true' if default else 'false'}")
    help_text = f"{help.rstrip()} [{'; '.join(extras)}]".strip().replace("%", "%%")

    kwargs: dict[str, Any] = {"help": help_text}
    if dest is not None:
        kwargs["dest"] = dest
    if metavar is not None:
        kwargs["metavar"] = metavar
    if choices is not None:
        kwargs["choices"] = choices
    converter: Callable[[str], Any]
    if type is bool:
        kwargs.update(action=_Switch, default=default)
        converter = parse_bool
    else:
        kwargs.update(
            action=_Append if multiple else _Store, type=type, default=None if multiple else default
        )
        converter = type
    action = parser.add_argument(name, *aliases, **kwargs)
    _TWINS[action] = _Twin(env, default, converter, multiple, required)
    return action


def flag_adder(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, prefix: str
) -> Callable[..., argparse.Action]:
    """A program's ``flag(name, **kwargs)``: :func:`add_flag` to ``parser`` with the environment twin
    ``prefix`` + the flag's name (``flag_adder(p, "CLUSTER_PROXY_SERVER_")("--agent-listen", ...)``
    reads ``CLUSTER_PROXY_SERVER_AGENT_LISTEN``)."""

    def flag(name: str, **kwargs: Any) -> argparse.Action:
        return add_flag(parser, name, env=env_for(name, prefix), **kwargs)

    return flag


def _convert(action: argparse.Action, convert: Callable[[str], Any], text: str) -> Any:
    value = convert(text)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise InvalidValue(f"invalid choice {text!r} (choose from {choices})")
    return value


def _twin_actions(parser: argparse.ArgumentParser) -> list[tuple[argparse.Action, _Twin]]:
    """Every flag added by :func:`add_flag` in ``parser`` and its sub-command parsers."""
    found: list[tuple[argparse.Action, _Twin]] = []
    seen: set[int] = set()
    todo = [parser]
    while todo:
        p = todo.pop()
        if id(p) in seen:
            continue
        seen.add(id(p))
        for a in p._actions:
            if (twin := _TWINS.get(a)) is not None:
                found.append((a, twin))
            elif isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    return found


def parse_args_or_exit(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) and the environment twins, or exit with status 2.

    Precedence: command line, then environment, then default. A bad value exits via
    ``parser.error`` with a message naming the flag or the environment variable and the value, e.g.
    ``error: environment variable CLUSTER_PROXY_AGENT_PORT (--agent-port): invalid port 'x': ...``.
    Works for flags of sub-command parsers too (those of the chosen sub-command).
    """
    environ = os.environ if environ is None else environ
    try:
        args = parser.parse_args(argv)
    except (ConfigError, ValueError) as exc:  # e.g. a converter that raised outside argparse's handling
        parser.error(str(exc))

    missing: list[str] = []
    for a, twin in _twin_actions(parser):
        if not hasattr(args, a.dest):  # belongs to a sub-command that was not chosen
            continue
        marker = _given_marker(a.dest)
        if getattr(args, marker, False):
            continue
        env, convert, multiple = twin.env, twin.convert, twin.multiple
        flag = a.option_strings[0] if a.option_strings else a.dest
        text = environ.get(env)
        if text is not None:
            try:
                if multiple:
                    value: Any = [
                        _convert(a, convert, item.strip()) for item in text.split(",") if item.strip()
                    ]
                else:
                    value = _convert(a, convert, text)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                detail = str(exc) or f"invalid value {text!r}"
                if repr(text) not in detail:
                    detail = f"invalid value {text!r}: {detail}"
                parser.error(f"environment variable {env} ({flag}): {detail}")
            setattr(args, a.dest, value)
        elif twin.required:
            missing.append(f"{flag} (or environment variable {env})")
        elif multiple:
            default = twin.default
            try:
                value = [_convert(a, convert, d) if isinstance(d, str) else d for d in default]
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                parser.error(f"default of {flag}: {exc}")
            setattr(args, a.dest, value)
    for name in [k for k in vars(args) if k.startswith("_cluster_proxy_given_")]:
        delattr(args, name)
    if missing:
        parser.error("the following settings are required: " + ", ".join(missing))
    return args

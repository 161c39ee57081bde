"""Logging: structlog, one event per line on stderr.

JSON lines when stderr is not a terminal (containers, CI, files) or when asked; a readable console
format on a terminal. Every event has ``timestamp`` (ISO 8601, UTC), ``level`` and ``event``; use the
stable keys ``cluster``, ``agent_id``, ``stream_id``, ``target``, ``bytes_in``, ``bytes_out``.
Standard-library ``logging`` records (from libraries) go through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import structlog
from structlog.typing import FilteringBoundLogger

from .config import ConfigError

__all__ = ["LEVELS", "LOG_FORMATS", "LOG_LEVELS", "add_log_flags", "configure_logging", "get_logger"]

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# --log-format: configure_logging's ``json`` for each
LOG_FORMATS: dict[str, bool | None] = {"auto": None, "json": True, "console": False}


def add_log_flags(flag: Callable[..., object]) -> None:
    """``--log-level`` and ``--log-format``, through a program's own ``flag(name, **kwargs)`` (which
    gives each its environment variable)."""
    flag("--log-level", default="info", choices=LOG_LEVELS, help="log level")
    flag(
        "--log-format",
        default="auto",
        choices=list(LOG_FORMATS),
        help="auto: JSON unless stderr is a terminal",
    )


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    try:
        return LEVELS[level.strip().lower()]
    except KeyError:
        raise ConfigError(f"invalid log level {level!r}: expected one of {', '.join(LOG_LEVELS)}") from None


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog (and the standard ``logging`` root) to write to the current ``sys.stderr``.

    ``json=None`` picks JSON when stderr is not a TTY. Safe to call again (e.g. in tests).
    """
    level_no = _level_number(level)
    stream = sys.stderr
    is_tty = bool(getattr(stream, "isatty", lambda: False)())
    use_json = (not is_tty) if json is None else json

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if use_json:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=is_tty)

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_cluster_proxy", False)]:
        root.removeHandler(old)
    handler._cluster_proxy = True  # type: ignore[attr-defined]  # our mark, found again (getattr) when called again
    root.addHandler(handler)
    root.setLevel(level_no)


def get_logger(name: str | None = None, **initial: Any) -> FilteringBoundLogger:
    """A structlog bound logger; ``name`` becomes the ``logger`` key of its events."""
    if name is not None:
        initial = {"logger": name, **initial}
    logger: FilteringBoundLogger = structlog.get_logger().bind(**initial)
    return logger

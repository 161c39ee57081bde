"""An object's metadata as the reconcilers read it: its generation (what a spec change bumps), whether
it is being deleted, and its resourceVersion as a number (which of two copies is newer)."""

from __future__ import annotations

from typing import Any

__all__ = ["generation_of", "is_deleting", "version_number"]


def generation_of(obj: dict[str, Any] | None) -> Any:
    return ((obj or {}).get("metadata") or {}).get("generation")


def is_deleting(obj: dict[str, Any] | None) -> bool:
    return bool(((obj or {}).get("metadata") or {}).get("deletionTimestamp"))


def version_number(obj: dict[str, Any] | None) -> int:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0

"""metav1.Condition lists: set one condition, keeping its lastTransitionTime while its status holds,
and tell whether a status write would change anything."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Condition", "merge_conditions", "same_conditions"]


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def _timestamp(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(
    existing: Sequence[Mapping[str, Any]] | None,
    wanted: Sequence[Condition],
    *,
    now: dt.datetime,
    observed_generation: int | None = None,
) -> list[dict[str, Any]]:
    """``existing`` with each of ``wanted`` set; conditions of other types (other writers') kept as
    they are. A condition whose status is unchanged keeps its lastTransitionTime."""
    result = [dict(c) for c in existing or [] if isinstance(c, Mapping)]
    by_type = {c.get("type"): i for i, c in enumerate(result)}
    for condition in wanted:
        entry: dict[str, Any] = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": _timestamp(now),
        }
        if observed_generation is not None:
            entry["observedGeneration"] = observed_generation
        index = by_type.get(condition.type)
        if index is None:
            by_type[condition.type] = len(result)
            result.append(entry)
            continue
        old = result[index]
        if old.get("status") == condition.status and old.get("lastTransitionTime"):
            entry["lastTransitionTime"] = old["lastTransitionTime"]
        result[index] = entry
    return result


def _comparable(condition: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        condition.get("type"),
        condition.get("status"),
        condition.get("reason"),
        condition.get("message"),
        condition.get("observedGeneration"),
        condition.get("lastTransitionTime"),
    )


def same_conditions(a: Sequence[Mapping[str, Any]] | None, b: Sequence[Mapping[str, Any]] | None) -> bool:
    return sorted(map(_comparable, a or []), key=repr) == sorted(map(_comparable, b or []), key=repr)

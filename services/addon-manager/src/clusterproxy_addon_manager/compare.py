"""Does an object on the API server already hold what the manager wants?

The API server adds defaults (a Deployment's strategy, a Service's clusterIP, ...) and other writers
add their own fields, so "equal" is the wrong test: an object is up to date when every field the
manager sets has the value it wants (:func:`contains`). A field the manager stops setting is not
detected here; server-side apply removes it at the next write, which any other change triggers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["contains"]


def contains(actual: Any, desired: Any) -> bool:
    """Whether ``desired`` is a sub-document of ``actual``: mappings by key (extra keys in ``actual``
    allowed), lists item by item with the same length, scalars equal."""
    if isinstance(desired, Mapping):
        if not isinstance(actual, Mapping):
            return False
        return all(key in actual and contains(actual[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return False
        return all(contains(a, d) for a, d in zip(actual, desired, strict=True))
    if isinstance(desired, bool) or isinstance(actual, bool):
        return type(desired) is type(actual) and desired == actual
    return bool(desired == actual)

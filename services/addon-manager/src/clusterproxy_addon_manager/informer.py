"""Informers: a thread per watched resource that keeps an in-memory copy of its objects and says
which ones changed.

Each thread lists (paged), then watches from the list's resourceVersion, moving that version forward
with every event and bookmark. When the server ends the watch (``timeoutSeconds``), it watches again
from where it was; when the version is too old (410 Gone) it lists again and reports the difference
(objects deleted meanwhile included); when the API server cannot be reached (a restart) it retries
with a capped, jittered backoff and resumes. So after any outage the copy converges to the server's
state, and every object that changed meanwhile is reported.

Why threads: the ``kubernetes`` client and urllib3 are synchronous and a watch blocks on its socket.
The handler runs in the informer's thread; the manager's handler only hands keys to the trio work
queue (``trio.from_thread.run_sync``).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

from clusterproxy_protocol import get_logger

from .kube import Forbidden, Gone, Kube, KubeError, NotFound, Resource, Unavailable

__all__ = ["Handler", "Informer", "object_key"]

#: ``handler(old, new)``: ``old`` None for an addition, ``new`` None for a deletion
Handler = Callable[[dict[str, Any] | None, dict[str, Any] | None], None]
Key = tuple[str, str]  # (namespace or "", name)


def object_key(obj: dict[str, Any]) -> Key:
    metadata = obj.get("metadata") or {}
    return str(metadata.get("namespace") or ""), str(metadata.get("name") or "")


def _version(obj: dict[str, Any] | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


class Informer:
    """The objects of ``resource`` (in ``namespace``, or all), optionally filtered by selectors."""

    def __init__(
        self,
        kube: Kube,
        resource: Resource,
        handler: Handler,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        watch_timeout: int = 60,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        on_problem: Callable[[str | None], None] | None = None,
    ) -> None:
        self.kube = kube
        self.resource = resource
        self.handler = handler
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.watch_timeout = watch_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.on_problem = on_problem
        self.synced = threading.Event()
        self.stopping = threading.Event()
        self.problem: str | None = None  # why the copy may be stale, for /readyz
        self.relists = 0
        self.rewatches = 0
        self._cache: dict[Key, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        where = f" in {namespace}" if namespace else ""
        self.name = f"{resource.describe}{where}"
        self.log = get_logger(
            "clusterproxy_addon_manager.informer", resource=resource.describe, namespace=namespace
        )

    # -- the copy -----------------------------------------------------------------------------------

    def get(self, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self._lock:
            return self._cache.get((namespace, name))

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._cache.values())

    # -- running ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"informer {self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (at its next event or watch timeout); its copy stops changing."""
        self.stopping.set()

    def _set_problem(self, problem: str | None) -> None:
        if problem != self.problem:
            self.problem = problem
            if self.on_problem is not None:
                self.on_problem(problem)

    def _emit(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if self.stopping.is_set():
            return
        try:
            self.handler(old, new)
        except Exception:  # a handler bug must not end the watch
            self.log.exception("informer_handler_failed")

    def _relist(self) -> str:
        items, version = self.kube.list(
            self.resource,
            self.namespace,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
        )
        fresh = {object_key(item): item for item in items}
        with self._lock:
            previous = self._cache
            self._cache = fresh
        for key, item in fresh.items():
            old = previous.get(key)
            if old is None or _version(old) != _version(item):
                self._emit(old, item)
        for key, old in previous.items():
            if key not in fresh:
                self._emit(old, None)
        self.relists += 1
        self.synced.set()
        return version

    def _apply(self, event_type: str, obj: dict[str, Any]) -> None:
        obj.setdefault("apiVersion", self.resource.api_version)
        obj.setdefault("kind", self.resource.kind)
        key = object_key(obj)
        with self._lock:
            old = self._cache.get(key)
            if event_type == "DELETED":
                self._cache.pop(key, None)
            else:
                self._cache[key] = obj
        self._emit(old, None if event_type == "DELETED" else obj)

    def run(self) -> None:
        version: str | None = None
        failures = 0
        while not self.stopping.is_set():
            try:
                if version is None:
                    version = self._relist()
                    self._set_problem(None)
                timeout = self.watch_timeout + random.randint(0, max(self.watch_timeout // 5, 1))
                for event in self.kube.watch(
                    self.resource,
                    self.namespace,
                    version,
                    label_selector=self.label_selector,
                    field_selector=self.field_selector,
                    timeout_seconds=timeout,
                ):
                    if self.stopping.is_set():
                        return
                    obj = event.get("object") or {}
                    version = _version(obj) or version
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._apply(str(event["type"]), obj)
                    failures = 0
                    self._set_problem(None)
                self.rewatches += 1
                failures = 0
            except Gone:
                self.log.info("watch_expired_relisting")
                version = None
            except (Unavailable, Forbidden, NotFound, KubeError) as exc:
                failures += 1
                # A missing CRD or missing RBAC needs an operator: say so, then keep trying slowly.
                needs_operator = isinstance(exc, Forbidden) or (
                    isinstance(exc, NotFound) and exc.missing_crd is not None
                )
                if needs_operator:
                    self.log.error("watch_failed", error=str(exc), attempt=failures)
                elif failures in (1, 10) or failures % 50 == 0:
                    self.log.warning("watch_failed", error=str(exc), attempt=failures)
                self._set_problem(f"{self.name}: {exc}")
                ceiling = min(
                    self.backoff_initial * 2 ** min(failures - 1, 16),
                    30.0 if needs_operator else self.backoff_max,
                )
                self.stopping.wait(ceiling / 2 + random.random() * ceiling / 2)

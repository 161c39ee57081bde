"""The ManagedClusterAddOn status the manager writes, against a stand-in of the API: its conditions,
the agent's namespace, and ``healthCheck.mode: Customized``, which tells OCM's registration agent to
leave ``Available`` to the manager (docs/addon-manager.md, "Who judges the addon's health")."""

from __future__ import annotations

import copy
import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest

from clusterproxy_addon_manager.conditions import Condition
from clusterproxy_addon_manager.kube import Conflict
from clusterproxy_addon_manager.status import HEALTH_CHECK_MODE, set_addon_status

NOW = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)


class FakeKube:
    """``replace_status`` and ``get`` of one ManagedClusterAddOn: the writes it saw, and a 409 for
    the first ``conflicts`` of them (someone else wrote in between)."""

    def __init__(self, stored: dict[str, Any], conflicts: int = 0) -> None:
        self.stored = stored
        self.conflicts = conflicts
        self.writes: list[dict[str, Any]] = []

    def replace_status(self, resource: Any, body: dict[str, Any]) -> dict[str, Any]:
        if self.conflicts:
            self.conflicts -= 1
            raise Conflict("the object has been modified")
        self.writes.append(copy.deepcopy(body))
        self.stored = copy.deepcopy(body)
        return copy.deepcopy(body)

    def get(self, resource: Any, name: str, namespace: str | None = None) -> dict[str, Any]:
        return copy.deepcopy(self.stored)


class Counter:
    def labels(self, *values: str) -> Counter:
        return self

    def inc(self) -> None:
        pass


def fake_controller(kube: FakeKube) -> Any:
    return SimpleNamespace(
        kube=kube,
        now=lambda: NOW,
        remember=lambda resource, obj: None,
        metrics=SimpleNamespace(writes=Counter()),
        log=SimpleNamespace(info=lambda *args, **kwargs: None),
    )


def addon(status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "ManagedClusterAddOn",
        "metadata": {"name": "cluster-proxy", "namespace": "cluster1", "resourceVersion": "7"},
        "spec": {"installNamespace": "open-cluster-management-agent-addon"},
    }
    if status is not None:
        obj["status"] = status
    return obj


AVAILABLE = Condition("Available", "True", "ProxyAgentConnected", "1 tunnel(s) on 1 replica(s)")


def test_the_first_write_sets_the_customized_health_check() -> None:
    kube = FakeKube(addon())
    set_addon_status(fake_controller(kube), addon(), [AVAILABLE], "open-cluster-management-cluster-proxy")
    [written] = kube.writes
    assert written["status"]["healthCheck"] == {"mode": "Customized"} == {"mode": HEALTH_CHECK_MODE}
    assert written["status"]["namespace"] == "open-cluster-management-cluster-proxy"
    assert [(c["type"], c["status"]) for c in written["status"]["conditions"]] == [("Available", "True")]


def test_a_lease_mode_is_replaced_even_when_the_conditions_hold() -> None:
    """An addon OCM defaulted to Lease (or an older manager left without a mode) is rewritten though
    nothing else changed: until it says Customized, the registration agent overwrites Available."""
    first = FakeKube(addon())
    set_addon_status(fake_controller(first), addon(), [AVAILABLE], None)
    status = copy.deepcopy(first.stored["status"])
    status["healthCheck"] = {"mode": "Lease"}
    kube = FakeKube(addon(status))
    set_addon_status(fake_controller(kube), addon(status), [AVAILABLE], None)
    [written] = kube.writes
    assert written["status"]["healthCheck"]["mode"] == "Customized"
    assert written["status"]["conditions"] == status["conditions"]  # lastTransitionTime kept


def test_nothing_is_written_when_mode_conditions_and_namespace_hold() -> None:
    first = FakeKube(addon())
    set_addon_status(fake_controller(first), addon(), [AVAILABLE], "ns1")
    stored = first.stored
    kube = FakeKube(stored)
    set_addon_status(fake_controller(kube), copy.deepcopy(stored), [AVAILABLE], "ns1")
    assert kube.writes == []


def test_other_writers_status_is_kept() -> None:
    """OCM's own status fields (its registrations, its other conditions) go back as they were: the
    manager writes only what the addon-framework itself would write."""
    theirs = {
        "conditions": [
            {
                "type": "RegistrationApplied",
                "status": "True",
                "reason": "SetPermissionApplied",
                "message": "",
                "lastTransitionTime": "2026-11-28T11:00:00Z",
            }
        ],
        "registrations": [{"signerName": "kubernetes.io/kube-apiserver-client"}],
        "healthCheck": {"mode": "Lease"},
    }
    kube = FakeKube(addon(theirs))
    set_addon_status(fake_controller(kube), addon(theirs), [AVAILABLE], None)
    [written] = kube.writes
    assert written["status"]["registrations"] == theirs["registrations"]
    assert [c["type"] for c in written["status"]["conditions"]] == ["RegistrationApplied", "Available"]
    assert written["status"]["healthCheck"] == {"mode": "Customized"}


@pytest.mark.parametrize("conflicts", [1, 2])
def test_a_conflict_is_retried_from_a_fresh_read(conflicts: int) -> None:
    kube = FakeKube(addon(), conflicts=conflicts)
    set_addon_status(fake_controller(kube), addon(), [AVAILABLE], None)
    assert [w["status"]["healthCheck"]["mode"] for w in kube.writes] == ["Customized"]

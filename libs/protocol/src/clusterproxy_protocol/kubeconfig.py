"""Where a hub-side service finds its Kubernetes API server, in one order for every service: the
``--kubeconfig`` flag, then ``$KUBECONFIG`` (a list like ``$PATH``, its files merged as kubectl
merges them), then the pod's ServiceAccount, then ``~/.kube/config``. An explicit kubeconfig wins
over the pod's own identity, even in a pod.

The kubernetes client is imported when this is called: the services that call it install it (the
proxy-agent, which shares this library, does not)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from .config import ConfigError

__all__ = ["Loaded", "load_configuration"]


class Loaded(NamedTuple):
    configuration: Any  # kubernetes.client.Configuration
    source: str  # where it came from, for messages: "--kubeconfig PATH", "the pod's ServiceAccount", ...


def load_configuration(kubeconfig: Path | None, *, flag_env: str) -> Loaded:
    """The configuration from the first source that is there; ConfigError naming the source and what
    to do when it is broken or none is there (``flag_env``, the environment twin of the service's
    ``--kubeconfig``, goes into that message)."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    how = f"--kubeconfig FILE (env {flag_env}), set KUBECONFIG, or run in a pod (its ServiceAccount)"

    def from_files(files: str, source: str) -> Loaded:
        try:
            # persist_config off: a refreshed token is not written back into the user's file
            config.load_kube_config(
                config_file=files, client_configuration=configuration, persist_config=False
            )
        except (ConfigException, OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return Loaded(configuration, source)

    if kubeconfig is not None:
        if not kubeconfig.is_file():
            raise ConfigError(f"--kubeconfig {kubeconfig}: no such file; give {how}")
        return from_files(str(kubeconfig), f"--kubeconfig {kubeconfig}")
    if listed := os.environ.get("KUBECONFIG"):
        if not any(Path(entry).expanduser().is_file() for entry in listed.split(os.pathsep) if entry):
            raise ConfigError(f"$KUBECONFIG {listed}: no such file; give {how}")
        return from_files(listed, f"$KUBECONFIG {listed}")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            raise ConfigError(f"the pod's ServiceAccount: {exc}") from None
        return Loaded(configuration, "the pod's ServiceAccount")
    default = Path.home() / ".kube" / "config"
    if not default.is_file():
        raise ConfigError(f"no Kubernetes configuration (and no {default}): give {how}")
    return from_files(str(default), str(default))

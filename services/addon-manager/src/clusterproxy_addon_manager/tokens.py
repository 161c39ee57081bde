"""What the bootstrap Secrets carry besides names, from the signer's store: the CA bundle (a Custom
CA imported into an empty store first), which group a token was minted for (its description: whose
key a token event queues), and pruning the tokens this manager minted that nothing holds any more."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .conditions import Condition
from .config import ProxyConfig
from .identity import DESCRIPTION_PREFIX, import_custom_ca
from .kube import SECRET, KubeError
from .render import SERVER_BOOTSTRAP_SECRET, token_from_manifest_work, token_from_secret

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["prune_tokens", "token_group", "trust_bundle"]


def trust_bundle(ctl: Controller, cfg: ProxyConfig) -> tuple[str, Condition | None]:
    """The CA bundle; for a Custom signer first import its CA into an empty store. The condition
    is set when the CA cannot be had (the reason, for the MPC status)."""
    if cfg.signer_type == "Custom":
        secret = ctl.kube.get_or_none(SECRET, cfg.custom_ca_secret, cfg.namespace)
        if secret is None:
            return "", Condition(
                "ProxyServerSecretsSigned",
                "False",
                "CustomCAMissing",
                f"Secret {cfg.namespace}/{cfg.custom_ca_secret} (spec.authentication.signer.custom."
                "caSecretName) does not exist: create it with tls.crt and tls.key of an ECDSA P-256 CA",
            )
        data = secret.get("data") or {}
        try:
            cert_pem = base64.b64decode(data.get("tls.crt", "")).decode()
            key_pem = base64.b64decode(data.get("tls.key", "")).decode()
            import_custom_ca(ctl.credentials.store(cfg.namespace), cert_pem, key_pem, now=ctl.now())
        except ValueError as exc:
            return "", Condition(
                "ProxyServerSecretsSigned",
                "False",
                "CustomCAInvalid",
                f"Secret {cfg.namespace}/{cfg.custom_ca_secret}: {exc}",
            )
    return ctl.credentials.trust_bundle(cfg.namespace), None


def token_group(secret: dict[str, Any]) -> str | None:
    """The group a token Secret of the signer's store was minted for (its description)."""
    raw = (secret.get("data") or {}).get("record.json")
    if not isinstance(raw, str):
        return None
    try:
        description = str(json.loads(base64.b64decode(raw)).get("description") or "")
    except (ValueError, AttributeError):
        return None
    return (
        description.removeprefix(DESCRIPTION_PREFIX) if description.startswith(DESCRIPTION_PREFIX) else None
    )


def prune_tokens(ctl: Controller, also_keep: Iterable[str] = ()) -> list[str]:
    """Delete unused tokens this manager minted that nothing holds any more (a crash between
    minting and writing, a superseded token). ``also_keep``: token ids held elsewhere (the
    manager's own, between its minting and its use). Blocking."""
    cfg = ctl.config()
    if cfg is None or ctl.hub is None or ctl.hub.namespace != cfg.namespace or not ctl.hub.synced:
        return []
    keep = set(also_keep)
    for work in ctl.works.items():
        token = token_from_manifest_work(work)
        if token:
            keep.add(token.split(".", 1)[0])
    server_token = token_from_secret(ctl.hub.secrets.get(SERVER_BOOTSTRAP_SECRET, cfg.namespace))
    if server_token:
        keep.add(server_token.split(".", 1)[0])
    for hub_client in ctl.options.hub_clients:
        namespace, name = hub_client.where(cfg.namespace)
        try:
            client_token = token_from_secret(ctl.read_hub_client_secret(ctl.hub, namespace, name))
        except KubeError as exc:
            # a token nobody can see may still be the one a client's Secret holds: prune nothing
            ctl.log.warning("tokens_not_pruned", reason=f"cannot read Secret {namespace}/{name}: {exc}")
            return []
        if client_token:
            keep.add(client_token.split(".", 1)[0])
    deleted = ctl.credentials.prune_tokens(cfg.namespace, keep, grace=ctl.options.token_prune_grace)
    if deleted:
        ctl.log.info("tokens_pruned", count=len(deleted), ids=deleted)
    return deleted

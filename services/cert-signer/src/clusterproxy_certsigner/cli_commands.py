"""The administration commands of ``cluster-proxy-cert-signer``: ``status [--json]``,
``rotate-ca [start|activate|retire] [--force]``, ``token create|list|delete``.

All work on the store directly (``--store``), so they need no running signer; the signer follows
store changes within its poll interval. ``cluster-proxy certs COMMAND ...`` runs
``cluster-proxy-cert-signer COMMAND ...`` as a process (the local mode's store by default).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from clusterproxy_castore.models import Binding
from clusterproxy_castore.rotation import (
    DEFAULT_CA_DAYS,
    SILENT_AFTER,
    RotationBlocked,
    RotationError,
    activate_pending,
    ensure_ca,
    retire_previous,
    start_rotation,
    status,
)
from clusterproxy_castore.store import CertStore, StoreError, open_store, parse_store
from clusterproxy_castore.tokens import MAX_TOKEN_TTL, create_token
from clusterproxy_protocol import InvalidValue, add_flag, parse_duration

from .core import utc_now
from .csr import normalize_host

__all__ = [
    "STORE_ENV",
    "add_store_flag",
    "open_store_from_args",
    "format_status",
    "parse_host",
    "register_certs_commands",
    "rotate_ca",
    "run_certs",
]

STORE_ENV = "CLUSTER_PROXY_CERT_SIGNER_STORE"
KUBECONFIG_ENV = "CLUSTER_PROXY_CERT_SIGNER_KUBECONFIG"
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _store_spec(text: str) -> tuple[str, str]:
    return parse_store(text)


def _ttl(text: str) -> dt.timedelta:
    seconds = parse_duration(text)
    if seconds <= 0 or seconds > MAX_TOKEN_TTL.total_seconds():
        raise InvalidValue(f"invalid token lifetime {text!r}: between 1s and {MAX_TOKEN_TTL}")
    return dt.timedelta(seconds=seconds)


def _silent_after(text: str) -> dt.timedelta:
    seconds = parse_duration(text)
    if seconds < 60:
        raise InvalidValue(
            f"invalid --silent-after {text!r}: at least 1m (keep it above the parties' trust refresh)"
        )
    return dt.timedelta(seconds=seconds)


def _name(text: str) -> str:
    if not text or len(text) > 64 or not set(text) <= _NAME_CHARS:
        raise InvalidValue(f"invalid name {text!r}: 1-64 letters, digits, '.', '_' or '-'")
    return text


def parse_host(text: str) -> str:
    try:
        return normalize_host(text)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None


def add_store_flag(parser: argparse.ArgumentParser) -> None:
    """``--store`` (env ``CLUSTER_PROXY_CERT_SIGNER_STORE``), required, and ``--kubeconfig`` (env
    ``CLUSTER_PROXY_CERT_SIGNER_KUBECONFIG``) for a Kubernetes store."""
    add_flag(
        parser,
        "--store",
        env=STORE_ENV,
        type=_store_spec,
        required=True,
        metavar="STORE",
        help="where the CA lives: a directory (files) or kubernetes:NAMESPACE[/PREFIX] (Secrets)",
    )
    add_flag(
        parser,
        "--kubeconfig",
        env=KUBECONFIG_ENV,
        metavar="FILE",
        help="kubeconfig for a kubernetes: store (default: $KUBECONFIG, else the pod's ServiceAccount, "
        "else ~/.kube/config)",
    )


def open_store_from_args(args: argparse.Namespace) -> CertStore:
    """The store named by ``--store`` (and ``--kubeconfig``) of a parsed command line."""
    return open_store(args.store, kubeconfig=getattr(args, "kubeconfig", None))


# --- operations (usable without argparse) --------------------------------------------------------------


def rotate_ca(
    store: CertStore,
    step: str | None = None,
    *,
    force: bool = False,
    days: int = DEFAULT_CA_DAYS,
    now: dt.datetime | None = None,
    silent_after: dt.timedelta = SILENT_AFTER,
) -> str:
    """Run one rotation step (``start``, ``activate``, ``retire``; None: the next one) and describe it.

    Raises :class:`RotationBlocked` / :class:`RotationError` when the step does not apply yet.
    """
    now = now or utc_now()
    current = store.read_authorities()
    if step is None:
        step = "activate" if current.pending else "retire" if current.previous else "start"
    if step == "start":
        record = start_rotation(store, now=now, days=days)
        return (
            f"step 1/3 done: new CA {record.id} is in the trust bundle (pending, not signing yet).\n"
            "Next: wait until `certs status` shows every party trusts it, then run `rotate-ca activate`."
        )
    if step == "activate":
        record = activate_pending(store, now=now, force=force, silent_after=silent_after)
        return (
            f"step 2/3 done: CA {record.id} now signs every new certificate; the old CA stays trusted.\n"
            "Next: parties renew onto it soon after their next trust refresh; when `certs status` shows "
            "every party presenting a certificate of the new CA, run `rotate-ca retire`."
        )
    if step == "retire":
        record = retire_previous(store, now=now, force=force, silent_after=silent_after)
        return f"step 3/3 done: CA {record.id} is retired: out of every trust bundle, its key deleted."
    raise RotationError(f"unknown rotation step {step!r}: start, activate or retire")


def format_status(data: dict[str, Any]) -> str:
    """``status()`` as a readable report."""
    lines = [
        f"store:      {data['store']}",
        f"phase:      {data['phase']}",
        f"next step:  {data['next_step']}",
        "",
        "certificate authorities:",
    ]
    rows: list[tuple[str, ...]] = [("ID", "STATE", "NOT AFTER", "SUBJECT")]
    rows += [(a["id"], a["state"], a["not_after"], a["subject"]) for a in data["authorities"]]
    lines += _table(rows)
    parties = data["parties"]
    lines += ["", f"parties (live certificates): {len(parties)}"]
    if parties:
        pending = data["phase"] == "new-ca-pending"
        moving = data["phase"] == "moving-leaves"
        header: tuple[str, ...] = ("IDENTITY", "SERIAL", "CA", "PRESENTS", "RENEW DUE", "NOT AFTER", "TRUSTS")
        if pending:
            header = (*header, "TRUSTS NEW CA")
        if moving:
            header = (*header, "PRESENTS NEW CA")
        rows = [header]
        for p in parties:
            trusts = "unknown" if p["trusted_cas"] is None else ",".join(t[:16] for t in p["trusted_cas"])
            presents = (
                "unknown"
                if p["presenting"] is None
                else ",".join(x["ca_id"] or f"?{x['serial'][:12]}" for x in p["presenting"]) or "none"
            )
            row: tuple[str, ...] = (
                p["identity"],
                p["serial"][:12],
                p["ca_id"],
                presents,
                p["renew_due"],
                p["not_after"],
                trusts,
            )
            if pending:
                row = (*row, {True: "yes", False: "NO", None: "unknown"}[p["trusts_pending"]])
            if moving:
                row = (*row, "NO" if p["waiting_for"] else "yes")
            rows.append(row)
        lines += _table(rows)
    if data["waiting_for"]:
        lines += ["", "waiting for:"]
        lines += [f"  {w['identity']} ({w['serial'][:12]}): {w['reason']}" for w in data["waiting_for"]]
    if data["silent"]:
        lines += ["", "silent (not heard from lately; taken for gone, not waited for):"]
        lines += [
            f"  {r['identity']} ({r['serial'][:12]}, CA {r['ca_id']}): last heard {r['last_heard']}"
            for r in data["silent"]
        ]
    t = data["tokens"]
    lines += ["", f"bootstrap tokens: {t['unused']} unused, {t['used']} used, {t['expired']} expired"]
    lines += [f"WARNING: {w}" for w in data["warnings"]]
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str | None, ...]]) -> list[str]:
    widths = [max(len(str(r[i] or "-")) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(str(c or "-").ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    ]


# --- argparse ------------------------------------------------------------------------------------------


def _add_silent_after(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--silent-after",
        type=_silent_after,
        default=SILENT_AFTER,
        metavar="DURATION",
        help="a certificate holder not heard from for this long is taken for gone and not waited for "
        f"(default {SILENT_AFTER.total_seconds() / 60:g}m)",
    )


def register_certs_commands(commands: Any) -> None:
    """Add ``status``, ``rotate-ca`` and ``token ...`` to an existing sub-command set
    (``parser.add_subparsers()``); each sets ``args.run`` to :func:`run_certs` and ``args.subparser``
    to its own parser."""

    st = commands.add_parser("status", help="CAs, rotation phase, parties and what they trust")
    add_store_flag(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    _add_silent_after(st)
    st.set_defaults(run=run_certs, certs_run=_status, subparser=st)

    rc = commands.add_parser(
        "rotate-ca",
        help="rotate the CA with overlap, one step at a time",
        description="start: add a new CA to every trust bundle (not signing); activate: sign with it "
        "once every party trusts it; retire: drop the old CA once no live certificate uses it. "
        "Without a step, runs the next one. See docs/certificates.md.",
    )
    add_store_flag(rc)
    rc.add_argument("step", nargs="?", choices=["start", "activate", "retire"], help="default: the next step")
    rc.add_argument("--force", action="store_true", help="skip the safety check of activate/retire")
    _add_silent_after(rc)
    rc.add_argument("--ca-days", type=int, default=DEFAULT_CA_DAYS, help="lifetime of a new CA in days")
    rc.set_defaults(run=run_certs, certs_run=_rotate, subparser=rc)

    tok = commands.add_parser("token", help="bootstrap tokens (single-use, short-lived, stored hashed)")
    tok_commands = tok.add_subparsers(dest="token_command", metavar="COMMAND", required=True)
    create = tok_commands.add_parser(
        "create",
        help="create a token and print it (shown once)",
        description="One of --cluster (an agent), --server NAME --host H... or --client NAME.",
    )
    add_store_flag(create)
    kind = create.add_mutually_exclusive_group(required=True)
    kind.add_argument("--cluster", type=_name, help="an agent token bound to this cluster")
    kind.add_argument("--server", type=_name, metavar="NAME", help="a server token (CN=NAME)")
    kind.add_argument("--client", type=_name, metavar="NAME", help="a hub client token (CN=NAME)")
    create.add_argument("--agent-id", type=_name, help="agent tokens: bind to this agent id too")
    create.add_argument(
        "--host", type=parse_host, action="append", default=[], help="server tokens: allowed SAN"
    )
    create.add_argument("--org", type=_name, help="client tokens: O= of the certificate")
    create.add_argument("--ttl", type=_ttl, default=dt.timedelta(minutes=10), help="lifetime (default 10m)")
    create.add_argument("--description", default="", help="a note kept with the token")
    create.add_argument("--json", action="store_true", help="print JSON (id, token, expires_at)")
    create.set_defaults(run=run_certs, certs_run=_token_create, subparser=create)

    ls = tok_commands.add_parser("list", help="tokens (ids and bindings; never the secret)")
    add_store_flag(ls)
    ls.set_defaults(run=run_certs, certs_run=_token_list, subparser=ls)
    rm = tok_commands.add_parser("delete", help="revoke an unused token")
    add_store_flag(rm)
    rm.add_argument("token_id", metavar="ID")
    rm.set_defaults(run=run_certs, certs_run=_token_delete, subparser=rm)


def run_certs(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None, *, out: TextIO | None = None
) -> int:
    """Run the chosen ``certs`` sub-command; the exit status (0 done, 1 refused or failed).

    Called as ``args.run(args, args.subparser)``, like every command of ``cluster-proxy-cert-signer``."""
    out = out or sys.stdout
    fn: Callable[[CertStore, argparse.Namespace, TextIO], int] = args.certs_run
    try:
        store = open_store_from_args(args)
        return fn(store, args, out)
    except RotationBlocked as exc:
        print(f"refused: {exc}", file=sys.stderr)
        for party in exc.parties[:20]:
            why = exc.reasons.get(party.serial)
            print(
                f"  {party.identity.key} (serial {party.serial[:12]}, CA {party.ca_id})"
                + (f": {why}" if why else ""),
                file=sys.stderr,
            )
        return 1
    except (RotationError, StoreError, NotImplementedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _status(store: CertStore, args: argparse.Namespace, out: TextIO) -> int:
    data = status(store, now=utc_now(), silent_after=args.silent_after)
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else format_status(data), file=out)
    return 0


def _rotate(store: CertStore, args: argparse.Namespace, out: TextIO) -> int:
    print(
        rotate_ca(store, args.step, force=args.force, days=args.ca_days, silent_after=args.silent_after),
        file=out,
    )
    return 0


def _token_create(store: CertStore, args: argparse.Namespace, out: TextIO) -> int:
    if args.cluster:
        binding = Binding(kind="agent", cluster=args.cluster, agent_id=args.agent_id)
    elif args.server:
        if not args.host:
            args.subparser.error("a server token needs at least one --host")
        binding = Binding(kind="server", name=args.server, hosts=tuple(dict.fromkeys(args.host)))
    else:
        binding = Binding(kind="client", name=args.client, organization=args.org)
    misplaced = [
        flag
        for flag, given, kind in (
            ("--agent-id", args.agent_id, "agent"),
            ("--host", args.host, "server"),
            ("--org", args.org, "client"),
        )
        if given and binding.kind != kind
    ]
    if misplaced:
        args.subparser.error(f"{', '.join(misplaced)} does not apply to {binding.kind} tokens")
    ensure_ca(store, now=utc_now())
    created = create_token(store, binding, args.ttl, description=args.description)
    if args.json:
        record = created.record
        print(
            json.dumps(
                {
                    "id": record.id,
                    "token": created.token,
                    "expires_at": record.expires_at.isoformat(),
                    "binding": binding.to_json(),
                }
            ),
            file=out,
        )
    else:
        print(created.token, file=out)
    return 0


def _token_list(store: CertStore, args: argparse.Namespace, out: TextIO) -> int:
    now = utc_now()
    rows: list[tuple[str, ...]] = [("ID", "FOR", "EXPIRES", "STATE")]
    for t in sorted(store.list_tokens(), key=lambda t: t.created_at):
        state = "used" if t.used_at else "expired" if t.expired(now) else "unused"
        rows.append((t.id, t.binding.describe(), t.expires_at.isoformat(timespec="seconds"), state))
    print("\n".join(_table(rows)), file=out)
    return 0


def _token_delete(store: CertStore, args: argparse.Namespace, out: TextIO) -> int:
    if store.get_token(args.token_id) is None:
        print(f"error: no token {args.token_id}", file=sys.stderr)
        return 1
    store.delete_token(args.token_id)
    print(f"deleted token {args.token_id}", file=out)
    return 0

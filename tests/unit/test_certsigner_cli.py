"""``cluster-proxy-cert-signer`` administration commands: init, token create/list/delete, status,
rotate-ca, trust-bundle (``cluster-proxy certs`` runs them as a process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.tokens import hash_secret, parse_token
from clusterproxy_certsigner.main import build_parser, main
from clusterproxy_protocol.certclient import bundle_fingerprints
from clusterproxy_protocol.config import parse_args_or_exit


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_token_create_prints_the_token_and_stores_only_its_hash(tmp_path: Path, capsys) -> None:
    store = str(tmp_path / "store")
    code, out, _ = run(["token", "create", "--store", store, "--cluster", "cluster1", "--ttl", "10m"], capsys)
    assert code == 0
    token = out.strip()
    token_id, secret = parse_token(token)
    record = FileStore(Path(store)).get_token(token_id)
    assert record is not None and record.secret_sha256 == hash_secret(secret)
    assert record.binding.cluster == "cluster1" and record.binding.kind == "agent"
    assert (record.expires_at - record.created_at).total_seconds() == 600
    everything = b"".join(p.read_bytes() for p in Path(store).rglob("*") if p.is_file())
    assert secret.encode() not in everything
    code, out, _ = run(["token", "list", "--store", store], capsys)
    assert token_id in out and "cluster1" in out and "unused" in out and secret not in out
    code, out, _ = run(["token", "delete", "--store", store, token_id], capsys)
    assert code == 0 and FileStore(Path(store)).get_token(token_id) is None
    code, _, err = run(["token", "delete", "--store", store, token_id], capsys)
    assert code == 1 and "no token" in err


def test_token_create_kinds_and_bad_flags(tmp_path: Path, capsys) -> None:
    store = str(tmp_path / "store")
    code, out, _ = run(["token", "create", "--store", store, "--server", "proxy-server", "--host", "localhost",
                        "--host", "[::1]", "--json"], capsys)  # fmt: skip
    data = json.loads(out)
    assert (
        code == 0
        and data["binding"]["hosts"] == ["localhost", "::1"]
        and data["token"].startswith(data["id"])
    )
    code, _, err = run(["token", "create", "--store", store, "--server", "proxy-server"], capsys)
    assert code == 2 and "--host" in err
    code, _, err = run(["token", "create", "--store", store, "--cluster", "c1", "--org", "x"], capsys)
    assert code == 2 and "--org does not apply to agent tokens" in err
    code, _, err = run(["token", "create", "--store", store, "--client", "alice", "--ttl", "48h"], capsys)
    assert code == 2 and "lifetime" in err
    code, _, err = run(["token", "create", "--store", store, "--cluster", "bad/name"], capsys)
    assert code == 2 and "invalid name" in err


def test_store_from_the_environment(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CLUSTER_PROXY_CERT_SIGNER_STORE", str(tmp_path / "env-store"))
    code, out, _ = run(["init"], capsys)
    assert code == 0 and "active CA" in out
    assert (tmp_path / "env-store" / "authorities.json").exists()


def test_status_rotate_and_trust_bundle(tmp_path: Path, capsys) -> None:
    store = str(tmp_path / "store")
    run(["init", "--store", store], capsys)
    code, out, _ = run(["status", "--store", store, "--json"], capsys)
    assert code == 0 and json.loads(out)["phase"] == "stable"
    code, out, _ = run(["rotate-ca", "--store", store], capsys)
    assert code == 0 and "step 1/3" in out
    code, out, _ = run(["trust-bundle", "--store", store], capsys)
    assert len(bundle_fingerprints(out)) == 2
    code, out, _ = run(["status", "--store", store], capsys)
    assert "new-ca-pending" in out and "pending" in out
    code, _, err = run(["rotate-ca", "--store", store, "retire"], capsys)
    assert code == 1 and "no previous CA" in err
    code, out, _ = run(["rotate-ca", "--store", store, "activate"], capsys)
    assert code == 0 and "step 2/3" in out
    run(["trust-bundle", "--store", store, "--out", str(tmp_path / "b.crt")], capsys)
    assert len(bundle_fingerprints((tmp_path / "b.crt").read_bytes())) == 2
    code, out, _ = run(["rotate-ca", "--store", store, "retire"], capsys)
    assert code == 0 and "step 3/3" in out
    code, out, _ = run(["trust-bundle", "--store", store], capsys)
    assert len(bundle_fingerprints(out)) == 1


def test_silent_after_is_checked(tmp_path: Path, capsys) -> None:
    store = str(tmp_path / "store")
    run(["init", "--store", store], capsys)
    code, _, err = run(["rotate-ca", "--store", store, "--silent-after", "30s"], capsys)
    assert code == 2 and "at least 1m" in err
    code, out, _ = run(["status", "--store", store, "--silent-after", "2h", "--json"], capsys)
    assert code == 0 and json.loads(out)["silent"] == []


def test_a_kubernetes_store_without_a_kubeconfig_is_a_clear_error(capsys, tmp_path) -> None:
    missing = tmp_path / "kubeconfig"
    code, _, err = run(["status", "--store", "kubernetes:hub", "--kubeconfig", str(missing)], capsys)
    assert (
        code == 1
        and f"the store kubernetes:hub/cluster-proxy-ca: --kubeconfig {missing}: no such file" in err
    )


def test_serve_flags_validate(capsys) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parse_args_or_exit(parser, ["serve", "--store", "/tmp/x", "--ip-rate", "0"], environ={})
    assert "expected a number > 0" in capsys.readouterr().err
    args = parse_args_or_exit(
        parser, ["serve", "--store", "/tmp/x"], environ={"CLUSTER_PROXY_CERT_SIGNER_CERT_TTL": "2h"}
    )
    assert args.cert_ttl.total_seconds() == 7200 and args.listen == ("0.0.0.0", 8443)
    assert args.tls_host == ["localhost", "127.0.0.1", "::1"]

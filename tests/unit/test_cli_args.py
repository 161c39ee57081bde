"""``cluster-proxy`` argument validation: bad values exit 2 naming the value; env twins work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterproxy_cli.certs import certs_argv
from clusterproxy_cli.main import build_parser, main, resolve_port_forward
from clusterproxy_cli.state import ProxySettings, build_local_json, write_local_json
from clusterproxy_protocol.config import parse_args_or_exit
from clusterproxy_protocol.pki import DevCA


def _exit_code_and_stderr(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["port-forward", "Bad_Name", "svc:80"], "'Bad_Name'"),
        (["port-forward", "cluster1", "svc"], "'svc'"),
        (["port-forward", "cluster1", "svc:0"], "'svc:0'"),
        (["port-forward", "cluster1", "svc:70000"], "'svc:70000'"),
        (["port-forward", "cluster1", "::1:80"], "'::1:80'"),
        (["port-forward", "cluster1", "svc:80", "--listen", "localhost"], "'localhost'"),
        (["port-forward", "cluster1", "svc:80", "--proxy", "http://hub:8090"], "'http://hub:8090'"),
        (["port-forward", "cluster1", "svc:80", "--proxy", "hub:0"], "'hub:0'"),
        (["port-forward", "cluster1", "svc:80", "--ca", "/no/such/ca.crt"], "'/no/such/ca.crt'"),
        (["port-forward", "cluster1", "svc:80", "--connect-timeout", "soon"], "'soon'"),
        (["port-forward", "cluster1", "svc:80", "--log-level", "loud"], "'loud'"),
        (["local", "up", "--base-port", "65530"], "'65530'"),
        (["local", "up", "--base-port", "-1"], "'-1'"),
        (["local", "up", "--ready-timeout=-5s"], "'-5s'"),
        (["local"], "required"),
        (["nope"], "'nope'"),
    ],
)
def test_bad_values_exit_2_naming_the_value(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit_code_and_stderr(argv, capsys)
    assert code == 2
    assert needle in err


def test_bad_environment_value_names_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLUSTER_PROXY_BASE_PORT", "lots")
    code, err = _exit_code_and_stderr(["local", "up"], capsys)
    assert code == 2
    assert "CLUSTER_PROXY_BASE_PORT" in err and "'lots'" in err


def test_environment_twins_fill_port_forward_flags(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path)
    client = ca.issue_client("me", tmp_path)
    environ = {
        "CLUSTER_PROXY_PROXY": "https://hub.example:8443",
        "CLUSTER_PROXY_CA": str(ca.ca_path),
        "CLUSTER_PROXY_CERT": str(client.cert),
        "CLUSTER_PROXY_KEY": str(client.key),
        "CLUSTER_PROXY_LISTEN": "[::1]:9000",
        "CLUSTER_PROXY_SERVER_NAME": "hub.internal",
    }
    parser = build_parser()
    args = parse_args_or_exit(parser, ["port-forward", "cluster1", "[fd00::1]:443"], environ=environ)
    pf = resolve_port_forward(args, args.subparser)
    assert pf.proxy == ("hub.example", 8443)
    assert (pf.listen_host, pf.listen_port) == ("::1", 9000)
    assert (pf.target_host, pf.target_port) == ("fd00::1", 443)
    assert pf.target == "[fd00::1]:443"
    assert pf.server_name == "hub.internal"
    assert Path(pf.tls.cert) == client.cert  # type: ignore[union-attr]


def test_flag_wins_over_environment() -> None:
    parser = build_parser()
    args = parse_args_or_exit(
        parser, ["local", "up", "--base-port", "20000"], environ={"CLUSTER_PROXY_BASE_PORT": "30000"}
    )
    assert args.base_port == 20000


def test_port_forward_reads_state_dir_and_flags_override(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "pki")
    client = ca.issue_client("local-admin", tmp_path / "pki")
    other = ca.issue_client("other", tmp_path / "pki")
    proxy = ProxySettings("127.0.0.1", 41000, ca.ca_path, client.cert, client.key, "http://127.0.0.1:41002")
    write_local_json(tmp_path / "state", build_local_json(proxy, {}, {}, tmp_path / "state"))
    parser = build_parser()
    argv = ["port-forward", "cluster1", "svc:80", "--state-dir", str(tmp_path / "state")]
    pf = resolve_port_forward(parse_args_or_exit(parser, argv, environ={}), parser)
    assert pf.proxy == ("127.0.0.1", 41000)
    assert Path(pf.tls.ca) == ca.ca_path.resolve()  # type: ignore[union-attr]
    args = parse_args_or_exit(parser, [*argv, "--cert", str(other.cert), "--key", str(other.key)], environ={})
    pf = resolve_port_forward(args, parser)
    assert Path(pf.tls.cert) == other.cert  # type: ignore[union-attr]


def test_port_forward_without_settings_explains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no .state/local/local.json here
    code, err = _exit_code_and_stderr(["port-forward", "cluster1", "svc:80"], capsys)
    assert code == 2
    assert "--proxy" in err and "--state-dir" in err


def test_port_forward_with_broken_state_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "local.json").write_text(json.dumps({"proxy": {"client_url": "https://h:1"}}))
    code, err = _exit_code_and_stderr(
        ["port-forward", "cluster1", "svc:80", "--state-dir", str(tmp_path)], capsys
    )
    assert code == 2
    assert "proxy.ca" in err


def test_port_forward_state_dir_without_local_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit_code_and_stderr(
        ["port-forward", "cluster1", "svc:80", "--state-dir", str(tmp_path)], capsys
    )
    assert code == 2
    assert "local up" in err and "not found" in err


def test_certs_runs_the_signers_command_on_the_local_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".state" / "local" / "pki" / "store").mkdir(parents=True)
    argv = certs_argv("status", ["--json"], {})
    assert Path(argv[0]).name == "cluster-proxy-cert-signer"
    assert argv[1:] == ["status", "--json", "--store", str(Path(".state/local/pki/store"))]
    for named in (["--store", "s"], ["--store=s"], ["--sto", "s"]):
        assert certs_argv("token", ["list", *named], {})[1:] == ["token", "list", *named]
    env = {"CLUSTER_PROXY_CERT_SIGNER_STORE": "elsewhere"}
    assert certs_argv("rotate-ca", ["start"], env)[1:] == ["rotate-ca", "start"]


def test_certs_without_a_store_explains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_PROXY_CERT_SIGNER_STORE", raising=False)
    code, err = _exit_code_and_stderr(["certs", "status"], capsys)
    assert code == 1
    assert "cluster-proxy certs: no store at .state/local/pki/store: start `cluster-proxy local up`" in err
    assert certs_argv("status", ["--help"], {})[-3:] == ["--help", "--store", ".state/local/pki/store"]


def test_certs_passes_the_signers_exit_status_through(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["certs", "token", "delete", "no-such-id", "--store", str(tmp_path / "store")])
    assert info.value.code == 1
    assert "no token no-such-id" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["local", "up"], "cluster-proxy-server"),
        (["certs", "status", "--store", "s"], "cluster-proxy-cert-signer"),
    ],
)
def test_a_service_not_installed_fails_at_once_naming_its_package(
    argv: list[str],
    missing: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    code, err = _exit_code_and_stderr(argv, capsys)
    assert code == 1
    assert f"{missing} not found" in err and f"install the {missing} package" in err
    assert "cluster-proxy-cli[local]" in err
    assert not (tmp_path / ".state").exists()  # nothing was started or written


def test_enroll_names_every_missing_setting(monkeypatch) -> None:
    for name in ("CLUSTER_PROXY_SIGNER", "CLUSTER_PROXY_CA", "CLUSTER_PROXY_ENROLL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as info:
        main(["enroll", "--name", "alice"])
    assert info.value.code == (
        "cluster-proxy enroll: missing --signer (or CLUSTER_PROXY_SIGNER), --ca (or CLUSTER_PROXY_CA), "
        "--token (or CLUSTER_PROXY_ENROLL_TOKEN)"
    )

"""The audit record's line (schema, RFC 3339 times) and the sinks: the spec's forms and errors, the file's
rotation and mode, a failing disk that never raises, and the flag on the proxy-server and local up."""

from __future__ import annotations

import json
import os
import stat
from datetime import datetime
from pathlib import Path

import pytest

from clusterproxy_cli.local_pki import issue_certificates
from clusterproxy_cli.local_plan import audit_log_path, local_server_argv, plan_ports
from clusterproxy_protocol.audit import (
    DEFAULT_MAX_BYTES,
    SCHEMA,
    AuditRecord,
    NullSink,
    RotatingFileSink,
    SinkSpec,
    StreamSink,
    open_sink,
    parse_sink_spec,
    worker_spec,
)
from clusterproxy_protocol.config import ConfigError, InvalidValue, parse_args_or_exit
from clusterproxy_server.main import build_parser, config_from_args, worker_config
from clusterproxy_server.worker_sockets import WorkerSpec

START = 1_795_000_000.25  # 2026-11-18T11:06:40.250Z


def record(**overrides: object) -> AuditRecord:
    fields: dict[str, object] = {
        "start": START,
        "end": START + 1.5,
        "client": "CN=alice,O=ops",
        "client_kind": "certificate",
        "cluster": "cluster1",
        "target": "10.0.0.1:443",
        "frontend": "h2",
        "outcome": "ok",
        "status": 200,
        "reason": None,
        "bytes_to_target": 12,
        "bytes_to_client": 3456,
        "agent_id": "agent-a",
        "server_id": "proxy-server-1",
    }
    fields.update(overrides)
    return AuditRecord(**fields)  # type: ignore[arg-type]


def test_a_record_is_one_json_line_with_the_schema_and_rfc3339_times() -> None:
    line = record(groups=("system:masters", "ops"), method="GET", reason="a\nb \u00e9").to_json()
    assert "\n" not in line and line.isascii()
    doc = json.loads(line)
    assert doc["schema"] == SCHEMA == "cluster-proxy.audit/v1"
    assert doc["time"] == "2026-11-18T11:06:40.250Z" and doc["end"] == "2026-11-18T11:06:41.750Z"
    assert datetime.fromisoformat(doc["time"]).timestamp() == START
    assert doc["duration_seconds"] == 1.5
    assert doc["groups"] == ["system:masters", "ops"] and doc["method"] == "GET"
    assert doc["reason"] == "a\nb \u00e9"
    expected = {
        "schema", "time", "end", "duration_seconds", "client", "client_kind", "groups", "cluster", "target",
        "method", "frontend", "outcome", "status", "reason", "bytes_to_target", "bytes_to_client",
        "agent_id", "server_id",
    }  # fmt: skip
    assert set(doc) == expected
    refused = json.loads(record(cluster=None, status=404, outcome="refused", agent_id=None).to_json())
    assert refused["cluster"] is None and refused["agent_id"] is None and refused["method"] is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("off", SinkSpec("off")),
        ("", SinkSpec("off")),
        (" OFF ", SinkSpec("off")),
        ("-", SinkSpec("stdout")),
        ("stdout", SinkSpec("stdout")),
        ("/var/log/audit.jsonl", SinkSpec("file", Path("/var/log/audit.jsonl"))),
        ("/l/a.jsonl:max=16MiB,keep=3", SinkSpec("file", Path("/l/a.jsonl"), 16 << 20, 3)),
        ("/l/a.jsonl:keep=1", SinkSpec("file", Path("/l/a.jsonl"), DEFAULT_MAX_BYTES, 1)),
        ("/l/odd:name.jsonl", SinkSpec("file", Path("/l/odd:name.jsonl"))),  # a colon in the name
        ("./off", SinkSpec("file", Path("off"))),
    ],
)
def test_spec_forms(text: str, expected: SinkSpec) -> None:
    assert parse_sink_spec(text) == expected
    assert parse_sink_spec(str(expected)) == expected  # str() writes it back as a spec


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("/l/a.jsonl:max=lots", "invalid size 'lots'"),
        ("/l/a.jsonl:max=100", "below 1KiB"),
        ("/l/a.jsonl:keep=0", "expected an integer >= 1"),
        ("/l/a.jsonl:size=1MiB", "unknown option 'size'"),
        ("/l/a.jsonl:keep=2,keep=3", "given twice"),
        (":max=1MiB", "no file before the options"),
    ],
)
def test_bad_specs_name_the_spec_and_what_was_expected(text: str, words: str) -> None:
    with pytest.raises(InvalidValue) as caught:
        parse_sink_spec(text)
    assert repr(text) in str(caught.value) and words in str(caught.value)


def test_a_directory_is_not_a_log_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidValue, match="is a directory"):
        parse_sink_spec(str(tmp_path))


def test_open_sink_kinds_and_a_file_that_cannot_be_opened(tmp_path: Path) -> None:
    assert isinstance(open_sink("off"), NullSink)
    assert isinstance(open_sink("-"), StreamSink)
    sink = open_sink(f"{tmp_path}/new/dir/audit.jsonl:max=4KiB,keep=2")
    assert isinstance(sink, RotatingFileSink) and (sink.max_bytes, sink.keep) == (4096, 2)
    sink.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot be opened"):
        open_sink(f"{tmp_path}/file/audit.jsonl")  # its folder is a file


def test_the_stdout_sink_writes_a_line_per_record(capsys: pytest.CaptureFixture[str]) -> None:
    sink = open_sink("stdout")
    sink.write(record())
    sink.write(record(outcome="refused"))
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["outcome"] for line in lines] == ["ok", "refused"]
    assert sink.written == 2 and sink.failures == 0
    sink.close()  # flushes, never closes standard output
    print("still open")
    assert capsys.readouterr().out == "still open\n"


def test_rotation_keeps_whole_lines_the_newest_files_and_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text("")
    path.chmod(0o644)  # an existing file is narrowed
    sink = RotatingFileSink(path, max_bytes=1024, keep=3)
    for i in range(60):
        sink.write(record(bytes_to_client=i))
    sink.close()
    files = [path, *(tmp_path / f"audit.jsonl.{i}" for i in (1, 2, 3))]
    assert sorted(tmp_path.iterdir()) == sorted(files)  # audit.jsonl.4 and older were dropped
    numbers = []
    for f in reversed(files):  # oldest first
        content = f.read_bytes()
        assert 0 < len(content) <= 1024 and content.endswith(b"\n")
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        numbers += [json.loads(line)["bytes_to_client"] for line in content.splitlines()]
    assert numbers == list(range(60 - len(numbers), 60))  # the newest, in order, none missing between
    assert sink.written == 60 and sink.failures == 0


def test_a_reopened_file_is_appended_to_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    for _ in range(2):
        sink = RotatingFileSink(path, max_bytes=1 << 20)
        sink.write(record())
        sink.close()
    assert len(path.read_text().splitlines()) == 2


def test_a_failing_disk_never_raises_and_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "audit.jsonl"
    sink = RotatingFileSink(path)
    sink.write(record(bytes_to_client=1))
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("clusterproxy_protocol.audit.os.write", full)
    for _ in range(3):
        sink.write(record(bytes_to_client=2))  # dropped, counted, logged once
    monkeypatch.setattr("clusterproxy_protocol.audit.os.write", real_write)
    sink.write(record(bytes_to_client=3))
    sink.close()
    sink.write(record(bytes_to_client=4))  # after close: counted, not raised, the file not reopened
    assert (sink.written, sink.failures) == (2, 4)
    assert [json.loads(line)["bytes_to_client"] for line in path.read_text().splitlines()] == [1, 3]


def test_a_write_torn_part_way_leaves_the_next_record_on_a_line_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    sink = RotatingFileSink(path)
    real_write = os.write
    calls = []

    def half_then_full(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("clusterproxy_protocol.audit.os.write", half_then_full)
    sink.write(record(bytes_to_client=1))
    monkeypatch.setattr("clusterproxy_protocol.audit.os.write", real_write)
    sink.write(record(bytes_to_client=2))
    sink.close()
    torn, whole = path.read_text().split("\n")[:2]
    assert len(torn) == 10 and json.loads(whole)["bytes_to_client"] == 2


def test_each_worker_gets_a_file_of_its_own() -> None:
    assert worker_spec("/l/audit.jsonl", 0) == "/l/audit.w0.jsonl"
    assert worker_spec("/l/audit.jsonl:max=16MiB,keep=3", 2) == "/l/audit.w2.jsonl:max=16MiB,keep=3"
    assert worker_spec("/l/audit", 1) == "/l/audit.w1"
    assert worker_spec("-", 1) == "-" and worker_spec("off", 1) == "off"


def test_the_server_flag_its_environment_twin_and_a_bad_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x").write_text("")
    base = ["--ca", str(tmp_path / "x"), "--cert", str(tmp_path / "x"), "--key", str(tmp_path / "x")]
    parser = build_parser()
    assert config_from_args(parse_args_or_exit(parser, base, environ={})).audit_log == "off"
    args = parse_args_or_exit(parser, base, environ={"CLUSTER_PROXY_SERVER_AUDIT_LOG": "/l/a.jsonl:keep=2"})
    config = config_from_args(args)
    assert config.audit_log == "/l/a.jsonl:keep=2"
    spec = WorkerSpec(1, 2, "s.w1", 2, (), (), (), 0, 0)
    assert worker_config(config, args, spec).audit_log == "/l/a.w1.jsonl:keep=2"
    with pytest.raises(SystemExit) as caught:
        parse_args_or_exit(parser, [*base, "--audit-log", "/l/a.jsonl:max=tiny"], environ={})
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert "--audit-log" in error and "invalid size 'tiny'" in error
    with pytest.raises(SystemExit):
        parse_args_or_exit(parser, base, environ={"CLUSTER_PROXY_SERVER_AUDIT_LOG": "/l/a:max=1"})
    assert "CLUSTER_PROXY_SERVER_AUDIT_LOG" in capsys.readouterr().err


def test_local_up_passes_an_audit_log_in_its_state_folder(tmp_path: Path) -> None:
    certs = issue_certificates(tmp_path / "pki", ["cluster1"])
    logs = tmp_path / "logs"
    one = plan_ports(20000, ["cluster1"])
    argv = local_server_argv(one, certs, ["cluster1"], audit_log=audit_log_path(logs, one, one.servers[0]))
    assert argv[argv.index("--audit-log") + 1] == str(logs / "audit.jsonl")
    two = plan_ports(20000, ["cluster1"], servers=2)
    paths = {audit_log_path(logs, two, server) for server in two.servers}
    assert paths == {logs / "audit.proxy-server-1.jsonl", logs / "audit.proxy-server-2.jsonl"}

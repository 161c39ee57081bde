"""Wire protocol of cluster-proxy: sans-IO reverse HTTP/2 tunnel, TLS and PKI helpers, config and logging.

The public API is this package: the names in ``__all__``. The services, the SDK, the CLI,
libs/castore and bench import only those (``from clusterproxy_protocol import TunnelCore, Budget``);
every submodule is an internal of the library, free to move, split or rename, except the five in
:data:`SUBMODULES`. ``tests/unit/test_layering.py`` refuses, from outside the library, an import of
any other submodule or of a name not in ``__all__``; the library's own tests may reach its internals.

The public submodules are namespaces whose functions are named to be read qualified, as
``trio.lowlevel`` is: ``http1client.get``, ``certclient.write_bundle``, ``workarounds.apply``,
``allocator.tune``, ``request_heads.next_event``. Flattened, those would be ``get``, ``apply`` and
``tune`` in one namespace; so they stay modules, and the list stays this short.

Two public names differ from the name in their submodule (:data:`_RENAMED`): ``AdminRoute`` is
``admin.Route`` (``Route`` is ``forward_proxy.Route``, another thing), and ``relay_streams`` is
``relay.relay`` (a package attribute named like a submodule is replaced by that submodule when it
is first imported, so a name never takes a submodule's name).

The exports are lazy (PEP 562 ``__getattr__``): importing the package imports no submodule, so a
sans-IO module (``core``, ``windows``, ...) still loads no trio when imported alone
(``tests/unit/test_sans_io.py``), and a program pays only for the submodules whose names it uses.
The first lookup of a name imports its submodule and binds the name here; ``from
clusterproxy_protocol import X`` binds ``X`` in the importer once, so no call goes through the
package afterwards. The ``TYPE_CHECKING`` imports below are the same names, for mypy and editors.

To add a name: import it in the ``TYPE_CHECKING`` block, list it under its submodule in
:data:`_EXPORTS` and in ``__all__``; ``tests/unit/test_protocol_api.py`` says which of the three
is missing."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterproxy_protocol import allocator, certclient, http1client, request_heads, workarounds
    from clusterproxy_protocol.admin import (
        INVENTORY_LABELS,
        Authenticated,
        PeerRoute,
        metrics_response,
        serve_admin,
    )
    from clusterproxy_protocol.admin import Route as AdminRoute
    from clusterproxy_protocol.agent_control import (
        CONTROL_CLIENT_HEADER,
        CONTROL_HOST,
        CONTROL_PORT,
        SERVICEACCOUNT_PATH,
        serviceaccount_path,
    )
    from clusterproxy_protocol.audit import AuditRecord, AuditSink, add_audit_flag, open_sink, worker_spec
    from clusterproxy_protocol.certclient import (
        CertFiles,
        SignerEndpoint,
        SignerRequestError,
        client_csr,
        ensure_bootstrapped,
        server_csr,
        write_bundle,
    )
    from clusterproxy_protocol.closing import abort, close_cleanly, reset_if_process_dies
    from clusterproxy_protocol.config import (
        ConfigError,
        InvalidValue,
        add_flag,
        existing_file,
        flag_adder,
        parse_args_or_exit,
        parse_count,
        parse_dialable_hostport,
        parse_duration,
        parse_fraction,
        parse_hostport,
        parse_non_negative_float,
        parse_port,
        parse_positive_duration,
        parse_positive_float,
        parse_positive_int,
        parse_size,
    )
    from clusterproxy_protocol.core import CANCEL, ENHANCE_YOUR_CALM, Role, TunnelCore
    from clusterproxy_protocol.driver import IncomingRequest, LimitHandler, Mux, limit_reporter, open_mux
    from clusterproxy_protocol.errors import (
        ConnectRefused,
        DialTimeout,
        Forbidden,
        MalformedTarget,
        NoAgentConnected,
        TargetUnreachable,
        TooManyRequests,
        TunnelClosed,
        TunnelError,
        UnknownCluster,
        clean_reason,
        describe_exception,
    )
    from clusterproxy_protocol.files import write_atomic
    from clusterproxy_protocol.forward_proxy import (
        NoProxy,
        ProxySettings,
        ProxyURL,
        Route,
        without_proxy_variables,
    )
    from clusterproxy_protocol.forward_proxy_trio import ForwardProxy, Prefixed
    from clusterproxy_protocol.httpserver import HttpLimits, Request, Response, serve_http, serve_stream
    from clusterproxy_protocol.kubeconfig import load_configuration
    from clusterproxy_protocol.logs import (
        LOG_FORMATS,
        LOG_LEVELS,
        add_log_flags,
        configure_logging,
        get_logger,
    )
    from clusterproxy_protocol.pki import (
        AGENT_ORGANIZATION,
        CLIENT_ROLE_URI,
        SERVER_ROLE_URI,
        CertRole,
        DevCA,
        PemPair,
        agent_identity_from_cert,
        agent_uri,
        certificate_role,
        key_pem,
        key_usage,
        new_ca,
        peer_identity,
        role_of_uri,
        role_refusal,
    )
    from clusterproxy_protocol.proxy_requests import (
        HOP_BY_HOP,
        MAX_REQUEST_HEAD,
        BadRequest,
        ConnectRequest,
        RequestHeadReader,
        cluster_from_proxy_authorization,
        error_response,
        established,
        forward_form,
    )
    from clusterproxy_protocol.relay import RelayResult
    from clusterproxy_protocol.relay import relay as relay_streams
    from clusterproxy_protocol.reloader import ReloadingContext
    from clusterproxy_protocol.renewal_metrics import RenewerCollector, RenewerCounters
    from clusterproxy_protocol.renewer import CertRenewer, RenewalPolicy
    from clusterproxy_protocol.restart_policy import RestartPolicy
    from clusterproxy_protocol.service_runtime import (
        SIGNER_HELP,
        SignerSettings,
        add_certificate_flags,
        add_signer_flags,
        check_without_signer,
        failure_in_log,
        failure_on_stderr,
        run_service,
        serve_until_signalled,
        signer_url,
        watch_signals,
    )
    from clusterproxy_protocol.settings import TunnelSettings
    from clusterproxy_protocol.steering import attach_steering, format_worker, parse_worker, source_port_for
    from clusterproxy_protocol.tls import client_context, server_context, web_client_context
    from clusterproxy_protocol.transport import read_in_bulk, receive_batch, send_all
    from clusterproxy_protocol.tunnel_stream import TunnelStream
    from clusterproxy_protocol.websocket import (
        MAX_MESSAGE,
        READ_SIZE,
        WebSocketFailed,
        WebSocketStream,
        host_header,
        open_websocket,
    )
    from clusterproxy_protocol.windows import Budget, format_size
    from clusterproxy_protocol.wire import (
        ALPN_H2,
        ALPN_HTTP1,
        CLUSTER_HEADER,
        CLUSTER_NAME,
        EXPECTED_HOSTPORT,
        FAULT_HEADER,
        FAULT_TARGET,
        INFO_PATH,
        PRESENTING_HEADER,
        REASON_HEADER,
        SERVER_COUNT_HEADER,
        SERVER_ID_HEADER,
        SERVER_WORKER_HEADER,
        TRUSTED_HEADER,
        WEBSOCKET_PATH,
        WEBSOCKET_SUBPROTOCOL,
        MalformedAddress,
        format_address,
        format_authority,
        parse_authority,
        port_number,
        split_hostport,
    )

#: The public submodules, imported as modules (``from clusterproxy_protocol import http1client``).
SUBMODULES = ("allocator", "certclient", "http1client", "request_heads", "workarounds")

#: Where each public name lives: submodule -> the names it exports under their own names.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "admin": (
        "INVENTORY_LABELS",
        "Authenticated",
        "PeerRoute",
        "metrics_response",
        "serve_admin",
    ),
    "agent_control": (
        "CONTROL_CLIENT_HEADER",
        "CONTROL_HOST",
        "CONTROL_PORT",
        "SERVICEACCOUNT_PATH",
        "serviceaccount_path",
    ),
    "audit": (
        "AuditRecord",
        "AuditSink",
        "add_audit_flag",
        "open_sink",
        "worker_spec",
    ),
    "certclient": (
        "CertFiles",
        "SignerEndpoint",
        "SignerRequestError",
        "client_csr",
        "ensure_bootstrapped",
        "server_csr",
        "write_bundle",
    ),
    "closing": (
        "abort",
        "close_cleanly",
        "reset_if_process_dies",
    ),
    "config": (
        "ConfigError",
        "InvalidValue",
        "add_flag",
        "existing_file",
        "flag_adder",
        "parse_args_or_exit",
        "parse_count",
        "parse_dialable_hostport",
        "parse_duration",
        "parse_fraction",
        "parse_hostport",
        "parse_non_negative_float",
        "parse_port",
        "parse_positive_duration",
        "parse_positive_float",
        "parse_positive_int",
        "parse_size",
    ),
    "core": (
        "CANCEL",
        "ENHANCE_YOUR_CALM",
        "Role",
        "TunnelCore",
    ),
    "driver": (
        "IncomingRequest",
        "LimitHandler",
        "Mux",
        "limit_reporter",
        "open_mux",
    ),
    "errors": (
        "ConnectRefused",
        "DialTimeout",
        "Forbidden",
        "MalformedTarget",
        "NoAgentConnected",
        "TargetUnreachable",
        "TooManyRequests",
        "TunnelClosed",
        "TunnelError",
        "UnknownCluster",
        "clean_reason",
        "describe_exception",
    ),
    "files": ("write_atomic",),
    "forward_proxy": (
        "NoProxy",
        "ProxySettings",
        "ProxyURL",
        "Route",
        "without_proxy_variables",
    ),
    "forward_proxy_trio": (
        "ForwardProxy",
        "Prefixed",
    ),
    "httpserver": (
        "HttpLimits",
        "Request",
        "Response",
        "serve_http",
        "serve_stream",
    ),
    "kubeconfig": ("load_configuration",),
    "logs": (
        "LOG_FORMATS",
        "LOG_LEVELS",
        "add_log_flags",
        "configure_logging",
        "get_logger",
    ),
    "pki": (
        "AGENT_ORGANIZATION",
        "CLIENT_ROLE_URI",
        "SERVER_ROLE_URI",
        "CertRole",
        "DevCA",
        "PemPair",
        "agent_identity_from_cert",
        "agent_uri",
        "certificate_role",
        "key_pem",
        "key_usage",
        "new_ca",
        "peer_identity",
        "role_of_uri",
        "role_refusal",
    ),
    "proxy_requests": (
        "HOP_BY_HOP",
        "MAX_REQUEST_HEAD",
        "BadRequest",
        "ConnectRequest",
        "RequestHeadReader",
        "cluster_from_proxy_authorization",
        "error_response",
        "established",
        "forward_form",
    ),
    "relay": ("RelayResult",),
    "reloader": ("ReloadingContext",),
    "renewal_metrics": (
        "RenewerCollector",
        "RenewerCounters",
    ),
    "renewer": (
        "CertRenewer",
        "RenewalPolicy",
    ),
    "restart_policy": ("RestartPolicy",),
    "service_runtime": (
        "SIGNER_HELP",
        "SignerSettings",
        "add_certificate_flags",
        "add_signer_flags",
        "check_without_signer",
        "failure_in_log",
        "failure_on_stderr",
        "run_service",
        "serve_until_signalled",
        "signer_url",
        "watch_signals",
    ),
    "settings": ("TunnelSettings",),
    "steering": (
        "attach_steering",
        "format_worker",
        "parse_worker",
        "source_port_for",
    ),
    "tls": (
        "client_context",
        "server_context",
        "web_client_context",
    ),
    "transport": (
        "read_in_bulk",
        "receive_batch",
        "send_all",
    ),
    "tunnel_stream": ("TunnelStream",),
    "websocket": (
        "MAX_MESSAGE",
        "READ_SIZE",
        "WebSocketFailed",
        "WebSocketStream",
        "host_header",
        "open_websocket",
    ),
    "windows": (
        "Budget",
        "format_size",
    ),
    "wire": (
        "ALPN_H2",
        "ALPN_HTTP1",
        "CLUSTER_HEADER",
        "CLUSTER_NAME",
        "EXPECTED_HOSTPORT",
        "FAULT_HEADER",
        "FAULT_TARGET",
        "INFO_PATH",
        "PRESENTING_HEADER",
        "REASON_HEADER",
        "SERVER_COUNT_HEADER",
        "SERVER_ID_HEADER",
        "SERVER_WORKER_HEADER",
        "TRUSTED_HEADER",
        "WEBSOCKET_PATH",
        "WEBSOCKET_SUBPROTOCOL",
        "MalformedAddress",
        "format_address",
        "format_authority",
        "parse_authority",
        "port_number",
        "split_hostport",
    ),
}
#: Public names that differ from their submodule's: public name -> (submodule, name there).
_RENAMED: dict[str, tuple[str, str]] = {
    "AdminRoute": ("admin", "Route"),
    "relay_streams": ("relay", "relay"),
}

__all__ = [
    # the public submodules
    "allocator",
    "certclient",
    "http1client",
    "request_heads",
    "workarounds",
    # admin
    "INVENTORY_LABELS",
    "Authenticated",
    "PeerRoute",
    "metrics_response",
    "serve_admin",
    "AdminRoute",
    # agent_control
    "CONTROL_CLIENT_HEADER",
    "CONTROL_HOST",
    "CONTROL_PORT",
    "SERVICEACCOUNT_PATH",
    "serviceaccount_path",
    # audit
    "AuditRecord",
    "AuditSink",
    "add_audit_flag",
    "open_sink",
    "worker_spec",
    # certclient
    "CertFiles",
    "SignerEndpoint",
    "SignerRequestError",
    "client_csr",
    "ensure_bootstrapped",
    "server_csr",
    "write_bundle",
    # closing
    "abort",
    "close_cleanly",
    "reset_if_process_dies",
    # config
    "ConfigError",
    "InvalidValue",
    "add_flag",
    "existing_file",
    "flag_adder",
    "parse_args_or_exit",
    "parse_count",
    "parse_dialable_hostport",
    "parse_duration",
    "parse_fraction",
    "parse_hostport",
    "parse_non_negative_float",
    "parse_port",
    "parse_positive_duration",
    "parse_positive_float",
    "parse_positive_int",
    "parse_size",
    # core
    "CANCEL",
    "ENHANCE_YOUR_CALM",
    "Role",
    "TunnelCore",
    # driver
    "IncomingRequest",
    "LimitHandler",
    "Mux",
    "limit_reporter",
    "open_mux",
    # errors
    "ConnectRefused",
    "DialTimeout",
    "Forbidden",
    "MalformedTarget",
    "NoAgentConnected",
    "TargetUnreachable",
    "TooManyRequests",
    "TunnelClosed",
    "TunnelError",
    "UnknownCluster",
    "clean_reason",
    "describe_exception",
    # files
    "write_atomic",
    # forward_proxy
    "NoProxy",
    "ProxySettings",
    "ProxyURL",
    "Route",
    "without_proxy_variables",
    # forward_proxy_trio
    "ForwardProxy",
    "Prefixed",
    # httpserver
    "HttpLimits",
    "Request",
    "Response",
    "serve_http",
    "serve_stream",
    # kubeconfig
    "load_configuration",
    # logs
    "LOG_FORMATS",
    "LOG_LEVELS",
    "add_log_flags",
    "configure_logging",
    "get_logger",
    # pki
    "AGENT_ORGANIZATION",
    "CLIENT_ROLE_URI",
    "SERVER_ROLE_URI",
    "CertRole",
    "DevCA",
    "PemPair",
    "agent_identity_from_cert",
    "agent_uri",
    "certificate_role",
    "key_pem",
    "key_usage",
    "new_ca",
    "peer_identity",
    "role_of_uri",
    "role_refusal",
    # proxy_requests
    "HOP_BY_HOP",
    "MAX_REQUEST_HEAD",
    "BadRequest",
    "ConnectRequest",
    "RequestHeadReader",
    "cluster_from_proxy_authorization",
    "error_response",
    "established",
    "forward_form",
    # relay
    "RelayResult",
    "relay_streams",
    # reloader
    "ReloadingContext",
    # renewal_metrics
    "RenewerCollector",
    "RenewerCounters",
    # renewer
    "CertRenewer",
    "RenewalPolicy",
    # restart_policy
    "RestartPolicy",
    # service_runtime
    "SIGNER_HELP",
    "SignerSettings",
    "add_certificate_flags",
    "add_signer_flags",
    "check_without_signer",
    "failure_in_log",
    "failure_on_stderr",
    "run_service",
    "serve_until_signalled",
    "signer_url",
    "watch_signals",
    # settings
    "TunnelSettings",
    # steering
    "attach_steering",
    "format_worker",
    "parse_worker",
    "source_port_for",
    # tls
    "client_context",
    "server_context",
    "web_client_context",
    # transport
    "read_in_bulk",
    "receive_batch",
    "send_all",
    # tunnel_stream
    "TunnelStream",
    # websocket
    "MAX_MESSAGE",
    "READ_SIZE",
    "WebSocketFailed",
    "WebSocketStream",
    "host_header",
    "open_websocket",
    # windows
    "Budget",
    "format_size",
    # wire
    "ALPN_H2",
    "ALPN_HTTP1",
    "CLUSTER_HEADER",
    "CLUSTER_NAME",
    "EXPECTED_HOSTPORT",
    "FAULT_HEADER",
    "FAULT_TARGET",
    "INFO_PATH",
    "PRESENTING_HEADER",
    "REASON_HEADER",
    "SERVER_COUNT_HEADER",
    "SERVER_ID_HEADER",
    "SERVER_WORKER_HEADER",
    "TRUSTED_HEADER",
    "WEBSOCKET_PATH",
    "WEBSOCKET_SUBPROTOCOL",
    "MalformedAddress",
    "format_address",
    "format_authority",
    "parse_authority",
    "port_number",
    "split_hostport",
]

_WHERE: dict[str, tuple[str, str]] = {
    **{name: (module, name) for module, names in _EXPORTS.items() for name in names},
    **_RENAMED,
}


# Hidden from mypy: a module-level __getattr__ would type every unknown name as its return type, so a
# misspelt import of this package would pass the type check. mypy sees the TYPE_CHECKING imports.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        if name in SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        try:
            module, attribute = _WHERE[name]
        except KeyError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
        # Bound here: the next lookup finds a plain module attribute and never comes back to this function.
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})

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

Every public name is its submodule's own name, and none is a submodule's name (a package attribute
named like a submodule is replaced by that submodule when it is first imported): hence
``admin.AdminRoute`` beside ``forward_proxy.Route``, and ``relay.relay_streams``.

The exports are lazy (PEP 562 ``__getattr__``): importing the package imports no submodule, so a
sans-IO module (``core``, ``windows``, ...) still loads no trio when imported alone
(``tests/unit/test_sans_io.py``), and a program pays only for the submodules whose names it uses.
The first lookup of a name imports its submodule and binds the name here; ``from
clusterproxy_protocol import X`` binds ``X`` in the importer once, so no call goes through the
package afterwards.

The ``TYPE_CHECKING`` imports below are the one list of the public API: mypy and editors read them
as imports (``X as X``: re-exported under mypy's strict rules), and at import time the lazy table and
``__all__`` are read from the same lines (:func:`_public_names`), so a name is added in one place."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterproxy_protocol import (
        allocator as allocator,
        certclient as certclient,
        http1client as http1client,
        request_heads as request_heads,
        workarounds as workarounds,
    )
    from clusterproxy_protocol.admin import (
        INVENTORY_LABELS as INVENTORY_LABELS,
        AdminRoute as AdminRoute,
        Authenticated as Authenticated,
        PeerRoute as PeerRoute,
        metrics_response as metrics_response,
        serve_admin as serve_admin,
    )
    from clusterproxy_protocol.agent_control import (
        CONTROL_CLIENT_HEADER as CONTROL_CLIENT_HEADER,
        CONTROL_HOST as CONTROL_HOST,
        CONTROL_PORT as CONTROL_PORT,
        SERVICEACCOUNT_PATH as SERVICEACCOUNT_PATH,
        serviceaccount_path as serviceaccount_path,
    )
    from clusterproxy_protocol.audit import (
        AuditRecord as AuditRecord,
        AuditSink as AuditSink,
        add_audit_flag as add_audit_flag,
        open_sink as open_sink,
        worker_spec as worker_spec,
    )
    from clusterproxy_protocol.certclient import (
        CertFiles as CertFiles,
        SignerEndpoint as SignerEndpoint,
        SignerRequestError as SignerRequestError,
        client_csr as client_csr,
        ensure_bootstrapped as ensure_bootstrapped,
        server_csr as server_csr,
        write_bundle as write_bundle,
    )
    from clusterproxy_protocol.closing import (
        abort as abort,
        close_cleanly as close_cleanly,
        reset_if_process_dies as reset_if_process_dies,
    )
    from clusterproxy_protocol.config import (
        ConfigError as ConfigError,
        InvalidValue as InvalidValue,
        add_flag as add_flag,
        existing_file as existing_file,
        flag_adder as flag_adder,
        parse_args_or_exit as parse_args_or_exit,
        parse_count as parse_count,
        parse_dialable_hostport as parse_dialable_hostport,
        parse_duration as parse_duration,
        parse_fraction as parse_fraction,
        parse_hostport as parse_hostport,
        parse_non_negative_float as parse_non_negative_float,
        parse_port as parse_port,
        parse_positive_duration as parse_positive_duration,
        parse_positive_float as parse_positive_float,
        parse_positive_int as parse_positive_int,
        parse_size as parse_size,
    )
    from clusterproxy_protocol.core import (
        CANCEL as CANCEL,
        ENHANCE_YOUR_CALM as ENHANCE_YOUR_CALM,
        Role as Role,
        TunnelCore as TunnelCore,
    )
    from clusterproxy_protocol.driver import (
        IncomingRequest as IncomingRequest,
        LimitHandler as LimitHandler,
        Mux as Mux,
        limit_reporter as limit_reporter,
        open_mux as open_mux,
    )
    from clusterproxy_protocol.errors import (
        ConnectRefused as ConnectRefused,
        DialTimeout as DialTimeout,
        Forbidden as Forbidden,
        MalformedTarget as MalformedTarget,
        NoAgentConnected as NoAgentConnected,
        TargetUnreachable as TargetUnreachable,
        TooManyRequests as TooManyRequests,
        TunnelClosed as TunnelClosed,
        TunnelError as TunnelError,
        UnknownCluster as UnknownCluster,
        clean_reason as clean_reason,
        describe_exception as describe_exception,
    )
    from clusterproxy_protocol.files import write_atomic as write_atomic
    from clusterproxy_protocol.forward_proxy import (
        NoProxy as NoProxy,
        ProxySettings as ProxySettings,
        ProxyURL as ProxyURL,
        Route as Route,
        without_proxy_variables as without_proxy_variables,
    )
    from clusterproxy_protocol.forward_proxy_trio import ForwardProxy as ForwardProxy, Prefixed as Prefixed
    from clusterproxy_protocol.httpserver import (
        HttpLimits as HttpLimits,
        Request as Request,
        Response as Response,
        serve_http as serve_http,
        serve_stream as serve_stream,
    )
    from clusterproxy_protocol.kubeconfig import load_configuration as load_configuration
    from clusterproxy_protocol.logs import (
        LOG_FORMATS as LOG_FORMATS,
        LOG_LEVELS as LOG_LEVELS,
        add_log_flags as add_log_flags,
        configure_logging as configure_logging,
        get_logger as get_logger,
    )
    from clusterproxy_protocol.pki import (
        AGENT_ORGANIZATION as AGENT_ORGANIZATION,
        CLIENT_ROLE_URI as CLIENT_ROLE_URI,
        SERVER_ROLE_URI as SERVER_ROLE_URI,
        CertRole as CertRole,
        DevCA as DevCA,
        PemPair as PemPair,
        agent_identity_from_cert as agent_identity_from_cert,
        agent_uri as agent_uri,
        certificate_role as certificate_role,
        key_pem as key_pem,
        key_usage as key_usage,
        new_ca as new_ca,
        peer_identity as peer_identity,
        role_of_uri as role_of_uri,
        role_refusal as role_refusal,
    )
    from clusterproxy_protocol.proxy_requests import (
        HOP_BY_HOP as HOP_BY_HOP,
        MAX_REQUEST_HEAD as MAX_REQUEST_HEAD,
        BadRequest as BadRequest,
        ConnectRequest as ConnectRequest,
        RequestHeadReader as RequestHeadReader,
        cluster_from_proxy_authorization as cluster_from_proxy_authorization,
        error_response as error_response,
        established as established,
        forward_form as forward_form,
    )
    from clusterproxy_protocol.relay import RelayResult as RelayResult, relay_streams as relay_streams
    from clusterproxy_protocol.reloader import ReloadingContext as ReloadingContext
    from clusterproxy_protocol.renewal_metrics import (
        RenewerCollector as RenewerCollector,
        RenewerCounters as RenewerCounters,
    )
    from clusterproxy_protocol.renewer import CertRenewer as CertRenewer, RenewalPolicy as RenewalPolicy
    from clusterproxy_protocol.restart_policy import RestartPolicy as RestartPolicy
    from clusterproxy_protocol.service_runtime import (
        SIGNER_HELP as SIGNER_HELP,
        SignerSettings as SignerSettings,
        add_certificate_flags as add_certificate_flags,
        add_signer_flags as add_signer_flags,
        check_without_signer as check_without_signer,
        failure_in_log as failure_in_log,
        failure_on_stderr as failure_on_stderr,
        listen_on as listen_on,
        run_service as run_service,
        serve_until_signalled as serve_until_signalled,
        signer_url as signer_url,
        watch_signals as watch_signals,
    )
    from clusterproxy_protocol.settings import TunnelSettings as TunnelSettings
    from clusterproxy_protocol.steering import (
        attach_steering as attach_steering,
        format_worker as format_worker,
        parse_worker as parse_worker,
        source_port_for as source_port_for,
    )
    from clusterproxy_protocol.tls import (
        client_context as client_context,
        server_context as server_context,
        web_client_context as web_client_context,
    )
    from clusterproxy_protocol.transport import (
        read_in_bulk as read_in_bulk,
        receive_batch as receive_batch,
        send_all as send_all,
    )
    from clusterproxy_protocol.tunnel_stream import TunnelStream as TunnelStream
    from clusterproxy_protocol.websocket import (
        MAX_MESSAGE as MAX_MESSAGE,
        READ_SIZE as READ_SIZE,
        WebSocketFailed as WebSocketFailed,
        WebSocketStream as WebSocketStream,
        host_header as host_header,
        open_websocket as open_websocket,
    )
    from clusterproxy_protocol.windows import Budget as Budget, format_size as format_size
    from clusterproxy_protocol.wire import (
        ALPN_H2 as ALPN_H2,
        ALPN_HTTP1 as ALPN_HTTP1,
        CLUSTER_HEADER as CLUSTER_HEADER,
        CLUSTER_NAME as CLUSTER_NAME,
        EXPECTED_HOSTPORT as EXPECTED_HOSTPORT,
        FAULT_HEADER as FAULT_HEADER,
        FAULT_TARGET as FAULT_TARGET,
        INFO_PATH as INFO_PATH,
        PRESENTING_HEADER as PRESENTING_HEADER,
        REASON_HEADER as REASON_HEADER,
        SERVER_COUNT_HEADER as SERVER_COUNT_HEADER,
        SERVER_ID_HEADER as SERVER_ID_HEADER,
        SERVER_WORKER_HEADER as SERVER_WORKER_HEADER,
        TRUSTED_HEADER as TRUSTED_HEADER,
        WEBSOCKET_PATH as WEBSOCKET_PATH,
        WEBSOCKET_SUBPROTOCOL as WEBSOCKET_SUBPROTOCOL,
        MalformedAddress as MalformedAddress,
        format_address as format_address,
        format_authority as format_authority,
        parse_authority as parse_authority,
        port_number as port_number,
        split_hostport as split_hostport,
    )


def _public_names() -> dict[str, tuple[str, str]]:
    """Public name -> (submodule, its name there; "" for a public submodule), read once from the
    ``TYPE_CHECKING`` imports of this file: the list mypy reads is the list the lazy lookup serves."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    names: dict[str, tuple[str, str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None, ast.unparse(node)
        for alias in node.names:
            public = alias.asname or alias.name
            if node.module == __name__:
                names[public] = (alias.name, "")
            else:
                names[public] = (node.module.removeprefix(f"{__name__}."), alias.name)
    return names


_WHERE = _public_names()
#: The public submodules, imported as modules (``from clusterproxy_protocol import http1client``).
SUBMODULES = tuple(name for name, (_, attribute) in _WHERE.items() if not attribute)
__all__ = list(_WHERE)


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

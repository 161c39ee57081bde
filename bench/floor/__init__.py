"""The floor: the shortest correct proxy-server and agent on our stack, nothing else (issue 36).

Same stack and choices as ours: trio; CPython ``ssl`` with TLS 1.3 and mutual TLS on both ports (the
client certificate verified against the CA); h11 for the client's HTTP/1.1 CONNECT; an HTTP/2
tunnel (h2) that the agent dials out and the server opens CONNECT streams on, with ours' SETTINGS and
windows; the agent dials the target and relays both ways with half-close. Left out: policy, roles,
metrics, logs, limits, timeouts, keepalives, reload, draining. Imports nothing of the project.

    python -m bench.floor.server --agent-listen H:P --client-listen H:P --ca CA --cert C --key K
    python -m bench.floor.agent --server H:P --ca CA --cert C --key K [--fleet FILE]
"""

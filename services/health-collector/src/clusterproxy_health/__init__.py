"""cluster-proxy health-collector: is every cluster reachable through its tunnel, and how fast.

Every ``--interval`` it asks each proxy-server replica's admin port which agents it holds, reads each
cluster's ManagedClusterAddOn (Kubernetes mode), and probes every cluster through the proxy-server's
client port (by default its kube-apiserver's ``/healthz``, named by the bare cluster name). It
serves the answer on one port: ``/api/v1/clusters`` (JSON), ``/metrics`` (Prometheus), ``/healthz``,
``/readyz`` and ``/`` (a page a person reads at a glance).
"""

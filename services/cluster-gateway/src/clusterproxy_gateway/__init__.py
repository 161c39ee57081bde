"""cluster-gateway: an aggregated API server for ``cluster.core.oam.dev/v1alpha1`` (see docs/cluster-gateway.md)."""

"""cluster-proxy proxy-agent: dials out from a managed cluster and serves the tunnel."""

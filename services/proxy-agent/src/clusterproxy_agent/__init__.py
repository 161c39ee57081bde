"""cluster-proxy proxy-agent: dials out to the hub's proxy-server and serves tunnel streams."""

"""cluster-proxy proxy-server: the hub end of the reverse tunnels."""

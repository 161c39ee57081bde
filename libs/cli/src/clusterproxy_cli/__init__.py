"""The cluster-proxy command-line tool (local mode, health, connect)."""

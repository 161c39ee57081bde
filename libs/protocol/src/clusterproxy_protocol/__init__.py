"""Wire protocol of cluster-proxy: sans-IO reverse HTTP/2 tunnel, TLS and PKI helpers, config and logging."""

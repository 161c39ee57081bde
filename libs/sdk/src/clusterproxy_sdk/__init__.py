"""Python client SDK for cluster-proxy: open TCP streams into managed clusters through the hub."""

"""Tests against real Kubernetes API servers (etcd + kube-apiserver per simulated cluster)."""

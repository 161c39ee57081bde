"""Benchmarks: the same workloads directly, through cluster-proxy and through upstream ANP.

See docs/benchmarks.md.
"""

"""cluster-proxy cert-signer: the signing API over HTTPS, its signing policy, and the `token`, `status` and
`rotate-ca` commands over the CA store of :mod:`clusterproxy_castore`."""

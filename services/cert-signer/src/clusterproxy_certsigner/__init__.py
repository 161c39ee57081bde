"""cluster-proxy cert-signer: the CA, bootstrap tokens, a signing API over HTTPS, CA rotation."""

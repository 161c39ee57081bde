"""The CA store of cluster-proxy: where the CAs, the bootstrap tokens and every issued certificate live
(files or Kubernetes Secrets), the records kept there, token minting and the CA's creation and
rotation. The cert-signer signs from it; the addon-manager mints tokens in it and reads its trust
bundle. Imports no service."""

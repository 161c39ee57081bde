"""cluster-proxy addon-manager: the Open Cluster Management addon controller of cluster-proxy.

It follows the ManagedProxyConfiguration and OCM's cluster inventory on the hub and writes what makes
the tunnels exist: the proxy-servers and the cert-signer on the hub, a ManifestWork with a proxy-agent
for every managed cluster that enables the addon. See docs/addon-manager.md.
"""

"""``python -m clusterproxy_cli`` is the ``cluster-proxy`` command."""

from clusterproxy_cli.main import main

main()

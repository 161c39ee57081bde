from clusterproxy_gateway.main import main

main()

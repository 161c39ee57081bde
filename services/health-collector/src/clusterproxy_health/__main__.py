from clusterproxy_health.main import main

main()

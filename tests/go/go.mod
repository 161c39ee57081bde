module clusterproxy.test/gopeers

go 1.22

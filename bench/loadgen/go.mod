module clusterproxy.bench/loadgen

go 1.22

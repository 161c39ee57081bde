// Command anp-multiagent runs N upstream apiserver-network-proxy agents in one process.
//
// It exists only for the fan-in benchmark (bench/, workload "fanin"): 1000 separate agent
// processes of ~10-20 MiB each do not fit a 2-core benchmark machine, so this program drives
// upstream's own agent library (sigs.k8s.io/apiserver-network-proxy/pkg/agent) exactly the way
// cmd/agent does (runProxyConnection in cmd/agent/app/server.go), once per agent, each with its
// own agent id, its own identifiers and its own gRPC/TLS connection to the proxy-server.
//
// It is written here and compiled by bench/upstream/build.sh against the pinned upstream module
// from the Go module registry; no upstream code is copied into this repository. It is not part of
// any Go module in this repository (build.sh puts it into a throw-away module in the cache folder).
//
// Identifiers: agent i gets "host=<ip-i>" where ip-i is the i-th address of --ip-base (a loopback
// range such as 127.1.0.0): the proxy-server's destHost strategy routes "CONNECT <ip-i>:PORT" to it
// and the agent dials <ip-i>:PORT, where the bench target listens.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"k8s.io/klog/v2"
	"sigs.k8s.io/apiserver-network-proxy/pkg/agent"
	"sigs.k8s.io/apiserver-network-proxy/pkg/util"
)

// FaninIP returns the i-th loopback address used by the fan-in benchmark: 127.1.(i/250).(i%250+1).
// The harness (bench/workloads.py) and the loadgen target use the same formula.
func FaninIP(base net.IP, i int) string {
	b := base.To4()
	return net.IPv4(b[0], b[1]+byte(i/62500), b[2]+byte((i/250)%250), byte(i%250+1)).String()
}

func main() {
	count := flag.Int("count", 1, "number of agents")
	first := flag.Int("first", 0, "index of the first agent (agent ids and identifiers are numbered from it)")
	ipBase := flag.String("ip-base", "127.1.0.0", "loopback base for per-agent host identifiers")
	idPrefix := flag.String("id-prefix", "bench-agent-", "agent id prefix")
	caCert := flag.String("ca-cert", "", "CA that signed the proxy-server's cluster (agent-side) certificate")
	agentCert := flag.String("agent-cert", "", "agent client certificate")
	agentKey := flag.String("agent-key", "", "agent client key")
	host := flag.String("proxy-server-host", "127.0.0.1", "proxy-server host (also the TLS server name)")
	port := flag.Int("proxy-server-port", 8091, "proxy-server agent port")
	syncInterval := flag.Duration("sync-interval", time.Second, "as upstream agent --sync-interval")
	syncIntervalCap := flag.Duration("sync-interval-cap", 10*time.Second, "as upstream agent --sync-interval-cap")
	probeInterval := flag.Duration("probe-interval", time.Second, "as upstream agent --probe-interval")
	keepaliveTime := flag.Duration("keepalive-time", time.Hour, "as upstream agent --keepalive-time")
	xfr := flag.Int("xfr-channel-size", 150, "as upstream agent --xfr-channel-size")
	klog.InitFlags(nil)
	flag.Parse()

	base := net.ParseIP(*ipBase)
	if base == nil || base.To4() == nil {
		fmt.Fprintf(os.Stderr, "bad --ip-base %q\n", *ipBase)
		os.Exit(2)
	}
	tlsConfig, err := util.GetClientTLSConfig(*caCert, *agentCert, *agentKey, *host, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	drainCh := make(chan struct{})
	stopCh := make(chan struct{})
	for i := *first; i < *first+*count; i++ {
		cc := &agent.ClientSetConfig{
			Address:          net.JoinHostPort(*host, strconv.Itoa(*port)),
			AgentID:          *idPrefix + strconv.Itoa(i),
			AgentIdentifiers: "host=" + FaninIP(base, i),
			SyncInterval:     *syncInterval,
			ProbeInterval:    *probeInterval,
			SyncIntervalCap:  *syncIntervalCap,
			DialOptions: []grpc.DialOption{
				grpc.WithTransportCredentials(credentials.NewTLS(tlsConfig.Clone())),
				grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: *keepaliveTime, PermitWithoutStream: true}),
			},
			XfrChannelSize:    *xfr,
			ServerCountSource: "default",
		}
		cs := cc.NewAgentClientSet(drainCh, stopCh)
		cs.SetServerCounter(agent.NewAggregateServerCounter(nil, agent.NewResponseBasedCounter(cs), "default"))
		cs.Serve()
	}
	fmt.Fprintf(os.Stderr, "started %d agents\n", *count)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	<-sig
	close(stopCh)
}

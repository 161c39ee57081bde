// Command loadgen is the one client (and the one target) used by every benchmark path in bench/:
// direct TCP, our proxy's HTTP/1.1 CONNECT frontend and upstream apiserver-network-proxy's
// http-connect frontend, and with --konnectivity the konnectivity gRPC frontends of both (ours on
// its client port, upstream's proxy-server --mode=grpc) through the real konnectivity-client
// module. Everything else is the standard library.
//
//	loadgen target  --listen 127.0.0.1:PORT                     the target (echo/sink/source/stall)
//	loadgen bulk    --target T [proxy flags] --streams N --direction up|down --duration D | --bytes B
//	loadgen connect --target T [proxy flags] --count N         sequential new streams, first-byte latency
//	loadgen rr      --target T [proxy flags] --rate R --conns C --duration D --size 1024
//	loadgen idle    --target T [proxy flags] --count K --hold D
//	loadgen hol     --target T [proxy flags] --streams 4 --direction down|up --duration D
//	loadgen probe   --targets FILE [proxy flags] --timeout D     until every CONNECT target answers
//	loadgen churn   --target T [proxy flags] --workers N --gap D  new streams until stdin closes
//
// Proxy flags: --proxy host:port --ca CA --cert CRT --key KEY [--server-name N] [--header 'K: V']...
// [--konnectivity] (the proxy is konnectivity gRPC: one CreateSingleUseGrpcTunnel per stream).
// Every client mode prints one JSON object on stdout (and progress events as JSON lines on stderr).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: loadgen target|bulk|connect|rr|idle|hol|probe|churn [flags]")
		os.Exit(2)
	}
	raiseNofile()
	mode, args := os.Args[1], os.Args[2:]
	var err error
	switch mode {
	case "target":
		err = runTarget(args)
	case "bulk", "connect", "rr", "idle", "hol", "probe", "churn":
		err = runClient(mode, args)
	default:
		err = fmt.Errorf("unknown mode %q", mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
}

// raiseNofile lifts the soft open-files limit to the hard limit (Go does this for itself since
// 1.19, but only on some paths; being explicit costs nothing).
func raiseNofile() {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil && rl.Cur < rl.Max {
		rl.Cur = rl.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl)
	}
}

type cpuSample struct {
	wall time.Time
	user time.Duration
	sys  time.Duration
}

func sampleCPU() cpuSample {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return cpuSample{
		wall: time.Now(),
		user: time.Duration(ru.Utime.Nano()),
		sys:  time.Duration(ru.Stime.Nano()),
	}
}

// emit writes the result object with the loadgen's own CPU use, so the harness can show that the
// client is not what limits a run.
func emit(mode string, params map[string]any, result map[string]any, start cpuSample) {
	end := sampleCPU()
	wall := end.wall.Sub(start.wall).Seconds()
	cpu := (end.user - start.user + end.sys - start.sys).Seconds()
	out := map[string]any{
		"mode":   mode,
		"params": params,
		"result": result,
		"loadgen_cpu": map[string]any{
			"wall_s":      round(wall, 3),
			"cpu_s":       round(cpu, 3),
			"cpu_percent": round(100*cpu/max(wall, 1e-9), 1),
			"gomaxprocs":  runtime.GOMAXPROCS(0),
		},
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	_ = enc.Encode(out)
}

// event writes a progress line (JSON) on stderr; the harness reacts to "ready".
func event(name string, fields map[string]any) {
	m := map[string]any{"event": name, "t": time.Now().UnixMilli()}
	for k, v := range fields {
		m[k] = v
	}
	b, _ := json.Marshal(m)
	fmt.Fprintln(os.Stderr, string(b))
}

// konnget: a Go program written the way upstream cluster-proxy's users write theirs, against the real
// konnectivity-client module: gRPC with mTLS to the proxy-server's client port,
// CreateSingleUseGrpcTunnel per connection, tunnel.DialContext as an http.Client's Dial.
//
// Modes (one JSON line on stdout):
//
//	get       -url URL -n N -c C   N GETs (C at a time), each over its own single-use tunnel; sha256 of
//	                               the first body, bytes, failures with their error texts
//	upload    -url URL -size S     POST S pattern bytes; the response body (the target's sha256) and ours
//	dial      -address HOST:PORT   one DialContext; its error text (to check refusals)
//	stall     -url URL -slow URL -n N
//	                               one tunnel GETs -slow and never reads its body, while N tunnels GET
//	                               -url one after another; bytes/s of those with and without the stall
package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	konnectivity "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"
)

var (
	proxy      = flag.String("proxy", "", "the proxy-server's client port, HOST:PORT")
	caFile     = flag.String("ca", "", "CA bundle for the proxy-server")
	certFile   = flag.String("cert", "", "client certificate")
	keyFile    = flag.String("key", "", "client key")
	serverName = flag.String("server-name", "localhost", "TLS name of the proxy-server")
	mode       = flag.String("mode", "get", "get, upload, dial or stall")
	url        = flag.String("url", "", "URL to fetch through the tunnel")
	slowURL    = flag.String("slow", "", "stall mode: the URL whose body is never read")
	address    = flag.String("address", "", "dial mode: HOST:PORT to dial")
	count      = flag.Int("n", 1, "requests")
	parallel   = flag.Int("c", 1, "requests at a time")
	size       = flag.Int64("size", 0, "upload mode: bytes to send")
	timeout    = flag.Duration("timeout", 60*time.Second, "bound on the whole run")
	cluster    = flag.String("cluster", "", "send the cluster-proxy-cluster header as gRPC metadata (else the host names it)")
)

// withCluster adds -cluster to the metadata of the tunnel's gRPC stream.
func withCluster(ctx context.Context) context.Context {
	if *cluster == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "cluster-proxy-cluster", *cluster)
}

type result struct {
	OK        int      `json:"ok"`
	Failed    int      `json:"failed"`
	Errors    []string `json:"errors,omitempty"`
	Bytes     int64    `json:"bytes"`
	SHA256    string   `json:"sha256,omitempty"`
	Body      string   `json:"body,omitempty"`
	Seconds   float64  `json:"seconds"`
	Alone     float64  `json:"alone_bytes_per_second,omitempty"`
	WithStall float64  `json:"with_stall_bytes_per_second,omitempty"`
	DialError string   `json:"dial_error,omitempty"`
}

func grpcOptions() []grpc.DialOption {
	cert, err := tls.LoadX509KeyPair(*certFile, *keyFile)
	check(err)
	pem, err := os.ReadFile(*caFile)
	check(err)
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		check(fmt.Errorf("no certificate in %s", *caFile))
	}
	config := &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, ServerName: *serverName}
	return []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(config))}
}

// client is an http.Client whose every connection is a new single-use konnectivity tunnel.
func client(options []grpc.DialOption) *http.Client {
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		tunnel, err := konnectivity.CreateSingleUseGrpcTunnel(withCluster(ctx), *proxy, options...)
		if err != nil {
			return nil, err
		}
		return tunnel.DialContext(ctx, network, addr)
	}
	return &http.Client{Transport: &http.Transport{DialContext: dial, DisableKeepAlives: true}}
}

func fetch(c *http.Client, target string, digest bool) (int64, string, error) {
	response, err := c.Get(target)
	if err != nil {
		return 0, "", err
	}
	defer response.Body.Close()
	if response.StatusCode != http.StatusOK {
		return 0, "", fmt.Errorf("status %s", response.Status)
	}
	hash := sha256.New()
	var sink io.Writer = io.Discard
	if digest {
		sink = hash
	}
	n, err := io.Copy(sink, response.Body)
	return n, hex.EncodeToString(hash.Sum(nil)), err
}

type pattern struct{ left, offset int64 }

func (p *pattern) Read(b []byte) (int, error) {
	if p.left == 0 {
		return 0, io.EOF
	}
	n := int64(len(b))
	if n > p.left {
		n = p.left
	}
	for i := int64(0); i < n; i++ {
		b[i] = byte((p.offset + i) * 31 % 251)
	}
	p.offset += n
	p.left -= n
	return int(n), nil
}

func main() {
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	options := grpcOptions()
	started := time.Now()
	out := result{}
	switch *mode {
	case "get":
		c := client(options)
		var lock sync.Mutex
		work := make(chan int)
		var group sync.WaitGroup
		for w := 0; w < *parallel; w++ {
			group.Add(1)
			go func() {
				defer group.Done()
				for i := range work {
					n, digest, err := fetch(c, *url, i == 0)
					lock.Lock()
					if err != nil {
						out.Failed++
						if len(out.Errors) < 5 {
							out.Errors = append(out.Errors, err.Error())
						}
					} else {
						out.OK++
						out.Bytes += n
						if i == 0 {
							out.SHA256 = digest
						}
					}
					lock.Unlock()
				}
			}()
		}
		for i := 0; i < *count; i++ {
			work <- i
		}
		close(work)
		group.Wait()
	case "upload":
		hash := sha256.New()
		body := io.TeeReader(&pattern{left: *size}, hash)
		response, err := client(options).Post(*url, "application/octet-stream", body)
		check(err)
		answer, err := io.ReadAll(response.Body)
		check(err)
		response.Body.Close()
		out.OK, out.Bytes, out.SHA256, out.Body = 1, *size, hex.EncodeToString(hash.Sum(nil)), string(answer)
	case "dial":
		tunnel, err := konnectivity.CreateSingleUseGrpcTunnel(withCluster(ctx), *proxy, options...)
		check(err)
		conn, err := tunnel.DialContext(ctx, "tcp", *address)
		if err != nil {
			out.Failed, out.DialError = 1, err.Error()
		} else {
			out.OK = 1
			conn.Close()
		}
	case "stall":
		c := client(options)
		measure := func() float64 {
			begin := time.Now()
			var total int64
			for i := 0; i < *count; i++ {
				n, _, err := fetch(c, *url, false)
				check(err)
				total += n
			}
			return float64(total) / time.Since(begin).Seconds()
		}
		out.Alone = measure()
		response, err := c.Get(*slowURL) // headers read, body never: its tunnel's window fills and stays full
		check(err)
		out.WithStall = measure()
		response.Body.Close()
		out.OK = 1
	default:
		check(fmt.Errorf("unknown mode %q", *mode))
	}
	out.Seconds = time.Since(started).Seconds()
	check(json.NewEncoder(os.Stdout).Encode(out))
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "konnget:", err)
		os.Exit(1)
	}
}

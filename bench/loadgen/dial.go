package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
)

// headerList is a repeatable --header "Name: value" flag.
type headerList []string

func (h *headerList) String() string     { return strings.Join(*h, ", ") }
func (h *headerList) Set(v string) error { *h = append(*h, v); return nil }

// Dialer reaches a target either directly (plain TCP), through an HTTP/1.1 CONNECT proxy that is
// spoken over TLS with a client certificate (mutual TLS), or (--konnectivity) through a
// konnectivity gRPC proxy, one single-use tunnel per stream (konnectivity.go). The same code path
// serves every system under test, so the client is never the difference between them.
type Dialer struct {
	Target       string // host:port of the target, as seen from the agent (CONNECT / DIAL_REQ address)
	Proxy        string // host:port of the proxy's client port; "" = direct
	Headers      []string
	TLS          *tls.Config
	DialTimeout  time.Duration
	Konnectivity bool
	grpcOptions  []grpc.DialOption
}

func addDialFlags(fs *flag.FlagSet) func() (*Dialer, error) {
	target := fs.String("target", "", "target host:port (the CONNECT authority when --proxy is set)")
	proxy := fs.String("proxy", "", "HTTP/1.1 CONNECT proxy host:port (TLS); empty = dial the target directly")
	konn := fs.Bool("konnectivity", false, "the proxy speaks konnectivity gRPC: a CreateSingleUseGrpcTunnel per stream (--header goes as gRPC metadata)")
	ca := fs.String("ca", "", "CA bundle (PEM) that verifies the proxy's certificate")
	cert := fs.String("cert", "", "client certificate (PEM) presented to the proxy")
	key := fs.String("key", "", "client key (PEM)")
	serverName := fs.String("server-name", "", "TLS server name of the proxy (default: the proxy host)")
	plainProxy := fs.Bool("proxy-plain", false, "speak to the proxy without TLS (debugging only)")
	dialTimeout := fs.Duration("dial-timeout", 10*time.Second, "timeout for TCP connect + TLS + CONNECT answer")
	var headers headerList
	fs.Var(&headers, "header", "extra CONNECT request header 'Name: value' (repeatable; gRPC metadata with --konnectivity)")
	return func() (*Dialer, error) {
		d := &Dialer{Target: *target, Proxy: *proxy, Headers: headers, DialTimeout: *dialTimeout, Konnectivity: *konn}
		if d.Konnectivity && (d.Proxy == "" || *plainProxy) {
			return nil, errors.New("--konnectivity needs --proxy and TLS (--ca, --cert, --key)")
		}
		if d.Proxy != "" && !*plainProxy {
			cfg := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}}
			if *ca != "" {
				pem, err := os.ReadFile(*ca)
				if err != nil {
					return nil, err
				}
				pool := x509.NewCertPool()
				if !pool.AppendCertsFromPEM(pem) {
					return nil, fmt.Errorf("no certificate in %s", *ca)
				}
				cfg.RootCAs = pool
			}
			if *cert != "" {
				c, err := tls.LoadX509KeyPair(*cert, *key)
				if err != nil {
					return nil, err
				}
				cfg.Certificates = []tls.Certificate{c}
			}
			cfg.ServerName = *serverName
			if cfg.ServerName == "" {
				h, _, err := net.SplitHostPort(d.Proxy)
				if err != nil {
					return nil, err
				}
				cfg.ServerName = h
			}
			d.TLS = cfg
			if d.Konnectivity {
				d.grpcOptions = konnectivityOptions(cfg)
			}
		}
		return d, nil
	}
}

// DialTimings are the phases of one proxied connection set-up, measured from the start of Dial.
type DialTimings struct {
	TCP       time.Duration // TCP connect to the proxy (or target)
	TLS       time.Duration // TLS handshake done
	Connected time.Duration // proxy answered 200 to CONNECT (= TLS for direct)
}

// bufferedConn returns bytes the CONNECT response reader buffered before reading the socket.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) {
	if c.r != nil {
		if c.r.Buffered() > 0 {
			return c.r.Read(p)
		}
		c.r = nil
	}
	return c.Conn.Read(p)
}

// CloseWrite half-closes when the underlying connection can (TCP, TLS).
func (c *bufferedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.New("half-close not supported")
}

// Dial opens one stream to the target (through the proxy when configured).
func (d *Dialer) Dial() (net.Conn, DialTimings, error) {
	return d.DialTo(d.Target, d.Headers)
}

// DialTo is Dial with another CONNECT authority and header set (the fan-in probe).
func (d *Dialer) DialTo(target string, headers []string) (net.Conn, DialTimings, error) {
	if d.Konnectivity {
		return d.dialKonnectivity(target, headers)
	}
	var tm DialTimings
	start := time.Now()
	deadline := start.Add(d.DialTimeout)
	addr := target
	if d.Proxy != "" {
		addr = d.Proxy
	}
	nd := net.Dialer{Timeout: d.DialTimeout}
	raw, err := nd.Dial("tcp", addr)
	if err != nil {
		return nil, tm, fmt.Errorf("tcp connect %s: %w", addr, err)
	}
	tm.TCP = time.Since(start)
	if d.Proxy == "" {
		tm.TLS, tm.Connected = tm.TCP, tm.TCP
		return raw, tm, nil
	}
	_ = raw.SetDeadline(deadline)
	var conn net.Conn = raw
	if d.TLS != nil {
		tc := tls.Client(raw, d.TLS)
		if err := tc.Handshake(); err != nil {
			raw.Close()
			return nil, tm, fmt.Errorf("tls handshake with %s: %w", addr, err)
		}
		conn = tc
	}
	tm.TLS = time.Since(start)
	var b strings.Builder
	fmt.Fprintf(&b, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n", target, target)
	for _, h := range headers {
		b.WriteString(h)
		b.WriteString("\r\n")
	}
	b.WriteString("\r\n")
	if _, err := conn.Write([]byte(b.String())); err != nil {
		conn.Close()
		return nil, tm, fmt.Errorf("write CONNECT: %w", err)
	}
	br := bufio.NewReaderSize(conn, 4096)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		conn.Close()
		return nil, tm, fmt.Errorf("read CONNECT response: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		body := make([]byte, 200)
		n, _ := br.Read(body)
		conn.Close()
		return nil, tm, fmt.Errorf("CONNECT %s: %s %q", target, resp.Status, strings.TrimSpace(string(body[:n])))
	}
	tm.Connected = time.Since(start)
	_ = raw.SetDeadline(time.Time{})
	return &bufferedConn{Conn: conn, r: br}, tm, nil
}

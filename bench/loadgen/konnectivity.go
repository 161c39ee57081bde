package main

// The konnectivity-gRPC client mode (--konnectivity): every stream is a single-use tunnel made the
// way upstream cluster-proxy's users make theirs, with the real konnectivity-client module:
// CreateSingleUseGrpcTunnel (its own gRPC connection: TCP, mutual TLS, HTTP/2) and one
// tunnel.DialContext. The same code reaches our proxy-server's client port and upstream's
// proxy-server in --mode=grpc, so the client is never the difference between them.

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	konnectivity "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"
)

// konnCloseWait bounds Close: the tunnel's own Close waits up to 10 s for the proxy's CLOSE_RSP.
const konnCloseWait = 5 * time.Second

// konnectivityOptions are the gRPC dial options for the proxy: mutual TLS with the flags' files.
func konnectivityOptions(cfg *tls.Config) []grpc.DialOption {
	c := cfg.Clone()
	c.NextProtos = nil // gRPC asks for h2 itself
	return []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(c))}
}

// tunnelMetadata turns the --header 'Name: value' flags into the gRPC metadata of the tunnel's
// stream (our proxy-server reads the cluster-proxy-cluster header from it).
func tunnelMetadata(headers []string) (metadata.MD, error) {
	md := metadata.MD{}
	for _, h := range headers {
		name, value, ok := strings.Cut(h, ":")
		if !ok || strings.TrimSpace(name) == "" {
			return nil, fmt.Errorf("header %q: expected 'Name: value'", h)
		}
		md.Append(strings.ToLower(strings.TrimSpace(name)), strings.TrimSpace(value))
	}
	return md, nil
}

// dialKonnectivity opens one single-use tunnel to d.Proxy and dials target through it. Timings:
// TCP and TLS are both the tunnel's creation (gRPC does not tell the phases apart), Connected the
// proxy's DIAL_RSP.
func (d *Dialer) dialKonnectivity(target string, headers []string) (net.Conn, DialTimings, error) {
	var tm DialTimings
	start := time.Now()
	md, err := tunnelMetadata(headers)
	if err != nil {
		return nil, tm, err
	}
	// The tunnel lives as long as tunnelCtx: cancelled by the returned connection's Close, or here
	// when the set-up does not finish within the dial timeout.
	tunnelCtx, cancel := context.WithCancel(metadata.NewOutgoingContext(context.Background(), md))
	setupCtx, setupDone := context.WithTimeout(context.Background(), d.DialTimeout)
	defer setupDone()
	stopWatch := context.AfterFunc(setupCtx, cancel)
	fail := func(what string, err error) (net.Conn, DialTimings, error) {
		cancel()
		if setupCtx.Err() != nil {
			err = fmt.Errorf("%w (dial timeout %s)", err, d.DialTimeout)
		}
		return nil, tm, fmt.Errorf("%s: %w", what, err)
	}
	tunnel, err := konnectivity.CreateSingleUseGrpcTunnelWithContext(setupCtx, tunnelCtx, d.Proxy, d.grpcOptions...)
	if err != nil {
		return fail("konnectivity tunnel to "+d.Proxy, err)
	}
	tm.TCP = time.Since(start)
	tm.TLS = tm.TCP
	conn, err := tunnel.DialContext(setupCtx, "tcp", target)
	if err != nil {
		return fail("konnectivity dial "+target, err)
	}
	if !stopWatch() {
		conn.Close()
		return fail("konnectivity dial "+target, errors.New("set-up timed out"))
	}
	tm.Connected = time.Since(start)
	return newKonnConn(conn, cancel), tm, nil
}

// konnConn gives a tunnel's connection the read deadlines the workloads use (konnectivity's
// connection has none: SetDeadline returns "not implemented"). A pump goroutine reads the tunnel
// into a few reusable buffers; Read takes from them or returns os.ErrDeadlineExceeded.
type konnConn struct {
	net.Conn
	cancel    context.CancelFunc
	chunks    chan []byte // filled by the pump, closed at the tunnel's end
	free      chan []byte // empty buffers back to the pump
	readErr   error       // the tunnel's end (io.EOF or the failure); set before chunks is closed
	held      []byte      // the buffer Read is taking from
	pending   []byte      // its unread part
	closed    chan struct{}
	closeOnce sync.Once
	closeErr  error
	deadline  readDeadline
}

const konnBuffers, konnBufferSize = 4, 64 << 10

func newKonnConn(c net.Conn, cancel context.CancelFunc) *konnConn {
	k := &konnConn{
		Conn:   c,
		cancel: cancel,
		chunks: make(chan []byte, konnBuffers),
		free:   make(chan []byte, konnBuffers),
		closed: make(chan struct{}),
	}
	k.deadline.expired = make(chan struct{})
	for i := 0; i < konnBuffers; i++ {
		k.free <- make([]byte, konnBufferSize)
	}
	go k.pump()
	return k
}

// pump reads the tunnel until it ends. After Close it goes on reading and drops what comes:
// konnectivity's tunnel stops delivering (and after 10 s gives up the connection) when a
// connection's data is not read, and Close waits for the CLOSE_RSP behind that data.
func (k *konnConn) pump() {
	discard := make([]byte, konnBufferSize)
	for {
		buf, dropping := discard, true
		select {
		case buf = <-k.free:
			dropping = false
		case <-k.closed:
		}
		n, err := k.Conn.Read(buf)
		switch {
		case dropping:
		case n > 0:
			select {
			case k.chunks <- buf[:n]:
			case <-k.closed:
			}
		default:
			k.free <- buf
		}
		if err != nil {
			k.readErr = err
			close(k.chunks)
			return
		}
	}
}

func (k *konnConn) Read(p []byte) (int, error) {
	if len(k.pending) == 0 {
		if k.held != nil {
			k.free <- k.held[:cap(k.held)]
			k.held = nil
		}
		select {
		case b, ok := <-k.chunks:
			if !ok {
				return 0, k.readErr
			}
			k.held, k.pending = b, b
		case <-k.deadline.wait():
			return 0, os.ErrDeadlineExceeded
		}
	}
	n := copy(p, k.pending)
	k.pending = k.pending[n:]
	return n, nil
}

func (k *konnConn) SetDeadline(t time.Time) error      { return k.SetReadDeadline(t) }
func (k *konnConn) SetReadDeadline(t time.Time) error  { k.deadline.set(t); return nil }
func (k *konnConn) SetWriteDeadline(_ time.Time) error { return nil } // writes are bounded by the workloads' watchdogs (Close)

// Close sends the tunnel's CLOSE_REQ and waits for the CLOSE_RSP (as a konnectivity user's Close
// does), at most konnCloseWait; then the tunnel's gRPC connection goes.
func (k *konnConn) Close() error {
	k.closeOnce.Do(func() {
		close(k.closed)
		done := make(chan error, 1)
		go func() { done <- k.Conn.Close() }()
		select {
		case k.closeErr = <-done:
		case <-time.After(konnCloseWait):
			k.closeErr = fmt.Errorf("konnectivity close: no CLOSE_RSP within %s", konnCloseWait)
		}
		k.cancel()
	})
	return k.closeErr
}

// readDeadline is a deadline as a channel that is closed when it passes.
type readDeadline struct {
	mu      sync.Mutex
	timer   *time.Timer
	expired chan struct{}
}

func (d *readDeadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil && !d.timer.Stop() {
		d.expired = make(chan struct{}) // the old timer fired or is firing: it closes the old channel
	}
	d.timer = nil
	select {
	case <-d.expired:
		d.expired = make(chan struct{})
	default:
	}
	if t.IsZero() {
		return
	}
	wait := time.Until(t)
	if wait <= 0 {
		close(d.expired)
		return
	}
	expired := d.expired
	d.timer = time.AfterFunc(wait, func() { close(expired) })
}

func (d *readDeadline) wait() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.expired
}

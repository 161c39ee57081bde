package main

import (
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// The target speaks a tiny protocol so that one port serves every workload. The first byte a
// client sends picks the service:
//
//	'E' echo:   every byte read is written back.
//	'S' sink:   records [u32 big-endian length][payload]; a record of length 0 makes the target
//	            answer with the u64 count of payload bytes received so far (then it goes on).
//	'R' source: u64 N follows; the target writes N bytes (N = 0: until the peer goes away).
//	'Z' stall:  u32 milliseconds follow; the target does not read for that long, then discards
//	            everything until EOF (a slow reader at the target side).
//	'H' hello:  the target writes one byte at once, then echoes (first-byte latency without a
//	            client write).
const (
	svcEcho   = 'E'
	svcSink   = 'S'
	svcSource = 'R'
	svcStall  = 'Z'
	svcHello  = 'H'
)

var targetConns atomic.Int64

func runTarget(args []string) error {
	fs := flag.NewFlagSet("target", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "listen address")
	faninN := fs.Int("fanin-ips", 0, "also listen on this many fan-in loopback addresses (127.1.x.y) at the same port")
	faninBase := fs.String("fanin-base", "127.1.0.0", "first fan-in loopback address")
	_ = fs.Parse(args)

	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	lns := []net.Listener{ln}
	base := net.ParseIP(*faninBase)
	for i := 0; i < *faninN; i++ {
		l, err := net.Listen("tcp", net.JoinHostPort(FaninIP(base, i), fmt.Sprint(port)))
		if err != nil {
			return fmt.Errorf("fan-in listener %d: %w", i, err)
		}
		lns = append(lns, l)
	}
	for _, l := range lns {
		go acceptLoop(l)
	}
	out, _ := json.Marshal(map[string]any{"event": "listening", "addr": ln.Addr().String(), "port": port, "fanin_ips": *faninN})
	fmt.Println(string(out))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	<-sig
	return nil
}

// FaninIP returns the i-th fan-in loopback address: base + (i/250, i%250+1) in the last two bytes.
// bench/upstream/multiagent and bench/systems.py use the same formula.
func FaninIP(base net.IP, i int) string {
	b := base.To4()
	return net.IPv4(b[0], b[1]+byte(i/62500), b[2]+byte((i/250)%250), byte(i%250+1)).String()
}

func acceptLoop(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if strings.Contains(err.Error(), "too many open files") {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return
		}
		go serveTarget(c)
	}
}

func serveTarget(c net.Conn) {
	targetConns.Add(1)
	defer targetConns.Add(-1)
	defer c.Close()
	var svc [1]byte
	if _, err := io.ReadFull(c, svc[:]); err != nil {
		return
	}
	switch svc[0] {
	case svcEcho:
		echo(c)
	case svcHello:
		if _, err := c.Write([]byte{'h'}); err != nil {
			return
		}
		echo(c)
	case svcSink:
		serveSink(c)
	case svcSource:
		var hdr [8]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint64(hdr[:])
		buf := make([]byte, 128<<10)
		for i := range buf {
			buf[i] = byte(i)
		}
		for sent := uint64(0); n == 0 || sent < n; {
			chunk := uint64(len(buf))
			if n != 0 && n-sent < chunk {
				chunk = n - sent
			}
			w, err := c.Write(buf[:chunk])
			sent += uint64(w)
			if err != nil {
				return
			}
		}
		// Keep the connection until the client closes it, so the last bytes are not reset.
		discard(c, -1)
	case svcStall:
		var hdr [4]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		time.Sleep(time.Duration(binary.BigEndian.Uint32(hdr[:])) * time.Millisecond)
		discard(c, -1)
	}
}

func serveSink(c net.Conn) {
	var hdr [4]byte
	var total uint64
	buf := make([]byte, 256<<10)
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		n := int64(binary.BigEndian.Uint32(hdr[:]))
		if n == 0 {
			var ack [8]byte
			binary.BigEndian.PutUint64(ack[:], total)
			if _, err := c.Write(ack[:]); err != nil {
				return
			}
			continue
		}
		got, err := discardBuf(c, n, buf)
		total += uint64(got)
		if err != nil {
			return
		}
	}
}

// echo writes back every byte read (plain loop: no splice, no small internal buffers).
func echo(c net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// discard reads and drops n bytes (n < 0: until EOF or error).
func discard(c net.Conn, n int64) (int64, error) {
	return discardBuf(c, n, make([]byte, 256<<10))
}

func discardBuf(c net.Conn, n int64, buf []byte) (int64, error) {
	var got int64
	for n < 0 || got < n {
		want := int64(len(buf))
		if n >= 0 && n-got < want {
			want = n - got
		}
		r, err := c.Read(buf[:want])
		got += int64(r)
		if err != nil {
			if err == io.EOF && n < 0 {
				return got, nil
			}
			return got, err
		}
	}
	return got, nil
}

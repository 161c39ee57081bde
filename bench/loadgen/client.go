package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

func runClient(mode string, args []string) error {
	fs := flag.NewFlagSet(mode, flag.ExitOnError)
	mkDialer := addDialFlags(fs)
	streams := fs.Int("streams", 1, "bulk/hol: parallel streams")
	direction := fs.String("direction", "up", "bulk/hol: up (client -> target) or down (target -> client)")
	duration := fs.Duration("duration", 5*time.Second, "bulk/rr/hol: how long to move data / send requests")
	totalBytes := fs.Int64("bytes", 0, "bulk: total bytes over all streams instead of --duration")
	chunk := fs.Int("chunk", 64<<10, "bulk/hol: write size (one sink record) in bytes")
	count := fs.Int("count", 100, "connect: streams to open one after another; idle: streams to hold")
	maxTime := fs.Duration("max-time", 60*time.Second, "connect/idle: give up after this long; churn: stop then")
	rate := fs.Float64("rate", 1000, "rr: requests per second (open loop)")
	conns := fs.Int("conns", 16, "rr: connections the requests are spread over")
	size := fs.Int("size", 1024, "rr: request and response size in bytes")
	parallel := fs.Int("parallel", 64, "idle/probe: dials in flight at once")
	hold := fs.Duration("hold", 5*time.Second, "idle: how long to hold the streams open after all are up")
	rounds := fs.Int("rounds", 2, "hol: alone/stalled pairs, alternated")
	settle := fs.Duration("settle", time.Second, "hol: time for the stalled stream to fill buffers before measuring")
	targets := fs.String("targets", "", "probe: file with one CONNECT authority per line, optionally TAB and a header 'K: V'")
	timeout := fs.Duration("timeout", 60*time.Second, "probe: give up after this long")
	workers := fs.Int("workers", 4, "churn: goroutines opening streams one after another")
	gap := fs.Duration("gap", 20*time.Millisecond, "churn: pause between a worker's streams")
	_ = fs.Parse(args)

	d, err := mkDialer()
	if err != nil {
		return err
	}
	if d.Target == "" && mode != "probe" {
		return errors.New("--target is required")
	}
	params := map[string]any{"target": d.Target, "proxy": d.Proxy, "headers": d.Headers}
	start := sampleCPU()
	var res map[string]any
	switch mode {
	case "bulk":
		params["streams"], params["direction"], params["duration_s"], params["bytes"], params["chunk"] =
			*streams, *direction, duration.Seconds(), *totalBytes, *chunk
		res = runBulk(d, *streams, *direction, *duration, *totalBytes, *chunk, 15*time.Second)
	case "connect":
		params["count"] = *count
		res = runConnect(d, *count, *maxTime)
	case "rr":
		params["rate"], params["conns"], params["size"], params["duration_s"] = *rate, *conns, *size, duration.Seconds()
		res = runRR(d, *rate, *conns, *size, *duration)
	case "idle":
		params["count"], params["parallel"], params["hold_s"] = *count, *parallel, hold.Seconds()
		res = runIdle(d, *count, *parallel, *hold, *maxTime)
	case "hol":
		params["streams"], params["direction"], params["duration_s"], params["rounds"] = *streams, *direction, duration.Seconds(), *rounds
		res = runHOL(d, *streams, *direction, *duration, *settle, *chunk, *rounds)
	case "churn":
		params["workers"], params["gap_ms"], params["max_time_s"] = *workers, ms(*gap), maxTime.Seconds()
		res = runChurn(d, *workers, *gap, *maxTime)
	case "probe":
		params["targets"], params["parallel"] = *targets, *parallel
		res, err = runProbe(d, *targets, *parallel, *timeout)
		if err != nil {
			return err
		}
	}
	emit(mode, params, res, start)
	return nil
}

// ---------------------------------------------------------------- bulk

type streamResult struct {
	bytes   int64
	elapsed time.Duration
	err     error
}

// runBulk moves data on n parallel streams. Up: the client writes sink records until the deadline
// (or its share of totalBytes), then asks the target how many bytes arrived; the stream's time ends
// when that answer arrives, so bytes still in proxy buffers are not counted as moved. Down: the
// target sends, the client counts what it read until the deadline (or its share of totalBytes).
func runBulk(d *Dialer, n int, dir string, dur time.Duration, totalBytes int64, chunk int, grace time.Duration) map[string]any {
	conns, dialErrs := dialStreams(d, n)
	return moveStreams(conns, &dialErrs, dir, dur, totalBytes, chunk, grace)
}

// dialStreams opens n streams in parallel; failed ones are nil.
func dialStreams(d *Dialer, n int) ([]net.Conn, errorBag) {
	if n < 1 {
		n = 1
	}
	conns := make([]net.Conn, n)
	var dialErrs errorBag
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c, _, err := d.Dial()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				dialErrs.add(err)
				return
			}
			conns[i] = c
		}(i)
	}
	wg.Wait()
	return conns, dialErrs
}

// moveStreams runs the bulk transfer on already open streams and closes them.
func moveStreams(conns []net.Conn, dialErrs *errorBag, dir string, dur time.Duration, totalBytes int64, chunk int, grace time.Duration) map[string]any {
	n := len(conns)
	perStream := int64(0)
	if totalBytes > 0 {
		perStream = totalBytes / int64(n)
	}
	var wg sync.WaitGroup
	results := make([]streamResult, n)
	start := time.Now()
	deadline := start.Add(dur)
	for i := 0; i < n; i++ {
		if conns[i] == nil {
			results[i].err = errors.New("not connected")
			continue
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := conns[i]
			defer c.Close()
			// Watchdog: a stalled path must not hang the run.
			hard := time.AfterFunc(time.Until(deadline)+grace, func() { c.Close() })
			defer hard.Stop()
			if dir == "down" {
				results[i] = bulkDown(c, start, deadline, perStream)
			} else {
				results[i] = bulkUp(c, start, deadline, perStream, chunk)
			}
		}(i)
	}
	wg.Wait()

	var total int64
	var longest time.Duration
	var errs errorBag
	errs.merge(dialErrs)
	perStreamMbit := make([]float64, 0, n)
	for _, r := range results {
		if r.err != nil && r.err.Error() != "not connected" {
			errs.add(r.err)
		}
		total += r.bytes
		if r.elapsed > longest {
			longest = r.elapsed
		}
		perStreamMbit = append(perStreamMbit, mbit(r.bytes, r.elapsed))
	}
	return map[string]any{
		"bytes":             total,
		"elapsed_s":         round(longest.Seconds(), 3),
		"mbit_s":            mbit(total, longest),
		"per_stream_mbit_s": perStreamMbit,
		"streams_ok":        n - errs.count,
		"errors":            errs.json(),
	}
}

func bulkUp(c net.Conn, start, deadline time.Time, limit int64, chunk int) streamResult {
	if chunk < 1024 {
		chunk = 1024
	}
	buf := make([]byte, 4+chunk)
	for i := 4; i < len(buf); i++ {
		buf[i] = byte(i)
	}
	if _, err := c.Write([]byte{svcSink}); err != nil {
		return streamResult{err: err}
	}
	var sent int64
	for (limit == 0 && time.Now().Before(deadline)) || (limit > 0 && sent < limit) {
		n := int64(chunk)
		if limit > 0 && limit-sent < n {
			n = limit - sent
		}
		binary.BigEndian.PutUint32(buf[:4], uint32(n))
		if _, err := c.Write(buf[:4+n]); err != nil {
			return streamResult{bytes: 0, elapsed: time.Since(start), err: fmt.Errorf("write: %w", err)}
		}
		sent += n
	}
	if _, err := c.Write([]byte{0, 0, 0, 0}); err != nil {
		return streamResult{elapsed: time.Since(start), err: err}
	}
	var ack [8]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		return streamResult{elapsed: time.Since(start), err: fmt.Errorf("waiting for sink count: %w", err)}
	}
	got := int64(binary.BigEndian.Uint64(ack[:]))
	var err error
	if got != sent {
		err = fmt.Errorf("sink counted %d bytes, sent %d", got, sent)
	}
	return streamResult{bytes: got, elapsed: time.Since(start), err: err}
}

func bulkDown(c net.Conn, start, deadline time.Time, limit int64) streamResult {
	var hdr [9]byte
	hdr[0] = svcSource
	binary.BigEndian.PutUint64(hdr[1:], uint64(limit))
	if _, err := c.Write(hdr[:]); err != nil {
		return streamResult{err: err}
	}
	if limit == 0 {
		_ = c.SetReadDeadline(deadline)
	}
	buf := make([]byte, 256<<10)
	var got int64
	for limit == 0 || got < limit {
		n, err := c.Read(buf)
		got += int64(n)
		if err != nil {
			var ne net.Error
			if limit == 0 && errors.As(err, &ne) && ne.Timeout() {
				return streamResult{bytes: got, elapsed: deadline.Sub(start)}
			}
			return streamResult{bytes: got, elapsed: time.Since(start), err: fmt.Errorf("read: %w", err)}
		}
	}
	return streamResult{bytes: got, elapsed: time.Since(start)}
}

// ---------------------------------------------------------------- connect

// runConnect opens count streams one after another. For each: time to the proxy's 200 (or TCP
// connect when direct), then one byte to the echo service and the time until it comes back.
func runConnect(d *Dialer, count int, maxTime time.Duration) map[string]any {
	var firstByte, connected, tlsDone []time.Duration
	var errs errorBag
	stop := time.Now().Add(maxTime)
	buf := make([]byte, 1)
	for i := 0; i < count && time.Now().Before(stop); i++ {
		t0 := time.Now()
		c, tm, err := d.Dial()
		if err != nil {
			errs.add(err)
			continue
		}
		_ = c.SetDeadline(time.Now().Add(d.DialTimeout))
		if _, err := c.Write([]byte{svcEcho, 'x'}); err != nil {
			errs.add(err)
			c.Close()
			continue
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			errs.add(err)
			c.Close()
			continue
		}
		firstByte = append(firstByte, time.Since(t0))
		connected = append(connected, tm.Connected)
		tlsDone = append(tlsDone, tm.TLS)
		c.Close()
	}
	return map[string]any{
		"first_byte":    latencySummary(firstByte),
		"connect_200":   latencySummary(connected),
		"tls_handshake": latencySummary(tlsDone),
		"ok":            len(firstByte),
		"errors":        errs.json(),
	}
}

// ---------------------------------------------------------------- rr

// runRR sends size-byte requests at a fixed rate (open loop: the schedule does not wait for
// answers) over conns echo streams. Latency counts from the moment the request is released by the
// schedule, so queueing behind a slow answer is included (no coordinated omission); "service"
// counts from the write on the stream.
func runRR(d *Dialer, rate float64, nconns, size int, dur time.Duration) map[string]any {
	var errs errorBag
	conns := make([]net.Conn, 0, nconns)
	for i := 0; i < nconns; i++ {
		c, _, err := d.Dial()
		if err != nil {
			errs.add(err)
			continue
		}
		if _, err := c.Write([]byte{svcEcho}); err != nil {
			errs.add(err)
			c.Close()
			continue
		}
		conns = append(conns, c)
	}
	total := int(rate * dur.Seconds())
	sched := make(chan time.Time, total+1)
	var mu sync.Mutex
	var lat, svc []time.Duration
	var done atomic.Int64
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Add(1)
		go func(c net.Conn) {
			defer wg.Done()
			req := make([]byte, size)
			resp := make([]byte, size)
			var myLat, mySvc []time.Duration
			var myErrs errorBag
			for t := range sched {
				w := time.Now()
				if _, err := c.Write(req); err != nil {
					myErrs.add(err)
					break
				}
				if _, err := io.ReadFull(c, resp); err != nil {
					myErrs.add(err)
					break
				}
				now := time.Now()
				myLat = append(myLat, now.Sub(t))
				mySvc = append(mySvc, now.Sub(w))
				done.Add(1)
			}
			mu.Lock()
			lat = append(lat, myLat...)
			svc = append(svc, mySvc...)
			errs.merge(&myErrs)
			mu.Unlock()
		}(c)
	}
	start := time.Now()
	interval := time.Duration(float64(time.Second) / rate)
	if len(conns) > 0 {
		for i := 0; i < total; i++ {
			at := start.Add(time.Duration(i) * interval)
			if wait := time.Until(at); wait > 0 {
				time.Sleep(wait)
			}
			// The release time, not the nominal one: Go's sleep overshoots by up to ~1 ms (epoll
			// timeout granularity) and that lag is the scheduler's, not the system's. Late
			// releases are followed by catch-up bursts, so the average rate holds.
			sched <- time.Now()
		}
	}
	close(sched)
	// Bound the drain: whatever is not answered 10 s after the schedule ends is dropped.
	drained := make(chan struct{})
	go func() { wg.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(10 * time.Second):
		for _, c := range conns {
			c.Close()
		}
		<-drained
	}
	elapsed := time.Since(start)
	for _, c := range conns {
		c.Close()
	}
	completed := done.Load()
	return map[string]any{
		"scheduled":    total,
		"completed":    completed,
		"achieved_rps": round(float64(completed)/elapsed.Seconds(), 1),
		"latency":      latencySummary(lat),
		"service":      latencySummary(svc),
		"conns_ok":     len(conns),
		"errors":       errs.json(),
	}
}

// ---------------------------------------------------------------- idle

func ping(c net.Conn, timeout time.Duration) error {
	_ = c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write([]byte{'p'}); err != nil {
		return err
	}
	var b [1]byte
	_, err := io.ReadFull(c, b[:])
	return err
}

// runIdle opens count echo streams (parallel dials at a time), checks each with a one-byte echo,
// says "ready" on stderr, holds them for hold, then checks every one again.
func runIdle(d *Dialer, count, parallel int, hold, maxTime time.Duration) map[string]any {
	var mu sync.Mutex
	var errs errorBag
	conns := make([]net.Conn, 0, count)
	var dialTimes []time.Duration
	start := time.Now()
	stop := start.Add(maxTime)
	jobs := make(chan int)
	var wg sync.WaitGroup
	for w := 0; w < parallel; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range jobs {
				if time.Now().After(stop) {
					mu.Lock()
					errs.add(errors.New("max-time reached before dialing"))
					mu.Unlock()
					continue
				}
				t0 := time.Now()
				c, _, err := d.Dial()
				if err == nil {
					if _, err = c.Write([]byte{svcEcho}); err == nil {
						err = ping(c, d.DialTimeout)
					}
					if err != nil {
						c.Close()
					}
				}
				mu.Lock()
				if err != nil {
					errs.add(err)
				} else {
					conns = append(conns, c)
					dialTimes = append(dialTimes, time.Since(t0))
				}
				mu.Unlock()
			}
		}()
	}
	for i := 0; i < count; i++ {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	openTime := time.Since(start)
	established := len(conns)
	event("ready", map[string]any{"established": established, "open_s": round(openTime.Seconds(), 3)})
	time.Sleep(hold)

	var alive atomic.Int64
	var aliveErrs errorBag
	idx := make(chan net.Conn)
	for w := 0; w < parallel; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := range idx {
				if err := ping(c, 10*time.Second); err != nil {
					mu.Lock()
					aliveErrs.add(err)
					mu.Unlock()
				} else {
					alive.Add(1)
				}
			}
		}()
	}
	for _, c := range conns {
		idx <- c
	}
	close(idx)
	wg.Wait()
	for _, c := range conns {
		c.Close()
	}
	return map[string]any{
		"requested":    count,
		"established":  established,
		"alive":        alive.Load(),
		"open_s":       round(openTime.Seconds(), 3),
		"open_per_s":   round(float64(established)/openTime.Seconds(), 1),
		"dial":         latencySummary(dialTimes),
		"errors":       errs.json(),
		"alive_errors": aliveErrs.json(),
	}
}

// ---------------------------------------------------------------- hol

// runHOL measures head-of-line blocking: the throughput of `streams` moving streams alone, then
// again while one more stream on the same path is stalled (down: the client does not read it; up:
// the target does not read it). Ratio = stalled / alone; 1.0 means no interference.
func runHOL(d *Dialer, streams int, dir string, dur, settle time.Duration, chunk, rounds int) map[string]any {
	// Rounds alternate alone / with a stall (A B A B ...), so slow drifts of the machine's load
	// hit both sides alike; the ratio is of the summed throughputs.
	var sumA, sumB float64
	out := map[string]any{}
	var roundsOut []map[string]any
	allNew := true
	for r := 0; r < max(rounds, 1); r++ {
		res, stallEnd := holRound(d, streams, dir, dur, settle, chunk)
		roundsOut = append(roundsOut, res)
		// A path that the stall blocked may stay blocked until the target reads again: let
		// the stall run out before the next round, so rounds do not contaminate each other.
		if ok, _ := res["new_stream_during_stall"].(map[string]any)["ok"].(bool); !ok && r+1 < rounds {
			time.Sleep(time.Until(stallEnd) + time.Second)
		}
		if e, ok := res["error"]; ok {
			out["error"] = e
			break
		}
		a, _ := res["alone"].(map[string]any)["mbit_s"].(float64)
		b, _ := res["with_stalled"].(map[string]any)["mbit_s"].(float64)
		sumA += a
		sumB += b
		if ok, _ := res["new_stream_during_stall"].(map[string]any)["ok"].(bool); !ok {
			allNew = false
		}
	}
	n := float64(len(roundsOut))
	out["rounds"] = roundsOut
	out["alone_mbit_s"] = round(sumA/n, 2)
	out["with_stalled_mbit_s"] = round(sumB/n, 2)
	out["new_stream_ok"] = allNew
	out["ratio"] = 0.0
	if sumA > 0 {
		out["ratio"] = round(sumB/sumA, 3)
	}
	return out
}

// holRound is one alone / with-stall pair. It returns when the target-side stall (up) ends.
func holRound(d *Dialer, streams int, dir string, dur, settle time.Duration, chunk int) (map[string]any, time.Time) {
	alone := runBulk(d, streams, dir, dur, 0, chunk, 5*time.Second)

	// The moving streams are opened before the stall, so what is measured is their data
	// movement; whether a new stream can be opened during the stall is measured separately.
	moving, dialErrs := dialStreams(d, streams)
	stalled, _, err := d.Dial()
	if err != nil {
		for _, c := range moving {
			if c != nil {
				c.Close()
			}
		}
		return map[string]any{"alone": alone, "error": "stalled stream: " + err.Error()}, time.Now()
	}
	// The target stops reading for the whole measured phase: settle, the moving streams (with
	// their 5 s watchdog) and the 3 s new-stream probe.
	stallFor := settle + dur + 9*time.Second
	stallEnd := time.Now().Add(stallFor)
	var stallWriter sync.WaitGroup
	if dir == "down" {
		var hdr [9]byte
		hdr[0] = svcSource // N = 0: the target sends until we go away; we never read
		_, err = stalled.Write(hdr[:])
	} else {
		var hdr [5]byte
		hdr[0] = svcStall
		binary.BigEndian.PutUint32(hdr[1:], uint32(stallFor.Milliseconds()))
		_, err = stalled.Write(hdr[:])
		stallWriter.Add(1)
		go func() {
			defer stallWriter.Done()
			buf := make([]byte, chunk)
			for {
				if _, err := stalled.Write(buf); err != nil {
					return
				}
			}
		}()
	}
	if err != nil {
		stalled.Close()
		return map[string]any{"alone": alone, "error": "stalled stream: " + err.Error()}, stallEnd
	}
	time.Sleep(settle)
	withStall := moveStreams(moving, &dialErrs, dir, dur, 0, chunk, 5*time.Second)

	// Can a new stream be opened and used while the stall lasts?
	newStream := map[string]any{"ok": false}
	probe := *d
	probe.DialTimeout = 3 * time.Second
	t0 := time.Now()
	if c, _, err := probe.Dial(); err != nil {
		newStream["error"] = err.Error()
	} else {
		if _, err = c.Write([]byte{svcEcho}); err == nil {
			err = ping(c, 3*time.Second)
		}
		c.Close()
		if err != nil {
			newStream["error"] = err.Error()
		} else {
			newStream["ok"] = true
			newStream["ms"] = ms(time.Since(t0))
		}
	}
	stalled.Close()
	stallWriter.Wait()

	a, _ := alone["mbit_s"].(float64)
	b, _ := withStall["mbit_s"].(float64)
	ratio := 0.0
	if a > 0 {
		ratio = round(b/a, 3)
	}
	return map[string]any{"alone": alone, "with_stalled": withStall, "ratio": ratio, "new_stream_during_stall": newStream}, stallEnd
}

// ---------------------------------------------------------------- probe

type probeTarget struct {
	authority string
	headers   []string
}

// runProbe dials every listed target (authority + optional header) until each has answered a
// one-byte echo once; used by the fan-in workload to see when all agents are routable.
func runProbe(d *Dialer, file string, parallel int, timeout time.Duration) (map[string]any, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	var targets []probeTarget
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		parts := strings.Split(line, "\t")
		targets = append(targets, probeTarget{authority: parts[0], headers: parts[1:]})
	}
	f.Close()

	start := time.Now()
	stop := start.Add(timeout)
	okAt := make([]time.Duration, len(targets))
	attempts := make([]int, len(targets))
	var errs errorBag
	var mu sync.Mutex
	pending := make(chan int, len(targets))
	for i := range targets {
		pending <- i
	}
	var remaining atomic.Int64
	remaining.Store(int64(len(targets)))
	var wg sync.WaitGroup
	for w := 0; w < parallel; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for remaining.Load() > 0 && time.Now().Before(stop) {
				var i int
				select {
				case i = <-pending:
				case <-time.After(50 * time.Millisecond):
					continue
				}
				t := targets[i]
				attempts[i]++
				c, _, err := d.DialTo(t.authority, t.headers)
				if err == nil {
					if _, err = c.Write([]byte{svcEcho}); err == nil {
						err = ping(c, 5*time.Second)
					}
					c.Close()
				}
				if err != nil {
					mu.Lock()
					errs.add(fmt.Errorf("%s: %w", t.authority, err))
					mu.Unlock()
					time.Sleep(100 * time.Millisecond)
					pending <- i
					continue
				}
				okAt[i] = time.Since(start)
				remaining.Add(-1)
			}
		}()
	}
	wg.Wait()
	var oks []time.Duration
	for _, v := range okAt {
		if v > 0 {
			oks = append(oks, v)
		}
	}
	var all time.Duration
	for _, v := range oks {
		if v > all {
			all = v
		}
	}
	return map[string]any{
		"targets":     len(targets),
		"ok":          len(oks),
		"time_all_s":  round(all.Seconds(), 3),
		"ok_times":    latencySummary(oks),
		"elapsed_s":   round(time.Since(start).Seconds(), 3),
		"failed_dial": errs.json(),
	}, nil
}

package main

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// churnAttempt is one new stream: when it began and ended (microseconds after the run's t0) and
// how it went (an index into the run's error messages, or -1 when it succeeded).
type churnAttempt struct {
	start, end int64
	errIndex   int
}

// churnErrors keeps the distinct error messages of a run (a failover produces few kinds, many times).
type churnErrors struct {
	mu       sync.Mutex
	messages []string
	index    map[string]int
}

const maxChurnMessages = 200

func (e *churnErrors) indexOf(err error) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	msg := err.Error()
	if i, ok := e.index[msg]; ok {
		return i
	}
	if len(e.messages) >= maxChurnMessages {
		msg = "(more distinct errors than kept)"
		if i, ok := e.index[msg]; ok {
			return i
		}
	}
	e.index[msg] = len(e.messages)
	e.messages = append(e.messages, msg)
	return e.index[msg]
}

// churnOnce opens one stream, has 16 random bytes echoed and closes it. Any failure (dial, CONNECT
// refused, a cut before the echo came back, wrong bytes) fails the attempt.
func churnOnce(d *Dialer, timeout time.Duration) error {
	c, _, err := d.Dial()
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	msg := make([]byte, 17)
	msg[0] = svcEcho
	_, _ = rand.Read(msg[1:])
	if _, err := c.Write(msg); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got := make([]byte, 16)
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("echo: %w", err)
	}
	if !bytes.Equal(got, msg[1:]) {
		return fmt.Errorf("echo: wrong bytes")
	}
	return nil
}

// runChurn opens new streams continuously on `workers` goroutines, each one stream after another
// with `gap` between them, until stdin is closed (the harness says stop) or maxTime passes. Every
// attempt is reported with its start and end relative to t0_unix_ns, a wall-clock time the harness
// can compare with its own (for example the moment it killed a proxy replica). It says "ready" on
// stderr after the first stream that succeeded.
func runChurn(d *Dialer, workers int, gap, maxTime time.Duration) map[string]any {
	if workers < 1 {
		workers = 1
	}
	t0 := time.Now()
	stop := make(chan struct{})
	var stopOnce sync.Once
	halt := func() { stopOnce.Do(func() { close(stop) }) }
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		halt()
	}()
	limit := time.AfterFunc(maxTime, halt)
	defer limit.Stop()

	errs := &churnErrors{messages: []string{}, index: map[string]int{}}
	var mu sync.Mutex
	var attempts []churnAttempt
	var readyOnce sync.Once
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []churnAttempt
			for {
				select {
				case <-stop:
					mu.Lock()
					attempts = append(attempts, mine...)
					mu.Unlock()
					return
				default:
				}
				begun := time.Now()
				err := churnOnce(d, d.DialTimeout)
				a := churnAttempt{start: begun.Sub(t0).Microseconds(), end: time.Since(t0).Microseconds(), errIndex: -1}
				if err != nil {
					a.errIndex = errs.indexOf(err)
				} else {
					readyOnce.Do(func() { event("ready", nil) })
				}
				mine = append(mine, a)
				select {
				case <-stop:
				case <-time.After(gap):
				}
			}
		}()
	}
	wg.Wait()
	rows := make([][3]int64, len(attempts))
	ok := 0
	for i, a := range attempts {
		rows[i] = [3]int64{a.start, a.end, int64(a.errIndex)}
		if a.errIndex < 0 {
			ok++
		}
	}
	return map[string]any{
		"t0_unix_ns": t0.UnixNano(),
		"attempts":   rows,
		"ok":         ok,
		"failed":     len(attempts) - ok,
		"errors":     errs.messages,
		"elapsed_s":  round(time.Since(t0).Seconds(), 3),
	}
}

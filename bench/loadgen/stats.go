package main

import (
	"math"
	"sort"
	"time"
)

func round(v float64, digits int) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0
	}
	p := math.Pow(10, float64(digits))
	return math.Round(v*p) / p
}

func ms(d time.Duration) float64 { return round(float64(d)/float64(time.Millisecond), 3) }

// latencySummary gives count, mean and percentiles (nearest-rank) in milliseconds.
func latencySummary(samples []time.Duration) map[string]any {
	out := map[string]any{"count": len(samples)}
	if len(samples) == 0 {
		return out
	}
	s := append([]time.Duration(nil), samples...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	var sum time.Duration
	for _, v := range s {
		sum += v
	}
	pct := func(p float64) float64 {
		idx := int(math.Ceil(p/100*float64(len(s)))) - 1
		if idx < 0 {
			idx = 0
		}
		if idx >= len(s) {
			idx = len(s) - 1
		}
		return ms(s[idx])
	}
	out["mean_ms"] = ms(sum / time.Duration(len(s)))
	out["min_ms"] = ms(s[0])
	out["p50_ms"] = pct(50)
	out["p90_ms"] = pct(90)
	out["p99_ms"] = pct(99)
	out["p999_ms"] = pct(99.9)
	out["max_ms"] = ms(s[len(s)-1])
	return out
}

func mbit(bytes int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return round(float64(bytes)*8/1e6/d.Seconds(), 2)
}

// errorBag counts errors and keeps the first few messages.
type errorBag struct {
	count int
	first []string
}

func (e *errorBag) add(err error) {
	e.count++
	if len(e.first) < 5 {
		e.first = append(e.first, err.Error())
	}
}

func (e *errorBag) merge(o *errorBag) {
	e.count += o.count
	for _, m := range o.first {
		if len(e.first) < 5 {
			e.first = append(e.first, m)
		}
	}
}

func (e *errorBag) json() map[string]any {
	first := e.first
	if first == nil {
		first = []string{}
	}
	return map[string]any{"count": e.count, "first": first}
}

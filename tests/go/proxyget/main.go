// proxyget fetches one URL through an HTTPS forward proxy with Go's net/http, the way client-go and
// every Go program with an https:// proxy URL does (ALPN h2 offered to the proxy, HTTP/1.1 CONNECT
// spoken on it), and prints a JSON line: status, bytes received and their sha256.
package main

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"time"
)

type result struct {
	Status int    `json:"status"`
	Bytes  int64  `json:"bytes"`
	SHA256 string `json:"sha256"`
	Proto  string `json:"proto"`
}

func main() {
	proxy := flag.String("proxy", "", "proxy URL, e.g. https://cluster1@127.0.0.1:8090")
	target := flag.String("url", "", "URL to fetch")
	caFile := flag.String("ca", "", "PEM bundle that verifies both the proxy and the target")
	certFile := flag.String("cert", "", "client certificate (presented to the proxy and the target)")
	keyFile := flag.String("key", "", "client key")
	timeout := flag.Duration("timeout", 60*time.Second, "whole request timeout")
	flag.Parse()
	if err := run(*proxy, *target, *caFile, *certFile, *keyFile, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "proxyget:", err)
		os.Exit(1)
	}
}

func run(proxy, target, caFile, certFile, keyFile string, timeout time.Duration) error {
	proxyURL, err := url.Parse(proxy)
	if err != nil {
		return fmt.Errorf("bad -proxy: %w", err)
	}
	pool := x509.NewCertPool()
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return err
	}
	if !pool.AppendCertsFromPEM(pem) {
		return fmt.Errorf("no certificate in %s", caFile)
	}
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return err
	}
	transport := &http.Transport{
		Proxy:             http.ProxyURL(proxyURL),
		TLSClientConfig:   &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{pair}},
		ForceAttemptHTTP2: true, // as client-go does: h2 is offered in every TLS handshake
	}
	client := &http.Client{Transport: transport, Timeout: timeout}
	response, err := client.Get(target)
	if err != nil {
		return err
	}
	defer response.Body.Close()
	digest := sha256.New()
	n, err := io.Copy(digest, response.Body)
	if err != nil {
		return fmt.Errorf("after %d bytes: %w", n, err)
	}
	return json.NewEncoder(os.Stdout).Encode(result{
		Status: response.StatusCode, Bytes: n, SHA256: hex.EncodeToString(digest.Sum(nil)), Proto: response.Proto,
	})
}

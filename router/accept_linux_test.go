//go:build linux

package router

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// childEnv, when set, makes TestAcceptErrorsChild run a router in this
// process under a low open-file limit; its value is the fleet, as
// "id=role=url,…".
const childEnv = "NARWHAL_TEST_ACCEPT_CHILD"

// TestAcceptErrorsKeepServingRAPI7 proves that running out of file
// descriptors never ends the router (R-API-7): a router in a child process
// with a low RLIMIT_NOFILE gets more connections than it has descriptors;
// it keeps running, logs the accept errors, counts them in
// narwhal_accept_errors_total, and serves again once the connections
// close.
func TestAcceptErrorsKeepServingRAPI7(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		t.Skip("in the child")
	}
	s := newStack(t, pd(), nil) // the engines, in this process
	var fleet []string
	for _, e := range s.cfg.Fleet {
		fleet = append(fleet, e.ID+"="+string(e.Role)+"="+e.URL)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestAcceptErrorsChild$", "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"="+strings.Join(fleet, ","))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr syncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	addrCh := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "LISTEN "); ok {
				addrCh <- a
			}
		}
		exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		stdin.Close()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
		}
	})
	var addr string
	select {
	case addr = <-addrCh:
	case err := <-exited:
		t.Fatalf("child exited before listening: %v\n%s", err, stderr.String())
	case <-time.After(20 * time.Second):
		t.Fatalf("child not listening\n%s", stderr.String())
	}

	// More connections than the child has descriptors: the kernel queues
	// them, the child's accept fails with EMFILE.
	var conns []net.Conn
	for i := 0; i < 80; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	testkit.WaitFor(t, 5*time.Second, "the accept error in the child's log", func() bool {
		return strings.Contains(stderr.String(), "accepting client connections failed")
	})
	select {
	case err := <-exited:
		t.Fatalf("the router exited on accept errors: %v\n%s", err, stderr.String())
	default:
	}
	for _, c := range conns {
		c.Close()
	}

	// Served again: a completion and the metrics, on new connections.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
	testkit.WaitFor(t, 10*time.Second, "the child serving again", func() bool {
		resp, err := client.Post("http://"+addr+schemas.EndpointChat, "application/json", strings.NewReader(doorChat))
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	n := testkit.ScrapedSum(t, client, "http://"+addr+"/metrics", "narwhal_accept_errors_total")
	if n < 1 {
		t.Fatalf("narwhal_accept_errors_total = %v after EMFILE", n)
	}
	logLines := strings.Count(stderr.String(), "accepting client connections failed")
	t.Logf("%v accept errors counted, %d log lines (at most one a second)", n, logLines)
	if float64(logLines) > n {
		t.Errorf("%d log lines for %v errors", logLines, n)
	}
}

// TestAcceptErrorsChild is the child of TestAcceptErrorsKeepServingRAPI7:
// a router over the parent's engines under a low open-file limit, until
// its stdin closes.
func TestAcceptErrorsChild(t *testing.T) {
	spec := os.Getenv(childEnv)
	if spec == "" {
		t.Skip("run by TestAcceptErrorsKeepServingRAPI7")
	}
	cfg := config.Default()
	cfg.Router.ID = "rt-child"
	for _, e := range strings.Split(spec, ",") {
		p := strings.SplitN(e, "=", 3)
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: p[0], Role: connector.Role(p[1]), URL: p[2], Connector: "nixl"})
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	rt, err := New(Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)), ShutdownGrace: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rt.Serve(ln) }()
	// Room for the engine connections and a few clients, no more.
	limit := uint64(openFDs() + 24)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: limit, Max: limit}); err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString("LISTEN " + ln.Addr().String() + "\n")
	_, _ = io.Copy(io.Discard, os.Stdin)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := rt.Shutdown(ctx); err != nil {
		t.Error(err)
	}
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
}

//go:build linux

package router

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

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
	ch := startChild(t, "TestAcceptErrorsChild", childEnv+"="+fleetSpec(s.cfg))
	addr := ch.line(t, "LISTEN ")

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
		return strings.Contains(ch.stderr.String(), "accepting client connections failed")
	})
	select {
	case err := <-ch.exited:
		t.Fatalf("the router exited on accept errors: %v\n%s", err, ch.stderr.String())
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
	logLines := strings.Count(ch.stderr.String(), "accepting client connections failed")
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
	cfg := childConfig(t, spec, nil)
	rt, err := New(Options{Config: cfg, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)), ShutdownGrace: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	addr, stop := serveChild(t, rt)
	// Room for the engine connections and a few clients, no more.
	limit := uint64(openFDs() + 24)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: limit, Max: limit}); err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString("LISTEN " + addr + "\n")
	_, _ = io.Copy(io.Discard, os.Stdin)
	stop()
}

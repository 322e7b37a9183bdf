//go:build linux

package router

import (
	"bufio"
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// The tests that need a process of their own (a lowered RLIMIT_NOFILE
// would starve the rest of the test binary) re-run this test binary as a
// child: the parent starts it with startChild, hands it the fleet of its
// engines as fleetSpec's value, and reads its stdout lines; the child
// builds its router with childConfig and serves it with serveChild.

// child is a test binary re-run as a child process, talking over stdin
// and stdout.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *syncBuffer
	mu     sync.Mutex
	lines  []string
	exited chan error
}

// startChild runs this test binary's test run under env, collecting its
// stdout lines.
func startChild(t *testing.T, run string, env ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+run+"$", "-test.v")
	cmd.Env = append(os.Environ(), env...)
	c := &child{cmd: cmd, stderr: &syncBuffer{}, exited: make(chan error, 1)}
	var err error
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = c.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.mu.Lock()
			c.lines = append(c.lines, sc.Text())
			c.mu.Unlock()
		}
		c.exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		c.stdin.Close()
		select {
		case <-c.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
		}
	})
	return c
}

// line waits for the child's first stdout line starting with prefix and
// returns the rest.
func (c *child) line(t *testing.T, prefix string) string {
	t.Helper()
	var rest string
	testkit.WaitFor(t, 20*time.Second, "the child's "+prefix+"line", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, l := range c.lines {
			if r, ok := strings.CutPrefix(l, prefix); ok {
				rest = r
				return true
			}
		}
		select {
		case err := <-c.exited:
			t.Fatalf("child exited: %v\n%s", err, c.stderr.String())
		default:
		}
		return false
	})
	return rest
}

// count is how many stdout lines start with prefix.
func (c *child) count(prefix string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, l := range c.lines {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}

// fleetSpec is cfg's fleet as a child's environment value,
// "id=role=url,…" (read back by childConfig).
func fleetSpec(cfg *config.Config) string {
	var fleet []string
	for _, e := range cfg.Fleet {
		fleet = append(fleet, e.ID+"="+string(e.Role)+"="+e.URL)
	}
	return strings.Join(fleet, ",")
}

// childConfig is the validated config of a child's router "rt-child" over
// the fleet spec (fleetSpec's value); tune, if not nil, changes it before
// it is validated.
func childConfig(t *testing.T, spec string, tune func(*config.Config)) *config.Config {
	t.Helper()
	cfg := config.Default()
	cfg.Router.ID = "rt-child"
	for _, e := range strings.Split(spec, ",") {
		p := strings.SplitN(e, "=", 3)
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: p[0], Role: connector.Role(p[1]), URL: p[2], Connector: "nixl"})
	}
	if tune != nil {
		tune(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return &cfg
}

// serveChild serves rt on a loopback port and returns its address; stop
// shuts rt down (within 5 s) and fails the test if Shutdown or Serve
// returned an error.
func serveChild(t *testing.T, rt *Router) (addr string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rt.Serve(ln) }()
	return ln.Addr().String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := rt.Shutdown(ctx); err != nil {
			t.Error(err)
		}
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}
}

package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// narwhalBin is the narwhal binary TestMain builds for the whole package.
var narwhalBin string

// Bounds of the process harness. They are generous next to what the
// processes need (tens of milliseconds) so that a loaded machine does not
// fail the suite, and short enough that a hung process fails it quickly.
const (
	// readyBound bounds the wait for a process's HTTP endpoint.
	readyBound = 10 * time.Second
	// stopBound bounds the wait for a process to exit after its signal;
	// it is then killed.
	stopBound = 10 * time.Second
	// pollInterval is the interval of every bounded poll.
	pollInterval = 10 * time.Millisecond
)

// TestMain builds the narwhal binary once (without the race detector: the
// in-process tests of the other packages cover races; this keeps the
// children fast), runs the tests, removes the binary and checks that no
// test left a goroutine behind.
func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "narwhal-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: temp dir:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	narwhalBin = filepath.Join(dir, "narwhal")
	build := exec.Command("go", "build", "-o", narwhalBin, "github.com/narwhalmesh/narwhal/cmd/narwhal")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: go build ./cmd/narwhal: %v\n%s", err, out)
		return 1
	}
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(testkit.NATSLongLived()...); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: goroutines left behind:", err)
			return 1
		}
	}
	return code
}

// process is one running narwhal child process with its output captured.
type process struct {
	name   string
	cmd    *exec.Cmd
	stdout testkit.LockedBuffer
	stderr testkit.LockedBuffer

	done    chan struct{} // closed when the process has exited
	waitErr error         // cmd.Wait's result, valid once done is closed

	stopOnce sync.Once
	crashed  atomic.Bool // ended on purpose with SIGKILL (see crash)
}

// childEnv is the test process's environment without NARWHAL_* variables
// (so the developer's shell cannot change what the tests run), plus extra.
func childEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "NARWHAL_") {
			env = append(env, kv)
		}
	}
	return append(env, extra...)
}

// startProcess starts `narwhal args…` with env added to a clean
// environment. The process is stopped with SIGTERM when the test ends
// (see halt), and its output is logged if the test failed.
func startProcess(t *testing.T, name string, env []string, args ...string) *process {
	t.Helper()
	p := spawn(t, name, env, args...)
	t.Cleanup(func() { p.halt(t) })
	return p
}

// spawn starts `narwhal args…` like startProcess but leaves stopping it to
// the caller (see halt).
func spawn(t *testing.T, name string, env []string, args ...string) *process {
	t.Helper()
	return spawnCommand(t, name, env, narwhalBin, args...)
}

// spawnCommand starts bin args… as a process of the harness, with env
// added to a clean environment, and leaves stopping it to the caller (see
// halt).
func spawnCommand(t *testing.T, name string, env []string, bin string, args ...string) *process {
	t.Helper()
	p := &process{name: name, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = childEnv(env...)
	p.cmd.Stdout = &p.stdout
	p.cmd.Stderr = &p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.waitErr = p.cmd.Wait()
		close(p.done)
	}()
	return p
}

// halt stops the process with SIGTERM (see stop); the test fails when it
// does not exit cleanly, unless it was crashed on purpose. Its output is
// logged if the test failed. Safe from any goroutine.
func (p *process) halt(t *testing.T) {
	if err := p.stop(syscall.SIGTERM); err != nil && !p.crashed.Load() {
		t.Errorf("%s did not exit cleanly when stopped: %v", p.name, err)
	}
	if t.Failed() {
		p.dump(t)
	}
}

// crash ends the process with SIGKILL — no shutdown, no goodbye — and
// waits until it has exited.
func (p *process) crash() {
	p.crashed.Store(true)
	_ = p.stop(syscall.SIGKILL)
}

// exited reports whether the process has ended.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends sig (once; later calls only wait), waits up to stopBound for
// the process to exit and kills it after that. It returns nil for a clean
// exit (status 0), else what went wrong.
func (p *process) stop(sig os.Signal) error {
	var killed bool
	p.stopOnce.Do(func() {
		if p.exited() {
			return
		}
		_ = p.cmd.Process.Signal(sig)
		timer := time.NewTimer(stopBound)
		defer timer.Stop()
		select {
		case <-p.done:
		case <-timer.C:
			killed = true
			_ = p.cmd.Process.Kill()
		}
	})
	<-p.done
	if killed {
		return fmt.Errorf("still running %v after %v, killed", sig, stopBound)
	}
	return p.waitErr
}

// dump logs the process's output.
func (p *process) dump(t *testing.T) {
	t.Helper()
	t.Logf("---- %s %s\n---- stdout:\n%s\n---- stderr:\n%s", p.name, strings.Join(p.cmd.Args[1:], " "), p.stdout.String(), p.stderr.String())
}

// probeClient is the HTTP client of the harness's readiness polls; its
// own transport lets the tests close its idle connections.
var probeClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: time.Second}

// waitHTTP polls GET url every pollInterval until it answers 200, the
// process exits, or readyBound passes; the test fails in the latter two
// cases.
func waitHTTP(t *testing.T, p *process, url string) {
	t.Helper()
	var last string
	answered := func() bool {
		resp, err := probeClient.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return true
			}
			last = fmt.Sprintf("HTTP %d %s", resp.StatusCode, body)
		} else {
			last = err.Error()
		}
		if p.exited() {
			p.dump(t)
			t.Fatalf("%s exited (%v) before %s answered", p.name, p.waitErr, url)
		}
		return false
	}
	if !testkit.Poll(readyBound, pollInterval, answered) {
		p.dump(t)
		t.Fatalf("%s: %s did not answer 200 within %v (last: %s)", p.name, url, readyBound, last)
	}
}

// freePorts returns n distinct TCP ports on 127.0.0.1 that were free a
// moment ago, for processes that take their port as a flag. They come
// from below the kernel's ephemeral range (ip_local_port_range), which
// is where every outgoing connection's local port and every port-0
// listener of any process on the machine lands: a port from there,
// picked and released, could be taken by such a socket before the
// child binds it (seen in CI as "bind: address already in use"). Below
// that range only an explicit bind takes a port, so each port this
// process hands out is handed out once (a counter), and it is checked
// free by binding it. Without a readable range it falls back to port 0.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	ports := make([]int, 0, n)
	for range n {
		ports = append(ports, pickPort(t))
	}
	return ports
}

// portBelow holds the next candidate of pickPort and the range it walks.
var portBelow struct {
	sync.Mutex
	lo, hi, next int
}

// pickPort returns one port for freePorts.
func pickPort(t *testing.T) int {
	t.Helper()
	portBelow.Lock()
	defer portBelow.Unlock()
	if portBelow.hi == 0 {
		portBelow.lo, portBelow.hi = -1, -1
		if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
			var low, high int
			if _, err := fmt.Sscan(string(b), &low, &high); err == nil && low > 12000 {
				portBelow.lo, portBelow.hi = low-10000, low
				// Concurrent test processes (two checkouts) start apart.
				portBelow.next = portBelow.lo + (os.Getpid()*37)%10000
			}
		}
	}
	if portBelow.lo < 0 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().(*net.TCPAddr).Port
	}
	for range portBelow.hi - portBelow.lo {
		p := portBelow.next
		portBelow.next++
		if portBelow.next >= portBelow.hi {
			portBelow.next = portBelow.lo
		}
		ln, err := net.Listen("tcp", hostPort(p))
		if err != nil {
			continue
		}
		ln.Close()
		return p
	}
	t.Fatalf("no free port in %d-%d", portBelow.lo, portBelow.hi)
	return 0
}

func hostPort(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }

// exitCode returns the exit status of a stopped process, -1 when it was
// ended by a signal or never ran.
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// testContext is a context bounded by d and cancelled when the test ends.
func testContext(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

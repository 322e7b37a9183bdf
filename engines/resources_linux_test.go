//go:build linux

package engines

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// lookupChildEnv, when set, makes TestNamedEngineOutOfDescriptorsChild
// run its legs in this process.
const lookupChildEnv = "NARWHAL_TEST_LOOKUP_CHILD"

// TestNamedEngineOutOfDescriptorsRFAIL9 proves behaviour.md R-FAIL-9 for
// an engine addressed by a DNS name (a Kubernetes service, say), with a
// real EMFILE: in a child process whose RLIMIT_NOFILE is lowered to the
// descriptors it holds, the resolver's own socket fails ("lookup …: dial
// udp …: socket: too many open files"). Go's resolver keeps only the
// text of that error (a *net.DNSError), so no errno is left to find in
// the chain; the legs must still be router_resources, not the engine's
// connect_error.
func TestNamedEngineOutOfDescriptorsRFAIL9(t *testing.T) {
	if os.Getenv(lookupChildEnv) != "" {
		t.Skip("in the child")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestNamedEngineOutOfDescriptorsChild$", "-test.v")
	cmd.Env = append(os.Environ(), lookupChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestNamedEngineOutOfDescriptorsChild") {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// TestNamedEngineOutOfDescriptorsChild is the child of
// TestNamedEngineOutOfDescriptorsRFAIL9.
func TestNamedEngineOutOfDescriptorsChild(t *testing.T) {
	if os.Getenv(lookupChildEnv) == "" {
		t.Skip("run by TestNamedEngineOutOfDescriptorsRFAIL9")
	}
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	// A name no hosts file holds: only the resolver's socket can answer.
	req, res := testRequest("http://narwhal-engine.example:9")
	// The runtime opens its poller's descriptor lazily, on the first
	// socket or timer; opened after the limit is lowered it would fail
	// (the runtime throws, "netpollinit failed"). A listener opens it now.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	limit := uint64(len(fds) - 1) // ReadDir's own descriptor is closed again
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: limit, Max: old.Max}); err != nil {
		t.Fatal(err)
	}
	// The limit bounds descriptor numbers, not their count: fill any
	// hole below it (the listener's number, say) so none is left.
	var filler []*os.File
	for {
		f, err := os.Open(os.DevNull)
		if err != nil {
			break
		}
		filler = append(filler, f)
	}
	defer func() {
		for _, f := range filler {
			f.Close()
		}
	}()
	_, perr := c.Prefill(context.Background(), req)
	_, derr := c.Decode(context.Background(), req, res)
	_, full := os.Open(os.DevNull)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(full, syscall.EMFILE) {
		t.Fatalf("the child did not run out of descriptors: open %s: %v", os.DevNull, full)
	}
	for phase, err := range map[string]error{"prefill": perr, "decode": derr} {
		var f *Fault
		if !errors.As(err, &f) {
			t.Fatalf("%s: %v (%T), want a fault", phase, err, err)
		}
		if !strings.Contains(f.Message, "lookup narwhal-engine.example") {
			t.Fatalf("%s: %s %q: the leg did not fail at its name lookup", phase, f.Kind, f.Message)
		}
		if f.Kind != KindRouterResources || f.Resource != ResourceEMFILE || f.CountsTowardEjection() {
			t.Errorf("%s: %s (resource %q, counts %v) %q, want router_resources emfile, counting towards no engine", phase, f.Kind, f.Resource, f.CountsTowardEjection(), f.Message)
		}
	}
}

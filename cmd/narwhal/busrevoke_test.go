package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// revokeBound is how soon a revocation must be enforced by every server
// (behaviour.md R-BUS-11).
const revokeBound = 5 * time.Second

// identityClient connects to url with a credential bustest.IssueIdentity
// wrote (nats.go's reconnects kept, which a revoked credential must not
// survive) and closes it when the test ends.
func identityClient(t *testing.T, url, path, id string) *nats.Conn {
	t.Helper()
	opts := append(bustest.IdentityOptions(path, bus.RoleEngine, id), nats.Timeout(2*time.Second),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})) // the revocation is expected
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatalf("engine %s connects to %s: %v", id, url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// answered reports whether nc is connected and JetStream answers it.
func answered(nc *nats.Conn) bool {
	if !nc.IsConnected() {
		return false
	}
	m, err := nc.Request("$JS.API.INFO", nil, 2*time.Second)
	return err == nil && strings.Contains(string(m.Data), "account_info_response")
}

// startAuthCluster starts three `narwhal bus --auth dir` processes
// in-process as one JetStream cluster (n1, n2, n3, each with its own
// --data) and returns their client URLs once each prints its listening
// line.
func startAuthCluster(t *testing.T, dir string) []string {
	t.Helper()
	ports := []int{freeTCPPort(t), freeTCPPort(t), freeTCPPort(t)}
	var nodes []*runningCmd
	for i := range ports {
		var routes []string
		for j, p := range ports {
			if j != i {
				routes = append(routes, "nats://127.0.0.1:"+strconv.Itoa(p))
			}
		}
		nodes = append(nodes, startCmd(t, runBus, "--name", fmt.Sprintf("n%d", i+1), "--listen", "127.0.0.1:0",
			"--data", t.TempDir(), "--auth", dir, "--cluster", "127.0.0.1:"+strconv.Itoa(ports[i]), "--routes", strings.Join(routes, ",")))
	}
	urls := make([]string, len(nodes))
	for i, c := range nodes {
		testkit.WaitFor(t, 3*cmdTestBound, fmt.Sprintf("n%d listening", i+1), func() bool {
			select {
			case err := <-c.errc:
				c.errc <- err
				t.Fatalf("n%d ended early: %v\nstderr: %s", i+1, err, c.stderr)
			default:
			}
			if lines := c.stdout.Lines(); len(lines) > 0 {
				m := busLine.FindStringSubmatch(lines[0])
				if m == nil {
					t.Fatalf("n%d printed %q", i+1, lines[0])
				}
				urls[i] = m[1]
				return true
			}
			return false
		})
	}
	return urls
}

// TestBusRevokeClusterRBUS11 proves `narwhal bus revoke` on a 3-node
// `narwhal bus --auth` cluster (behaviour.md R-BUS-11): pushed to one
// node, engine d1's revocation is enforced by all three within 5 s — its
// client on each node disconnected, a new connect to each refused —
// while engine d2 keeps its connections; the command names what it
// revoked and each server's answer.
func TestBusRevokeClusterRBUS11(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := filepath.Join(t.TempDir(), "creds")
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, &testkit.LockedBuffer{}, &testkit.LockedBuffer{}); err != nil {
		t.Fatal(err)
	}
	d1, d1Pub := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d1")
	d2, _ := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d2")
	urls := startAuthCluster(t, dir)
	var c1, c2 []*nats.Conn
	for _, u := range urls {
		c1 = append(c1, identityClient(t, u, d1, "d1"))
		c2 = append(c2, identityClient(t, u, d2, "d2"))
	}

	t.Setenv("NARWHAL_NATS_URL", urls[0])
	out, errOut := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	start := time.Now()
	if err := runBus(context.Background(), []string{"revoke", "--creds", dir, "--engine", "d1"}, out, errOut); err != nil {
		t.Fatalf("bus revoke: %v\n%s%s", err, out, errOut)
	}
	t.Logf("narwhal bus revoke:\n%s", out)
	for _, want := range []string{"revoked engine d1: user " + d1Pub + " (narwhal-engine-d1)",
		"server n1: jwt updated", "server n2: jwt updated", "server n3: jwt updated", "3 servers answered"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("bus revoke's output lacks %q", want)
		}
	}
	for i, nc := range c1 {
		testkit.WaitFor(t, revokeBound-time.Since(start)+time.Millisecond, fmt.Sprintf("d1's client on n%d disconnected", i+1),
			func() bool {
				if nc.IsConnected() && time.Since(start) > revokeBound-100*time.Millisecond {
					t.Logf("d1's client of n%d is connected to %s (reconnects %d)", i+1, nc.ConnectedServerName(), nc.Stats().Reconnects)
				}
				return !nc.IsConnected()
			})
	}
	t.Logf("d1 disconnected from all three nodes %v after the command started", time.Since(start))
	for i, u := range urls {
		opts := append(bustest.IdentityOptions(d1, bus.RoleEngine, "d1"), nats.Timeout(2*time.Second))
		if nc, err := nats.Connect(u, opts...); err == nil {
			nc.Close()
			t.Errorf("revoked d1 connects to n%d anew", i+1)
		} else if !strings.Contains(strings.ToLower(err.Error()), "authorization") {
			t.Errorf("revoked d1 connecting to n%d: %v, want an authorization violation", i+1, err)
		}
		if !answered(c2[i]) {
			t.Errorf("d2's client on n%d lost its connection with d1's revocation", i+1)
		}
	}
}

// TestBusRevokeCommandErrorsRBUS11 proves that `narwhal bus revoke`
// names what is missing (behaviour.md R-BUS-11): --creds, something to
// revoke, the identity's credential file, a valid user key; and that
// `narwhal bus creds` wrote and listed sys.creds.
func TestBusRevokeCommandErrorsRBUS11(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "creds")
	out := &testkit.LockedBuffer{}
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, out, &testkit.LockedBuffer{}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), bus.SysCredsFile) {
		t.Errorf("bus creds does not list %s:\n%s", bus.SysCredsFile, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--engine", "d1"}, "--creds DIR"},
		{[]string{"--creds", dir}, "nothing to revoke"},
		{[]string{"--creds", dir, "--engine", "zz"}, "engine-zz.creds"},
		{[]string{"--creds", dir, "--router", "../x"}, "not an id"},
		{[]string{"--creds", dir, "--user", "UNOTAKEY"}, "UNOTAKEY"},
	} {
		err := runBus(context.Background(), append([]string{"revoke"}, c.args...), &testkit.LockedBuffer{}, &testkit.LockedBuffer{})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("bus revoke %q: %v, want an error naming %q", c.args, err, c.want)
		}
	}
}

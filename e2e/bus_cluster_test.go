package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// busCluster is a JetStream cluster of `narwhal bus` processes n1, n2, n3
// started with --name, --cluster and --routes (nats-server's clustering),
// each with its own data directory, all enforcing one credential set
// (R-BUS-8) and creating the stream and the buckets with three replicas.
type busCluster struct {
	nodes    []*busNode
	credsDir string
	natsURL  string   // every node's client URL, comma-separated
	conn     *bus.Bus // the test's own connection, with the admin's credential
}

// busNode is one `narwhal bus` of a busCluster.
type busNode struct {
	name    string
	client  string // HOST:PORT for clients
	cluster string // HOST:PORT for routes
	data    string
	args    []string
	p       *process
}

// clusterLine is what a clustered `narwhal bus` prints once the cluster's
// stream and buckets are set up.
var clusterLine = regexp.MustCompile(`bus listening on (nats://\S+)`)

// startBusCluster starts three `narwhal bus` processes as one JetStream
// cluster with NARWHAL_NATS_REPLICAS=3, and waits until each prints its
// listening line — which it does only once the cluster has a quorum and the
// stream and buckets exist. The nodes are stopped when the test ends.
func startBusCluster(t *testing.T) *busCluster {
	t.Helper()
	dir := t.TempDir()
	bc := &busCluster{credsDir: filepath.Join(dir, "creds")}
	if out, code := runNarwhal(t, "bus", "creds", "--out", bc.credsDir); code != 0 {
		t.Fatalf("narwhal bus creds: exit %d\n%s", code, out)
	}
	ports := freePorts(t, 6)
	var urls []string
	for i := range 3 {
		n := &busNode{name: fmt.Sprintf("n%d", i+1), client: hostPort(ports[i]), cluster: hostPort(ports[3+i]),
			data: filepath.Join(dir, fmt.Sprintf("n%d", i+1))}
		bc.nodes = append(bc.nodes, n)
		urls = append(urls, "nats://"+n.client)
	}
	bc.natsURL = strings.Join(urls, ",")
	for _, n := range bc.nodes {
		var routes []string
		for _, o := range bc.nodes {
			if o != n {
				routes = append(routes, "nats://"+o.cluster)
			}
		}
		n.args = []string{"bus", "--name", n.name, "--listen", n.client, "--data", n.data, "--auth", bc.credsDir,
			"--cluster", n.cluster, "--routes", strings.Join(routes, ",")}
		bc.start(t, n)
	}
	t.Cleanup(func() {
		if bc.conn != nil {
			bc.conn.Close()
		}
		var ps []*process
		for _, n := range bc.nodes {
			ps = append(ps, n.p)
		}
		haltAll(t, ps...)
	})
	for _, n := range bc.nodes {
		bc.waitListening(t, n)
	}
	var err error
	bc.conn, err = bus.Connect(testContext(t, readyBound), bus.ConnectOptions{URL: bc.natsURL, Name: "narwhal-e2e-bus-cluster",
		CredsFile: bc.creds(bus.RoleAdmin)})
	if err != nil {
		t.Fatal(err)
	}
	return bc
}

// start spawns node n with its command line.
func (bc *busCluster) start(t *testing.T, n *busNode) {
	t.Helper()
	n.p = spawn(t, "bus "+n.name, append([]string{"NARWHAL_NATS_REPLICAS=3"}, clusterEnv...), n.args...)
}

// waitListening waits for n's listening line.
func (bc *busCluster) waitListening(t *testing.T, n *busNode) {
	t.Helper()
	testkit.WaitEvery(t, 3*readyBound, pollInterval, n.name+"'s listening line", func() bool {
		if n.p.exited() {
			n.p.dump(t)
			t.Fatalf("%s exited: %v", n.name, n.p.waitErr)
		}
		m := clusterLine.FindStringSubmatch(n.p.stdout.String())
		return m != nil && m[1] == "nats://"+n.client
	})
}

// creds returns the path of role's credential.
func (bc *busCluster) creds(role string) string {
	return filepath.Join(bc.credsDir, bus.CredsFile(role))
}

// env returns the environment of a process of role on the cluster.
func (bc *busCluster) env(role string) []string {
	return []string{"NARWHAL_NATS_URL=" + bc.natsURL, "NARWHAL_NATS_CREDS=" + bc.creds(role)}
}

// replicasOn returns the replicas of Narwhal's stream and of each of its
// buckets on b's bus, keyed by name (R-BUS-8). Read only.
func replicasOn(t *testing.T, b *bus.Bus) map[string]int {
	t.Helper()
	r, err := b.Replicas(testContext(t, readyBound))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// checkReplicas fails the test unless the stream and every bucket on b's
// bus exist with want replicas each (R-BUS-8: nothing lowers them).
func checkReplicas(t *testing.T, b *bus.Bus, want int) {
	t.Helper()
	got := replicasOn(t, b)
	for _, name := range []string{bus.StreamName, bus.HistoryStream, bus.PlacementBucket, bus.LeaseBucket, bus.ChaosBucket} {
		if got[name] != want {
			t.Errorf("%s has %d replicas, want %d (all: %v)", name, got[name], want, got)
		}
	}
}

// TestBusCluster proves issue 11's clustering of `narwhal bus` (R-BUS-4,
// R-BUS-8): three processes with --name, --cluster and --routes form one
// JetStream cluster; each says it listens only once the stream and the
// buckets exist, with three replicas; a read-only `narwhal events` and an
// admin's `narwhal bus setup` that wants one replica leave them at three
// (the latter says what it found against what it wanted); with one node
// stopped the other two still store events, and the node that comes back
// rejoins.
func TestBusCluster(t *testing.T) {
	bc := startBusCluster(t)
	checkReplicas(t, bc.conn, 3)
	ctx := testContext(t, readyBound)
	st, err := bc.conn.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	info := st.CachedInfo()
	if info.Cluster == nil || info.Cluster.Name != bus.ClusterName || len(info.Cluster.Replicas) != 2 {
		t.Fatalf("stream cluster info %+v: want cluster %q, a leader and two replicas", info.Cluster, bus.ClusterName)
	}
	t.Logf("stream %s: leader %s, replicas %d", bus.StreamName, info.Cluster.Leader, len(info.Cluster.Replicas)+1)

	// A viewer follows the events; nothing changes.
	if _, err := bc.conn.JetStream().Publish(ctx, "narwhal.events.failure.d1", []byte(`{"n":1}`)); err != nil {
		t.Fatal(err)
	}
	events := spawn(t, "events", bc.env(bus.RoleViewer), "events", "--since", "all", "--json")
	testkit.WaitEvery(t, readyBound, pollInterval, "narwhal events printing the stored event", func() bool {
		if events.exited() {
			events.dump(t)
			t.Fatalf("narwhal events exited: %v", events.waitErr)
		}
		return strings.Contains(events.stdout.String(), `{"n":1}`)
	})
	events.halt(t)
	checkReplicas(t, bc.conn, 3)

	// An admin that wants one replica keeps three and says so.
	out, code := runNarwhalEnv(t, bc.env(bus.RoleAdmin), "bus", "setup")
	if code != 0 {
		t.Fatalf("narwhal bus setup: exit %d\n%s", code, out)
	}
	if !strings.Contains(out, "found=3 wanted=1") {
		t.Errorf("narwhal bus setup does not say it kept 3 replicas against 1 wanted:\n%s", out)
	}
	checkReplicas(t, bc.conn, 3)

	// One node down: the others keep a quorum and store events.
	down := bc.nodes[2]
	down.p.halt(t)
	pctx, cancel := context.WithTimeout(context.Background(), 2*readyBound)
	defer cancel()
	for i := range 10 {
		if _, err := bc.conn.JetStream().Publish(pctx, "narwhal.events.failure.d1", fmt.Appendf(nil, `{"down":%d}`, i)); err != nil {
			t.Fatalf("publish with %s down: %v", down.name, err)
		}
	}
	bc.start(t, down)
	bc.waitListening(t, down)
	checkReplicas(t, bc.conn, 3)
	testkit.WaitEvery(t, 2*readyBound, pollInterval, "the stream with every replica current", func() bool {
		st, err := bc.conn.JetStream().Stream(pctx, bus.StreamName)
		if err != nil {
			return false
		}
		info, err := st.Info(pctx)
		if err != nil || info.Cluster == nil || info.State.Msgs != 11 {
			return false
		}
		for _, r := range info.Cluster.Replicas {
			if !r.Current {
				return false
			}
		}
		return len(info.Cluster.Replicas) == 2
	})
}

package bus_test

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
)

// TestMeshDocNamesWhatSetupCreates proves that docs/mesh.md's "Who sets the
// bus up" names every stream and bucket the admin's set-up creates
// (behaviour.md R-BUS-8): it lists them on a freshly set-up server and
// looks for each in the section's first item.
func TestMeshDocNamesWhatSetupCreates(t *testing.T) {
	b, err := os.ReadFile("../docs/mesh.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n### Who sets the bus up\n")
	if !ok {
		t.Fatal("docs/mesh.md: no section \"Who sets the bus up\"")
	}
	_, item, _ := strings.Cut(section, "\n- `narwhal bus` is the admin")
	item, _, _ = strings.Cut(item, "\n- ")
	js := connect(t, bustest.StartWith(t, bus.EmbeddedOptions{Port: 0})).JetStream()
	// Buckets are streams named KV_<bucket>.
	names := streamNames(t, js)
	if len(names) < 3 {
		t.Fatalf("set-up created only %q", names)
	}
	for _, name := range names {
		if bucket, ok := strings.CutPrefix(name, "KV_"); ok {
			name = bucket
		}
		if !strings.Contains(item, "`"+name+"`") {
			t.Errorf("docs/mesh.md, Who sets the bus up: `narwhal bus` creates %s, which the item does not name:%s", name, item)
		}
	}
}

// TestSetUpNamesAreWhatSetupCreatesRBUS8 proves that bus.SetUpNames, the
// list `narwhal bus setup` reports, is exactly what the admin's set-up
// creates on a bare server (R-BUS-8), and that SetupWrites tells a set-up
// that wrote from one that found everything as wanted.
func TestSetUpNamesAreWhatSetupCreatesRBUS8(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Port: 0, NoSetup: true})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first := bustest.Connect(t, e, bus.ConnectOptions{Setup: &bus.SetupOptions{}})
	if first.SetupWrites() == 0 {
		t.Error("the set-up of a bare server wrote nothing, says SetupWrites")
	}
	var want []string
	for _, n := range bus.SetUpNames() {
		switch n.What {
		case "stream":
			want = append(want, n.Name)
		case "bucket":
			want = append(want, "KV_"+n.Name)
		default:
			t.Errorf("SetUpNames: %s %s: want stream or bucket", n.What, n.Name)
		}
	}
	have := streamNames(t, first.JetStream())
	slices.Sort(want)
	slices.Sort(have)
	if !slices.Equal(have, want) {
		t.Errorf("set-up created %q; SetUpNames lists %q", have, want)
	}
	replicas, err := first.Replicas(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(replicas) != len(want) {
		t.Errorf("Replicas reports %v, want one count for each of %q", replicas, want)
	}
	again := bustest.Connect(t, e, bus.ConnectOptions{Setup: &bus.SetupOptions{}})
	if n := again.SetupWrites(); n != 0 {
		t.Errorf("a second set-up with nothing to change wrote %d, says SetupWrites", n)
	}
}

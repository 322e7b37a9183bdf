package bus_test

import (
	"os"
	"strings"
	"testing"

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

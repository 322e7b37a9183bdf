package main

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/engines/sim"
)

// TestSimSharedStorageFlags: `narwhal sim --connector shared-storage`
// needs --kv-store (behaviour.md R-DESC-8), --kv-store is refused with
// another connector, and with both the simulator starts (creating the
// store's directory) and stops when its context ends.
func TestSimSharedStorageFlags(t *testing.T) {
	base := []string{"--listen", "127.0.0.1:0", "--engine-id", "s1", "--model", "m"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--connector", "shared-storage"}, "KV store"},
		{[]string{"--kv-store", t.TempDir()}, "shared-storage connector"},
		{[]string{"--connector", "shared-storage", "--kv-store", t.TempDir(), "--kv-store-blocks", "-1"}, "negative"},
	} {
		err := runSim(context.Background(), append(append([]string(nil), base...), c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("narwhal sim %v: %v, want an error about %q", c.args, err, c.want)
		}
	}
	dir := filepath.Join(t.TempDir(), "store")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := runSim(ctx, append(base, "--role", "prefill", "--connector", "shared-storage", "--kv-store", dir, "--kv-store-blocks", "8")); err != nil {
		t.Fatalf("narwhal sim --connector shared-storage: %v", err)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		t.Fatalf("--kv-store directory not created: %v", err)
	}
}

// TestSimFlagsDocumented proves that docs/simulator.md's list of flags
// (the paragraph that starts "Flags:") names every flag `narwhal sim`
// has, so that what `narwhal sim --help` offers is documented, and no
// flag it does not have.
func TestSimFlagsDocumented(t *testing.T) {
	text, err := os.ReadFile("../../docs/simulator.md")
	if err != nil {
		t.Fatal(err)
	}
	_, list, ok := strings.Cut(string(text), "\nFlags: ")
	if !ok {
		t.Fatal(`docs/simulator.md has no paragraph starting "Flags:"`)
	}
	list, _, _ = strings.Cut(list, "\n\n")
	var cfg sim.Config
	fs, _ := newSimFlags(&cfg)
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("`--([a-z][a-z-]*)").FindAllStringSubmatch(list, -1) {
		listed[m[1]] = true
		if fs.Lookup(m[1]) == nil {
			t.Errorf("docs/simulator.md lists --%s, which narwhal sim does not have", m[1])
		}
	}
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		n++
		if !listed[f.Name] {
			t.Errorf("docs/simulator.md's flag list lacks --%s (%s)", f.Name, f.Usage)
		}
	})
	if n < 20 {
		t.Errorf("narwhal sim has %d flags; is newSimFlags whole?", n)
	}
}

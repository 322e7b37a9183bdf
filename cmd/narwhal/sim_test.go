package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
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

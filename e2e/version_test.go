package e2e

import (
	"context"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestVersion runs `narwhal version` and `narwhal --version` on the real
// binary (one line: version, commit, the Go version that built it, the
// same for both spellings), then links a second binary with the release
// -ldflags and checks that they set the version and commit it prints.
func TestVersion(t *testing.T) {
	out, code := runNarwhal(t, "version")
	if code != 0 || !strings.HasPrefix(out, "narwhal ") || !strings.Contains(out, " commit ") || !strings.HasSuffix(out, " "+runtime.Version()+"\n") {
		t.Fatalf("narwhal version: exit %d, %q", code, out)
	}
	again, code := runNarwhal(t, "--version")
	if code != 0 || again != out {
		t.Errorf("narwhal --version: exit %d, %q, want %q", code, again, out)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bin := filepath.Join(t.TempDir(), "narwhal")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin,
		"-ldflags", "-X main.version=v9.8.7 -X main.commit=0badc0de",
		"github.com/narwhalmesh/narwhal/cmd/narwhal")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build -ldflags: %v\n%s", err, b)
	}
	got, err := exec.CommandContext(ctx, bin, "version").CombinedOutput()
	if want := "narwhal v9.8.7 commit 0badc0de " + runtime.Version() + "\n"; err != nil || string(got) != want {
		t.Errorf("ldflags build: %v %q, want %q", err, got, want)
	}
}

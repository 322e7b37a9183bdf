package main

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

// TestReadBuildStamp checks where each part of `narwhal version` comes
// from: the build information's module version and VCS revision (with
// "-dirty" for a modified tree), the link-time -X values over them, and
// defaults when the binary carries nothing.
func TestReadBuildStamp(t *testing.T) {
	stamped := &debug.BuildInfo{
		GoVersion: "go1.99.1",
		Main:      debug.Module{Path: "github.com/narwhalmesh/narwhal", Version: "v0.4.0"},
		Settings: []debug.BuildSetting{
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
			{Key: "vcs.modified", Value: "false"},
		},
	}
	dirty := &debug.BuildInfo{
		GoVersion: "go1.99.1",
		Main:      debug.Module{Version: "(devel)"},
		Settings:  []debug.BuildSetting{{Key: "vcs.revision", Value: "feedface"}, {Key: "vcs.modified", Value: "true"}},
	}
	for _, tc := range []struct {
		name         string
		info         *debug.BuildInfo
		linkV, linkC string
		want         buildStamp
	}{
		{"no build information", nil, "", "", buildStamp{"(devel)", "unknown", runtime.Version()}},
		{"module version and revision", stamped, "", "", buildStamp{"v0.4.0", "0123456789abcdef0123456789abcdef01234567", "go1.99.1"}},
		{"modified tree", dirty, "", "", buildStamp{"(devel)", "feedface-dirty", "go1.99.1"}},
		{"link-time values win", stamped, "v1.0.0", "abc1234", buildStamp{"v1.0.0", "abc1234", "go1.99.1"}},
		{"link-time commit only", dirty, "", "abc1234", buildStamp{"(devel)", "abc1234", "go1.99.1"}},
		{"no VCS settings", &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Version: "(devel)"}}, "", "", buildStamp{"(devel)", "unknown", "go1.99.1"}},
	} {
		if got := readBuildStamp(tc.info, tc.linkV, tc.linkC); got != tc.want {
			t.Errorf("%s: got %+v, want %+v", tc.name, got, tc.want)
		}
	}
	if got, want := (buildStamp{"v0.4.0", "abc", "go1.99.1"}).String(), "narwhal v0.4.0 commit abc go1.99.1"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

// TestVersionCommand checks that `narwhal version` prints one line with
// this binary's Go version and refuses arguments with a usage error.
func TestVersionCommand(t *testing.T) {
	var out, errOut bytes.Buffer
	if err := runVersion(context.Background(), nil, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	line := out.String()
	if !strings.HasPrefix(line, "narwhal ") || !strings.HasSuffix(line, " "+runtime.Version()+"\n") || strings.Count(line, "\n") != 1 || !strings.Contains(line, " commit ") {
		t.Errorf("narwhal version printed %q", line)
	}
	out.Reset()
	err := runVersion(context.Background(), []string{"extra"}, &out, &errOut)
	var said *reportedError
	if err == nil || !errors.As(err, &said) || said.code != 2 || out.Len() != 0 || !strings.Contains(errOut.String(), `"extra"`) {
		t.Errorf("narwhal version extra: err %v, stdout %q, stderr %q; want a usage error", err, out.String(), errOut.String())
	}
}

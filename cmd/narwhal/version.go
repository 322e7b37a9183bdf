package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// version and commit are set at link time, for a release build:
//
//	go build -ldflags "-X main.version=v1.2.0 -X main.commit=abc1234" ./cmd/narwhal
//
// When they are empty, narwhal reads them from the build information the
// Go toolchain stamps into the binary (the module version and the VCS
// revision of the checkout it was built from).
var (
	version string
	commit  string
)

// buildStamp is what `narwhal version` prints: Version is a module
// version ("v0.3.1") or "(devel)" for a build from a checkout, Commit the
// VCS revision with a "-dirty" suffix when the work tree had changes, or
// "unknown" when the binary carries none (go run of a non-VCS tree), and
// GoVersion the toolchain that built it ("go1.26.8").
type buildStamp struct {
	Version   string
	Commit    string
	GoVersion string
}

// readBuildStamp returns the binary's buildStamp: the link-time values of
// version and commit win over the build information; info may be nil
// (no build information).
func readBuildStamp(info *debug.BuildInfo, linkVersion, linkCommit string) buildStamp {
	s := buildStamp{Version: "(devel)", Commit: "unknown", GoVersion: runtime.Version()}
	if info != nil {
		if v := info.Main.Version; v != "" {
			s.Version = v
		}
		if info.GoVersion != "" {
			s.GoVersion = info.GoVersion
		}
		var rev string
		var modified bool
		for _, kv := range info.Settings {
			switch kv.Key {
			case "vcs.revision":
				rev = kv.Value
			case "vcs.modified":
				modified = kv.Value == "true"
			}
		}
		if rev != "" {
			s.Commit = rev
			if modified {
				s.Commit += "-dirty"
			}
		}
	}
	if linkVersion != "" {
		s.Version = linkVersion
	}
	if linkCommit != "" {
		s.Commit = linkCommit
	}
	return s
}

// currentBuildStamp is readBuildStamp of this binary.
func currentBuildStamp() buildStamp {
	info, _ := debug.ReadBuildInfo()
	return readBuildStamp(info, version, commit)
}

// String is the one line `narwhal version` prints, e.g.
// "narwhal (devel) commit 6b91791… go1.26.8".
func (s buildStamp) String() string {
	return fmt.Sprintf("narwhal %s commit %s %s", s.Version, s.Commit, s.GoVersion)
}

// runVersion prints the version line to stdout; it takes no flags.
func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
		fmt.Fprintln(stderr, "usage: narwhal version\n\nPrints the version, the commit it was built from and the Go version.")
		return nil
	}
	if len(args) > 0 {
		fmt.Fprintf(stderr, "narwhal version: takes no arguments, got %q\n", args[0])
		return reported(fmt.Errorf("unexpected argument %q", args[0]), 2)
	}
	fmt.Fprintln(stdout, currentBuildStamp())
	return nil
}

func init() {
	commands["version"] = command{summary: "print the version, commit and Go version", run: withOutput(runVersion)}
}

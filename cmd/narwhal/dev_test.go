package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/config"
)

// TestDevBannerSaysAuthIsOnRAPI9 proves the dev banner with client API
// keys (behaviour.md R-API-9, NARWHAL_AUTH_API_KEYS_FILE): it says that
// authentication is on, from which file, names the keys, and its curl
// sends Authorization: Bearer $OPENAI_API_KEY — never a key's digest,
// which is all the router knows. Without keys the banner says nothing of
// authentication and its curl sends no Authorization header.
func TestDevBannerSaysAuthIsOnRAPI9(t *testing.T) {
	db := &devBus{natsURL: "nats://127.0.0.1:4222"}
	digest := strings.Repeat("ab", 32)
	auth := config.Auth{APIKeysFile: "/tmp/keys.yaml", APIKeys: []config.APIKey{{Name: "team-a", KeySHA256: digest}, {Name: "team-b", KeySHA256: digest}}}
	var b bytes.Buffer
	writeDevBanner(&b, "http://127.0.0.1:8080", "narwhal", db, auth)
	banner := b.String()
	for _, want := range []string{
		"Client authentication is on: 2 API key(s) from /tmp/keys.yaml (team-a, team-b)",
		"\nexport OPENAI_API_KEY='<the key of team-a>'\n",
		"\ncurl -N http://127.0.0.1:8080/v1/chat/completions -H \"Authorization: Bearer $OPENAI_API_KEY\" -H 'Content-Type: application/json' -d '{",
	} {
		if !strings.Contains(banner, want) {
			t.Errorf("the banner with keys lacks %q:\n%s", want, banner)
		}
	}
	if strings.Contains(banner, digest) {
		t.Errorf("the banner prints a key's digest:\n%s", banner)
	}
	if !strings.HasPrefix(banner, "\nNarwhal dev stack is up: router http://127.0.0.1:8080") {
		t.Errorf("the banner does not start by saying the stack is up:\n%s", banner)
	}

	b.Reset()
	writeDevBanner(&b, "http://127.0.0.1:8080", "narwhal", db, config.Auth{})
	if open := b.String(); strings.Contains(open, "authentication") || strings.Contains(open, "Authorization") ||
		!strings.Contains(open, "\ncurl -N http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' -d '{") {
		t.Errorf("the banner of an open router:\n%s", open)
	}
}

// devMention is a mention of `narwhal dev` in the documentation, up to
// the end of its code span or line: the flags it names follow.
var devMention = regexp.MustCompile("narwhal dev([^`\n]*)")

// TestDocumentedDevFlagsExist proves that every flag README.md and
// docs/*.md give `narwhal dev` (behaviour.md §14: the one command a
// newcomer runs) is a flag it has, so that what a newcomer copies from the
// documentation runs.
func TestDocumentedDevFlagsExist(t *testing.T) {
	fs, _ := newDevFlags()
	docs, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, path := range append([]string{"../../README.md"}, docs...) {
		text, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range devMention.FindAllStringSubmatch(string(text), -1) {
			for _, f := range regexp.MustCompile(`--([a-z][a-z-]*)`).FindAllStringSubmatch(m[1], -1) {
				seen[f[1]] = true
				if fs.Lookup(f[1]) == nil {
					t.Errorf("%s: `narwhal dev%s` names --%s, which narwhal dev does not have", filepath.Base(path), m[1], f[1])
				}
			}
		}
	}
	for _, f := range []string{"ttft", "itl", "chaos", "dashboard", "listen"} {
		if !seen[f] {
			t.Errorf("no documentation names narwhal dev's --%s", f)
		}
	}
}

// TestFleetPagePortDocumented proves that README.md, docs/observability.md
// and behaviour.md §14 give the fleet page's real default address, and
// that it is none of examples/mesh.sh's default router ports: `narwhal
// dev` and the mesh example run side by side.
func TestFleetPagePortDocumented(t *testing.T) {
	for path, want := range map[string]string{
		"../../README.md":             "<http://" + defaultDashboardListen + "/>",
		"../../docs/observability.md": "`narwhal dev` serves it on `" + defaultDashboardListen + "`",
		"../../docs/behaviour.md":     "the live fleet page (on `" + defaultDashboardListen + "`)",
	} {
		text, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(text), want) {
			t.Errorf("%s does not say %q", filepath.Base(path), want)
		}
	}
	script, err := os.ReadFile("../../examples/mesh.sh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`MESH_ROUTER_PORTS:-([0-9 ]+)\}`).FindSubmatch(script)
	if m == nil {
		t.Fatal("examples/mesh.sh has no default MESH_ROUTER_PORTS")
	}
	_, port, _ := strings.Cut(defaultDashboardListen, ":")
	for _, p := range strings.Fields(string(m[1])) {
		if p == port {
			t.Errorf("the fleet page's default port %s is a router port of examples/mesh.sh", port)
		}
	}
}

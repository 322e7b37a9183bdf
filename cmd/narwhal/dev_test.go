package main

import (
	"bytes"
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

package config

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

func digest(token string) string {
	d := sha256.Sum256([]byte(token))
	return hex.EncodeToString(d[:])
}

// TestAPIKeysLoad proves the auth section of R-API-9: keys from the file
// and from NARWHAL_AUTH_API_KEYS_FILE (a bare list or a mapping with
// api_keys), digests lowercased, models and max_inflight kept.
func TestAPIKeysLoad(t *testing.T) {
	dir := t.TempDir()
	listFile := filepath.Join(dir, "list.yaml")
	mapFile := filepath.Join(dir, "map.yaml")
	if err := os.WriteFile(listFile, []byte("- name: team-b\n  key_sha256: "+digest("b")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mapFile, []byte("api_keys:\n  - name: team-c\n    key_sha256: "+digest("c")+"\n    max_inflight: 3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	doc := "auth:\n  api_keys:\n    - name: team-a\n      key_sha256: \"" + strings.ToUpper(digest("a")) + "\"\n      models: [m1, m2]\n      max_inflight: 64\n"
	for _, file := range []string{listFile, mapFile} {
		c, err := load([]byte(doc), map[string]string{"NARWHAL_AUTH_API_KEYS_FILE": file})
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		keys := c.Auth.APIKeys
		if len(keys) != 2 || keys[0].Name != "team-a" || keys[0].KeySHA256 != digest("a") || keys[0].MaxInflight != 64 ||
			strings.Join(keys[0].Models, ",") != "m1,m2" {
			t.Errorf("%s: keys %+v", file, keys)
		}
		if file == mapFile && (keys[1].Name != "team-c" || keys[1].MaxInflight != 3 || keys[1].KeySHA256 != digest("c")) {
			t.Errorf("mapping file: %+v", keys[1])
		}
		if file == listFile && keys[1].Name != "team-b" {
			t.Errorf("list file: %+v", keys[1])
		}
	}
	// No keys at all: an open router.
	c, err := load(nil, map[string]string{})
	if err != nil || len(c.Auth.APIKeys) != 0 {
		t.Errorf("no keys: %+v %v", c, err)
	}
}

// TestAPIKeysValidation proves every invalid key entry is named, by its
// position and name, and that no message repeats a key_sha256 value (it
// may be the key itself, pasted by mistake).
func TestAPIKeysValidation(t *testing.T) {
	secret := "sk-this-is-the-raw-key-not-its-digest-0123456789abcdef0123456"
	dir := t.TempDir()
	file := filepath.Join(dir, "keys.yaml")
	if err := os.WriteFile(file, []byte("- name: team-a\n  key_sha256: "+digest("z")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	doc := `auth:
  api_keys:
    - name: team-a
      key_sha256: "` + secret + `"
    - name: team-a
      key_sha256: "` + digest("x") + `"
    - name: "bad name"
      key_sha256: "` + digest("x") + `"
    - name: none
      key_sha256: "` + digest("y")[:63] + `"
    - name: team-e
      key_sha256: "` + digest("e") + `"
      max_inflight: -1
      models: [""]
`
	_, err := load([]byte(doc), map[string]string{"NARWHAL_AUTH_API_KEYS_FILE": file})
	if err == nil {
		t.Fatal("invalid keys accepted")
	}
	msg := err.Error()
	for _, want := range []string{
		`config: auth.api_keys[0].key_sha256: key "team-a": must be the SHA-256 of the key as 64 hexadecimal digits, got ` + fmt.Sprint(len(secret)) + ` characters (and characters that are not hexadecimal digits)`,
		`config: auth.api_keys[1].name: duplicate name "team-a" (also auth.api_keys[0].name)`,
		`config: auth.api_keys[2].name: must be 1 to 64 letters, digits, '.', '-' or '_', got "bad name"`,
		`config: auth.api_keys[2].key_sha256: key "bad name": the same key as auth.api_keys[1].name ("team-a")`,
		`config: auth.api_keys[3].name: "none" is reserved`,
		`config: auth.api_keys[3].key_sha256: key "none": must be the SHA-256 of the key as 64 hexadecimal digits, got 63 characters`,
		`config: auth.api_keys[4].max_inflight: key "team-e": must be >= 0, got -1`,
		`config: auth.api_keys[4].models[0]: key "team-e": must not be empty`,
		`config: ` + file + `: api_keys[0].name: duplicate name "team-a" (also auth.api_keys[0].name)`,
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("missing %q in:\n%s", want, msg)
		}
	}
	if strings.Contains(msg, secret) || strings.Contains(msg, digest("x")) || strings.Contains(msg, digest("y")[:63]) {
		t.Errorf("a key_sha256 value is repeated in the error:\n%s", msg)
	}

	// A keys file that cannot be read, or holds something else, is named.
	_, err = load(nil, map[string]string{"NARWHAL_AUTH_API_KEYS_FILE": filepath.Join(dir, "missing.yaml")})
	if err == nil || !strings.HasPrefix(err.Error(), "config: NARWHAL_AUTH_API_KEYS_FILE (auth.api_keys_file): ") {
		t.Errorf("missing keys file: %v", err)
	}
	if err := os.WriteFile(file, []byte("keys: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = load(nil, map[string]string{"NARWHAL_AUTH_API_KEYS_FILE": file})
	if err == nil || !strings.Contains(err.Error(), file+": keys: unknown key") {
		t.Errorf("keys file with another key: %v", err)
	}
}

// TestEngineAPIKeyEnv proves fleet[].api_key_env: the key is read from the
// named variable, a missing one fails naming the entry and the variable,
// and the key never shows when the configuration is printed, logged or
// encoded.
func TestEngineAPIKeyEnv(t *testing.T) {
	const key = "engine-secret-4f1c2e"
	doc := "fleet:\n  - id: p1\n    url: https://p1.example:8000\n    role: prefill\n    api_key_env: P1_KEY\n  - id: d1\n    url: http://d1.example:8000\n    role: decode\n"
	c, err := load([]byte(doc), map[string]string{"P1_KEY": key})
	if err != nil {
		t.Fatal(err)
	}
	if c.Fleet[0].APIKey.Reveal() != key || c.Fleet[1].APIKey != "" {
		t.Errorf("keys: %q %q", c.Fleet[0].APIKey.Reveal(), c.Fleet[1].APIKey.Reveal())
	}
	var logged bytes.Buffer
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("cfg", "fleet", c.Fleet, "key", c.Fleet[0].APIKey)
	slog.New(slog.NewTextHandler(&logged, nil)).Info("cfg", "spec", c.Fleet[0], "key", c.Fleet[0].APIKey)
	js, _ := json.Marshal(c)
	shown := fmt.Sprintf("%v %+v %#v %s", *c, *c, *c, c.Fleet[0].APIKey) + string(js) + logged.String()
	if strings.Contains(shown, key) {
		t.Errorf("the engine key shows:\n%s", shown)
	}
	if !strings.Contains(shown, "[redacted]") {
		t.Errorf("no redaction marker in:\n%s", shown)
	}

	_, err = load([]byte(doc), map[string]string{})
	if err == nil || err.Error() != "config: fleet[0].api_key_env: engine p1: environment variable P1_KEY is not set or empty" {
		t.Errorf("missing variable: %v", err)
	}
	_, err = load([]byte(strings.Replace(doc, "P1_KEY", "1-bad", 1)), map[string]string{})
	if err == nil || !strings.Contains(err.Error(), `fleet[0].api_key_env: must be an environment variable name, got "1-bad"`) {
		t.Errorf("bad variable name: %v", err)
	}
}

// TestServerTLSAndEngineCA proves the TLS keys: cert and key go together,
// and engine.tls_ca_file must hold a PEM certificate.
func TestServerTLSAndEngineCA(t *testing.T) {
	_, err := load([]byte("server:\n  tls_key_file: k.pem\n"), map[string]string{})
	if err == nil || err.Error() != "config: server.tls_cert_file: must be set when server.tls_key_file is" {
		t.Errorf("key without cert: %v", err)
	}
	c, err := load([]byte("server:\n  tls_cert_file: c.pem\n  tls_key_file: k.pem\n  metrics_on_admin: true\n"), map[string]string{})
	if err != nil || !c.Server.TLS() || !c.Server.MetricsOnAdmin {
		t.Errorf("server section: %+v %v", c, err)
	}
	_, err = load([]byte("server:\n  metrics_on_admin: yes please\n"), map[string]string{})
	if err == nil || !strings.Contains(err.Error(), "server.metrics_on_admin: must be true or false") {
		t.Errorf("non-boolean: %v", err)
	}
	dir := t.TempDir()
	ca, junk := testkit.NewCA(t).Path, filepath.Join(dir, "junk.pem")
	if err := os.WriteFile(junk, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err = load(nil, map[string]string{"NARWHAL_ENGINE_TLS_CA_FILE": ca})
	if err != nil || c.Engine.RootCAs() == nil {
		t.Errorf("CA file: %v", err)
	}
	_, err = load(nil, map[string]string{"NARWHAL_ENGINE_TLS_CA_FILE": junk})
	if err == nil || err.Error() != "config: NARWHAL_ENGINE_TLS_CA_FILE (engine.tls_ca_file): "+junk+" holds no PEM certificate" {
		t.Errorf("junk CA file: %v", err)
	}
}

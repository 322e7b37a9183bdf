package config

import (
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"strconv"
	"strings"

	"github.com/goccy/go-yaml"
)

// Auth holds client authentication (behaviour.md R-API-9): which bearer tokens may
// call /v1/* and what each may do. With no keys at all the router is open.
type Auth struct {
	// APIKeys are the accepted client keys, each stored as the SHA-256 of
	// the bearer token, never the token itself. Empty means no client
	// authentication (development).
	APIKeys []APIKey `yaml:"api_keys"`
	// APIKeysFile, when set, names a YAML file holding more keys: either a
	// list of key entries or a mapping with the single key api_keys (for
	// secrets mounted apart from the config). Its entries are added to
	// APIKeys; names must be unique over both. Set it in the YAML file as
	// auth.api_keys_file or with NARWHAL_AUTH_API_KEYS_FILE.
	APIKeysFile string `yaml:"api_keys_file" env:"API_KEYS_FILE"`
}

// APIKey is one accepted client key (behaviour.md R-API-9).
type APIKey struct {
	// Name identifies the caller in logs, events (the request event's key
	// field) and metrics (the key label); never the key. 1 to 64 letters,
	// digits, '.', '-' and '_'; unique; not "none" (the label value of
	// requests made without a valid key).
	Name string `yaml:"name"`
	// KeySHA256 is the SHA-256 of the bearer token as 64 hexadecimal
	// digits (either case; Load lowercases it).
	KeySHA256 string `yaml:"key_sha256"`
	// Models, when not empty, are the only models the key may call; a
	// request for another model gets 403. Empty means every model.
	Models []string `yaml:"models"`
	// MaxInflight caps the key's requests in progress at once on this
	// router; beyond it a request gets 429. 0 means no cap.
	MaxInflight int `yaml:"max_inflight"`
}

// NoKeyName is the key label value (narwhal_requests_total{key}) of
// requests that were not made with a valid configured key: every request
// of an open router, and the ones refused with 401.
const NoKeyName = "none"

// maxKeyNameLen bounds an APIKey name.
const maxKeyNameLen = 64

// validKeyName reports whether s may name an API key.
func validKeyName(s string) bool {
	if s == "" || len(s) > maxKeyNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !idByte(c) && c != '.' {
			return false
		}
	}
	return true
}

// Secret is a credential read from the environment (an engine's API key).
// Its String, GoString, LogValue, MarshalJSON, MarshalText and
// MarshalYAML forms are "[redacted]" (or "" when empty), so printing,
// logging or encoding a configuration never shows it; Reveal returns the
// value for the one place that sends it.
type Secret string

const redacted = "[redacted]"

func (s Secret) shown() string {
	if s == "" {
		return ""
	}
	return redacted
}

// Reveal returns the secret's value.
func (s Secret) Reveal() string { return string(s) }

// String returns "[redacted]", or "" for an empty secret.
func (s Secret) String() string { return s.shown() }

// GoString returns the quoted String form.
func (s Secret) GoString() string { return strconv.Quote(s.shown()) }

// LogValue returns the String form for log/slog.
func (s Secret) LogValue() slog.Value { return slog.StringValue(s.shown()) }

// MarshalText returns the String form.
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.shown()), nil }

// MarshalJSON returns the String form as a JSON string.
func (s Secret) MarshalJSON() ([]byte, error) { return []byte(strconv.Quote(s.shown())), nil }

// MarshalYAML returns the String form.
func (s Secret) MarshalYAML() (any, error) { return s.shown(), nil }

// loadAPIKeysFile reads c.Auth.APIKeysFile, when set, and appends its
// entries to c.Auth.APIKeys. Errors name the file and the entry.
func loadAPIKeysFile(c *Config, fromEnv map[string]string) error {
	path := c.Auth.APIKeysFile
	if path == "" {
		return nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return &KeyError{Key: "auth.api_keys_file", Env: fromEnv["auth.api_keys_file"], Problem: err.Error()}
	}
	keys, err := ParseAPIKeys(b, path)
	if err != nil {
		return err
	}
	c.Auth.APIKeys = append(c.Auth.APIKeys, keys...)
	return nil
}

// ParseAPIKeys decodes an API keys file (see Auth.APIKeysFile): a YAML list
// of key entries, or a mapping with the single key api_keys holding that
// list. name labels the errors, each a *KeyError whose Key is
// "<name>: api_keys[<i>].<field>". Entries are not validated here (Validate
// does that).
func ParseAPIKeys(data []byte, name string) ([]APIKey, error) {
	var root any
	if err := yaml.UnmarshalWithOptions(data, &root, yaml.UseOrderedMap()); err != nil {
		return nil, fmt.Errorf("config: %s: yaml: %s", name, yaml.FormatError(err, false, false))
	}
	if m, ok := root.(yaml.MapSlice); ok {
		var list any
		for _, item := range m {
			if k := fmt.Sprint(item.Key); k != "api_keys" {
				return nil, &KeyError{Key: name + ": " + k, Problem: "unknown key (the file holds api_keys only)"}
			}
			list = item.Value
		}
		root = list
	}
	if root == nil {
		return nil, nil
	}
	var keys []APIKey
	var errs []error
	decodeValue(reflect.ValueOf(&keys).Elem(), root, name+": api_keys", &errs)
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	for i := range keys {
		keys[i].KeySHA256 = strings.ToLower(keys[i].KeySHA256)
	}
	return keys, nil
}

// validate checks the API keys: every name valid and unique, every
// key_sha256 64 hex digits and unique, max_inflight >= 0, no empty model
// name. The last fileKeys keys came from the keys file: they are named by
// their position in it, with the file's name, the others as
// auth.api_keys[<i>]; p takes the keys whole. Messages never repeat a
// key_sha256 value.
func (a Auth) validate(p problems, fileKeys int) {
	bad := p.bad
	own := len(a.APIKeys) - fileKeys
	keyOf := func(i int, field string) string {
		if i >= own && a.APIKeysFile != "" {
			return a.APIKeysFile + ": api_keys[" + strconv.Itoa(i-own) + "]." + field
		}
		return "auth.api_keys[" + strconv.Itoa(i) + "]." + field
	}
	names := make(map[string]int, len(a.APIKeys))
	hashes := make(map[string]int, len(a.APIKeys))
	for i, k := range a.APIKeys {
		switch {
		case !validKeyName(k.Name):
			bad(keyOf(i, "name"), "must be 1 to %d letters, digits, '.', '-' or '_', got %q", maxKeyNameLen, truncate(k.Name, maxKeyNameLen))
		case k.Name == NoKeyName:
			bad(keyOf(i, "name"), "%q is reserved (it labels requests made without a valid key)", NoKeyName)
		default:
			if j, dup := names[k.Name]; dup {
				bad(keyOf(i, "name"), "duplicate name %q (also %s)", k.Name, keyOf(j, "name"))
			} else {
				names[k.Name] = i
			}
		}
		label := "key " + strconv.Quote(truncate(k.Name, maxKeyNameLen))
		if _, err := hex.DecodeString(k.KeySHA256); err != nil || len(k.KeySHA256) != 64 {
			// Never echo the value: it may be the key itself, pasted by
			// mistake.
			bad(keyOf(i, "key_sha256"), "%s: must be the SHA-256 of the key as 64 hexadecimal digits, got %d characters%s",
				label, len(k.KeySHA256), notHex(k.KeySHA256))
		} else if j, dup := hashes[k.KeySHA256]; dup {
			bad(keyOf(i, "key_sha256"), "%s: the same key as %s (%q)", label, keyOf(j, "name"), a.APIKeys[j].Name)
		} else {
			hashes[k.KeySHA256] = i
		}
		if k.MaxInflight < 0 {
			bad(keyOf(i, "max_inflight"), "%s: must be >= 0, got %d", label, k.MaxInflight)
		}
		for j, m := range k.Models {
			if m == "" {
				bad(keyOf(i, "models")+"["+strconv.Itoa(j)+"]", "%s: must not be empty", label)
			}
		}
	}
}

// notHex says that s holds characters other than hex digits, if it does.
func notHex(s string) string {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return " (and characters that are not hexadecimal digits)"
		}
	}
	return ""
}

// truncate cuts s to at most n bytes, marking the cut with "…".
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// resolveEngineKeys reads the API key of every fleet entry that names an
// api_key_env from environ. A variable that is unset or empty is an error
// naming fleet[<i>].api_key_env and the variable (never a value).
func resolveEngineKeys(c *Config, environ map[string]string) error {
	var errs []error
	for i := range c.Fleet {
		s := &c.Fleet[i]
		if s.APIKeyEnv == "" {
			continue
		}
		key := "fleet[" + strconv.Itoa(i) + "].api_key_env"
		if !validEnvName(s.APIKeyEnv) {
			errs = append(errs, &KeyError{Key: key, Problem: fmt.Sprintf("must be an environment variable name, got %q", truncate(s.APIKeyEnv, 64))})
			continue
		}
		v := environ[s.APIKeyEnv]
		if v == "" {
			errs = append(errs, &KeyError{Key: key, Problem: fmt.Sprintf("engine %s: environment variable %s is not set or empty", s.ID, s.APIKeyEnv)})
			continue
		}
		s.APIKey = Secret(v)
	}
	return errors.Join(errs...)
}

// validEnvName reports whether s is a portable environment variable name.
func validEnvName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// loadEngineCAs reads engine.tls_ca_file, when set, into c.Engine.rootCAs.
// A file that cannot be read or holds no PEM certificate is an error
// naming the key.
func loadEngineCAs(c *Config, fromEnv map[string]string) error {
	path := c.Engine.TLSCAFile
	if path == "" {
		return nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return &KeyError{Key: "engine.tls_ca_file", Env: fromEnv["engine.tls_ca_file"], Problem: err.Error()}
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return &KeyError{Key: "engine.tls_ca_file", Env: fromEnv["engine.tls_ca_file"], Problem: path + " holds no PEM certificate"}
	}
	c.Engine.rootCAs = pool
	return nil
}

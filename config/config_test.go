package config

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// specExample is the config file of behaviour.md §14, verbatim.
const specExample = `engine:
  first_token_timeout_s: 30
  decode_read_timeout_s: 30
  prefill_timeout_s: 60
request:
  timeout_s: 600
handoff:
  max_age_s: 120
recovery:
  eject_after: 3
  failure_quarantine_s: 0
  retry_attempts: 0
  retry_budget_ratio: 0.2
  readmit_interval_s: 5
engine_contract:          # optional; without it, health checks readmit (development fleets)
  model: my-model
  engine: vllm
  version: ">=0.10"
  connector: nixl
fleet:
  - id: p1
    url: http://10.0.0.11:8000
    role: prefill         # prefill | decode | both
    connector: nixl
  - id: d1
    url: http://10.0.0.21:8000
    role: decode
    connector: nixl
`

// keyErrors returns the *KeyError values joined in err.
func keyErrors(t *testing.T, err error) []*KeyError {
	t.Helper()
	var out []*KeyError
	for _, e := range unjoin(err) {
		var ke *KeyError
		if !errors.As(e, &ke) {
			t.Fatalf("error %q is not a *KeyError", e)
		}
		out = append(out, ke)
	}
	return out
}

// TestDefaults proves the defaults table of behaviour.md §11 (and R-RETRY-1: one
// attempt by default, R-QUAR-1: quarantine off by default).
func TestDefaults(t *testing.T) {
	d := Default()
	if d.Server.TLS() || d.Server.TLSKeyFile != "" || d.Server.MetricsOnAdmin || d.Auth.APIKeysFile != "" || len(d.Auth.APIKeys) != 0 || d.Engine.TLSCAFile != "" {
		t.Errorf("TLS, admin metrics and client keys must be off by default: %+v %+v", d.Server, d.Auth)
	}
	want := map[string]float64{
		"engine.first_token_timeout_s":    30,
		"engine.decode_read_timeout_s":    30,
		"engine.prefill_timeout_s":        60,
		"request.timeout_s":               600,
		"handoff.max_age_s":               120,
		"recovery.eject_after":            3,
		"recovery.failure_quarantine_s":   0,
		"recovery.retry_attempts":         0,
		"recovery.retry_budget_ratio":     0.2,
		"recovery.readmit_interval_s":     5,
		"recovery.max_quarantine_s":       300,
		"breaker.lease_ttl_s":             5,
		"request.max_body_bytes":          32 << 20,
		"router.event_buffer":             4096,
		"request.max_n":                   16,
		"request.max_tokens_limit":        1 << 20,
		"request.max_response_bytes":      64 << 20,
		"server.stall_timeout_s":          30,
		"server.header_timeout_s":         10,
		"server.idle_timeout_s":           90,
		"server.max_header_bytes":         65536,
		"server.max_connections":          0,
		"server.max_inflight":             0,
		"server.max_body_bytes_inflight":  1 << 30,
		"placement.balance_abs_threshold": 32,
		"placement.balance_rel_threshold": 1.5,
		"placement.prefix_index_blocks":   65536,
		"placement.tokenize_timeout_s":    0.05,
		"placement.tokenize_min_blocks":   8,
	}
	got := map[string]float64{
		"engine.first_token_timeout_s":    d.Engine.FirstTokenTimeoutS,
		"engine.decode_read_timeout_s":    d.Engine.DecodeReadTimeoutS,
		"engine.prefill_timeout_s":        d.Engine.PrefillTimeoutS,
		"request.timeout_s":               d.Request.TimeoutS,
		"handoff.max_age_s":               d.Handoff.MaxAgeS,
		"recovery.eject_after":            float64(d.Recovery.EjectAfter),
		"recovery.failure_quarantine_s":   d.Recovery.FailureQuarantineS,
		"recovery.retry_attempts":         float64(d.Recovery.RetryAttempts),
		"recovery.retry_budget_ratio":     d.Recovery.RetryBudgetRatio,
		"recovery.readmit_interval_s":     d.Recovery.ReadmitIntervalS,
		"recovery.max_quarantine_s":       d.Recovery.MaxQuarantineS,
		"breaker.lease_ttl_s":             d.Breaker.LeaseTTLS,
		"request.max_body_bytes":          float64(d.Request.MaxBodyBytes),
		"router.event_buffer":             float64(d.Router.EventBuffer),
		"request.max_n":                   float64(d.Request.MaxN),
		"request.max_tokens_limit":        float64(d.Request.MaxTokensLimit),
		"request.max_response_bytes":      float64(d.Request.MaxResponseBytes),
		"server.stall_timeout_s":          d.Server.StallTimeoutS,
		"server.header_timeout_s":         d.Server.HeaderTimeoutS,
		"server.idle_timeout_s":           d.Server.IdleTimeoutS,
		"server.max_header_bytes":         float64(d.Server.MaxHeaderBytes),
		"server.max_connections":          float64(d.Server.MaxConnections),
		"server.max_inflight":             float64(d.Server.MaxInflight),
		"server.max_body_bytes_inflight":  float64(d.Server.MaxBodyBytesInflight),
		"placement.balance_abs_threshold": float64(d.Placement.BalanceAbsThreshold),
		"placement.balance_rel_threshold": d.Placement.BalanceRelThreshold,
		"placement.prefix_index_blocks":   float64(d.Placement.PrefixIndexBlocks),
		"placement.tokenize_timeout_s":    d.Placement.TokenizeTimeoutS,
		"placement.tokenize_min_blocks":   float64(d.Placement.TokenizeMinBlocks),
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("defaults:\n got %v\nwant %v", got, want)
	}
	if d.Placement.Index != "auto" {
		t.Errorf("placement.index default %q, want auto (R-PLACE-4)", d.Placement.Index)
	}
	if d.Placement.Policy != "prefix" {
		t.Errorf("placement.policy default %q, want prefix (R-PLACE-2)", d.Placement.Policy)
	}
	if d.Router.LogFormat != "text" || d.Router.LogLevel != "info" || d.Router.Level() != slog.LevelInfo {
		t.Errorf("log defaults: %q %q", d.Router.LogFormat, d.Router.LogLevel)
	}
	if d.EngineContract != nil || d.Fleet != nil {
		t.Errorf("default contract %v, fleet %v; want none", d.EngineContract, d.Fleet)
	}
	// The default router id is the host's name, stable across restarts.
	if host, _ := os.Hostname(); d.Router.ID != SanitizeID(host) || !validID(d.Router.ID) || d.Router.ID != Default().Router.ID {
		t.Errorf("default router id %q: want the host name %q", d.Router.ID, host)
	}
	if err := d.Validate(); err != nil {
		t.Fatalf("defaults do not validate: %v", err)
	}
	if d.Engine.FirstTokenTimeout() != 30*time.Second || d.Engine.DecodeReadTimeout() != 30*time.Second ||
		d.Engine.PrefillTimeout() != time.Minute || d.Request.Timeout() != 10*time.Minute ||
		d.Handoff.MaxAge() != 2*time.Minute || d.Recovery.FailureQuarantine() != 0 ||
		d.Recovery.ReadmitInterval() != 5*time.Second {
		t.Errorf("duration accessors disagree with the defaults: %+v", d)
	}

	// No file and no environment gives exactly the defaults.
	c, err := load(nil, map[string]string{})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(*c, d) {
		t.Errorf("load of nothing:\n got %+v\nwant %+v", *c, d)
	}
	// A file of comments only, or an empty document, changes nothing.
	for _, doc := range []string{"# nothing here\n", "---\n", "engine:\n"} {
		c, err := load([]byte(doc), map[string]string{})
		if err != nil {
			t.Fatalf("%q: %v", doc, err)
		}
		if !reflect.DeepEqual(*c, d) {
			t.Errorf("%q changed the defaults: %+v", doc, *c)
		}
	}
}

// TestSpecExampleLoads proves the example config file of behaviour.md §14 loads
// from a file with the values it spells out.
func TestSpecExampleLoads(t *testing.T) {
	for _, name := range envNames(t) {
		t.Setenv(name, "") // an empty variable overrides nothing
	}
	path := filepath.Join(t.TempDir(), "narwhal.yaml")
	if err := os.WriteFile(path, []byte(specExample), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	wantContract := &Contract{Model: "my-model", Engine: "vllm", Version: ">=0.10", Connector: "nixl"}
	if !reflect.DeepEqual(c.EngineContract, wantContract) {
		t.Errorf("contract %+v, want %+v", c.EngineContract, wantContract)
	}
	wantFleet := []EngineSpec{
		{ID: "p1", URL: "http://10.0.0.11:8000", Role: connector.RolePrefill, Connector: "nixl"},
		{ID: "d1", URL: "http://10.0.0.21:8000", Role: connector.RoleDecode, Connector: "nixl"},
	}
	if !reflect.DeepEqual(c.Fleet, wantFleet) {
		t.Errorf("fleet %+v, want %+v", c.Fleet, wantFleet)
	}
	d := Default()
	if c.Engine != d.Engine || c.Request != d.Request || c.Handoff != d.Handoff || c.Recovery != d.Recovery {
		t.Errorf("scalar settings %+v differ from the example's (= the defaults)", c)
	}
	if p, ok := c.EngineByID("p1"); !ok || !p.CanPrefill() || p.CanDecode() {
		t.Errorf("EngineByID(p1) = %+v, %v", p, ok)
	}
	if _, ok := c.EngineByID("nope"); ok {
		t.Error("EngineByID found an engine that is not in the fleet")
	}

	if _, err := Load(filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.HasPrefix(err.Error(), "config: ") {
		t.Errorf("missing file: %v", err)
	}
}

func TestYAMLOverridesDefaultsAndKeepsTheRest(t *testing.T) {
	c, err := load([]byte(`
engine:
  first_token_timeout_s: 2.5
  decode_read_timeout_s: 0   # R-TMO-4: no per-chunk bound
recovery:
  retry_attempts: 2
router:
  id: router-a
  log_format: json
  log_level: debug
fleet:
  - id: both1
    url: https://e1.example:8443/
    role: both
    prefill_slots: 4
    decode_slots: 8
`), map[string]string{})
	if err != nil {
		t.Fatal(err)
	}
	if c.Engine.FirstTokenTimeout() != 2500*time.Millisecond || c.Engine.DecodeReadTimeoutS != 0 {
		t.Errorf("engine %+v", c.Engine)
	}
	if c.Engine.PrefillTimeoutS != 60 || c.Recovery.EjectAfter != 3 || c.Request.TimeoutS != 600 {
		t.Errorf("keys absent from the file lost their defaults: %+v", c)
	}
	if c.Recovery.RetryAttempts != 2 || c.Router.ID != "router-a" || c.Router.LogFormat != "json" || c.Router.Level() != slog.LevelDebug {
		t.Errorf("recovery %+v router %+v", c.Recovery, c.Router)
	}
	want := EngineSpec{ID: "both1", URL: "https://e1.example:8443/", Role: connector.RoleBoth, Connector: connector.DefaultName, PrefillSlots: 4, DecodeSlots: 8}
	if len(c.Fleet) != 1 || c.Fleet[0] != want || !c.Fleet[0].CanPrefill() || !c.Fleet[0].CanDecode() {
		t.Errorf("fleet %+v, want [%+v] (connector defaults to nixl)", c.Fleet, want)
	}
}

// envNames lists every scalar setting as (dotted key, variable name), by
// reflection over the sections that have an envPrefix tag.
func envNames(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	ct := reflect.TypeFor[Config]()
	for i := range ct.NumField() {
		sf := ct.Field(i)
		prefix, ok := sf.Tag.Lookup("envPrefix")
		if !ok {
			continue
		}
		section := yamlName(sf)
		want := strings.ToUpper(section) + "_"
		if section == "bus" {
			want = "NATS_" // NARWHAL_NATS_URL and its siblings predate the section: a public interface
		}
		if prefix != want {
			t.Errorf("section %s: envPrefix %q, want %q", section, prefix, want)
		}
		for j := range sf.Type.NumField() {
			f := sf.Type.Field(j)
			if !f.IsExported() || f.Type.Kind() == reflect.Slice {
				continue // not a scalar setting (auth.api_keys, parsed state)
			}
			if want := strings.ToUpper(yamlName(f)); f.Tag.Get("env") != want {
				t.Errorf("%s.%s: env tag %q, want %q", section, yamlName(f), f.Tag.Get("env"), want)
			}
			out[section+"."+yamlName(f)] = EnvPrefix + prefix + f.Tag.Get("env")
		}
	}
	return out
}

// TestEnvOverridesYAMLForEveryKey proves behaviour.md §11: every scalar key has an
// environment variable NARWHAL_<SECTION>_<KEY>, and the variable wins over
// the file.
func TestEnvOverridesYAMLForEveryKey(t *testing.T) {
	names := envNames(t)
	if len(names) != 54 {
		t.Fatalf("%d scalar keys, want 54: %v", len(names), names)
	}
	dir := t.TempDir()
	caFile, keysFile := testkit.NewCA(t).Path, filepath.Join(dir, "keys.yaml")
	if err := os.WriteFile(keysFile, []byte("api_keys: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if names["engine.first_token_timeout_s"] != "NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S" ||
		names["bus.url"] != "NARWHAL_NATS_URL" || names["bus.creds"] != "NARWHAL_NATS_CREDS" ||
		names["bus.tls_ca"] != "NARWHAL_NATS_TLS_CA" || names["bus.replicas"] != "NARWHAL_NATS_REPLICAS" ||
		names["request.timeout_s"] != "NARWHAL_REQUEST_TIMEOUT_S" ||
		names["recovery.eject_after"] != "NARWHAL_RECOVERY_EJECT_AFTER" {
		t.Fatalf("variable names: %v", names)
	}
	fileValues := map[string]string{
		"engine.first_token_timeout_s": "11", "engine.decode_read_timeout_s": "12", "engine.prefill_timeout_s": "13",
		"request.timeout_s": "14", "request.max_body_bytes": "15",
		"handoff.max_age_s": "16", "handoff.on_recompute": "count",
		"recovery.eject_after": "17", "recovery.failure_quarantine_s": "18", "recovery.retry_attempts": "19",
		"recovery.retry_budget_ratio": "0.5", "recovery.readmit_interval_s": "21", "breaker.lease_ttl_s": "23",
		"recovery.max_quarantine_s": "33",
		"router.id":                 "from-file", "router.event_buffer": "22", "router.log_format": "json", "router.log_level": "warn",
		"request.max_n": "24", "request.max_tokens_limit": "25", "request.max_response_bytes": "35",
		"server.stall_timeout_s": "26", "server.header_timeout_s": "27", "server.idle_timeout_s": "28",
		"server.max_header_bytes": "29000", "server.max_connections": "30", "server.max_inflight": "31",
		"server.max_body_bytes_inflight": "32",
		"bus.url":                        "nats://file:4222", "bus.creds": "file.creds", "bus.token_file": "file.token", "bus.tls_ca": "file-ca.pem", "bus.tls_cert": "file-cert.pem",
		"bus.tls_key": "file-key.pem", "bus.replicas": "3", "bus.connect_timeout_s": "30",
		"engine.tls_ca_file": "/nonexistent/ca.pem", "server.tls_cert_file": "file.crt", "server.tls_key_file": "file.key",
		"server.metrics_on_admin": "false", "auth.api_keys_file": "/nonexistent/keys.yaml",
		"membership.registration_ttl_s": "41", "membership.drain_timeout_s": "42", "membership.max_engines": "46",
		"membership.max_registration_ttl_s": "47",
		"placement.policy":                  "random", "placement.balance_abs_threshold": "43", "placement.balance_rel_threshold": "2.5",
		"placement.prefix_index_blocks": "44", "placement.share_index": "true", "placement.engine_metrics_interval_s": "45",
		"placement.index": "exact", "placement.tokenize_timeout_s": "0.2", "placement.tokenize_min_blocks": "48",
	}
	envValues := map[string]string{
		"engine.first_token_timeout_s": "1.5", "engine.decode_read_timeout_s": "0", "engine.prefill_timeout_s": "3",
		"request.timeout_s": "4", "request.max_body_bytes": "5",
		"handoff.max_age_s": "6", "handoff.on_recompute": "fail_pair",
		"recovery.eject_after": "7", "recovery.failure_quarantine_s": "8", "recovery.retry_attempts": "9",
		"recovery.retry_budget_ratio": "1", "recovery.readmit_interval_s": "0.25", "breaker.lease_ttl_s": "0.75",
		"recovery.max_quarantine_s": "34",
		"router.id":                 "from-env", "router.event_buffer": "10", "router.log_format": "text", "router.log_level": "error",
		"request.max_n": "2", "request.max_tokens_limit": "3", "request.max_response_bytes": "36",
		"server.stall_timeout_s": "0.5", "server.header_timeout_s": "1.25", "server.idle_timeout_s": "2",
		"server.max_header_bytes": "8192", "server.max_connections": "11", "server.max_inflight": "12",
		"server.max_body_bytes_inflight": "13",
		"bus.url":                        "nats://env:4222,nats://env2:4222", "bus.creds": "env.creds", "bus.token_file": "env.token", "bus.tls_ca": "env-ca.pem", "bus.tls_cert": "env-cert.pem",
		"bus.tls_key": "env-key.pem", "bus.replicas": "5", "bus.connect_timeout_s": "2.5",
		"engine.tls_ca_file": caFile, "server.tls_cert_file": "env.crt", "server.tls_key_file": "env.key",
		"server.metrics_on_admin": "true", "auth.api_keys_file": keysFile,
		"membership.registration_ttl_s": "4.5", "membership.drain_timeout_s": "0.5", "membership.max_engines": "8",
		"membership.max_registration_ttl_s": "9.5",
		"placement.policy":                  "least_loaded", "placement.balance_abs_threshold": "0", "placement.balance_rel_threshold": "1",
		"placement.prefix_index_blocks": "7", "placement.share_index": "false", "placement.engine_metrics_interval_s": "0.5",
		"placement.index": "approximate", "placement.tokenize_timeout_s": "0.01", "placement.tokenize_min_blocks": "2",
	}
	var file strings.Builder
	sections := map[string][]string{}
	for k := range fileValues {
		s, key, _ := strings.Cut(k, ".")
		sections[s] = append(sections[s], "  "+key+": "+fileValues[k]+"\n")
	}
	for s, lines := range sections {
		file.WriteString(s + ":\n" + strings.Join(lines, ""))
	}
	environ := map[string]string{"UNRELATED": "x"}
	for k, v := range envValues {
		environ[names[k]] = v
	}

	// The file's own paths do not exist: alone it fails on the first
	// file read, naming the key.
	if _, err := load([]byte(file.String()), map[string]string{}); err == nil || !strings.Contains(err.Error(), "auth.api_keys_file") {
		t.Errorf("file alone with missing files: %v, want an error naming auth.api_keys_file", err)
	}
	fileOK := strings.NewReplacer("/nonexistent/ca.pem", caFile, "/nonexistent/keys.yaml", keysFile).Replace(file.String())
	fromFile, err := load([]byte(fileOK), map[string]string{})
	if err != nil {
		t.Fatal(err)
	}
	fromBoth, err := load([]byte(file.String()), environ)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		Engine:     Engine{FirstTokenTimeoutS: 1.5, DecodeReadTimeoutS: 0, PrefillTimeoutS: 3},
		Request:    Request{TimeoutS: 4, MaxBodyBytes: 5, MaxN: 2, MaxTokensLimit: 3, MaxResponseBytes: 36},
		Handoff:    Handoff{MaxAgeS: 6, OnRecompute: "fail_pair"},
		Recovery:   Recovery{EjectAfter: 7, FailureQuarantineS: 8, RetryAttempts: 9, RetryBudgetRatio: 1, ReadmitIntervalS: 0.25, MaxQuarantineS: 34},
		Breaker:    Breaker{LeaseTTLS: 0.75},
		Membership: Membership{RegistrationTTLS: 4.5, DrainTimeoutS: 0.5, MaxEngines: 8, MaxRegistrationTTLS: 9.5},
		Placement: Placement{Policy: "least_loaded", BalanceAbsThreshold: 0, BalanceRelThreshold: 1, PrefixIndexBlocks: 7, ShareIndex: false, EngineMetricsIntervalS: 0.5,
			Index: "approximate", TokenizeTimeoutS: 0.01, TokenizeMinBlocks: 2},
		Router: Router{ID: "from-env", EventBuffer: 10, LogFormat: "text", LogLevel: "error"},
		Server: Server{StallTimeoutS: 0.5, HeaderTimeoutS: 1.25, IdleTimeoutS: 2, MaxHeaderBytes: 8192,
			MaxConnections: 11, MaxInflight: 12, MaxBodyBytesInflight: 13,
			TLSCertFile: "env.crt", TLSKeyFile: "env.key", MetricsOnAdmin: true},
		Bus: Bus{URL: "nats://env:4222,nats://env2:4222", Creds: "env.creds", TokenFile: "env.token", TLSCA: "env-ca.pem", TLSCert: "env-cert.pem",
			TLSKey: "env-key.pem", Replicas: 5, ConnectTimeoutS: 2.5},
		Auth: Auth{APIKeysFile: keysFile},
	}
	want.Engine.TLSCAFile = caFile
	if fromBoth.Engine.RootCAs() == nil {
		t.Error("engine.tls_ca_file from the environment was not read")
	}
	fromBoth.Engine.rootCAs = nil
	if !reflect.DeepEqual(*fromBoth, want) {
		t.Errorf("env over file:\n got %+v\nwant %+v", *fromBoth, want)
	}
	if fromFile.Router.ID != "from-file" || fromFile.Engine.FirstTokenTimeoutS != 11 || fromFile.Recovery.RetryBudgetRatio != 0.5 ||
		fromFile.Bus.URL != "nats://file:4222" || fromFile.Bus.Replicas != 3 || fromFile.Bus.ConnectTimeout() != 30*time.Second {
		t.Errorf("file alone: %+v", *fromFile)
	}

	// An empty variable does not override.
	c, err := load([]byte("engine:\n  prefill_timeout_s: 7\n"), map[string]string{"NARWHAL_ENGINE_PREFILL_TIMEOUT_S": ""})
	if err != nil || c.Engine.PrefillTimeoutS != 7 {
		t.Errorf("empty variable: %v, %v", c, err)
	}
}

// TestParseAndLoadReadTheProcessEnvironment proves the exported entry
// points apply the real environment over the file.
func TestParseAndLoadReadTheProcessEnvironment(t *testing.T) {
	t.Setenv("NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S", "4")
	t.Setenv("NARWHAL_RECOVERY_EJECT_AFTER", "9")
	c, err := Parse([]byte("engine:\n  first_token_timeout_s: 30\nrecovery:\n  eject_after: 2\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Engine.FirstTokenTimeout() != 4*time.Second || c.Recovery.EjectAfter != 9 {
		t.Errorf("Parse: %+v", c)
	}
	c, err = Load("")
	if err != nil || c.Engine.FirstTokenTimeoutS != 4 {
		t.Errorf("Load(\"\"): %+v, %v", c, err)
	}

	t.Setenv("NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S", "-1")
	_, err = Parse(nil)
	const want = "config: NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S (engine.first_token_timeout_s): must be > 0, got -1"
	if err == nil || err.Error() != want {
		t.Errorf("got %v, want %s", err, want)
	}
}

// TestBadEnvValueNamesVariableAndKey proves behaviour.md §11: invalid config fails
// with a message naming the key — here the variable too.
func TestBadEnvValueNamesVariableAndKey(t *testing.T) {
	cases := map[string]struct {
		environ map[string]string
		want    []string
	}{
		"float": {map[string]string{"NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S": "abc"},
			[]string{`config: NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S (engine.first_token_timeout_s): must be a number, got "abc"`}},
		"int": {map[string]string{"NARWHAL_RECOVERY_EJECT_AFTER": "2.5"},
			[]string{`config: NARWHAL_RECOVERY_EJECT_AFTER (recovery.eject_after): must be an integer, got "2.5"`}},
		"int range": {map[string]string{"NARWHAL_REQUEST_MAX_BODY_BYTES": "99999999999"},
			[]string{`config: NARWHAL_REQUEST_MAX_BODY_BYTES (request.max_body_bytes): must be an integer in range, got "99999999999"`}},
		"two sections": {map[string]string{"NARWHAL_HANDOFF_MAX_AGE_S": "2m", "NARWHAL_ROUTER_EVENT_BUFFER": "lots"},
			[]string{`config: NARWHAL_HANDOFF_MAX_AGE_S (handoff.max_age_s): must be a number, got "2m"`,
				`config: NARWHAL_ROUTER_EVENT_BUFFER (router.event_buffer): must be an integer, got "lots"`}},
		"parses but invalid": {map[string]string{"NARWHAL_RECOVERY_RETRY_BUDGET_RATIO": "1.5", "NARWHAL_ROUTER_LOG_LEVEL": "loud"},
			[]string{`config: NARWHAL_RECOVERY_RETRY_BUDGET_RATIO (recovery.retry_budget_ratio): must be between 0 and 1, got 1.5`,
				`config: NARWHAL_ROUTER_LOG_LEVEL (router.log_level): must be one of debug, info, warn, error, got "loud"`}},
		"not finite": {map[string]string{"NARWHAL_ENGINE_PREFILL_TIMEOUT_S": "NaN"},
			[]string{`config: NARWHAL_ENGINE_PREFILL_TIMEOUT_S (engine.prefill_timeout_s): must be a finite number, got NaN`}},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := load(nil, tc.environ)
			if err == nil {
				t.Fatal("no error")
			}
			if got := strings.Split(err.Error(), "\n"); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got\n%s\nwant\n%s", err, strings.Join(tc.want, "\n"))
			}
		})
	}
}

// TestValidateNamesEveryKey proves behaviour.md §11 (invalid config fails naming
// the key) for every rule of Validate, and R-TMO-4 (decode_read_timeout_s
// = 0 is valid) and R-QUAR-1 (failure_quarantine_s = 0 is valid).
func TestValidateNamesEveryKey(t *testing.T) {
	// The registered connectors, as the messages list them: nixl, sglang,
	// shared-storage, and any connector added to engines/connector/all.
	known := strings.Join(connector.Names(), ", ")
	for _, shipped := range []string{"nixl", "sglang", "shared-storage"} {
		if !slices.Contains(connector.Names(), shipped) {
			t.Fatalf("registered connectors %q lack %s", known, shipped)
		}
	}
	valid := func() Config {
		c := Default()
		c.Fleet = []EngineSpec{
			{ID: "p1", URL: "http://10.0.0.11:8000", Role: connector.RolePrefill, Connector: "nixl"},
			{ID: "d1", URL: "https://10.0.0.21:8000", Role: connector.RoleDecode, Connector: "nixl", DecodeSlots: 2},
		}
		c.EngineContract = &Contract{Model: "m", Engine: "vllm", Version: ">=0.10,<0.12", Connector: "nixl"}
		return c
	}
	if c := valid(); c.Validate() != nil {
		t.Fatalf("base config invalid: %v", c.Validate())
	}
	zeroOK := valid()
	zeroOK.Engine.DecodeReadTimeoutS = 0
	zeroOK.Recovery.FailureQuarantineS = 0
	zeroOK.Recovery.RetryAttempts = 0
	zeroOK.Recovery.RetryBudgetRatio = 0
	zeroOK.Fleet = nil
	zeroOK.EngineContract = &Contract{}
	if err := zeroOK.Validate(); err != nil {
		t.Fatalf("zero values that are allowed were rejected: %v", err)
	}

	cases := []struct {
		mutate func(*Config)
		want   string
	}{
		{func(c *Config) { c.Engine.FirstTokenTimeoutS = -1 }, "config: engine.first_token_timeout_s: must be > 0, got -1"},
		{func(c *Config) { c.Engine.FirstTokenTimeoutS = 0 }, "config: engine.first_token_timeout_s: must be > 0, got 0"},
		{func(c *Config) { c.Engine.FirstTokenTimeoutS = math.Inf(1) }, "config: engine.first_token_timeout_s: must be a finite number, got +Inf"},
		{func(c *Config) { c.Engine.DecodeReadTimeoutS = -0.5 }, "config: engine.decode_read_timeout_s: must be >= 0, got -0.5"},
		{func(c *Config) { c.Engine.PrefillTimeoutS = 0 }, "config: engine.prefill_timeout_s: must be > 0, got 0"},
		{func(c *Config) { c.Request.TimeoutS = -3 }, "config: request.timeout_s: must be > 0, got -3"},
		{func(c *Config) { c.Handoff.OnRecompute = "eject" }, `config: handoff.on_recompute: must be count or fail_pair, got "eject"`},
		{func(c *Config) { c.Request.MaxBodyBytes = 0 }, "config: request.max_body_bytes: must be > 0, got 0"},
		{func(c *Config) { c.Request.MaxN = 0 }, "config: request.max_n: must be >= 1, got 0"},
		{func(c *Config) { c.Request.MaxTokensLimit = -1 }, "config: request.max_tokens_limit: must be >= 1, got -1"},
		{func(c *Config) { c.Request.MaxResponseBytes = 0 }, "config: request.max_response_bytes: must be > 0, got 0"},
		{func(c *Config) { c.Server.StallTimeoutS = 0 }, "config: server.stall_timeout_s: must be > 0, got 0"},
		{func(c *Config) { c.Server.HeaderTimeoutS = math.NaN() }, "config: server.header_timeout_s: must be a finite number, got NaN"},
		{func(c *Config) { c.Server.IdleTimeoutS = -1 }, "config: server.idle_timeout_s: must be > 0, got -1"},
		{func(c *Config) { c.Server.MaxHeaderBytes = 100 }, "config: server.max_header_bytes: must be between 4096 and 16777216, got 100"},
		{func(c *Config) { c.Server.MaxConnections = -1 }, "config: server.max_connections: must be >= 1, or 0 to derive it from the descriptor limit, got -1"},
		{func(c *Config) { c.Server.MaxInflight = -1 }, "config: server.max_inflight: must be >= 0 (0 = no limit), got -1"},
		{func(c *Config) { c.Server.MaxBodyBytesInflight = 1 << 20 }, "config: server.max_body_bytes_inflight: must be >= request.max_body_bytes (33554432), or the largest body allowed could never be read, got 1048576"},
		{func(c *Config) { c.Handoff.MaxAgeS = 0 }, "config: handoff.max_age_s: must be > 0, got 0"},
		{func(c *Config) { c.Recovery.EjectAfter = 0 }, "config: recovery.eject_after: must be >= 1, got 0"},
		{func(c *Config) { c.Recovery.FailureQuarantineS = -1 }, "config: recovery.failure_quarantine_s: must be >= 0, got -1"},
		{func(c *Config) { c.Recovery.RetryAttempts = -1 }, "config: recovery.retry_attempts: must be >= 0, got -1"},
		{func(c *Config) { c.Recovery.RetryBudgetRatio = 1.01 }, "config: recovery.retry_budget_ratio: must be between 0 and 1, got 1.01"},
		{func(c *Config) { c.Recovery.RetryBudgetRatio = -0.1 }, "config: recovery.retry_budget_ratio: must be between 0 and 1, got -0.1"},
		{func(c *Config) { c.Recovery.RetryBudgetRatio = math.NaN() }, "config: recovery.retry_budget_ratio: must be between 0 and 1, got NaN"},
		{func(c *Config) { c.Recovery.ReadmitIntervalS = 0 }, "config: recovery.readmit_interval_s: must be > 0, got 0"},
		{func(c *Config) { c.Recovery.MaxQuarantineS = 0 }, "config: recovery.max_quarantine_s: must be > 0, got 0"},
		{func(c *Config) { c.Placement.Policy = "round_robin" }, `config: placement.policy: must be one of prefix, least_loaded, random, got "round_robin"`},
		{func(c *Config) { c.Placement.BalanceAbsThreshold = -1 }, "config: placement.balance_abs_threshold: must be >= 0, got -1"},
		{func(c *Config) { c.Placement.BalanceRelThreshold = 0.5 }, "config: placement.balance_rel_threshold: must be >= 1, got 0.5"},
		{func(c *Config) { c.Placement.BalanceRelThreshold = math.NaN() }, "config: placement.balance_rel_threshold: must be a finite number, got NaN"},
		{func(c *Config) { c.Placement.PrefixIndexBlocks = 0 }, "config: placement.prefix_index_blocks: must be between 1 and 16777216, got 0"},
		{func(c *Config) { c.Placement.Index = "lmcache" }, `config: placement.index: must be one of auto, exact, approximate, got "lmcache"`},
		{func(c *Config) { c.Placement.TokenizeTimeoutS = 0 }, "config: placement.tokenize_timeout_s: must be > 0, got 0"},
		{func(c *Config) { c.Placement.TokenizeTimeoutS = math.Inf(1) }, "config: placement.tokenize_timeout_s: must be a finite number, got +Inf"},
		{func(c *Config) { c.Placement.TokenizeMinBlocks = 0 }, "config: placement.tokenize_min_blocks: must be between 1 and 4096, got 0"},
		{func(c *Config) { c.Breaker.LeaseTTLS = 0.2 }, "config: breaker.lease_ttl_s: must be >= 0.5, got 0.2"},
		{func(c *Config) { c.Router.ID = "" }, `config: router.id: must be non-empty and hold only letters, digits, '-' and '_', got ""`},
		{func(c *Config) { c.Router.ID = "host.example.com-1" }, `config: router.id: must be non-empty and hold only letters, digits, '-' and '_', got "host.example.com-1"`},
		{func(c *Config) { c.Router.EventBuffer = 0 }, "config: router.event_buffer: must be > 0, got 0"},
		{func(c *Config) { c.Router.LogFormat = "xml" }, `config: router.log_format: must be "text" or "json", got "xml"`},
		{func(c *Config) { c.Router.LogLevel = "" }, `config: router.log_level: must be one of debug, info, warn, error, got ""`},
		{func(c *Config) { c.Bus.Replicas = 0 }, "config: bus.replicas: must be between 1 and 5, got 0"},
		{func(c *Config) { c.Bus.Replicas = 6 }, "config: bus.replicas: must be between 1 and 5, got 6"},
		{func(c *Config) { c.Bus.ConnectTimeoutS = -1 }, "config: bus.connect_timeout_s: must be >= 0, got -1"},
		{func(c *Config) { c.Bus.TLSCert = "cert.pem" }, "config: bus.tls_cert: bus.tls_cert and bus.tls_key go together (a client certificate and its key), got only one"},
		{func(c *Config) { c.EngineContract.Version = "~0.10" }, `config: engine_contract.version: bad version constraint "~0.10": clause "~0.10": want a dotted numeric version such as 0.10`},
		{func(c *Config) { c.EngineContract.Version = ">=0.10,," }, `config: engine_contract.version: bad version constraint ">=0.10,,": clause "": want a dotted numeric version such as 0.10`},
		{func(c *Config) { c.EngineContract.Connector = "lmcache" }, `config: engine_contract.connector: must be one of ` + known + `, got "lmcache"`},
		{func(c *Config) { c.Fleet[1].ID = "" }, `config: fleet[1].id: must be non-empty and hold only letters, digits, '-' and '_', got ""`},
		{func(c *Config) { c.Fleet[1].ID = "d.1" }, `config: fleet[1].id: must be non-empty and hold only letters, digits, '-' and '_', got "d.1"`},
		{func(c *Config) { c.Fleet[1].ID = "p1" }, `config: fleet[1].id: duplicate id "p1" (also fleet[0])`},
		{func(c *Config) { c.Fleet[0].URL = "10.0.0.11:8000" }, `config: fleet[0].url: must be an absolute http or https URL, got "10.0.0.11:8000"`},
		{func(c *Config) { c.Fleet[0].URL = "grpc://10.0.0.11:8000" }, `config: fleet[0].url: must be an absolute http or https URL, got "grpc://10.0.0.11:8000"`},
		{func(c *Config) { c.Fleet[0].URL = "http:///v1" }, `config: fleet[0].url: must be an absolute http or https URL, got "http:///v1"`},
		{func(c *Config) { c.Fleet[0].Role = "producer" }, `config: fleet[0].role: must be "prefill", "decode" or "both", got "producer"`},
		{func(c *Config) { c.Fleet[0].Connector = "" }, `config: fleet[0].connector: must be one of ` + known + `, got ""`},
		{func(c *Config) { c.Fleet[0].Connector = "no-such-connector" }, `config: fleet[0].connector: must be one of ` + known + `, got "no-such-connector"`},
		{func(c *Config) { c.Fleet[0].PrefillSlots = -1 }, "config: fleet[0].prefill_slots: must be >= 0, got -1"},
		{func(c *Config) { c.Fleet[1].DecodeSlots = -2 }, "config: fleet[1].decode_slots: must be >= 0, got -2"},
		// The sglang connector (R-DESC-7): a prefill names its bootstrap
		// port, nothing else has one, no role both; a nixl producer with
		// only an sglang consumer (or the reverse) is a mix that cannot
		// hand off (R-DESC-3).
		{func(c *Config) { c.Fleet[0].Connector, c.Fleet[1].Connector = "sglang", "sglang" },
			"config: fleet[0].bootstrap_port: must be set on a prefill sglang engine (the port of its bootstrap server)"},
		{func(c *Config) { c.Fleet[0].BootstrapPort = 8998 },
			"config: fleet[0].bootstrap_port: only engines of a connector with a bootstrap server (sglang) have one, not nixl"},
		{func(c *Config) {
			c.Fleet[0].Connector, c.Fleet[1].Connector, c.Fleet[0].BootstrapPort, c.Fleet[1].BootstrapPort = "sglang", "sglang", 8998, 70000
		}, "config: fleet[1].bootstrap_port: must be a port number (1 to 65535)"},
		{func(c *Config) {
			c.Fleet[0].Connector, c.Fleet[1].Connector, c.Fleet[0].BootstrapPort, c.Fleet[1].Role = "sglang", "sglang", 8998, "both"
		}, "config: fleet[1].role: an sglang engine runs in one disaggregation mode: prefill or decode, not both"},
		{func(c *Config) { c.Fleet[0].Connector, c.Fleet[0].BootstrapPort = "sglang", 8998 },
			"config: fleet[0].connector: prefill engine p1 uses sglang, but no decode engine does (a producer and a consumer of different connectors cannot hand off KV)\n" +
				"config: fleet[1].connector: decode engine d1 uses nixl, but no prefill engine does (a producer and a consumer of different connectors cannot hand off KV)"},
	}
	for _, tc := range cases {
		c := valid()
		tc.mutate(&c)
		err := c.Validate()
		if err == nil {
			t.Errorf("%s: no error", tc.want)
			continue
		}
		if err.Error() != tc.want {
			t.Errorf("got  %s\nwant %s", err, tc.want)
		}
		kes := keyErrors(t, err)
		if len(kes) != strings.Count(tc.want, "\n")+1 || !strings.HasPrefix(tc.want, "config: "+kes[0].Key+": ") || kes[0].Env != "" {
			t.Errorf("%s: key errors %+v", tc.want, kes)
		}
	}

	// Several problems are all reported, one line each.
	c := valid()
	c.Engine.PrefillTimeoutS = -1
	c.Fleet[0].Role = ""
	kes := keyErrors(t, c.Validate())
	if len(kes) != 2 || kes[0].Key != "engine.prefill_timeout_s" || kes[1].Key != "fleet[0].role" {
		t.Errorf("two problems: %+v", kes)
	}
}

// registryConnector is a connector registered only by
// TestConnectorRegistryIsTheOnlyList.
type registryConnector struct{}

func (registryConnector) Name() string     { return "lmcache-test" }
func (registryConnector) Fields() []string { return nil }
func (registryConnector) CheckEngine(connector.Role, int) (string, string) {
	return "", ""
}
func (registryConnector) Start(context.Context, connector.Legs) (connector.Run, error) {
	return nil, errors.New("lmcache-test runs no attempt")
}

var registerOnce sync.Once

// TestConnectorRegistryIsTheOnlyList proves connector names are defined
// once, by the registry of engines/connector: a connector unknown there is
// refused for the fleet and the contract, and registering it is all it
// takes to make it valid.
func TestConnectorRegistryIsTheOnlyList(t *testing.T) {
	doc := []byte("engine_contract:\n  connector: lmcache-test\nfleet:\n  - {id: e1, url: 'http://h:1', role: both, connector: lmcache-test}\n")
	if !slices.Contains(connector.Names(), "lmcache-test") {
		if _, err := load(doc, map[string]string{}); err == nil {
			t.Fatal("lmcache-test accepted before it is registered")
		}
	}
	registerOnce.Do(func() { connector.Register(registryConnector{}) })
	if _, err := load(doc, map[string]string{}); err != nil {
		t.Fatalf("lmcache-test rejected once registered: %v", err)
	}
	bad := []byte("fleet:\n  - {id: e1, url: 'http://h:1', role: producer}\n")
	if _, err := load(bad, map[string]string{}); err == nil || !strings.Contains(err.Error(), `must be "prefill", "decode" or "both", got "producer"`) {
		t.Fatalf("role producer: %v", err)
	}
}

// TestYAMLErrorsNameTheKey proves behaviour.md §11 for the file: unknown keys and
// values of the wrong type fail with a message naming the key.
func TestYAMLErrorsNameTheKey(t *testing.T) {
	cases := map[string]struct {
		doc  string
		want string
	}{
		"unknown top-level key": {"engines:\n  first_token_timeout_s: 3\n",
			"config: engines: unknown key (known keys here: engine, request, handoff, recovery, breaker, membership, placement, router, server, bus, auth, engine_contract, fleet)"},
		"unknown section key": {"engine:\n  first_token_timeout: 3\n",
			"config: engine.first_token_timeout: unknown key (known keys here: first_token_timeout_s, decode_read_timeout_s, prefill_timeout_s, tls_ca_file)"},
		"unknown contract key": {"engine_contract:\n  modle: m\n",
			"config: engine_contract.modle: unknown key (known keys here: model, engine, version, connector)"},
		"unknown fleet key": {"fleet:\n  - id: p1\n    url: http://h:1\n    role: prefill\n    slots: 2\n",
			"config: fleet[0].slots: unknown key (known keys here: id, url, role, connector, bootstrap_port, prefill_slots, decode_slots, api_key_env)"},
		"string for a number": {"engine:\n  first_token_timeout_s: 30s\n",
			`config: engine.first_token_timeout_s: must be a number, got string "30s"`},
		"fraction for an integer": {"recovery:\n  eject_after: 1.5\n",
			"config: recovery.eject_after: must be an integer, got number 1.5"},
		"null for an integer": {"recovery:\n  eject_after:\n",
			"config: recovery.eject_after: must be an integer, got null"},
		"unquoted version": {"engine_contract:\n  version: 0.10\n",
			"config: engine_contract.version: must be a string, got number 0.1 (quote it)"},
		"list for a section": {"engine: [1]\n",
			"config: engine: must be a mapping, got a list"},
		"mapping for the fleet": {"fleet:\n  id: p1\n",
			"config: fleet: must be a list, got a mapping"},
		"null fleet entry": {"fleet:\n  -\n",
			"config: fleet[0]: must be a mapping, got null"},
		"top level not a mapping": {"- 1\n",
			"config: yaml: the top level must be a mapping, got a list"},
		"two documents": {"engine: {}\n---\nrequest: {}\n",
			"config: yaml: the file holds 2 documents, want one"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := load([]byte(tc.doc), map[string]string{})
			if err == nil {
				t.Fatal("no error")
			}
			if err.Error() != tc.want {
				t.Errorf("got  %s\nwant %s", err, tc.want)
			}
		})
	}

	// Syntax errors and duplicate keys carry the position.
	for _, doc := range []string{"engine: [\n", "engine:\n  prefill_timeout_s: 1\n  prefill_timeout_s: 2\n"} {
		_, err := load([]byte(doc), map[string]string{})
		if err == nil || !strings.HasPrefix(err.Error(), "config: yaml: [") {
			t.Errorf("%q: %v", doc, err)
		}
	}
	// An explicit null contract or fleet means none.
	c, err := load([]byte("engine_contract:\nfleet:\n"), map[string]string{})
	if err != nil || c.EngineContract != nil || c.Fleet != nil {
		t.Errorf("null contract and fleet: %+v, %v", c, err)
	}
	// Anchors and merge keys work as YAML says; a later key wins.
	c, err = load([]byte("fleet:\n  - &base {id: p1, url: 'http://h:1', role: prefill, prefill_slots: 3}\n  - <<: *base\n    id: d1\n    role: decode\n"), map[string]string{})
	if err != nil {
		t.Fatal(err)
	}
	want := []EngineSpec{
		{ID: "p1", URL: "http://h:1", Role: connector.RolePrefill, Connector: "nixl", PrefillSlots: 3},
		{ID: "d1", URL: "http://h:1", Role: connector.RoleDecode, Connector: "nixl", PrefillSlots: 3},
	}
	if !reflect.DeepEqual(c.Fleet, want) {
		t.Errorf("merge keys: %+v, want %+v", c.Fleet, want)
	}
}

func TestSeconds(t *testing.T) {
	cases := map[float64]time.Duration{
		0: 0, 1: time.Second, 0.25: 250 * time.Millisecond, 1e-9: time.Nanosecond, 0.1: 100 * time.Millisecond,
		-2: -2 * time.Second, 1e12: math.MaxInt64, math.Inf(1): math.MaxInt64, math.Inf(-1): math.MinInt64, math.NaN(): 0,
	}
	for s, want := range cases {
		if got := Seconds(s); got != want {
			t.Errorf("Seconds(%v) = %v, want %v", s, got, want)
		}
	}
}

func TestSanitizeID(t *testing.T) {
	for in, want := range map[string]string{"": "", "gpu-node_1": "gpu-node_1", "host.example.com-42": "host-example-com-42", "a b*c>d": "a-b-c-d", "é": "--"} {
		if got := SanitizeID(in); got != want {
			t.Errorf("SanitizeID(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestConnectionLimitRFAIL9 proves the arithmetic of server.max_connections
// (behaviour.md R-API-7, R-FAIL-9): unset, it is derived from the
// descriptor limit, leaving DescriptorRoom and two engine legs per client
// connection, at most 10,000; a value set that leaves no such room is
// refused with the arithmetic; so is a limit that leaves room for no
// connection at all.
func TestConnectionLimitRFAIL9(t *testing.T) {
	for _, c := range []struct {
		set     int
		nofile  uint64
		want    int
		derived bool
		err     string
	}{
		{0, 1024, 320, true, ""},      // (1024 − 64) / 3
		{0, 256, 64, true, ""},        // (256 − 64) / 3
		{0, 1 << 20, 10000, true, ""}, // capped
		{0, 0, 10000, true, ""},       // limit unknown
		{0, ^uint64(0), 10000, true, ""},
		{320, 1024, 320, false, ""},
		{20000, 1 << 20, 20000, false, ""},
		{10000, 1024, 0, false, "config: server.max_connections 10000 leaves no descriptors for engine legs: limit 1024 − room 64 (listeners, bus, files, engine control connections) = 960, 3 per client connection (itself, its prefill leg, its decode leg): at most 320; raise the limit (ulimit -n, LimitNOFILE=) or lower server.max_connections"},
		{321, 1024, 0, false, "config: server.max_connections 321 leaves no descriptors for engine legs: limit 1024 − room 64"},
		{0, 64, 0, false, "config: the descriptor limit 64 leaves room for no client connection: limit 64 − room 64 (listeners, bus, files, engine control connections) = 0, 3 per client connection (itself, its prefill leg, its decode leg): at most 0"},
	} {
		s := Default().Server
		s.MaxConnections = c.set
		n, derived, err := s.ConnectionLimit(c.nofile)
		if c.err != "" {
			if err == nil || !strings.HasPrefix(err.Error(), c.err) {
				t.Errorf("set %d, limit %d: error %v, want %q…", c.set, c.nofile, err, c.err)
			}
			continue
		}
		if err != nil || n != c.want || derived != c.derived {
			t.Errorf("set %d, limit %d: %d derived %v (%v), want %d derived %v", c.set, c.nofile, n, derived, err, c.want, c.derived)
		}
	}
	if d := Default().Server.MaxConnections; d != 0 {
		t.Errorf("default server.max_connections %d, want 0 (derived)", d)
	}
}

// TestMaxRegistrationTTLRFLEET5: membership.max_registration_ttl_s, the
// cap of R-FLEET-5 on a registration's fleet key, defaults to 60 s and
// must be > 0.
func TestMaxRegistrationTTLRFLEET5(t *testing.T) {
	if d := Default(); d.Membership.MaxRegistrationTTL() != time.Minute {
		t.Errorf("default cap %v, want 1m", d.Membership.MaxRegistrationTTL())
	}
	for _, v := range []string{"0", "-1"} {
		if _, err := load([]byte("membership:\n  max_registration_ttl_s: "+v+"\n"), map[string]string{}); err == nil ||
			!strings.Contains(err.Error(), "membership.max_registration_ttl_s") {
			t.Errorf("max_registration_ttl_s %s: %v, want refused naming the key", v, err)
		}
	}
}

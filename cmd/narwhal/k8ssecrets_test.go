package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
)

// readSecrets decodes DIR/KubernetesSecretsFile strictly (an unknown
// field fails) into its Secrets, by name.
func readSecrets(t *testing.T, dir string) map[string]k8sSecret {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, KubernetesSecretsFile))
	if err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(filepath.Join(dir, KubernetesSecretsFile)); fi.Mode().Perm() != 0o600 {
		t.Errorf("%s mode %v, want 0600", KubernetesSecretsFile, fi.Mode().Perm())
	}
	got := map[string]k8sSecret{}
	for doc := range strings.SplitSeq(string(raw), "---\n") {
		dec := json.NewDecoder(strings.NewReader(doc))
		dec.DisallowUnknownFields()
		var s k8sSecret
		if err := dec.Decode(&s); err != nil {
			t.Fatalf("document %q: %v", doc, err)
		}
		if s.APIVersion != "v1" || s.Kind != "Secret" || s.Type != "Opaque" {
			t.Errorf("%s: %s %s %s, want v1 Secret Opaque", s.Metadata.Name, s.APIVersion, s.Kind, s.Type)
		}
		got[s.Metadata.Name] = s
	}
	return got
}

// TestBusCredsKubernetesSecretsRBUS8 proves `narwhal bus creds
// --kubernetes-secrets` (behaviour.md R-BUS-8, R-BUS-11): on a new DIR and
// again on the existing one, it writes one Secret for the bus's side
// holding exactly auth.conf, route.secret and admin.creds — never a seed of
// keys/ — and one per credential file of DIR, byte for byte, in the
// namespace asked for; a directory without a mesh and a bad namespace are
// refused.
func TestBusCredsKubernetesSecretsRBUS8(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "mesh")
	var stdout, stderr bytes.Buffer
	if err := runBusCreds([]string{"--out", dir, "--engine", "p-0", "--kubernetes-secrets", "--namespace", "llm"}, &stdout, &stderr); err != nil {
		t.Fatalf("new mesh: %v %s", err, stderr.String())
	}
	if !strings.Contains(stdout.String(), KubernetesSecretsFile) || !strings.Contains(stdout.String(), BusAuthSecret) {
		t.Errorf("stdout does not list the Secrets: %s", stdout.String())
	}
	// On the existing DIR: an identity added, and a re-render with no id.
	if err := runBusCreds([]string{"--out", dir, "--router", "Edge_1", "--kubernetes-secrets", "--namespace", "llm"}, &stdout, &stderr); err != nil {
		t.Fatalf("existing mesh, new router: %v", err)
	}
	before, _ := os.ReadFile(filepath.Join(dir, "admin.creds"))
	if err := runBusCreds([]string{"--out", dir, "--kubernetes-secrets", "--namespace", "llm"}, &stdout, &stderr); err != nil {
		t.Fatalf("existing mesh, no identity: %v", err)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "admin.creds")); !bytes.Equal(before, after) {
		t.Error("--kubernetes-secrets on an existing mesh rotated a credential")
	}
	got := readSecrets(t, dir)
	var names []string
	for n, s := range got {
		names = append(names, n)
		if s.Metadata.Namespace != "llm" {
			t.Errorf("%s: namespace %q, want llm", n, s.Metadata.Namespace)
		}
	}
	sort.Strings(names)
	want := []string{"narwhal-admin-creds", BusAuthSecret, "narwhal-breaker-creds", "narwhal-chaos-creds",
		"narwhal-engine-p-0-creds", "narwhal-router-edge-1-creds", "narwhal-viewer-creds"}
	sort.Strings(want)
	if strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("Secrets %v, want %v", names, want)
	}
	busSecret := got[BusAuthSecret]
	var keys []string
	for k, v := range busSecret.Data {
		keys = append(keys, k)
		if f, _ := os.ReadFile(filepath.Join(dir, k)); !bytes.Equal(f, v) {
			t.Errorf("%s: %s differs from the file", BusAuthSecret, k)
		}
	}
	sort.Strings(keys)
	if strings.Join(keys, " ") != "admin.creds auth.conf route.secret" {
		t.Errorf("%s holds %v, want admin.creds auth.conf route.secret only", BusAuthSecret, keys)
	}
	seeds, _ := filepath.Glob(filepath.Join(dir, "keys", "*.nk"))
	if len(seeds) < 2 {
		t.Fatalf("keys/ holds %v", seeds)
	}
	raw, _ := os.ReadFile(filepath.Join(dir, KubernetesSecretsFile))
	for _, s := range got {
		for k, v := range s.Data {
			for _, seed := range seeds {
				b, _ := os.ReadFile(seed)
				if bytes.Contains(v, bytes.TrimSpace(b)) {
					t.Errorf("%s/%s holds the seed of %s", s.Metadata.Name, k, seed)
				}
			}
		}
	}
	if bytes.Contains(raw, []byte("account.nk")) || bytes.Contains(raw, []byte("operator.nk")) {
		t.Error("the manifests name a seed file of keys/")
	}
	if v := got["narwhal-router-edge-1-creds"].Data["creds"]; !bytes.Equal(v, mustRead(t, filepath.Join(dir, bus.IdentityCredsFile(bus.RoleRouter, "Edge_1")))) {
		t.Error("router Edge_1's Secret differs from router-Edge_1.creds")
	}

	empty := t.TempDir()
	if err := runBusCreds([]string{"--out", empty, "--kubernetes-secrets", "--namespace", "Bad_NS"}, &stdout, &stderr); err == nil || !strings.Contains(err.Error(), "--namespace") {
		t.Errorf("bad namespace: %v, want an error naming --namespace", err)
	}
	if bus.HasMesh(empty) {
		t.Error("a bad namespace was refused only after a mesh was written")
	}
	if _, err := writeKubernetesSecrets(t.TempDir(), ""); err == nil || !strings.Contains(err.Error(), "no mesh") {
		t.Errorf("a directory without a mesh: %v, want refused", err)
	}
	if err := runBusCreds([]string{"--out", dir, "--namespace", "llm"}, &stdout, &stderr); err == nil {
		t.Error("--namespace without --kubernetes-secrets accepted")
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

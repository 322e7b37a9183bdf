package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"github.com/narwhalmesh/narwhal/bus"
)

// KubernetesSecretsFile is the file `narwhal bus creds --kubernetes-secrets`
// writes into DIR: the Secret manifests of its credentials, for
// `kubectl apply -f` (docs/kubernetes.md).
const KubernetesSecretsFile = "kubernetes-secrets.yaml"

// BusAuthSecret is the name of the Secret of the bus servers' side (what
// `narwhal bus --auth DIR` reads): auth.conf, route.secret and the
// set-up's admin.creds — never the keys/ seeds (behaviour.md R-BUS-8).
const BusAuthSecret = "narwhal-bus-auth"

// k8sSecret is a core/v1 Secret as a manifest: encoding/json writes Data's
// bytes in base64, as the API's data field holds them; JSON is YAML, so
// kubectl and Helm read the file as it is.
type k8sSecret struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   k8sMeta           `json:"metadata"`
	Type       string            `json:"type"`
	Data       map[string][]byte `json:"data"`
}

// k8sMeta is the part of a Secret's metadata the manifests set.
type k8sMeta struct {
	Name      string            `json:"name"`
	Namespace string            `json:"namespace,omitempty"`
	Labels    map[string]string `json:"labels"`
}

// dns1123 is a Kubernetes object name (a DNS-1123 subdomain, at most 253).
var dns1123 = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`)

// secretName returns the Secret name of a credential file of DIR:
// "narwhal-<role>-creds" for a role (admin.creds → narwhal-admin-creds),
// "narwhal-<kind>-<id>-creds" for an identity, the id lower-cased with '_'
// as '-' (Kubernetes names allow neither).
func secretName(credsFile string) string {
	base := strings.TrimSuffix(credsFile, ".creds")
	return "narwhal-" + strings.ReplaceAll(strings.ToLower(base), "_", "-") + "-creds"
}

// writeKubernetesSecrets writes DIR/KubernetesSecretsFile (mode 0600,
// replacing an earlier one: it is derived from DIR's files) for the mesh
// of dir: BusAuthSecret, one Secret per role and identity credential
// (key "creds"), and, when dir holds authd.creds and
// keys/authd-signing.nk (`narwhal bus creds --authd`), the Secret
// narwhal-authd with both. Namespace ns is set when not empty. It returns
// the Secret names written, or an error when dir holds no mesh, a file
// cannot be read, ns is not a valid name, or two identities map to one
// Secret name.
func writeKubernetesSecrets(dir, ns string) ([]string, error) {
	if !bus.HasMesh(dir) {
		return nil, fmt.Errorf("--kubernetes-secrets: %s holds no mesh (write one with narwhal bus creds --out %s)", dir, dir)
	}
	if err := checkNamespace(ns); err != nil {
		return nil, err
	}
	read := func(name string) ([]byte, error) {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, fmt.Errorf("--kubernetes-secrets: %w", err)
		}
		return b, nil
	}
	secret := func(name, component string, data map[string][]byte) k8sSecret {
		return k8sSecret{APIVersion: "v1", Kind: "Secret", Type: "Opaque", Data: data,
			Metadata: k8sMeta{Name: name, Namespace: ns, Labels: map[string]string{
				"app.kubernetes.io/name": "narwhal", "app.kubernetes.io/component": component,
				"app.kubernetes.io/managed-by": "narwhal-bus-creds"}}}
	}
	var out []k8sSecret
	busData := map[string][]byte{}
	for _, f := range []string{bus.AuthConfFile, bus.RouteSecretFile, bus.CredsFile(bus.RoleAdmin)} {
		b, err := read(f)
		if err != nil {
			return nil, err
		}
		busData[f] = b
	}
	out = append(out, secret(BusAuthSecret, "bus", busData))
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("--kubernetes-secrets: %w", err)
	}
	var files []string
	for _, e := range entries {
		if n := e.Name(); e.Type().IsRegular() && strings.HasSuffix(n, ".creds") && n != bus.SysCredsFile && n != "authd.creds" {
			files = append(files, n)
		}
	}
	sort.Strings(files)
	seen := map[string]string{BusAuthSecret: "the bus"}
	for _, f := range files {
		name := secretName(f)
		if other, dup := seen[name]; dup {
			return nil, fmt.Errorf("--kubernetes-secrets: %s and %s would both be Secret %s", f, other, name)
		}
		if len(name) > 253 || !dns1123.MatchString(name) {
			return nil, fmt.Errorf("--kubernetes-secrets: %s: %q is not a Kubernetes name", f, name)
		}
		seen[name] = f
		b, err := read(f)
		if err != nil {
			return nil, err
		}
		component := strings.SplitN(strings.TrimSuffix(f, ".creds"), "-", 2)[0]
		out = append(out, secret(name, component, map[string][]byte{"creds": b}))
	}
	if _, err := os.Stat(filepath.Join(dir, "authd.creds")); err == nil {
		creds, err := read("authd.creds")
		if err != nil {
			return nil, err
		}
		key, err := read(filepath.Join("keys", "authd-signing.nk"))
		if err != nil {
			return nil, err
		}
		out = append(out, secret("narwhal-authd", "authd", map[string][]byte{"authd.creds": creds, "authd-signing.nk": key}))
	}
	var buf bytes.Buffer
	names := make([]string, 0, len(out))
	for i, s := range out {
		if i > 0 {
			buf.WriteString("---\n")
		}
		b, err := json.MarshalIndent(s, "", "  ")
		if err != nil {
			return nil, err
		}
		buf.Write(b)
		buf.WriteByte('\n')
		names = append(names, s.Metadata.Name)
	}
	path := filepath.Join(dir, KubernetesSecretsFile)
	if err := os.WriteFile(path+".tmp", buf.Bytes(), 0o600); err != nil {
		return nil, fmt.Errorf("--kubernetes-secrets: %w", err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		return nil, errors.Join(fmt.Errorf("--kubernetes-secrets: %w", err), os.Remove(path+".tmp"))
	}
	return names, nil
}

// checkNamespace returns an error naming --namespace unless ns is empty or
// a Kubernetes namespace name (a DNS-1123 label).
func checkNamespace(ns string) error {
	if ns != "" && (len(ns) > 63 || !dns1123.MatchString(ns) || strings.Contains(ns, ".")) {
		return fmt.Errorf("--namespace %q: a namespace is a DNS-1123 label (lower-case letters, digits and '-')", ns)
	}
	return nil
}

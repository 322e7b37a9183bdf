package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/engines/connector"
)

// configurationDoc is the operator's reference of every setting.
const configurationDoc = "../docs/configuration.md"

// documentedDefaults are the defaults docs/configuration.md gives in
// words instead of a value: the key's default cell starts with the text.
var documentedDefaults = map[string]string{
	"router.id": "the host name", // defaultRouterID
}

// docSetting is one row of the scalar settings table of
// docs/configuration.md.
type docSetting struct {
	env, def string
}

// docSettings reads the scalar settings table of doc: dotted key →
// variable and default cell. A row naming several keys ("`bus.tls_cert`,
// `bus.tls_key`") names as many variables, in the same order, with one
// default for all.
func docSettings(t *testing.T, doc string) map[string]docSetting {
	t.Helper()
	_, table, ok := strings.Cut(doc, "\n## Scalar settings\n")
	if !ok {
		t.Fatalf("%s: no section \"Scalar settings\"", configurationDoc)
	}
	table, _, _ = strings.Cut(table, "\n## ")
	out := map[string]docSetting{}
	for _, line := range strings.Split(table, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(line, "|")
		if len(cells) < 5 {
			t.Fatalf("%s: row with fewer than 4 cells: %s", configurationDoc, line)
		}
		keys, envs := codeSpans(cells[1]), codeSpans(cells[2])
		if len(keys) == 0 || len(keys) != len(envs) {
			t.Errorf("%s: row names keys %q and variables %q: %s", configurationDoc, keys, envs, line)
			continue
		}
		def := strings.TrimSpace(cells[3])
		for i, k := range keys {
			if _, dup := out[k]; dup {
				t.Errorf("%s: key %s has two rows", configurationDoc, k)
			}
			out[k] = docSetting{env: envs[i], def: def}
		}
	}
	return out
}

// codeSpans returns the texts between backquotes in s.
func codeSpans(s string) []string {
	var out []string
	for {
		_, rest, ok := strings.Cut(s, "`")
		if !ok {
			return out
		}
		span, after, ok := strings.Cut(rest, "`")
		if !ok {
			return out
		}
		out = append(out, span)
		s = after
	}
}

// docValue returns a default cell's value: backquotes dropped, a
// parenthesised gloss ("33554432 (32 MiB)") cut, "empty" as "".
func docValue(cell string) string {
	v, _, _ := strings.Cut(cell, " (")
	v = strings.Trim(strings.TrimSpace(v), "`")
	if v == "empty" {
		return ""
	}
	return v
}

// defaultValues returns every scalar setting of Default as the text
// docs/configuration.md writes it, by dotted key.
func defaultValues(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	d := reflect.ValueOf(Default())
	for i := range d.NumField() {
		sf := d.Type().Field(i)
		if _, ok := sf.Tag.Lookup("envPrefix"); !ok {
			continue
		}
		section := d.Field(i)
		for j := range section.NumField() {
			f := section.Type().Field(j)
			if !f.IsExported() || f.Type.Kind() == reflect.Slice {
				continue // not a scalar setting (auth.api_keys, parsed state)
			}
			v := section.Field(j)
			var s string
			switch v.Kind() {
			case reflect.String:
				s = v.String()
			case reflect.Int:
				s = strconv.FormatInt(v.Int(), 10)
			case reflect.Float64:
				s = strconv.FormatFloat(v.Float(), 'f', -1, 64)
			case reflect.Bool:
				s = strconv.FormatBool(v.Bool())
			default:
				t.Fatalf("%s.%s: no text for kind %s", yamlName(sf), yamlName(f), v.Kind())
			}
			out[yamlName(sf)+"."+yamlName(f)] = s
		}
	}
	return out
}

// TestConfigurationDocDefaults proves docs/configuration.md documents
// every scalar setting (behaviour.md §11: every key, its default and its
// range are there) with its environment variable and the default Default
// gives, and no setting the configuration does not have; and that the
// fleet entry's default connector is the one Load sets.
func TestConfigurationDocDefaults(t *testing.T) {
	b, err := os.ReadFile(configurationDoc)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	checkDocDefaults(t, doc, func(format string, args ...any) { t.Errorf(format, args...) })

	// The check fails on a mismatch: a changed default, a dropped row.
	for name, broken := range map[string]string{
		"changed default": strings.Replace(doc, "| `NARWHAL_REQUEST_MAX_N` | 16 |", "| `NARWHAL_REQUEST_MAX_N` | 17 |", 1),
		"dropped row":     strings.Replace(doc, "| `recovery.eject_after` |", "| recovery.eject_after |", 1),
	} {
		if broken == doc {
			t.Fatalf("%s: the document no longer has the row this case changes", name)
		}
		failed := false
		checkDocDefaults(t, broken, func(string, ...any) { failed = true })
		if !failed {
			t.Errorf("%s: not noticed", name)
		}
	}
}

// checkDocDefaults reports through fail every difference between the
// settings doc documents and Default.
func checkDocDefaults(t *testing.T, doc string, fail func(format string, args ...any)) {
	t.Helper()
	documented := docSettings(t, doc)
	defaults := defaultValues(t)
	names := envNames(t)
	for key, want := range defaults {
		row, ok := documented[key]
		switch {
		case !ok:
			fail("%s: %s is not documented", configurationDoc, key)
			continue
		case row.env != names[key]:
			fail("%s: %s: variable %s, want %s", configurationDoc, key, row.env, names[key])
		}
		if words, ok := documentedDefaults[key]; ok {
			if !strings.HasPrefix(row.def, words) {
				fail("%s: %s: default %q, want %q", configurationDoc, key, row.def, words+"…")
			}
			continue
		}
		if got := docValue(row.def); got != want {
			fail("%s: %s: default %q, but Default gives %q", configurationDoc, key, got, want)
		}
	}
	for key := range documented {
		if _, ok := defaults[key]; !ok {
			fail("%s: %s is documented but is not a setting", configurationDoc, key)
		}
	}
	if want := "connector: " + connector.DefaultName; !strings.Contains(doc, want) || !strings.Contains(doc, "# "+connector.DefaultName+" (default)") {
		fail("%s: the fleet example does not give %s as the default connector", configurationDoc, connector.DefaultName)
	}
}

// keysFileDocs are the pages that show a keys file (auth.api_keys_file).
var keysFileDocs = []string{"../README.md", "../docs/configuration.md", "../docs/security.md"}

// yamlBlocks returns the fenced yaml blocks of doc whose first line starts
// with first.
func yamlBlocks(doc, first string) []string {
	var out []string
	for _, part := range strings.Split(doc, "```yaml\n")[1:] {
		block, _, ok := strings.Cut(part, "```")
		if ok && strings.HasPrefix(block, first) {
			out = append(out, block)
		}
	}
	return out
}

// TestKeysFileDocExamplesLoad proves the keys files the documentation shows
// (a yaml block starting "# keys.yaml") load through the real loader as
// NARWHAL_AUTH_API_KEYS_FILE and validate (behaviour.md R-API-9), that the
// configuration file's auth: example does too, and that every digest
// command given prints the digest alone (sha256sum's "  -" cut).
func TestKeysFileDocExamplesLoad(t *testing.T) {
	found := 0
	for _, page := range keysFileDocs {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		doc := string(b)
		for _, block := range yamlBlocks(doc, "# keys.yaml") {
			found++
			file := filepath.Join(t.TempDir(), "keys.yaml")
			if err := os.WriteFile(file, []byte(block), 0o600); err != nil {
				t.Fatal(err)
			}
			c, err := load(nil, map[string]string{"NARWHAL_AUTH_API_KEYS_FILE": file})
			if err != nil {
				t.Errorf("%s: the keys file example does not load: %v\n%s", page, err, block)
				continue
			}
			if len(c.Auth.APIKeys) == 0 {
				t.Errorf("%s: the keys file example holds no key:\n%s", page, block)
			}
		}
		for _, block := range yamlBlocks(doc, "auth:\n") {
			found++
			if c, err := load([]byte(block), map[string]string{}); err != nil || len(c.Auth.APIKeys) == 0 {
				t.Errorf("%s: the auth: example does not load (%v):\n%s", page, err, block)
			}
		}
		for rest := doc; ; {
			_, after, ok := strings.Cut(rest, "sha256sum")
			if !ok {
				break
			}
			if !strings.HasPrefix(after, " | cut -d' ' -f1") && !strings.HasPrefix(after, "` alone") {
				line, _, _ := strings.Cut(after, "\n")
				t.Errorf("%s: a digest command without | cut -d' ' -f1 (sha256sum prints \"<hex>  -\"): sha256sum%s", page, line)
			}
			rest = after
		}
	}
	if found < 4 {
		t.Errorf("found %d key examples in %v, want the keys file in each and the auth: example", found, keysFileDocs)
	}
}

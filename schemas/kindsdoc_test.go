package schemas_test

import (
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/schemas"
)

// docSection returns the text of file (under docs/) from the line heading
// to the next heading of its level or above; it fails the test when the
// heading is missing.
func docSection(t *testing.T, file, heading string) string {
	t.Helper()
	b, err := os.ReadFile("../docs/" + file)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n"+heading+"\n")
	if !ok {
		t.Fatalf("docs/%s: no heading %q", file, heading)
	}
	level := len(heading) - len(strings.TrimLeft(heading, "#"))
	lines := strings.SplitAfter(rest, "\n")
	n := 0
	for _, line := range lines {
		if h := len(line) - len(strings.TrimLeft(line, "#")); h > 0 && h <= level && strings.HasPrefix(line[h:], " ") {
			break
		}
		n += len(line)
	}
	return rest[:n]
}

// quoted returns the words in backticks of s that are names of event
// kinds, or the extra names given, in their order.
func quoted(s string, extra ...string) []string {
	var out []string
	for _, m := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(s, -1) {
		if _, ok := schemas.LookupEventKind(m[1]); ok || slices.Contains(extra, m[1]) {
			out = append(out, m[1])
		}
	}
	return out
}

// kindRows returns the rows of the markdown tables of s whose first cell is
// a kind in backticks, by kind: each row's cells, trimmed.
func kindRows(s string) map[string][]string {
	rows := map[string][]string{}
	for line := range strings.SplitSeq(s, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		for _, k := range quoted(cells[0]) {
			rows[k] = cells
		}
	}
	return rows
}

// kindNames returns the names of the kinds of schemas.EventKinds for which
// keep is true, in the table's order.
func kindNames(keep func(schemas.EventKind) bool) []string {
	var out []string
	for _, k := range schemas.EventKinds() {
		if keep(k) {
			out = append(out, k.Name)
		}
	}
	return out
}

// sorted returns a sorted copy of names.
func sorted(names []string) []string {
	names = slices.Clone(names)
	slices.Sort(names)
	return names
}

// TestDocsListEveryEventKindRBUS1 proves that the lists of event kinds
// that users read follow schemas.EventKinds, the table the bus, the
// credentials and `narwhal events --kind` are built from (behaviour.md
// R-BUS-1, R-BUS-11): docs/mesh.md's Subjects table (one row per kind,
// with its schema, its publishing role and which id its fourth token
// carries), the kinds with a router's id as fifth token, the retention of
// each kind, the engine_id of each kind and `narwhal events --kind`;
// docs/observability.md's values of the label kind.
func TestDocsListEveryEventKindRBUS1(t *testing.T) {
	all := schemas.EventKindNames()

	subjects := docSection(t, "mesh.md", "## Subjects")
	rows := kindRows(subjects)
	if have := sorted(slices.Collect(maps.Keys(rows))); !slices.Equal(have, sorted(all)) {
		t.Errorf("docs/mesh.md, Subjects: the table has rows for %q, want one per kind %q", have, all)
	}
	for _, k := range schemas.EventKinds() {
		row, ok := rows[k.Name]
		if !ok || len(row) < 5 {
			continue
		}
		if row[4] != "`"+k.Schema+"`" {
			t.Errorf("docs/mesh.md, Subjects: kind %s has schema %s, want `%s`", k.Name, row[4], k.Schema)
		}
		if byRouter := strings.Contains(row[1], "router id"); byRouter != (k.ID == schemas.IDRouter) {
			t.Errorf("docs/mesh.md, Subjects: kind %s: the fourth token %q, want the %s", k.Name, row[1], k.ID)
		}
		for _, p := range k.Publishers {
			if !strings.Contains(row[2], p) {
				t.Errorf("docs/mesh.md, Subjects: kind %s is published by %q, want the %s role named", k.Name, row[2], p)
			}
		}
	}
	_, routed, _ := strings.Cut(subjects, "a router's events about an engine\n(")
	routed, _, _ = strings.Cut(routed, ")")
	if have, want := strings.Fields(strings.ReplaceAll(routed, ",", " ")), kindNames(schemas.EventKind.Routed); !slices.Equal(have, want) {
		t.Errorf("docs/mesh.md, Subjects: the kinds with the router's id as fifth token are %q, want %q", have, want)
	}

	history := docSection(t, "mesh.md", "## Retention per kind: the stream `NARWHAL_HISTORY`")
	historyKinds := kindNames(func(k schemas.EventKind) bool { return k.History })
	var kept, liveOnly []string
	for line := range strings.SplitSeq(history, "\n") {
		switch {
		case strings.HasPrefix(line, "| subjects |"):
			var sources []string
			for _, m := range regexp.MustCompile(`(?:narwhal\.events\.|…)([a-z_]+)\.>`).FindAllStringSubmatch(line, -1) {
				sources = append(sources, m[1])
			}
			if !slices.Equal(sorted(sources), sorted(historyKinds)) {
				t.Errorf("docs/mesh.md, NARWHAL_HISTORY sources %q, want the kinds kept in the history %q", sources, historyKinds)
			}
		case strings.Contains(line, "**and** `NARWHAL_HISTORY`"):
			cells := strings.Split(line, "|")
			kept = append(kept, quoted(cells[1])...)
		case strings.Contains(line, "`NARWHAL_EVENTS` only"):
			cells := strings.Split(line, "|")
			liveOnly = append(liveOnly, quoted(cells[1])...)
		}
	}
	if !slices.Equal(sorted(kept), sorted(historyKinds)) {
		t.Errorf("docs/mesh.md: the kinds kept in NARWHAL_HISTORY are %q, want %q", kept, historyKinds)
	}
	if want := kindNames(func(k schemas.EventKind) bool { return !k.History }); !slices.Equal(sorted(liveOnly), sorted(want)) {
		t.Errorf("docs/mesh.md: the kinds kept in NARWHAL_EVENTS only are %q, want %q", liveOnly, want)
	}

	schemasSection := docSection(t, "mesh.md", "## Event schemas")
	_, engineIDs, _ := strings.Cut(schemasSection, "| kind | `engine_id` |")
	engineIDs, _, _ = strings.Cut(engineIDs, "\n\n")
	if have := sorted(slices.Collect(maps.Keys(kindRows(engineIDs)))); !slices.Equal(have, sorted(all)) {
		t.Errorf("docs/mesh.md, Event schemas: the engine_id table has rows for %q, want one per kind %q", have, all)
	}

	events := docSection(t, "mesh.md", "### `narwhal events`")
	_, kindItem, _ := strings.Cut(events, "- `--kind K`: one of")
	kindItem, _, _ = strings.Cut(kindItem, "\n- ")
	if have := quoted(kindItem); !slices.Equal(have, all) {
		t.Errorf("docs/mesh.md, narwhal events: --kind takes %q, want %q", have, all)
	}

	labels := docSection(t, "observability.md", "### Labels")
	_, label, _ := strings.Cut(labels, "an event kind (")
	label, _, _ = strings.Cut(label, ")")
	if have, want := quoted(label, "unknown"), append(slices.Clone(all), "unknown"); !slices.Equal(have, want) {
		t.Errorf("docs/observability.md, Labels: the label kind of event series takes %q, want %q", have, want)
	}
}

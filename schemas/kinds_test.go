package schemas_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/schemas"
)

// TestEventKindRows checks each row of the table of event kinds on its
// own (R-BUS-1, R-BUS-3): a unique name that is one subject token, a
// subject id field, a schema with its file, at least one publishing role,
// and a payload type of its own whose Subject is the row's subject.
func TestEventKindRows(t *testing.T) {
	kinds := schemas.EventKinds()
	if len(kinds) == 0 {
		t.Fatal("no event kinds")
	}
	names, schemaNames, types := map[string]bool{}, map[string]bool{}, map[reflect.Type]string{}
	for _, k := range kinds {
		if names[k.Name] {
			t.Errorf("kind %q: two rows", k.Name)
		}
		names[k.Name] = true
		if k.Name == "" || strings.ContainsAny(k.Name, ".*> \t\r\n") {
			t.Errorf("kind %q: not one subject token", k.Name)
		}
		if got, ok := schemas.LookupEventKind(k.Name); !ok || got.Schema != k.Schema {
			t.Errorf("LookupEventKind(%q) = %+v, %v", k.Name, got, ok)
		}
		if schemaNames[k.Schema] {
			t.Errorf("kind %s: schema %s is another kind's too", k.Name, k.Schema)
		}
		schemaNames[k.Schema] = true
		if _, err := fs.Stat(schemas.SchemaFS, k.Schema+".json"); err != nil {
			t.Errorf("kind %s: no schema file %s.json: %v", k.Name, k.Schema, err)
		}
		if len(k.Publishers) == 0 || slices.Contains(k.Publishers, "") {
			t.Errorf("kind %s: publishers %q, want at least one role", k.Name, k.Publishers)
		}
		wantSubject := "narwhal.events." + k.Name + ".x"
		if k.Routed() {
			wantSubject += ".r"
		}
		if k.Filter() != "narwhal.events."+k.Name+".>" || k.Subject("x", "r") != wantSubject {
			t.Errorf("kind %s: filter %q, subject %q", k.Name, k.Filter(), k.Subject("x", "r"))
		}
		if routed := k.ID == schemas.IDEngine && slices.Contains(k.Publishers, schemas.RoleRouter); k.Routed() != routed {
			t.Errorf("kind %s: Routed() = %v, want %v", k.Name, k.Routed(), routed)
		}
		if k.New == nil {
			t.Errorf("kind %s: no payload type", k.Name)
			continue
		}
		ev := k.New()
		rt := reflect.TypeOf(ev)
		if other, dup := types[rt]; dup {
			t.Errorf("kinds %s and %s share payload type %v", other, k.Name, rt)
		}
		types[rt] = k.Name
		h := ev.Head()
		h.EngineID, h.RouterID = "engine-1", "router-1"
		var id string
		switch k.ID {
		case schemas.IDEngine:
			id = h.EngineID
		case schemas.IDRouter:
			id = h.RouterID
		default:
			t.Errorf("kind %s: subject id %q, want %q or %q", k.Name, k.ID, schemas.IDEngine, schemas.IDRouter)
		}
		if got := ev.Subject(); got != k.Subject(id, h.RouterID) {
			t.Errorf("kind %s: %v.Subject() = %q, want %q (its row's subject, ending in its %s)", k.Name, rt, got, k.Subject(id, h.RouterID), k.ID)
		}
		if why := schemas.EventSubjectMismatch(ev.Subject(), h.EngineID, h.RouterID); why != "" {
			t.Errorf("kind %s: its own subject %q mismatches its payload: %s", k.Name, ev.Subject(), why)
		}
	}
	if got := schemas.EventKindNames(); len(got) != len(kinds) {
		t.Errorf("EventKindNames %v: %d names for %d rows", got, len(got), len(kinds))
	}
	if _, ok := schemas.LookupEventKind("nothing"); ok {
		t.Error("LookupEventKind found a kind the table does not have")
	}
}

// TestEverySchemaFileHasARow proves that SchemaFS holds nothing but the
// schemas of the table's kinds and those of the bucket values
// (ValueSchemas), and that the schema tests of this package cover every
// kind: a sample of the row's payload type with the row's schema, and its
// subject ids.
func TestEverySchemaFileHasARow(t *testing.T) {
	rows := map[string]schemas.EventKind{}
	for _, k := range schemas.EventKinds() {
		rows[k.Schema] = k
	}
	values := schemas.ValueSchemas()
	files, err := fs.Glob(schemas.SchemaFS, "*.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		name := strings.TrimSuffix(f, ".json")
		_, isEvent := rows[name]
		isValue := slices.Contains(values, name)
		switch {
		case isEvent && isValue:
			t.Errorf("schema %s is both an event kind's and a bucket value's", name)
		case !isEvent && !isValue:
			t.Errorf("schema file %s has no row in schemas.EventKinds (and is not one of ValueSchemas)", f)
		}
	}
	for _, name := range values {
		if _, err := fs.Stat(schemas.SchemaFS, name+".json"); err != nil {
			t.Errorf("value schema %s has no file: %v", name, err)
		}
	}
	sampled := map[string]bool{}
	for _, s := range samples() {
		k, ok := schemas.LookupEventKind(s.kind)
		if !ok {
			t.Errorf("sample of kind %q: no row", s.kind)
			continue
		}
		sampled[s.kind] = true
		for _, ev := range []schemas.Event{s.full, s.minimal} {
			if ev.Head().Schema != k.Schema || reflect.TypeOf(ev) != reflect.TypeOf(k.New()) {
				t.Errorf("sample of kind %s: %T with schema %q, want %T with %q", s.kind, ev, ev.Head().Schema, k.New(), k.Schema)
			}
		}
	}
	for _, k := range schemas.EventKinds() {
		if !sampled[k.Name] {
			t.Errorf("kind %s has no sample in samples() (events_test.go): its schema file is not checked against its type", k.Name)
		}
		if ids := subjectIDs[k.Schema]; !slices.Contains(ids, k.ID) {
			t.Errorf("kind %s: subjectIDs[%s] = %v lacks its subject id %s", k.Name, k.Schema, ids, k.ID)
		}
	}
}

// TestEveryPublishableKindHasARow fails when an event kind is published
// or named somewhere without a row in schemas.EventKinds: every type of
// this package with a Subject method (what bus.Publisher publishes) must
// be a row's payload type, every Kind* constant a row's name, and every
// subject narwhal.events.<kind>… written in the module's code, schema
// files, page scripts and deployment files must name a kind of the table
// (tests and docs aside: they use made-up kinds on purpose).
func TestEveryPublishableKindHasARow(t *testing.T) {
	rowTypes := map[string]bool{}
	for _, k := range schemas.EventKinds() {
		rowTypes[reflect.TypeOf(k.New()).Elem().Name()] = true
	}
	fset := token.NewFileSet()
	sources, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var eventTypes, kindConsts int
	for _, path := range sources {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil || d.Name.Name != "Subject" || d.Type.Params.NumFields() != 0 {
					continue
				}
				recv := d.Recv.List[0].Type
				if star, ok := recv.(*ast.StarExpr); ok {
					recv = star.X
				}
				ident, ok := recv.(*ast.Ident)
				if !ok {
					continue
				}
				eventTypes++
				if !rowTypes[ident.Name] {
					t.Errorf("%s: %s has a Subject method (it can be published) but is no row's payload type in schemas.EventKinds", fset.Position(d.Pos()), ident.Name)
				}
			case *ast.GenDecl:
				if d.Tok != token.CONST {
					continue
				}
				for _, spec := range d.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, name := range vs.Names {
						if !strings.HasPrefix(name.Name, "Kind") || i >= len(vs.Values) {
							continue
						}
						lit, ok := vs.Values[i].(*ast.BasicLit)
						if !ok || lit.Kind != token.STRING {
							continue
						}
						kindConsts++
						v, _ := strconv.Unquote(lit.Value)
						if _, ok := schemas.LookupEventKind(v); !ok {
							t.Errorf("%s: event kind %s = %q has no row in schemas.EventKinds", fset.Position(name.Pos()), name.Name, v)
						}
					}
				}
			}
		}
	}
	if n := len(schemas.EventKinds()); eventTypes < n || kindConsts < n {
		t.Errorf("found %d event types and %d kind constants in schemas/, want at least %d of each", eventTypes, kindConsts, n)
	}

	subject := regexp.MustCompile(`narwhal\.events\.([A-Za-z0-9_-]+)`)
	named := map[string]bool{}
	err = filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != ".." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		switch filepath.Ext(path) {
		case ".go", ".json", ".js", ".html", ".yaml", ".yml":
		default:
			return nil
		}
		if strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		here := map[string]bool{}
		for _, m := range subject.FindAllSubmatch(b, -1) {
			kind := string(m[1])
			named[kind] = true
			if _, ok := schemas.LookupEventKind(kind); !ok && !here[kind] {
				t.Errorf("%s names subject narwhal.events.%s…: kind %q has no row in schemas.EventKinds", path, kind, kind)
			}
			here[kind] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(named) == 0 {
		t.Error("no event subject found in the module: the walk read nothing")
	}
}

// TestEventSubjectMismatchRBUS11 proves the check every consumer of
// router events makes (behaviour.md R-BUS-11): a payload whose router id
// or engine id is not its subject's, or a router kind's event on a
// four-token subject (an old or forged shape), is told apart from one
// that matches, with the reason its consumer counts.
func TestEventSubjectMismatchRBUS11(t *testing.T) {
	for _, c := range []struct {
		subject, engine, router, want string
	}{
		{"narwhal.events.failure.e1.r1", "e1", "r1", ""},
		{"narwhal.events.failure.e1.r2", "e1", "r1", schemas.MismatchRouterID},
		{"narwhal.events.failure.e1", "e1", "r1", schemas.MismatchRouterID},
		{"narwhal.events.failure.e1.r1.x", "e1", "r1", schemas.MismatchRouterID},
		{"narwhal.events.failure.e2.r1", "e1", "r1", schemas.MismatchEngineID},
		{"narwhal.events.quarantine.e1.r1", "e1", "r1", ""},
		{"narwhal.events.handoff.e1.", "e1", "", schemas.MismatchRouterID},
		{"narwhal.events.kv_recomputed.e1.r1", "e1", "r1", ""},
		{"narwhal.events.request.r1", "", "r1", ""},
		{"narwhal.events.request.r2", "", "r1", schemas.MismatchRouterID},
		{"narwhal.events.request.r1.r1", "", "r1", schemas.MismatchSubject},
		{"narwhal.events.eligibility.e1", "e1", "", ""},
		{"narwhal.events.eligibility.e2", "e1", "", schemas.MismatchEngineID},
		{"narwhal.events.eligibility.e1.r1", "e1", "", schemas.MismatchSubject},
		{"narwhal.events.nothing.e1", "e1", "", schemas.MismatchSubject},
		{"narwhal.other.failure.e1.r1", "e1", "r1", schemas.MismatchSubject},
	} {
		if got := schemas.EventSubjectMismatch(c.subject, c.engine, c.router); got != c.want {
			t.Errorf("EventSubjectMismatch(%q, %q, %q) = %q, want %q", c.subject, c.engine, c.router, got, c.want)
		}
	}
}

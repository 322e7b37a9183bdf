package doccheck

import (
	"go/build"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// modulePath is the module's import path.
const modulePath = "github.com/narwhalmesh/narwhal"

// projectImports returns, for every package of the module, the module's
// packages its non-test files import (paths relative to the
// module, as docs/architecture.md names them), as go list reports them
// for this GOOS.
func projectImports(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	err := filepath.WalkDir(moduleRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		if name := d.Name(); path != moduleRoot && (strings.HasPrefix(name, ".") || name == "testdata") {
			return filepath.SkipDir
		}
		if path != moduleRoot {
			// A directory with a go.mod of its own (deploy/helm) is
			// another module, outside this table.
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir
			}
		}
		pkg, err := build.ImportDir(path, 0)
		if err != nil {
			if _, ok := err.(*build.NoGoError); ok {
				return nil
			}
			return err
		}
		rel, err := filepath.Rel(moduleRoot, path)
		if err != nil {
			return err
		}
		var own []string
		for _, imp := range pkg.Imports {
			if p, ok := strings.CutPrefix(imp, modulePath+"/"); ok {
				own = append(own, p)
			}
		}
		slices.Sort(own)
		out[filepath.ToSlash(rel)] = own
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// architectureRow is one row of docs/architecture.md's package table.
type architectureRow struct {
	imports, mayImport []string
}

// architectureTable reads the package table of docs/architecture.md:
// | `pkg/` | owns | imports | may import |, the package names in
// backquotes, "—" for none.
func architectureTable(t *testing.T) map[string]architectureRow {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(moduleRoot, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("^\\| `([a-z0-9/]+)/` \\|[^|]*\\|([^|]*)\\|([^|]*)\\|$")
	names := regexp.MustCompile("`([a-z0-9/]+)`")
	list := func(cell string) []string {
		var l []string
		if strings.Contains(cell, "everything") {
			l = append(l, "everything")
		}
		for _, m := range names.FindAllStringSubmatch(cell, -1) {
			l = append(l, strings.TrimSuffix(m[1], "/"))
		}
		slices.Sort(l)
		return l
	}
	table := map[string]architectureRow{}
	for _, line := range strings.Split(string(doc), "\n") {
		if m := row.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			table[m[1]] = architectureRow{imports: list(m[2]), mayImport: list(m[3])}
		}
	}
	if len(table) == 0 {
		t.Fatal("docs/architecture.md has no package table")
	}
	return table
}

// TestArchitectureImportsAsGoListReports proves docs/architecture.md's
// package table is true: every package of the module has a row, its
// imports column lists exactly the module's packages it imports, and each
// of those is one its "may import" column allows — so the table a
// newcomer reads is the graph the compiler sees.
func TestArchitectureImportsAsGoListReports(t *testing.T) {
	table := architectureTable(t)
	actual := projectImports(t)
	for pkg, imports := range actual {
		row, ok := table[pkg]
		if !ok {
			t.Errorf("package %s has no row in docs/architecture.md (it imports %v)", pkg, imports)
			continue
		}
		if !slices.Equal(row.imports, imports) {
			t.Errorf("docs/architecture.md says %s imports %v; it imports %v", pkg, row.imports, imports)
		}
		for _, imp := range imports {
			if !slices.Contains(row.mayImport, imp) && !slices.Contains(row.mayImport, "everything") {
				t.Errorf("%s imports %s, which docs/architecture.md does not allow it", pkg, imp)
			}
		}
	}
	for pkg := range table {
		if _, ok := actual[pkg]; !ok {
			t.Errorf("docs/architecture.md has a row for %s, which is no package with code", pkg)
		}
	}
}

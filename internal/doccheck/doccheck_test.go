// Package doccheck holds tests of the module's text rather than its
// behaviour: what users read must speak for itself.
package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// moduleRoot is the module's top folder, seen from this package.
const moduleRoot = "../.."

// ruleID matches a rule id of docs/behaviour.md: R-API-1, R-LEG-1a, …
var ruleID = regexp.MustCompile(`R-[A-Z]+-[0-9]+[a-z]?`)

// goFiles returns the module's Go files, test files or the others.
func goFiles(t *testing.T, tests bool) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(moduleRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != moduleRoot && (strings.HasPrefix(name, ".") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(path, ".go") && strings.HasSuffix(path, "_test.go") == tests {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no Go files found under " + moduleRoot)
	}
	return files
}

// TestUserTextCitesNoRuleIDs proves that help texts, metric descriptions,
// error messages and every other string of the program name no rule id
// and no section of the contract: a user reads them without docs/behaviour.md at
// hand. Comments and tests may name ids.
func TestUserTextCitesNoRuleIDs(t *testing.T) {
	spec := regexp.MustCompile(`R-[A-Z]+-[0-9]|\b[S]PEC\b`)
	fset := token.NewFileSet()
	var found []string
	for _, path := range goFiles(t, false) {
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING && spec.MatchString(lit.Value) {
				found = append(found, fset.Position(lit.Pos()).String()+": "+lit.Value)
			}
			return true
		})
	}
	for _, s := range found {
		t.Error(s)
	}
}

// TestBehaviourStatesEveryNamedRule proves docs/behaviour.md is
// self-contained for what the module names: every rule id that a comment,
// a test or a page of docs/ cites has its anchor there.
func TestBehaviourStatesEveryNamedRule(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(moduleRoot, "docs", "behaviour.md"))
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, m := range regexp.MustCompile(`<a id="(R-[A-Z]+-[0-9]+[a-z]?)"></a>`).FindAllStringSubmatch(string(doc), -1) {
		anchors[m[1]] = true
	}
	if len(anchors) < 50 {
		t.Fatalf("docs/behaviour.md has %d rule anchors; is the file whole?", len(anchors))
	}
	sources := append(goFiles(t, false), goFiles(t, true)...)
	pages, err := filepath.Glob(filepath.Join(moduleRoot, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	sources = append(sources, pages...)
	missing := map[string][]string{}
	for _, path := range sources {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ruleID.FindAllString(string(b), -1) {
			if !anchors[id] {
				missing[id] = append(missing[id], path)
			}
		}
	}
	ids := make([]string, 0, len(missing))
	for id := range missing {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		t.Errorf("%s is named in %s but not stated in docs/behaviour.md", id, strings.Join(dedupe(missing[id]), ", "))
	}
}

func dedupe(s []string) []string {
	sort.Strings(s)
	out := s[:0]
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}

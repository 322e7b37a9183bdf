package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// docReference matches a page of docs/ named in user text, with the
// section after it if one is named: docs/mesh.md, docs/security.md,
// "Revoking a credential", or a bare capitalised section name
// (docs/observability.md, Tracing).
var docReference = regexp.MustCompile(`docs/([A-Za-z0-9_-]+\.md)(?:, (?:"([^"]+)"|([A-Z][^)";,]*)))?`)

// headings returns the headings of a Markdown page, lower-cased, without
// the lines of its fenced code blocks (a shell comment is no heading).
func headings(t *testing.T, page string) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	fenced := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
			continue
		}
		if !fenced && strings.HasPrefix(line, "#") {
			out[strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))] = true
		}
	}
	return out
}

// TestUserTextNamesRealSections proves that every page of docs/ that a
// string of the program names (an error message, a help text) exists,
// and that the section named after it, as in (docs/security.md,
// "Revoking a credential"), is a heading of that page: a user who
// follows the pointer finds it.
func TestUserTextNamesRealSections(t *testing.T) {
	fset := token.NewFileSet()
	pages := map[string]map[string]bool{}
	checked := 0
	for _, path := range goFiles(t, false) {
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			s, err := strconv.Unquote(lit.Value)
			if err != nil {
				t.Fatalf("%s: %v", fset.Position(lit.Pos()), err)
			}
			for _, m := range docReference.FindAllStringSubmatch(s, -1) {
				at := fset.Position(lit.Pos()).String()
				page := m[1]
				hs, seen := pages[page]
				if !seen {
					file := filepath.Join(moduleRoot, "docs", page)
					if _, err := os.Stat(file); err != nil {
						t.Errorf("%s names docs/%s, which does not exist", at, page)
						pages[page] = nil
						continue
					}
					hs = headings(t, file)
					pages[page] = hs
				}
				if hs == nil {
					continue
				}
				checked++
				section := strings.TrimSpace(m[2] + m[3])
				if section != "" && !hs[strings.ToLower(section)] {
					t.Errorf("%s names section %q of docs/%s, which has no such heading", at, section, page)
				}
			}
			return true
		})
	}
	if checked == 0 {
		t.Fatal("no string names a page of docs/; is the pattern right?")
	}
}

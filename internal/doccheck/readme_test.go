package doccheck

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeListsEveryJustRecipe proves that README.md's list of `just`
// commands names every recipe of the justfile: a recipe missing there is
// one a reader never learns of.
func TestReadmeListsEveryJustRecipe(t *testing.T) {
	justfile, err := os.ReadFile(filepath.Join(moduleRoot, "justfile"))
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(moduleRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	// A recipe starts a line: its name, its parameters, then a colon.
	recipe := regexp.MustCompile(`(?m)^([a-z][a-z0-9_-]*)(?: [^:\n]*)?:(?:\s|$)`)
	found := recipe.FindAllStringSubmatch(string(justfile), -1)
	if len(found) < 5 {
		t.Fatalf("the justfile has %d recipes; is the pattern right?", len(found))
	}
	for _, m := range found {
		if !strings.Contains(string(readme), "`just "+m[1]+"`") {
			t.Errorf("README.md does not list `just %s`, a recipe of the justfile", m[1])
		}
	}
}

package config

import (
	"strings"
	"testing"
)

// TestVersionSatisfies proves the engine_contract version pin of R-BRK-6
// and R-PRE-1.
func TestVersionSatisfies(t *testing.T) {
	cases := []struct {
		version, constraint string
		want                bool
	}{
		{"0.10.0", ">=0.10", true},
		{"0.10", ">=0.10", true},
		{"0.9.2", ">=0.10", false},
		{"0.11.1", ">=0.10", true},
		{"1.0", ">=0.10", true},
		{"0.10.1", ">0.10", true},
		{"0.10.0", ">0.10", false},
		{"0.12", "<0.12", false},
		{"0.11.9", "<0.12", true},
		{"0.12.0", "<=0.12", true},
		{"0.12.1", "<=0.12", false},
		{"0.10.0", "==0.10", true},
		{"0.10.0", "=0.10.0", true},
		{"0.10.0", "0.10", true},
		{"0.10.1", "0.10", false},
		{"0.10.1", "!=0.10.1", false},
		{"0.10.2", "!=0.10.1", true},
		{"0.11.0", ">=0.10,<0.12", true},
		{"0.12.0", ">=0.10,<0.12", false},
		{"0.9.9", ">=0.10,<0.12", false},
		{"0.11.0", " >= 0.10 , < 0.12 ", true},
		// Reported versions: prefix "v" and suffixes are ignored.
		{"v0.10.1", ">=0.10.1", true},
		{"0.10.1rc1", "==0.10.1", true},
		{"0.10.2.dev12+gabc123", ">=0.10.2,<0.10.3", true},
		{"0.10.1+cu124", "<0.10.1", false},
		{"0.10.", "==0.10", true},
	}
	for _, tc := range cases {
		got, err := VersionSatisfies(tc.version, tc.constraint)
		if err != nil {
			t.Errorf("VersionSatisfies(%q, %q): %v", tc.version, tc.constraint, err)
			continue
		}
		if got != tc.want {
			t.Errorf("VersionSatisfies(%q, %q) = %v, want %v", tc.version, tc.constraint, got, tc.want)
		}
	}
}

func TestVersionSatisfiesErrors(t *testing.T) {
	cases := []struct{ version, constraint, want string }{
		{"0.10", "", "empty version constraint"},
		{"0.10", "  ", "empty version constraint"},
		{"0.10", ">=", `bad version constraint ">=": clause ">=": want a dotted numeric version`},
		{"0.10", "~0.10", `clause "~0.10"`},
		{"0.10", "^1", `clause "^1"`},
		{"0.10", ">=0.x", `clause ">=0.x"`},
		{"0.10", ">=0..1", `clause ">=0..1"`},
		{"0.10", ">=0.-1", `clause ">=0.-1"`},
		{"0.10", ">=+1", `clause ">=+1"`},
		{"0.10", ">=0.10 <0.12", `clause ">=0.10 <0.12"`},
		{"0.10", ">=0.10,", `clause ""`},
		{"", ">=0.10", `bad version "": no leading number`},
		{"vllm", ">=0.10", `bad version "vllm": no leading number`},
		{"99999999999999999999", ">=0.10", `bad version "99999999999999999999"`},
	}
	for _, tc := range cases {
		_, err := VersionSatisfies(tc.version, tc.constraint)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("VersionSatisfies(%q, %q): error %v, want one containing %q", tc.version, tc.constraint, err, tc.want)
		}
	}
}

func FuzzVersionSatisfies(f *testing.F) {
	f.Add("0.10.1", ">=0.10,<0.12")
	f.Add("v1.2.3rc1", "!=1.2.3")
	f.Fuzz(func(t *testing.T, version, constraint string) {
		ok, err := VersionSatisfies(version, constraint)
		if err != nil && ok {
			t.Fatalf("true with an error: %v", err)
		}
	})
}

package config

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// VersionSatisfies reports whether version meets constraint (behaviour.md R-BRK-6,
// R-PRE-1: the engine_contract's version pin).
//
// constraint is one or more comma-joined clauses, all of which must hold,
// e.g. ">=0.10" or ">=0.10, <0.12". A clause is an operator — >=, >, <=,
// <, ==, = or != — followed by a dotted numeric version ("0.10",
// "0.10.1"); a clause without an operator means ==. Versions compare
// component by component as integers, missing components counting as 0, so
// "0.10" == "0.10.0" and "0.9" < "0.10".
//
// version is what an engine reports: a leading "v" and anything after its
// dotted numeric prefix are ignored, so "v0.10.1", "0.10.1rc1" and
// "0.10.1.dev12+gabc" all compare as 0.10.1.
//
// It returns an error when constraint is empty or malformed, or when
// version has no leading number.
func VersionSatisfies(version, constraint string) (bool, error) {
	clauses, err := parseConstraint(constraint)
	if err != nil {
		return false, err
	}
	v, err := parseReportedVersion(version)
	if err != nil {
		return false, err
	}
	for _, c := range clauses {
		if !c.holds(compareVersions(v, c.version)) {
			return false, nil
		}
	}
	return true, nil
}

// versionClause is one "<op><version>" of a constraint.
type versionClause struct {
	op      string
	version []int
}

// holds reports whether the clause holds, given cmp = compare(version,
// clause version).
func (c versionClause) holds(cmp int) bool {
	switch c.op {
	case ">=":
		return cmp >= 0
	case ">":
		return cmp > 0
	case "<=":
		return cmp <= 0
	case "<":
		return cmp < 0
	case "!=":
		return cmp != 0
	}
	return cmp == 0 // "==", "="
}

// constraintOps in matching order: longer operators before their prefixes.
var constraintOps = []string{">=", "<=", "==", "!=", ">", "<", "="}

// parseConstraint parses a version constraint (see VersionSatisfies).
func parseConstraint(constraint string) ([]versionClause, error) {
	if strings.TrimSpace(constraint) == "" {
		return nil, errors.New("empty version constraint")
	}
	parts := strings.Split(constraint, ",")
	clauses := make([]versionClause, 0, len(parts))
	for _, part := range parts {
		p := strings.TrimSpace(part)
		op := "=="
		for _, o := range constraintOps {
			if strings.HasPrefix(p, o) {
				op, p = o, strings.TrimSpace(p[len(o):])
				break
			}
		}
		v, err := parseDotted(p)
		if err != nil {
			return nil, fmt.Errorf("bad version constraint %q: clause %q: %v", constraint, strings.TrimSpace(part), err)
		}
		clauses = append(clauses, versionClause{op: op, version: v})
	}
	return clauses, nil
}

// parseDotted parses a strictly dotted numeric version such as "0.10.1".
func parseDotted(s string) ([]int, error) {
	if s == "" {
		return nil, errors.New("want a dotted numeric version such as 0.10")
	}
	fields := strings.Split(s, ".")
	v := make([]int, len(fields))
	for i, f := range fields {
		n, err := strconv.Atoi(f)
		if err != nil || n < 0 || f[0] == '+' {
			return nil, errors.New("want a dotted numeric version such as 0.10")
		}
		v[i] = n
	}
	return v, nil
}

// parseReportedVersion reads the dotted numeric prefix of an engine's
// reported version, after an optional leading "v".
func parseReportedVersion(s string) ([]int, error) {
	rest := strings.TrimPrefix(strings.TrimSpace(s), "v")
	var v []int
	for {
		i := 0
		for i < len(rest) && rest[i] >= '0' && rest[i] <= '9' {
			i++
		}
		if i == 0 {
			break
		}
		n, err := strconv.Atoi(rest[:i])
		if err != nil {
			return nil, fmt.Errorf("bad version %q: %v", s, err)
		}
		v = append(v, n)
		rest = rest[i:]
		if len(rest) < 2 || rest[0] != '.' || rest[1] < '0' || rest[1] > '9' {
			break
		}
		rest = rest[1:]
	}
	if len(v) == 0 {
		return nil, fmt.Errorf("bad version %q: no leading number", s)
	}
	return v, nil
}

// compareVersions returns -1, 0 or +1 as a is before, equal to or after b,
// padding the shorter with zeros.
func compareVersions(a, b []int) int {
	for i := range max(len(a), len(b)) {
		var x, y int
		if i < len(a) {
			x = a[i]
		}
		if i < len(b) {
			y = b[i]
		}
		switch {
		case x < y:
			return -1
		case x > y:
			return 1
		}
	}
	return 0
}

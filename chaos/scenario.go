package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"time"

	"github.com/goccy/go-yaml"

	"github.com/narwhalmesh/narwhal/internal/pause"
)

// Scenario is a timed list of arm and disarm steps (`narwhal chaos run
// FILE`), read from YAML:
//
//	steps:
//	  - at: 0s
//	    arm: {engine: decode-1, fault: first-token-delay, phase: decode, params: {delay_ms: 5000}, for: 30s}
//	  - at: 20s
//	    disarm: {engine: decode-1}
type Scenario struct {
	// Steps run in order, each at its offset from the start.
	Steps []Step `yaml:"steps"`
}

// Step is one step of a Scenario: exactly one of Arm and Disarm.
type Step struct {
	// At is the step's offset from the start of the run, e.g. 20s; the
	// steps' offsets never decrease.
	At time.Duration `yaml:"at"`
	// Arm arms a fault.
	Arm *ArmStep `yaml:"arm"`
	// Disarm disarms faults.
	Disarm *DisarmStep `yaml:"disarm"`
}

// ArmStep arms one fault, as `narwhal chaos arm` does.
type ArmStep struct {
	// Engine is the engine id.
	Engine string `yaml:"engine"`
	// Fault is the fault's name in the catalogue.
	Fault string `yaml:"fault"`
	// ID is the fault id (default: the fault's name).
	ID string `yaml:"id"`
	// Phase is "prefill", "decode" or "any" (default "any").
	Phase string `yaml:"phase"`
	// Prob is the probability, 0…1 (default 1).
	Prob *float64 `yaml:"prob"`
	// Count is the number of strikes, 0 = unlimited (default 0).
	Count int `yaml:"count"`
	// For is the fault's lifetime (default DefaultFor).
	For time.Duration `yaml:"for"`
	// Params are the fault's parameters; numbers and strings are both
	// accepted, e.g. {delay_ms: 5000, message: "overloaded"}.
	Params map[string]any `yaml:"params"`
}

// DisarmStep disarms faults, as `narwhal chaos disarm` does: one fault
// (Engine and ID), every fault of Engine, or every fault (All).
type DisarmStep struct {
	// Engine is the engine id.
	Engine string `yaml:"engine"`
	// ID is a fault id of Engine; empty: all of Engine's faults.
	ID string `yaml:"id"`
	// All disarms every fault of every engine.
	All bool `yaml:"all"`
}

// ParseScenario reads a Scenario from YAML. Unknown fields are errors, and
// so are a step with neither or both of arm and disarm, a negative or
// decreasing "at", an arm step whose fault would not validate, and a
// disarm step with neither engine nor all. Errors name the step (1-based).
func ParseScenario(data []byte) (*Scenario, error) {
	var sc Scenario
	if err := yaml.UnmarshalWithOptions(data, &sc, yaml.Strict()); err != nil {
		return nil, fmt.Errorf("scenario: %w", err)
	}
	if len(sc.Steps) == 0 {
		return nil, errors.New("scenario: no steps")
	}
	var prev time.Duration
	for i, st := range sc.Steps {
		n := i + 1
		switch {
		case st.At < 0:
			return nil, fmt.Errorf("scenario step %d: at %v is negative", n, st.At)
		case st.At < prev:
			return nil, fmt.Errorf("scenario step %d: at %v comes before the previous step's %v (steps run in order)", n, st.At, prev)
		case (st.Arm == nil) == (st.Disarm == nil):
			return nil, fmt.Errorf("scenario step %d: want exactly one of arm and disarm", n)
		}
		prev = st.At
		if st.Arm != nil {
			f, d, err := st.Arm.fault()
			if err != nil {
				return nil, fmt.Errorf("scenario step %d: %w", n, err)
			}
			// Validate as Store.Arm will, with a placeholder expiry.
			if f.ID == "" {
				f.ID = f.Name
			}
			if f.Phase == "" {
				f.Phase = PhaseAny
			}
			f.Expires = time.Now().Add(d)
			if d < 0 || d > MaxFor {
				return nil, fmt.Errorf("scenario step %d: for %v is not within 0…%v", n, d, MaxFor)
			}
			if err := f.Validate(); err != nil {
				return nil, fmt.Errorf("scenario step %d: %w", n, err)
			}
		} else {
			d := st.Disarm
			if d.All == (d.Engine != "") {
				return nil, fmt.Errorf("scenario step %d: disarm wants one of engine and all", n)
			}
			if d.All && d.ID != "" {
				return nil, fmt.Errorf("scenario step %d: disarm: id needs engine", n)
			}
			if d.Engine != "" && !validID(d.Engine) || d.ID != "" && !validID(d.ID) {
				return nil, fmt.Errorf("scenario step %d: disarm: engine and id want letters, digits, '-' or '_'", n)
			}
		}
	}
	return &sc, nil
}

// fault returns the Fault the step arms and its lifetime.
func (a *ArmStep) fault() (Fault, time.Duration, error) {
	f := Fault{EngineID: a.Engine, ID: a.ID, Name: a.Fault, Phase: a.Phase, Probability: 1, Count: a.Count}
	if a.Prob != nil {
		f.Probability = *a.Prob
	}
	if len(a.Params) > 0 {
		f.Params = make(map[string]string, len(a.Params))
		for k, v := range a.Params {
			s, err := paramValue(v)
			if err != nil {
				return Fault{}, 0, fmt.Errorf("param %s: %w", k, err)
			}
			f.Params[k] = s
		}
	}
	d := a.For
	if d == 0 {
		d = DefaultFor
	}
	return f, d, nil
}

// paramValue turns a YAML scalar into a parameter value.
func paramValue(v any) (string, error) {
	switch v := v.(type) {
	case string:
		return v, nil
	case int:
		return strconv.Itoa(v), nil
	case int64:
		return strconv.FormatInt(v, 10), nil
	case uint64:
		return strconv.FormatUint(v, 10), nil
	case float64:
		if v == math.Trunc(v) && math.Abs(v) < 1<<53 {
			return strconv.FormatInt(int64(v), 10), nil
		}
		return strconv.FormatFloat(v, 'g', -1, 64), nil
	case bool:
		return strconv.FormatBool(v), nil
	}
	return "", fmt.Errorf("want a number or a string, got %T", v)
}

// Run plays the scenario against st: each step at its offset from the
// start of the run, printing one line per step to out, e.g.
//
//	+0.000s arm decode-1/first-token-delay phase=decode prob=1 count=unlimited delay_ms=5000 expires=…
//	+20.001s disarm decode-1: decode-1/first-token-delay
//
// It returns when the last step ran, or — when until > 0 — at until after
// the start (steps after it are skipped, and it waits for until when the
// steps end sooner). It returns ctx's error when ctx ends first, and the
// first error of a step (the steps after it do not run).
func (sc *Scenario) Run(ctx context.Context, st *Store, out io.Writer, until time.Duration) error {
	start := time.Now()
	at := func() string { return fmt.Sprintf("+%.3fs", time.Since(start).Seconds()) }
	for i, step := range sc.Steps {
		if until > 0 && step.At > until {
			break
		}
		if !pause.For(ctx, time.Until(start.Add(step.At))) {
			return context.Cause(ctx)
		}
		if step.Arm != nil {
			f, d, err := step.Arm.fault()
			if err != nil {
				return fmt.Errorf("scenario step %d: %w", i+1, err)
			}
			armed, err := st.Arm(ctx, f, d)
			if err != nil {
				return fmt.Errorf("scenario step %d: %w", i+1, err)
			}
			fmt.Fprintf(out, "%s arm %s\n", at(), armed.String())
			continue
		}
		d := step.Disarm
		gone, err := st.Disarm(ctx, d.Engine, d.ID)
		if err != nil {
			return fmt.Errorf("scenario step %d: %w", i+1, err)
		}
		what := "all"
		if d.Engine != "" {
			what = d.Engine
			if d.ID != "" {
				what += "/" + d.ID
			}
		}
		if len(gone) == 0 {
			fmt.Fprintf(out, "%s disarm %s: nothing armed\n", at(), what)
		}
		for _, f := range gone {
			fmt.Fprintf(out, "%s disarm %s: %s/%s\n", at(), what, f.EngineID, f.ID)
		}
	}
	if until > 0 && !pause.For(ctx, time.Until(start.Add(until))) {
		return context.Cause(ctx)
	}
	return nil
}

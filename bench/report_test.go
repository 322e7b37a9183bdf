package bench

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// fakeReport builds a report from synthetic log-normal-ish samples.
func fakeReport(target string, seed uint64, n int, scale time.Duration) *Report {
	rng := rand.New(rand.NewPCG(seed, 1))
	st := &stretch{elapsed: 2 * time.Second, benchCPU: 900 * time.Millisecond, allocs: uint64(n) * 300, allocB: uint64(n) * 30000}
	st.rec.errors = map[string]int{"http_502": 2, ClassTruncated: 1}
	for i := 0; i < n; i++ {
		f := func() time.Duration { return time.Duration(float64(scale) * (0.5 + rng.ExpFloat64())) }
		ttft := f()
		st.rec.ttft = append(st.rec.ttft, ttft)
		st.rec.e2e = append(st.rec.e2e, ttft+16*f()/10)
		for k := 0; k < 16; k++ {
			st.rec.itl = append(st.rec.itl, f()/10)
		}
		st.rec.ok++
		st.rec.tokens += 16
	}
	var t Target = &FloorTarget{}
	if target == "router" {
		t = NewRouterTarget("http://127.0.0.1:9", 1)
	}
	return newReport(t, st, "4 sims")
}

func fakeFile() *File {
	cmp := &Comparison{Slices: 8, Router: fakeReport("router", 1, 500, time.Millisecond), Floor: fakeReport("floor", 2, 700, 400*time.Microsecond)}
	cmp.Router.RouterProcess = &ProcessCost{Holds: "router (child process)", CPUS: 0.3, CPUCores: 0.15, CPUPerRequestUS: 597.6}
	cmp.RouterCPUPerRequestUS = 597.6
	cmp.compute()
	wl := testWorkload("narwhal-sim", 16)
	wl.Duration, wl.Requests, wl.Concurrency = 60*time.Second, 0, 64
	p := NewParams("local", wl)
	p.CompareFloor, p.Slices, p.RouterProcess = true, 8, true
	single := fakeReport("router", 3, 300, 2*time.Millisecond)
	single.itl = nil // a non-streamed run: no ITL samples
	single.ITL = Distribution{}
	p2 := NewParams("http://10.0.0.1:8080", wl)
	p2.Concurrency, p2.RatePerS = 0, 250.5
	return &File{
		StartedAt: "2025-01-02T03:04:05.123456789Z",
		Machine:   ThisMachine(),
		Results:   []Result{{Params: p, Comparison: cmp}, {Params: p2, Run: single}},
	}
}

// dropSamples clears the samples kept for histograms, which are not part
// of the JSON.
func dropSamples(f *File) {
	for i := range f.Results {
		for _, r := range []*Report{f.Results[i].Run, comparisonSide(f.Results[i].Comparison, true), comparisonSide(f.Results[i].Comparison, false)} {
			if r != nil {
				r.ttft, r.itl, r.e2e = nil, nil, nil
			}
		}
	}
}

func comparisonSide(c *Comparison, router bool) *Report {
	if c == nil {
		return nil
	}
	if router {
		return c.Router
	}
	return c.Floor
}

// The JSON file round-trips: every figure, the parameters and the machine
// read back equal to what was written.
func TestJSONFileRoundTrips(t *testing.T) {
	f := fakeFile()
	path := filepath.Join(t.TempDir(), "bench.json")
	if err := WriteFile(path, f); err != nil {
		t.Fatal(err)
	}
	back, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dropSamples(f)
	if !reflect.DeepEqual(f, back) {
		a, _ := json.Marshal(f)
		b, _ := json.Marshal(back)
		t.Fatalf("round trip differs:\n%s\n%s", a, b)
	}
	c := back.Results[0].Comparison
	if c.Router.Errors["http_502"] != 2 || c.RouterCPUPerRequestUS != 597.6 || back.Machine.GOMAXPROCS < 1 || back.Machine.GoVersion == "" {
		t.Errorf("figures lost: %+v %+v", c.Router.Errors, back.Machine)
	}
}

// The SVG is well-formed XML with an <svg> root, one histogram per metric
// and run, and labelled percentiles.
func TestSVGIsWellFormed(t *testing.T) {
	f := fakeFile()
	results := []*Result{&f.Results[0], &f.Results[1]}
	var buf bytes.Buffer
	if err := WriteSVG(&buf, `narwhal bench <&> "test"`, results); err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(bytes.NewReader(buf.Bytes()))
	var root string
	elements := map[string]int{}
	var texts []string
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = el.Name.Local
				if el.Name.Space != "http://www.w3.org/2000/svg" {
					t.Errorf("root namespace %q", el.Name.Space)
				}
			}
			elements[el.Name.Local]++
		case xml.CharData:
			texts = append(texts, string(el))
		}
	}
	if root != "svg" {
		t.Fatalf("root element %q, want svg", root)
	}
	// Comparison: 3 metrics × 2 series; run: TTFT and E2E (no ITL samples).
	if elements["polygon"] != 8 {
		t.Errorf("%d histograms, want 8", elements["polygon"])
	}
	all := strings.Join(texts, "\n")
	for _, want := range []string{"narwhal bench <&> \"test\"", "p50", "p90", "p99", "router", "floor", "no samples", "1ms", "concurrency 64", "rate 250.5/s"} {
		if !strings.Contains(all, want) {
			t.Errorf("SVG text lacks %q", want)
		}
	}
}

// The table shows both sides, the added latency and the costs.
func TestWriteTable(t *testing.T) {
	f := fakeFile()
	var buf bytes.Buffer
	for i := range f.Results {
		if err := WriteTable(&buf, &f.Results[i]); err != nil {
			t.Fatal(err)
		}
	}
	out := buf.String()
	for _, want := range []string{"router vs floor", "TTFT p99", "E2E p50", "ratio ", "router CPU: 597.6 µs/request", "http_502=2 truncated=1", "sims CPU (estimate)", "requests/s", "tokens/s"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

func TestDecadeLabels(t *testing.T) {
	for d, want := range map[int]string{-9: "1ns", -7: "100ns", -6: "1µs", -4: "100µs", -3: "1ms", -1: "100ms", 0: "1s", 1: "10s"} {
		if got := decadeLabel(d); got != want {
			t.Errorf("decadeLabel(%d) = %q, want %q", d, got, want)
		}
	}
}

func TestFmtShort(t *testing.T) {
	for sec, want := range map[float64]string{0: "0", 3e-7: "0.3µs", 914e-6: "914µs", 0.0353: "35.3ms", 0.001234: "1.23ms", 1.2: "1.2s", 12.34: "12.3s"} {
		if got := fmtShort(sec); got != want {
			t.Errorf("fmtShort(%g) = %q, want %q", sec, got, want)
		}
	}
}

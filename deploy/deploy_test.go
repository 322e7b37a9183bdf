// Package deploy holds the tests of what deploy/ ships: the Grafana
// dashboard (grafana/narwhal.json) and the Prometheus alerts
// (prometheus/alerts.yaml) with their promtool unit tests.
package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goccy/go-yaml"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/narwhalmesh/narwhal/authd"
	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/kvevents"
	"github.com/narwhalmesh/narwhal/router"
)

const (
	alertsFile     = "prometheus/alerts.yaml"
	alertTestsFile = "prometheus/alerts_test.yaml"
	dashboardFile  = "grafana/narwhal.json"
)

// promtool returns the path of promtool. Without it the test is skipped,
// except under CI=true, where .ci/run installs it: there it fails.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err == nil {
		return p
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("promtool is not installed (Debian package prometheus); .ci/run installs it")
	}
	t.Skip("promtool is not installed: apt-get install -y prometheus (Debian) to run the alert rule tests")
	return ""
}

// runPromtool runs promtool with args in dir and fails the test with its
// output when it fails.
func runPromtool(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// alertRules is alerts.yaml as far as the tests read it.
type alertRules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func readAlerts(t *testing.T) alertRules {
	t.Helper()
	b, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	var r alertRules
	if err := yaml.Unmarshal(b, &r); err != nil {
		t.Fatalf("%s: %v", alertsFile, err)
	}
	return r
}

// wantAlerts are the alerts the mesh's operators need; each must be in
// alerts.yaml.
var wantAlerts = []string{
	"NarwhalEngineEjected", "NarwhalPhaseEjected", "NarwhalErrorRatioHigh", "NarwhalEventsDropped",
	"NarwhalBusDisconnected", "NarwhalRetryBudgetExhausted", "NarwhalBreakerWithoutLeader",
}

// TestAlertRulesPassPromtoolRBUS10 proves alerts.yaml is valid (promtool
// check rules) and that its unit tests pass (promtool test rules): each
// alert fires on the series that should fire it and stays quiet on the
// others — engine and phase ejection, error ratio, events dropped
// (R-BUS-10), bus disconnected (R-BUS-6), retry budget, breaker without
// leader (R-BRK-8). Every alert has at least one test where it fires and
// one where it does not, a severity, a summary, a description, and a
// runbook section in docs/observability.md.
func TestAlertRulesPassPromtoolRBUS10(t *testing.T) {
	rules := readAlerts(t)
	var names []string
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			names = append(names, r.Alert)
			if r.Labels["severity"] != "warning" && r.Labels["severity"] != "critical" {
				t.Errorf("%s: severity %q, want warning or critical", r.Alert, r.Labels["severity"])
			}
			for _, a := range []string{"summary", "description", "runbook"} {
				if r.Annotations[a] == "" {
					t.Errorf("%s: no %s annotation", r.Alert, a)
				}
			}
			if want := "docs/observability.md#" + strings.ToLower(r.Alert); r.Annotations["runbook"] != want {
				t.Errorf("%s: runbook %q, want %q", r.Alert, r.Annotations["runbook"], want)
			}
		}
	}
	for _, a := range wantAlerts {
		if !slices.Contains(names, a) {
			t.Errorf("alerts.yaml lacks %s", a)
		}
	}
	doc, err := os.ReadFile("../docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range names {
		if !regexp.MustCompile(`(?m)^### ` + a + `$`).Match(doc) {
			t.Errorf("docs/observability.md has no section ### %s saying what to do when it fires", a)
		}
	}

	b, err := os.ReadFile(alertTestsFile)
	if err != nil {
		t.Fatal(err)
	}
	var tests struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	if err := yaml.Unmarshal(b, &tests); err != nil {
		t.Fatalf("%s: %v", alertTestsFile, err)
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	for _, a := range names {
		if !fires[a] || !quiet[a] {
			t.Errorf("%s: alerts_test.yaml has a firing case %v and a quiet case %v; want both", a, fires[a], quiet[a])
		}
	}

	runPromtool(t, "prometheus", "check", "rules", "alerts.yaml")
	runPromtool(t, "prometheus", "test", "rules", "alerts_test.yaml")
}

// grafanaDashboard is narwhal.json as far as the tests read it.
type grafanaDashboard struct {
	Title         string `json:"title"`
	UID           string `json:"uid"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []struct {
			Type       string          `json:"type"`
			Name       string          `json:"name"`
			Query      json.RawMessage `json:"query"`
			Datasource *datasourceRef  `json:"datasource"`
		} `json:"list"`
	} `json:"templating"`
	Panels []grafanaPanel `json:"panels"`
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type grafanaPanel struct {
	ID         int            `json:"id"`
	Type       string         `json:"type"`
	Title      string         `json:"title"`
	Datasource *datasourceRef `json:"datasource"`
	GridPos    struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		Expr       string         `json:"expr"`
		RefID      string         `json:"refId"`
		Datasource *datasourceRef `json:"datasource"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"`
}

func readDashboard(t *testing.T) grafanaDashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// panels returns every panel, those inside collapsed rows included.
func (d grafanaDashboard) panels() []grafanaPanel {
	var out []grafanaPanel
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			out = append(out, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// TestDashboardIsImportable proves narwhal.json is a dashboard current
// Grafana imports as it is: a datasource variable of type prometheus that
// every panel and query uses (${datasource}), unique panel ids, panels on
// the 24-column grid, rows for the fleet overview, latency, errors,
// ejections and bus health, latency panels built from the histograms, and
// every query valid PromQL (promtool parses them as recording rules).
func TestDashboardIsImportable(t *testing.T) {
	d := readDashboard(t)
	if d.Title == "" || d.UID == "" || d.SchemaVersion < 36 {
		t.Errorf("title %q, uid %q, schemaVersion %d: want both set and a current schema (>= 36)", d.Title, d.UID, d.SchemaVersion)
	}
	hasDS := false
	for _, v := range d.Templating.List {
		if v.Type == "datasource" && v.Name == "datasource" && string(v.Query) == `"prometheus"` {
			hasDS = true
		} else if v.Datasource == nil || v.Datasource.UID != "${datasource}" {
			t.Errorf("variable %s does not query ${datasource}", v.Name)
		}
	}
	if !hasDS {
		t.Error("no datasource variable named datasource of type prometheus")
	}
	ids := map[int]bool{}
	var rows []string
	var exprs []string
	for _, p := range d.panels() {
		if ids[p.ID] || p.ID == 0 {
			t.Errorf("panel %q: id %d missing or used twice", p.Title, p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.W < 1 || p.GridPos.H < 1 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v off the 24-column grid", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			rows = append(rows, p.Title)
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q: datasource %+v, want the ${datasource} variable", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			if q.Datasource == nil || q.Datasource.UID != "${datasource}" || q.Expr == "" || q.RefID == "" {
				t.Errorf("panel %q: query %+v", p.Title, q)
			}
			exprs = append(exprs, q.Expr)
		}
	}
	for _, r := range []string{"Fleet overview", "Latency", "Errors", "Ejections", "Bus health"} {
		if !slices.Contains(rows, r) {
			t.Errorf("no row %q (rows: %v)", r, rows)
		}
	}
	joined := strings.Join(exprs, "\n")
	for _, h := range []string{"narwhal_first_byte_seconds_bucket", "narwhal_ttft_seconds_bucket", "narwhal_inter_token_seconds_bucket", "narwhal_request_duration_seconds_bucket"} {
		if !strings.Contains(joined, "histogram_quantile(0.99, sum by (le) (rate("+h) {
			t.Errorf("no p99 panel from %s", h)
		}
	}

	// Every query as a recording rule, the variables given values, for
	// promtool's PromQL parser.
	var rules strings.Builder
	rules.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for i, e := range exprs {
		e = strings.NewReplacer("$__rate_interval", "5m", "$model", ".*").Replace(e)
		q, _ := json.Marshal(e)
		fmt.Fprintf(&rules, "      - record: dashboard:query_%d\n        expr: %s\n", i, q)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "dashboard.yaml"), []byte(rules.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	runPromtool(t, dir, "check", "rules", "dashboard.yaml")
}

// metricName matches a Narwhal metric name in a query.
var metricName = regexp.MustCompile(`\bnarwhal_[a-z0-9_]+\b`)

// TestDashboardAndAlertMetricsExistRBUS1 proves that every metric the
// dashboard and the alerts query is one a live router or breaker serves
// on /metrics (a histogram's _bucket, _sum and _count by its name), and
// every label a query matches, groups or joins by is one its metrics
// have: a renamed metric or label cannot leave a panel or an alert
// silently empty. The router and the breaker run in this process on an embedded
// bus, over two simulated engines.
func TestDashboardAndAlertMetricsExistRBUS1(t *testing.T) {
	used := map[string][]string{}
	exprs := map[string]string{} // query → where it is used
	for _, p := range readDashboard(t).panels() {
		for _, q := range p.Targets {
			exprs[q.Expr] = "dashboard panel " + p.Title
			for _, m := range metricName.FindAllString(q.Expr, -1) {
				used[m] = append(used[m], "dashboard panel "+p.Title)
			}
		}
	}
	for _, g := range readAlerts(t).Groups {
		for _, r := range g.Rules {
			exprs[r.Expr] = "alert " + r.Alert
			for _, m := range metricName.FindAllString(r.Expr, -1) {
				used[m] = append(used[m], "alert "+r.Alert)
			}
		}
	}
	if len(used) < 20 {
		t.Fatalf("only %d metric names found in the dashboard and the alerts", len(used))
	}

	served := liveMetrics(t)
	for name, where := range used {
		if served[name] {
			continue
		}
		base := name
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(name, suffix); ok && served[b+"#histogram"] {
				base = ""
				break
			}
		}
		if base != "" {
			t.Errorf("%s (used by %s) is not served by a router or a breaker", name, strings.Join(slices.Compact(where), ", "))
		}
	}

	// Every label a query matches on a metric is one of that metric's;
	// every label it groups or joins by is one of a metric it queries
	// (or Prometheus's own instance and job, or a histogram's le).
	family := func(name string) string {
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(name, suffix); ok && served[b+"#histogram"] {
				return b
			}
		}
		return name
	}
	for expr, where := range exprs {
		for _, m := range selector.FindAllStringSubmatch(expr, -1) {
			for _, l := range matcherLabel.FindAllStringSubmatch(m[2], -1) {
				if !served[family(m[1])+"{"+l[1]+"}"] {
					t.Errorf("%s: %s has no label %s", where, m[1], l[1])
				}
			}
		}
		for _, g := range grouping.FindAllStringSubmatch(expr, -1) {
			for _, l := range strings.Split(g[1], ",") {
				l = strings.TrimSpace(l)
				ok := l == "instance" || l == "job" || l == "le" && strings.Contains(expr, "_bucket")
				for _, m := range metricName.FindAllString(expr, -1) {
					ok = ok || served[family(m)+"{"+l+"}"]
				}
				if !ok {
					t.Errorf("%s: groups or joins by %s, a label of none of its metrics", where, l)
				}
			}
		}
	}
}

var (
	// selector matches a metric name with its label matchers.
	selector = regexp.MustCompile(`\b(narwhal_[a-z0-9_]+)\{([^}]*)\}`)
	// matcherLabel matches the label of one label matcher.
	matcherLabel = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	// grouping matches the labels of by, without, on, ignoring,
	// group_left and group_right.
	grouping = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)`)
)

// liveMetrics starts a router, a leading breaker, an authd (on a bus
// with auth callout) and an agent's KV event bridge, and returns the
// metric names their /metrics pages serve; a histogram also as
// "<name>#histogram"; each also as "<name>#type=<counter, gauge,
// histogram…>" and, for each label its series have, "<name>{<label>}".
func liveMetrics(t *testing.T) map[string]bool {
	t.Helper()
	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	cfg := config.Default()
	cfg.Router.ID = "rt-deploy"
	for _, e := range []struct{ id, role string }{{"p1", "prefill"}, {"d1", "decode"}} {
		srv := simtest.Start(t, sim.Config{Role: e.role, EngineID: e.id, Model: "m"})
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: e.id, URL: srv.URL(), Role: connector.Role(e.role), Connector: connector.DefaultName})
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	connect := func(name string) *bus.Bus {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		b, err := bus.Connect(ctx, bus.ConnectOptions{URL: emb.ClientURL(), Name: name})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(b.Close)
		return b
	}

	// The router, publishing its events on the bus.
	reg := prometheus.NewRegistry()
	pub := bus.NewPublisher(connect("router"), 64, reg)
	t.Cleanup(pub.Close)
	rb := connect("router-mesh")
	rt, err := router.New(router.Options{Config: &cfg, Publisher: pub, Registry: reg, ShutdownGrace: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// In the mesh as `narwhal router` joins it: placement, quarantines and
	// the shared prefix index, with their metrics.
	if err := rt.JoinMesh(rb, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rt.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = rt.Shutdown(ctx)
		<-done
	})

	// The breaker, leading, with its placement entries written.
	breg := prometheus.NewRegistry()
	svc, err := breaker.New(breaker.Options{Config: &cfg, Bus: connect("breaker"), ID: "b-deploy", Registry: breg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	bdone := make(chan error, 1)
	go func() { bdone <- svc.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-bdone })
	bsrv := httptest.NewServer(promhttp.HandlerFor(breg, promhttp.HandlerOpts{}))
	t.Cleanup(bsrv.Close)

	// narwhal bus authd, on a bus of its own with auth callout: its
	// series exist at start (every role and reason at 0).
	authDir := t.TempDir()
	if err := bus.WriteCredentials(authDir); err != nil {
		t.Fatal(err)
	}
	if err := bus.WriteAuthd(authDir); err != nil {
		t.Fatal(err)
	}
	authEmb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: authDir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(authEmb.Shutdown)
	keys, err := authd.NewKeySource(authd.KeySourceOptions{Location: filepath.Join(t.TempDir(), "jwks.json")})
	if err != nil {
		t.Fatal(err)
	}
	areg := prometheus.NewRegistry()
	asvc, err := authd.Start(authd.Options{URL: authEmb.ClientURL(), CredsFile: filepath.Join(authDir, bus.AuthdCredsFile),
		SigningKeyFile: filepath.Join(authDir, "keys", bus.AuthdSigningKeyFile), Registry: areg,
		Verifier: &authd.Verifier{Keys: keys, Roles: authd.Roles{"llm/narwhal-router": bus.RoleRouter}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(asvc.Close)
	// An agent carrying an engine's KV events: its series exist from the
	// start for each configured rank.
	if _, err := kvevents.New(kvevents.Config{EngineID: "p1", Sources: []kvevents.Source{{Endpoint: "tcp://127.0.0.1:1"}}, Registry: areg}); err != nil {
		t.Fatal(err)
	}
	asrv := httptest.NewServer(promhttp.HandlerFor(areg, promhttp.HandlerOpts{}))
	t.Cleanup(asrv.Close)

	served := map[string]bool{}
	scrape := func(url string) []*dto.MetricFamily {
		mfs, err := testkit.Scrape(http.DefaultClient, url)
		if err != nil {
			t.Fatal(err)
		}
		return mfs
	}
	testkit.WaitFor(t, 10*time.Second, "the breaker leading and reporting each engine's state", func() bool {
		for _, mf := range scrape(bsrv.URL + "/metrics") {
			if mf.GetName() == "narwhal_breaker_engine_ejected" && len(mf.GetMetric()) == 2 {
				return true
			}
		}
		return false
	})
	testkit.WaitFor(t, 10*time.Second, "the router knowing its engines' models", func() bool {
		for _, mf := range scrape("http://" + ln.Addr().String() + "/metrics") {
			if mf.GetName() == "narwhal_prompt_tokens_total" && len(mf.GetMetric()) > 1 {
				return true // "other" and "m"
			}
		}
		return false
	})
	for _, url := range []string{"http://" + ln.Addr().String() + "/metrics", bsrv.URL + "/metrics", asrv.URL + "/metrics"} {
		for _, mf := range scrape(url) {
			served[mf.GetName()] = true
			if mf.GetType() == dto.MetricType_HISTOGRAM {
				served[mf.GetName()+"#histogram"] = true
			}
			served[mf.GetName()+"#type="+strings.ToLower(mf.GetType().String())] = true
			labels := map[string]bool{}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					labels[l.GetName()] = true
				}
			}
			for l := range labels {
				served[mf.GetName()+"{"+l+"}"] = true
			}
		}
	}
	return served
}

// docRow matches a metric's row in docs/observability.md's tables:
// | `name` | type | labels | unit | meaning |.
var docRow = regexp.MustCompile("(?m)^\\| `(narwhal_[a-z0-9_]+)` \\| ([a-z]+) \\| ([^|]*) \\|")

// seriesLater are the documented metrics whose series appear at their
// first count rather than at start: a producer and consumer pair's
// recompute counter (one series per pair would be prefill × decode
// engines).
var seriesLater = map[string]bool{"narwhal_kv_recomputed_total": true}

// docMetric is a metric's row in docs/observability.md.
type docMetric struct {
	typ    string
	labels map[string]bool
}

// TestEveryMetricDocumented proves docs/observability.md lists every
// Narwhal metric a live router, breaker, authd and agent (its KV event
// series) serve, with its type and exactly the labels it has, and lists
// no metric they do not serve.
func TestEveryMetricDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	documentedRows := map[string]docMetric{}
	for _, m := range docRow.FindAllStringSubmatch(string(doc), -1) {
		name, typ, labelCol := m[1], m[2], m[3]
		var labels []string
		if strings.TrimSpace(labelCol) != "—" {
			for _, l := range strings.Split(labelCol, ",") {
				labels = append(labels, strings.Trim(strings.TrimSpace(l), "`"))
			}
		}
		doc := map[string]bool{}
		for _, l := range labels {
			doc[l] = true
		}
		documentedRows[name] = docMetric{typ: typ, labels: doc}
	}
	if len(documentedRows) < 40 {
		t.Fatalf("only %d metric rows found in docs/observability.md", len(documentedRows))
	}
	served := liveMetrics(t)
	for key := range served {
		name, label, hasLabel := strings.Cut(strings.TrimSuffix(key, "}"), "{")
		if strings.Contains(name, "#") || !strings.HasPrefix(name, "narwhal_") {
			continue
		}
		row, ok := documentedRows[name]
		if !ok {
			if !hasLabel {
				t.Errorf("%s is served but docs/observability.md does not list it", name)
			}
			continue
		}
		if hasLabel && label != "le" && !row.labels[label] {
			t.Errorf("%s has label %s, which docs/observability.md does not list", name, label)
		}
		if !hasLabel && !served[name+"#type="+row.typ] {
			t.Errorf("%s: docs/observability.md says it is a %s", name, row.typ)
		}
	}
	for name, row := range documentedRows {
		if !served[name] && seriesLater[name] {
			continue
		}
		if !served[name] {
			t.Errorf("docs/observability.md lists %s, which no router, breaker or authd serves", name)
			continue
		}
		for l := range row.labels {
			if !served[name+"{"+l+"}"] {
				t.Errorf("docs/observability.md lists label %s of %s, which its series do not have", l, name)
			}
		}
	}
}

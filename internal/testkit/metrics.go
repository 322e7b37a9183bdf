package testkit

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Sum adds up the samples of metric name in families whose labels include
// every name/value pair of labels ("engine", "d1", "phase", "decode", …;
// a trailing odd name is ignored). A counter, gauge or untyped sample
// adds its value; a histogram or summary sample adds its observation
// count. found reports whether any sample matched, so that a series that
// is absent can be told from one that is 0.
func Sum(families []*dto.MetricFamily, name string, labels ...string) (sum float64, found bool) {
	for _, mf := range families {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !hasLabels(m, labels) {
				continue
			}
			found = true
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Untyped != nil:
				sum += m.GetUntyped().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			case m.Summary != nil:
				sum += float64(m.GetSummary().GetSampleCount())
			}
		}
	}
	return sum, found
}

func hasLabels(m *dto.Metric, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		found := false
		for _, l := range m.GetLabel() {
			if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// GatheredSum is Sum over what g gathers now; a gather error fails the
// test. A series that is absent counts as 0.
func GatheredSum(t testing.TB, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	sum, _ := Sum(mfs, name, labels...)
	return sum
}

// GatheredSeries counts the series of metric name that g gathers now whose
// labels include every name/value pair of labels (as Sum matches them); a
// gather error fails the test.
func GatheredSeries(t testing.TB, g prometheus.Gatherer, name string, labels ...string) int {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	n := 0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if hasLabels(m, labels) {
				n++
			}
		}
	}
	return n
}

// Scrape fetches url (a /metrics page in Prometheus' text format) with
// client and parses it. It returns an error when the request fails, the
// status is not 200, or the page does not parse; it never fails a test,
// so that it can run on any goroutine.
func Scrape(client *http.Client, url string) ([]*dto.MetricFamily, error) {
	resp, err := client.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: HTTP %d", url, resp.StatusCode)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	byName, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	mfs := make([]*dto.MetricFamily, 0, len(byName))
	for _, mf := range byName {
		mfs = append(mfs, mf)
	}
	return mfs, nil
}

// ScrapedSum is Sum over the page Scrape fetches from url; an error
// fails the test. A series that is absent counts as 0.
func ScrapedSum(t testing.TB, client *http.Client, url, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := Scrape(client, url)
	if err != nil {
		t.Fatal(err)
	}
	sum, _ := Sum(mfs, name, labels...)
	return sum
}

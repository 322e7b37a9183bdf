package bench

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"strings"
	"time"
)

// SVG geometry, in pixels.
const (
	svgPanelW   = 460
	svgPanelH   = 290
	svgTitleH   = 34
	svgMarginL  = 56
	svgMarginR  = 16
	svgMarginT  = 64
	svgMarginB  = 44
	svgPageTopH = 30
)

// svgSeries is one latency sample of one target, sorted ascending.
type svgSeries struct {
	name    string
	color   string
	samples []time.Duration
	dist    Distribution
}

// WriteSVG writes an SVG document with one row per result and, in each
// row, the histograms of TTFT, ITL and end-to-end latency on a log-scaled
// time axis (share of requests or chunks per bin on the y axis), router
// and floor overlaid for a comparison, with p50, p90 and p99 marked and
// labelled. It is plain SVG text: no scripts, no external resources.
func WriteSVG(w io.Writer, title string, results []*Result) error {
	bw := bufio.NewWriter(w)
	width := 3 * svgPanelW
	rowH := svgTitleH + svgPanelH
	height := svgPageTopH + len(results)*rowH + 10
	fmt.Fprintf(bw, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(bw, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica, Arial, sans-serif" font-size="11">`+"\n", width, height, width, height)
	fmt.Fprintf(bw, `<rect x="0" y="0" width="%d" height="%d" fill="#ffffff"/>`+"\n", width, height)
	fmt.Fprintf(bw, `<text x="10" y="20" font-size="15" font-weight="bold">%s</text>`+"\n", esc(title))
	for i, res := range results {
		y0 := svgPageTopH + i*rowH
		fmt.Fprintf(bw, `<text x="10" y="%d" font-size="13" font-weight="bold">%s</text>`+"\n", y0+22, esc(res.Params.Target+" — "+res.Params.Title()))
		for j, metric := range []string{"TTFT", "ITL", "E2E"} {
			series := resultSeries(res, metric)
			writePanel(bw, j*svgPanelW, y0+svgTitleH, metric, series)
		}
	}
	fmt.Fprintln(bw, `</svg>`)
	return bw.Flush()
}

// resultSeries returns the series of one metric of res: the run's, or the
// router's and the floor's.
func resultSeries(res *Result, metric string) []svgSeries {
	pick := func(r *Report, name, color string) svgSeries {
		s := svgSeries{name: name, color: color}
		switch metric {
		case "TTFT":
			s.samples, s.dist = r.ttft, r.TTFT
		case "ITL":
			s.samples, s.dist = r.itl, r.ITL
		default:
			s.samples, s.dist = r.e2e, r.E2E
		}
		return s
	}
	var out []svgSeries
	if res.Run != nil {
		out = append(out, pick(res.Run, res.Run.Target, "#1f77b4"))
	}
	if c := res.Comparison; c != nil {
		out = append(out, pick(c.Router, "router", "#1f77b4"), pick(c.Floor, "floor", "#ff7f0e"))
	}
	return out
}

// writePanel draws one histogram panel whose top-left corner is (x0, y0).
func writePanel(w io.Writer, x0, y0 int, metric string, series []svgSeries) {
	plotX, plotY := float64(x0+svgMarginL), float64(y0+svgMarginT)
	plotW := float64(svgPanelW - svgMarginL - svgMarginR)
	plotH := float64(svgPanelH - svgMarginT - svgMarginB)
	names := map[string]string{"TTFT": "TTFT (time to first output)", "ITL": "ITL (between output chunks)", "E2E": "end-to-end latency"}
	fmt.Fprintf(w, `<g><text x="%d" y="%d" font-size="12" font-weight="bold">%s</text>`+"\n", x0+svgMarginL, y0+14, esc(names[metric]))
	// The legend: one line per series with its percentiles.
	for i, s := range series {
		ly := y0 + 30 + i*14
		fmt.Fprintf(w, `<rect x="%d" y="%d" width="10" height="10" fill="%s" fill-opacity="0.5" stroke="%s"/>`, x0+svgMarginL, ly-9, s.color, s.color)
		fmt.Fprintf(w, `<text x="%d" y="%d" font-size="10">%s  n=%d  p50 %s  p90 %s  p99 %s  max %s</text>`+"\n", x0+svgMarginL+14, ly,
			esc(s.name), s.dist.Count, esc(fmtShort(s.dist.P50S)), esc(fmtShort(s.dist.P90S)), esc(fmtShort(s.dist.P99S)), esc(fmtShort(s.dist.MaxS)))
	}
	fmt.Fprintf(w, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#999999"/>`+"\n", plotX, plotY, plotW, plotH)

	minS, maxS := math.Inf(1), math.Inf(-1)
	for _, s := range series {
		if len(s.samples) == 0 {
			continue
		}
		minS = math.Min(minS, math.Max(s.samples[0].Seconds(), 1e-9))
		maxS = math.Max(maxS, math.Max(s.samples[len(s.samples)-1].Seconds(), 1e-9))
	}
	if math.IsInf(minS, 1) {
		fmt.Fprintf(w, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#666666">no samples</text></g>`+"\n", plotX+plotW/2, plotY+plotH/2)
		return
	}
	lo, hi := math.Floor(math.Log10(minS)), math.Ceil(math.Log10(maxS))
	if hi <= lo {
		hi = lo + 1
	}
	decades := hi - lo
	perDecade := math.Max(5, math.Min(40, math.Floor(60/decades)))
	bins := int(decades * perDecade)
	xOf := func(sec float64) float64 {
		return plotX + (math.Log10(math.Max(sec, 1e-9))-lo)/decades*plotW
	}

	// Shares per bin, in percent of each series' samples.
	shares := make([][]float64, len(series))
	top := 0.0
	for i, s := range series {
		shares[i] = make([]float64, bins)
		if len(s.samples) == 0 {
			continue
		}
		for _, d := range s.samples {
			b := int((math.Log10(math.Max(d.Seconds(), 1e-9)) - lo) * perDecade)
			shares[i][min(max(b, 0), bins-1)]++
		}
		for b := range shares[i] {
			shares[i][b] *= 100 / float64(len(s.samples))
			top = math.Max(top, shares[i][b])
		}
	}
	yMax := niceCeil(top)
	yOf := func(pct float64) float64 { return plotY + plotH - pct/yMax*plotH }

	// Grid and axes: a tick per decade (labelled) and at 2…9 (not).
	for d := lo; d <= hi; d++ {
		x := xOf(math.Pow(10, d))
		fmt.Fprintf(w, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`, x, plotY, x, plotY+plotH)
		fmt.Fprintf(w, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", x, plotY+plotH+14, esc(decadeLabel(int(d))))
		if d < hi {
			for m := 2; m <= 9; m++ {
				xm := xOf(float64(m) * math.Pow(10, d))
				fmt.Fprintf(w, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#999999"/>`, xm, plotY+plotH, xm, plotY+plotH+3)
			}
			fmt.Fprintln(w)
		}
	}
	for i := 0; i <= 4; i++ {
		pct := yMax * float64(i) / 4
		y := yOf(pct)
		fmt.Fprintf(w, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eeeeee"/>`, plotX, y, plotX+plotW, y)
		fmt.Fprintf(w, `<text x="%.1f" y="%.1f" text-anchor="end">%s%%</text>`+"\n", plotX-4, y+4, trimFloat(pct))
	}
	fmt.Fprintf(w, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#444444">latency (log scale)</text>`+"\n", plotX+plotW/2, plotY+plotH+32)
	fmt.Fprintf(w, `<text x="%d" y="%.1f" text-anchor="middle" fill="#444444" transform="rotate(-90 %d %.1f)">share of samples</text>`+"\n",
		x0+14, plotY+plotH/2, x0+14, plotY+plotH/2)

	// The histograms, as filled step outlines so that two can overlay.
	for i, s := range series {
		if len(s.samples) == 0 {
			continue
		}
		var pts strings.Builder
		fmt.Fprintf(&pts, "%.1f,%.1f", plotX, yOf(0))
		for b, pct := range shares[i] {
			xa := plotX + float64(b)/float64(bins)*plotW
			xb := plotX + float64(b+1)/float64(bins)*plotW
			fmt.Fprintf(&pts, " %.1f,%.1f %.1f,%.1f", xa, yOf(pct), xb, yOf(pct))
		}
		fmt.Fprintf(&pts, " %.1f,%.1f", plotX+plotW, yOf(0))
		fmt.Fprintf(w, `<polygon points="%s" fill="%s" fill-opacity="0.35" stroke="%s" stroke-width="1.2"/>`+"\n", pts.String(), s.color, s.color)
	}
	// Percentile markers, labelled at the top of the plot.
	for i, s := range series {
		if len(s.samples) == 0 {
			continue
		}
		for k, p := range []struct {
			name string
			v    float64
		}{{"p50", s.dist.P50S}, {"p90", s.dist.P90S}, {"p99", s.dist.P99S}} {
			x := xOf(p.v)
			fmt.Fprintf(w, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="1.5" stroke-dasharray="4 3"/>`, x, plotY, x, plotY+plotH, s.color)
			ty := plotY + 11 + float64(i*3+k)*11
			fmt.Fprintf(w, `<text x="%.1f" y="%.1f" fill="%s" font-size="10">%s</text>`+"\n", x+3, ty, s.color, esc(p.name))
		}
	}
	fmt.Fprintln(w, `</g>`)
}

// fmtShort formats seconds with three significant digits and a unit:
// "0.3µs", "914µs", "35.3ms", "1.2s".
func fmtShort(sec float64) string {
	if sec <= 0 {
		return "0"
	}
	v, unit := sec, "s"
	switch {
	case sec < 1e-3:
		v, unit = sec*1e6, "µs"
	case sec < 1:
		v, unit = sec*1e3, "ms"
	}
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f%s", v, unit)
	case v >= 10:
		return fmt.Sprintf("%.1f%s", v, unit)
	}
	return fmt.Sprintf("%.3g%s", v, unit)
}

// decadeLabel names 10^d seconds: 1ns … 100s.
func decadeLabel(d int) string {
	units := []struct {
		exp  int
		name string
	}{{-9, "ns"}, {-6, "µs"}, {-3, "ms"}, {0, "s"}}
	for i := len(units) - 1; i >= 0; i-- {
		if d >= units[i].exp || i == 0 {
			v := math.Pow(10, float64(d-units[i].exp))
			return trimFloat(v) + units[i].name
		}
	}
	return ""
}

// niceCeil rounds a positive percentage up to 1, 2 or 5 times a power of
// ten (at least 1).
func niceCeil(v float64) float64 {
	if v <= 1 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func trimFloat(v float64) string {
	s := fmt.Sprintf("%.3f", v)
	s = strings.TrimRight(s, "0")
	return strings.TrimSuffix(s, ".")
}

// esc escapes text for XML character data and attribute values.
func esc(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch r {
		case '&':
			b.WriteString("&amp;")
		case '<':
			b.WriteString("&lt;")
		case '>':
			b.WriteString("&gt;")
		case '"':
			b.WriteString("&quot;")
		case '\'':
			b.WriteString("&apos;")
		default:
			if r < 0x20 && r != '\t' && r != '\n' {
				continue // not allowed in XML 1.0
			}
			b.WriteRune(r)
		}
	}
	return b.String()
}

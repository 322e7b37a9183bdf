package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Bounds of the browser test.
const (
	// browserBound bounds the whole browser test.
	browserBound = 90 * time.Second
	// pageBound bounds each wait for the page to show something. The page
	// updates within a second; the rest is a loaded machine's margin.
	pageBound = 20 * time.Second
)

// pageLine is the banner line of `narwhal dev` that names the fleet page.
var pageLine = regexp.MustCompile(`(?m)^Watch the fleet live in a browser: (http://\S+/)$`)

// natsLine is the banner line of `narwhal dev` that names its bus.
var natsLine = regexp.MustCompile(`(?m)^NARWHAL_NATS_URL=(nats://\S+) `)

// chromium returns the headless browser of the browser tests: Debian's
// chromium (.ci/run installs it). Without one the test is skipped — unless
// CI=true, where a missing browser fails it.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "headless-shell"} {
		if path, err := exec.LookPath(name); err == nil {
			return path
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("no chromium on PATH: the browser test needs it under CI (apt-get install chromium)")
	}
	t.Skip("no chromium on PATH: skipping the browser test (apt-get install chromium to run it)")
	return ""
}

// pageRow is an engine row of the fleet page as the browser shows it.
type pageRow struct {
	ID    string `json:"id"`
	Role  string `json:"role"`
	State string `json:"state"`
}

// TestDashboardInBrowser runs `narwhal dev --chaos` and drives its fleet
// page in a real headless browser (the observability page over behaviour.md
// R-BUS-5): the page lists every engine with its role as eligible; a
// fault armed with `narwhal chaos arm` (three HTTP 503s on decode-1)
// shows in the chaos table; the requests it strikes eject decode-1
// (R-BRK-1), which the page shows — state, timeline, failures — without a
// reload; the breaker's probe then readmits it (R-BRK-3) and the page
// shows that too. The keyboard alone reaches the page's one control. A
// forged failure event whose message is HTML is shown as text and runs
// nothing. A screenshot is taken and checked.
func TestDashboardInBrowser(t *testing.T) {
	browser := chromium(t)
	ctx := testContext(t, browserBound)
	ports := freePorts(t, 2)
	routerURL := "http://" + hostPort(ports[0])
	dev := startProcess(t, "dev", []string{
		"NARWHAL_RECOVERY_READMIT_INTERVAL_S=1",
		"NARWHAL_RECOVERY_EJECT_AFTER=3",
	}, "dev", "--chaos", "--listen", hostPort(ports[0]), "--dashboard", hostPort(ports[1]))
	testkit.WaitEvery(t, readyBound, pollInterval, "the fleet page's line in the banner", func() bool {
		if dev.exited() {
			t.Fatalf("narwhal dev exited: %v", dev.waitErr)
		}
		return pageLine.MatchString(dev.stdout.String()) && curlLine.MatchString(dev.stdout.String())
	})
	banner := dev.stdout.String()
	pageURL := pageLine.FindStringSubmatch(banner)[1]
	if want := "http://" + hostPort(ports[1]) + "/"; pageURL != want {
		t.Fatalf("the banner names the page %s, want %s (--dashboard)", pageURL, want)
	}
	natsURL := natsLine.FindStringSubmatch(banner)[1]

	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(browser), chromedp.NoSandbox, chromedp.Headless, chromedp.DisableGPU,
		chromedp.WindowSize(1400, 1000), chromedp.UserDataDir(t.TempDir()))
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	if err := chromedp.Do(bctx, chromedp.Navigate(pageURL)); err != nil {
		t.Fatalf("open %s: %v", pageURL, err)
	}
	// The document is marked once: the same mark at the end proves no
	// reload happened in between.
	if err := chromedp.Do(bctx, chromedp.Evaluate[chromedp.Void](`window.narwhalTestMark = "first load"`)); err != nil {
		t.Fatal(err)
	}

	rows := func() []pageRow {
		var out []pageRow
		js, err := chromedp.Run(bctx, chromedp.Evaluate[string](`JSON.stringify(Array.from(
			document.querySelectorAll("#engines tbody tr"),
			(r) => ({id: r.cells[0].textContent, role: r.cells[1].textContent, state: r.cells[2].textContent})))`))
		if err != nil {
			t.Fatalf("read the engine rows: %v", err)
		}
		if err := json.Unmarshal([]byte(js), &out); err != nil {
			t.Fatalf("engine rows %s: %v", js, err)
		}
		return out
	}
	stateOf := func(id string) string {
		for _, r := range rows() {
			if r.ID == id {
				return r.State
			}
		}
		return ""
	}
	text := func(selector string) string {
		s, err := chromedp.Run(bctx, chromedp.Evaluate[string](`(document.querySelector(`+jsString(selector)+`) || {textContent: ""}).textContent`))
		if err != nil {
			t.Fatalf("read %s: %v", selector, err)
		}
		return s
	}

	// Every engine, with its role, eligible.
	want := []pageRow{{"decode-1", "decode", "eligible"}, {"decode-2", "decode", "eligible"},
		{"prefill-1", "prefill", "eligible"}, {"prefill-2", "prefill", "eligible"}}
	testkit.WaitEvery(t, pageBound, 50*time.Millisecond, "every engine on the page, eligible", func() bool {
		got := rows()
		return fmt.Sprint(got) == fmt.Sprint(want)
	})
	if s := text("#status"); s != "live" {
		t.Errorf("status %q, want live", s)
	}

	// The keyboard alone: Tab reaches the one control (after the skip
	// link), and the L key toggles large text.
	large := func() bool {
		on, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`document.documentElement.classList.contains("large")`))
		if err != nil {
			t.Fatal(err)
		}
		return on
	}
	var focused string
	var err error
	for range 4 {
		if err := chromedp.Do(bctx, chromedp.KeyEvent("\t")); err != nil {
			t.Fatal(err)
		}
		if focused, err = chromedp.Run(bctx, chromedp.Evaluate[string](`document.activeElement ? document.activeElement.id : ""`)); err != nil {
			t.Fatal(err)
		}
		if focused == "large" {
			break
		}
	}
	if focused != "large" {
		t.Errorf("Tab did not reach the Large text button (focus on %q)", focused)
	}
	if err := chromedp.Do(bctx, chromedp.KeyEvent("\r")); err != nil {
		t.Fatal(err)
	}
	if !large() {
		t.Error("Enter on the Large text button did not enlarge the text")
	}
	if err := chromedp.Do(bctx, chromedp.KeyEvent("l")); err != nil {
		t.Fatal(err)
	}
	if large() {
		t.Error("the L key did not toggle large text back")
	}

	// Arm three HTTP 503s on decode-1: the page lists the fault.
	env := []string{"NARWHAL_NATS_URL=" + natsURL}
	out, code := runNarwhalEnv(t, env, "chaos", "arm", "--engine", "decode-1", "--fault", "http-status", "--param", "code=503", "--count", "3", "--for", "2m")
	if code != 0 {
		t.Fatalf("narwhal chaos arm: exit %d: %s", code, out)
	}
	testkit.WaitEvery(t, pageBound, 50*time.Millisecond, "the armed fault on the page", func() bool {
		return strings.Contains(text("#chaos tbody"), "decode-1http-statusany")
	})

	// Requests until the fault has struck three times and decode-1 is
	// ejected; the page shows it without a reload.
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	body := `{"model":"` + devModel + `","messages":[{"role":"user","content":"Hello, fleet page!"}],"max_tokens":8}`
	ejected := false
	for i := 0; !ejected; i++ {
		if i > 200 {
			t.Fatalf("decode-1 not shown ejected after %d requests; rows %+v", i, rows())
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, routerURL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
		}
		ejected = stateOf("decode-1") == "ejected"
	}
	t.Logf("the page shows decode-1 ejected")
	testkit.WaitEvery(t, pageBound, 50*time.Millisecond, "the ejection on the timeline and the failures", func() bool {
		return strings.Contains(text(`#timeline li[data-what="ejected"]`), "decode-1") &&
			strings.Contains(text("#failures tbody"), "HTTP 503")
	})

	// The fault is spent: the breaker's probe readmits decode-1.
	testkit.WaitEvery(t, pageBound, 50*time.Millisecond, "decode-1 readmitted on the page", func() bool {
		return stateOf("decode-1") == "eligible" &&
			strings.Contains(text(`#timeline li[data-what="readmitted"]`), "decode-1")
	})
	t.Logf("the page shows decode-1 readmitted")

	// A forged event: its message is HTML, shown as text, never run.
	hostile := `<script>window.narwhalPwned=1</script><img src=x onerror="window.narwhalPwned=2"><b>bold</b>`
	publishForged(t, natsURL, hostile)
	testkit.WaitEvery(t, pageBound, 50*time.Millisecond, "the forged message as text", func() bool {
		return strings.Contains(text("#failures tbody"), hostile)
	})
	injected, err := chromedp.Run(bctx, chromedp.Evaluate[bool](
		`typeof window.narwhalPwned !== "undefined" || document.querySelector("main script, main img, main b") !== null`))
	if err != nil || injected {
		t.Fatalf("the forged message became markup or ran (err %v)", err)
	}
	if mark, err := chromedp.Run(bctx, chromedp.Evaluate[string](`window.narwhalTestMark || ""`)); err != nil || mark != "first load" {
		t.Fatalf("the page was reloaded (mark %q, %v)", mark, err)
	}

	shot, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	path := filepath.Join(t.TempDir(), "dashboard.png")
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	if len(shot) < 10<<10 || !bytes.HasPrefix(shot, []byte("\x89PNG\r\n\x1a\n")) {
		t.Fatalf("screenshot %s: %d bytes, PNG header %v: want a PNG over 10 KiB", path, len(shot), bytes.HasPrefix(shot, []byte("\x89PNG")))
	}
	t.Logf("screenshot %s: %d bytes", path, len(shot))

	cancelBrowser()
	cancelAlloc()
	if err := dev.stop(os.Interrupt); err != nil {
		t.Fatalf("narwhal dev after SIGINT: %v", err)
	}
}

// publishForged publishes a schema-valid failure event on the dev bus
// that no router sent: uncounted (so the breaker ignores it), about an
// engine of no fleet, with message as its message.
func publishForged(t *testing.T, natsURL, message string) {
	t.Helper()
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ev := &schemas.Failure{
		Envelope: schemas.Envelope{Schema: schemas.SchemaFailure, ID: "forged-1", At: time.Now().UTC(),
			RouterID: "forger", EngineID: "forged-engine", RequestID: "forged-request"},
		Phase: schemas.PhaseDecode, Kind: "protocol", Status: 502, Message: message, Attempt: 1,
	}
	payload, err := json.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish(ev.Subject(), payload); err != nil {
		t.Fatal(err)
	}
	if err := nc.FlushTimeout(5 * time.Second); err != nil {
		t.Fatal(err)
	}
}

// jsString quotes s as a JavaScript string literal.
func jsString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

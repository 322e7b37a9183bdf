package main

import (
	"context"
	"encoding/json"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestDashboardCommand runs `narwhal dashboard` against a bus that
// enforces role credentials, with the viewer's (R-BUS-8: read-only
// suffices, R-BUS-5): it prints the page's URL, the page answers with the
// snapshot of a connected bus, and SIGINT (ctx) stops it with nil. Bad
// flags fail before anything starts.
func TestDashboardCommand(t *testing.T) {
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_NATS_CREDS", bustest.CredsFile(dir, bus.RoleViewer))

	for _, args := range [][]string{{"--bogus"}, {"extra"}, {"--connect-timeout", "-1s"}, {"--listen", "127.0.0.1:bad"}} {
		var stdout, stderr testkit.LockedBuffer
		if err := runDashboard(context.Background(), args, &stdout, &stderr); err == nil {
			t.Errorf("narwhal dashboard %q: no error", args)
		}
	}

	listen := "127.0.0.1:" + strconv.Itoa(freeTCPPort(t))
	var stdout, stderr testkit.LockedBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runDashboard(ctx, []string{"--listen", listen}, &stdout, &stderr) }()
	stopped := false
	defer func() {
		if !stopped {
			cancel()
			<-done
		}
	}()
	line := regexp.MustCompile(`Fleet page: (http://\S+/)\n`)
	testkit.WaitFor(t, cmdTestBound, "the page's URL on stdout", func() bool { return line.MatchString(stdout.String()) })
	url := line.FindStringSubmatch(stdout.String())[1]
	if url != "http://"+listen+"/" {
		t.Fatalf("page URL %s, want http://%s/", url, listen)
	}
	client := &http.Client{Timeout: 2 * time.Second}
	var snap struct {
		Bus struct {
			Connected bool `json:"connected"`
		} `json:"bus"`
	}
	testkit.WaitFor(t, cmdTestBound, "a connected bus on /state", func() bool {
		status, body := getBody(client, url+"state")
		return status == 200 && json.Unmarshal([]byte(body), &snap) == nil && snap.Bus.Connected
	})
	if status, body := getBody(client, url); status != 200 || !strings.Contains(body, "Narwhal fleet") {
		t.Errorf("GET /: %d %.80q", status, body)
	}
	cancel()
	stopped = true
	if err := <-done; err != nil {
		t.Errorf("narwhal dashboard after SIGINT: %v", err)
	}
	if strings.Contains(stderr.String(), "Permissions Violation") || strings.Contains(stderr.String(), "level=WARN") {
		t.Errorf("the viewer's credential was refused something:\n%s", stderr.String())
	}

	// With --config the file's fleet is listed before the live fleet
	// names it (the bucket is empty here).
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	listen = "127.0.0.1:" + strconv.Itoa(freeTCPPort(t))
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	done = make(chan error, 1)
	var out2, err2 testkit.LockedBuffer
	go func() { done <- runDashboard(ctx, []string{"--listen", listen, "--config", path}, &out2, &err2) }()
	var engines struct {
		Engines []struct {
			ID   string `json:"id"`
			Role string `json:"role"`
		} `json:"engines"`
	}
	testkit.WaitFor(t, cmdTestBound, "the config file's engines on /state", func() bool {
		status, body := getBody(client, "http://"+listen+"/state")
		return status == 200 && json.Unmarshal([]byte(body), &engines) == nil && len(engines.Engines) == 2
	})
	if e := engines.Engines; e[0].ID != "d1" || e[0].Role != "decode" || e[1].ID != "p1" || e[1].Role != "prefill" {
		t.Errorf("engines %+v, want d1 decode and p1 prefill", e)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("narwhal dashboard --config after SIGINT: %v", err)
	}
}

package e2e

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// meshScriptBound bounds the example mesh's start (the script waits for
// each process itself) and its stop after Ctrl-C.
const meshScriptBound = 60 * time.Second

// TestExampleMesh runs README's mesh recipe as a newcomer would:
// examples/mesh.sh (in its own process group, with free ports through
// its environment overrides) until its banner says the mesh is up, then
// runs each `curl` line the banner prints through the real curl (when
// there is one) and its `fleet list` line (the four simulators registered
// themselves and are active, R-FLEET-4), and streams a chat completion through each router with
// Go's client — both must answer 200 with a prefill and a decode engine
// named and end with [DONE] — then presses Ctrl-C (SIGINT to the whole
// group, as a terminal does) and checks that the script exits 0 and that
// no process of the group is left; the group is killed in any case.
func TestExampleMesh(t *testing.T) {
	ports := freePorts(t, 7)
	dir := t.TempDir()
	cmd := exec.Command("bash", filepath.Join("..", "examples", "mesh.sh"))
	cmd.Env = childEnv(
		"MESH_BIN="+narwhalBin,
		"MESH_DIR="+dir,
		"MESH_BUS_PORT="+strconv.Itoa(ports[0]),
		"MESH_ROUTER_PORTS="+portList(ports[1:3]),
		"MESH_SIM_PORTS="+portList(ports[3:7]),
		"MESH_READY_S=20",
	)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr testkit.LockedBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pgid := cmd.Process.Pid
	done := make(chan error, 1)
	var out testkit.LockedBuffer
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			out.Write([]byte(sc.Text() + "\n"))
			select {
			case lines <- sc.Text():
			default:
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		close(lines)
		done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-pgid, syscall.SIGKILL) // whatever is left of the group
		if t.Failed() {
			t.Logf("---- mesh.sh stdout:\n%s\n---- stderr:\n%s", out.String(), stderr.String())
			for _, name := range []string{"bus", "breaker", "r1", "r2", "p1", "d1"} {
				if b, err := os.ReadFile(filepath.Join(dir, name+".log")); err == nil {
					t.Logf("---- %s.log:\n%s", name, b)
				}
			}
		}
	})

	// The banner, and the curl and fleet list lines in it.
	var curls []string
	var fleetList string
	deadline := time.After(meshScriptBound)
	for up := false; !up; {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("mesh.sh ended before its banner")
			}
			if strings.HasPrefix(l, "curl ") {
				curls = append(curls, l)
			}
			if strings.HasSuffix(l, " fleet list") {
				fleetList = l
			}
			up = strings.HasPrefix(l, "Press Ctrl-C")
		case <-deadline:
			t.Fatalf("no banner within %v", meshScriptBound)
		}
	}
	banner := out.String()
	for _, want := range []string{"Narwhal mesh is up", "NARWHAL_NATS_URL=nats://127.0.0.1:" + strconv.Itoa(ports[0]), " events\n", "/readyz"} {
		if !strings.Contains(banner, want) {
			t.Errorf("banner lacks %q:\n%s", want, banner)
		}
	}
	if len(curls) != 2 || !strings.Contains(curls[0], hostPort(ports[1])) || !strings.Contains(curls[1], hostPort(ports[2])) {
		t.Fatalf("banner's curl lines %q, want one per router", curls)
	}

	// What the banner says to paste, pasted.
	if _, err := exec.LookPath("curl"); err == nil {
		for _, line := range curls {
			ctx, cancel := context.WithTimeout(context.Background(), requestBound)
			b, err := exec.CommandContext(ctx, "bash", "-c", line).Output() // curl's progress meter goes to stderr
			cancel()
			if err != nil || !regexp.MustCompile(`(?m)^HTTP/1.1 200 OK`).Match(b) || !strings.Contains(string(b), "X-Narwhal-Decode-Engine: d") ||
				!strings.Contains(string(b), "data: [DONE]") {
				t.Errorf("%s: %v\n%s", line, err, b)
			}
		}
	}
	// The simulators registered themselves and the breaker made each
	// active (R-FLEET-2, R-FLEET-4).
	if fleetList == "" {
		t.Fatalf("no fleet list line in the banner:\n%s", banner)
	}
	ctx, cancel := context.WithTimeout(context.Background(), requestBound)
	b, err := exec.CommandContext(ctx, "bash", "-c", fleetList).CombinedOutput()
	cancel()
	for _, id := range []string{"p1", "p2", "d1", "d2"} {
		if err != nil || !regexp.MustCompile(`(?m)^`+id+`\s.*\sactive\s.*registration`).Match(b) {
			t.Errorf("%s: %v, want %s active by registration:\n%s", fleetList, err, id, b)
		}
	}
	// The same through Go's client, on each router.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: requestBound}
	for _, port := range ports[1:3] {
		body := `{"model":"narwhal-sim","messages":[{"role":"user","content":"Hello"}],"stream":true,"max_tokens":4}`
		resp, err := client.Post("http://"+hostPort(port)+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("router on %d: %v", port, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("X-Narwhal-Prefill-Engine"), "p") ||
			!strings.HasPrefix(resp.Header.Get("X-Narwhal-Decode-Engine"), "d") || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") {
			t.Errorf("router on %d: HTTP %d %v\n%s", port, resp.StatusCode, resp.Header, b)
		}
	}

	// Ctrl-C.
	if err := syscall.Kill(-pgid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("mesh.sh after Ctrl-C: %v, want exit 0", err)
		}
	case <-time.After(meshScriptBound):
		t.Fatalf("mesh.sh still running %v after Ctrl-C", meshScriptBound)
	}
	if !strings.Contains(out.String(), "stopped\n") {
		t.Errorf("mesh.sh did not say it stopped:\n%s", out.String())
	}
	// Every process of the group is gone (a zombie-free group answers
	// ESRCH); allow a moment for the last exits to be reaped.
	var alive error
	if !testkit.Poll(100*pollInterval, pollInterval, func() bool {
		alive = syscall.Kill(-pgid, 0)
		return errors.Is(alive, syscall.ESRCH)
	}) {
		t.Errorf("processes of the mesh's group still alive after it stopped (kill -0: %v)", alive)
	}
}

// portList is ports joined by spaces, as the script's overrides take them.
func portList(ports []int) string {
	s := make([]string, len(ports))
	for i, p := range ports {
		s[i] = strconv.Itoa(p)
	}
	return strings.Join(s, " ")
}

package e2e

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
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
// group, as a terminal does), and again once the stop has begun, and
// checks that the script stops quietly all the same: one line per
// process, routers first and the bus last, no log on the terminal, exit
// status 0, no process left, and the directory it made (with the
// credentials) removed. The script runs each
// process in a process group of its own (job control), so the Ctrl-C
// reaches the script alone; the test finds them as the script's children
// and kills them in any case.
func TestExampleMesh(t *testing.T) {
	m := startMeshScript(t, meshOptions{ownDir: true})
	ports, pgid, lines, done := m.ports, m.pgid, m.lines, m.done
	out, stderr := &m.out, &m.stderr

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
	// The directory it made, which holds the credentials and the logs.
	if d := regexp.MustCompile(`Logs: (\S+)/\*\.log`).FindStringSubmatch(banner); d == nil {
		t.Fatalf("the banner names no log directory:\n%s", banner)
	} else {
		m.dir = d[1]
	}
	if _, err := os.Stat(filepath.Join(m.dir, "creds", "admin.creds")); err != nil {
		t.Errorf("the mesh's directory holds no admin credential: %v", err)
	}
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
	if !strings.Contains(fleetList, "/viewer.creds ") {
		t.Errorf("the banner's fleet list line %q does not use the viewer's credential, which suffices (docs/fleet.md)", fleetList)
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

	// The eight processes, each in a group of its own.
	children := childPIDs(t, pgid)
	m.children = children
	if len(children) != 8 {
		t.Errorf("mesh.sh has %d processes running, want 8 (bus, 4 simulators, breaker, 2 routers)", len(children))
	}
	for _, pid := range children {
		if g, err := syscall.Getpgid(pid); err != nil || g == pgid {
			t.Errorf("process %d is in the script's process group %d (%v): a terminal's Ctrl-C would reach it", pid, g, err)
		}
	}
	stdoutBefore := len(out.String())

	// Ctrl-C, and a second one once the stop has begun: it is ignored,
	// the stop completes.
	if err := syscall.Kill(-pgid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if testkit.Poll(meshScriptBound, time.Millisecond, func() bool {
		return strings.Contains(out.String()[stdoutBefore:], "stopping the mesh ...\n")
	}) {
		if err := syscall.Kill(-pgid, syscall.SIGINT); err != nil && !errors.Is(err, syscall.ESRCH) {
			t.Fatal(err)
		}
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("mesh.sh after Ctrl-C: %v, want exit 0", err)
		}
	case <-time.After(meshScriptBound):
		t.Fatalf("mesh.sh still running %v after Ctrl-C", meshScriptBound)
	}
	// Quietly: one line per process in the order it stops them, nothing
	// on stderr.
	want := "\nstopping the mesh ...\n"
	for _, name := range []string{"r2", "r1", "breaker", "d2", "d1", "p2", "p1", "bus"} {
		want += fmt.Sprintf("  %-8s stopped\n", name)
	}
	want += "stopped\n"
	if got := out.String()[stdoutBefore:]; got != want {
		t.Errorf("mesh.sh after Ctrl-C printed:\n%s\nwant:\n%s", got, want)
	}
	if stderr.String() != "" {
		t.Errorf("mesh.sh wrote to stderr:\n%s", stderr.String())
	}
	// Its directory, with the credentials, is gone.
	if _, err := os.Stat(m.dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the mesh's directory %s is still there after the stop (%v)", m.dir, err)
	}
	// Every process is gone: the script waited for each.
	for _, pid := range children {
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("process %d still there after mesh.sh stopped (kill -0: %v)", pid, err)
		}
	}
	var alive error
	if !testkit.Poll(100*pollInterval, pollInterval, func() bool {
		alive = syscall.Kill(-pgid, 0)
		return errors.Is(alive, syscall.ESRCH)
	}) {
		t.Errorf("processes of the mesh's group still alive after it stopped (kill -0: %v)", alive)
	}
}

// meshScript is examples/mesh.sh running in a process group of its own.
type meshScript struct {
	ports       []int // bus, r1, r2, p1, p2, d1, d2
	dir         string
	pgid        int
	out, stderr testkit.LockedBuffer
	lines       chan string // stdout, line by line (dropped when full)
	done        chan error  // the script's exit
	children    []int       // the processes it started, once known
}

// meshOptions are how startMeshScript runs the script.
type meshOptions struct {
	// ownDir: in the temporary directory the script makes itself (under a
	// TMPDIR of the test's; m.dir is then empty until the banner names
	// it), not in MESH_DIR, a directory of the test's.
	ownDir bool
	// busyBus: another process listens on the bus's port.
	busyBus bool
}

// startMeshScript starts examples/mesh.sh on free ports with its
// environment overrides, as o says. The script's group and its children
// are killed when the test ends, and their output logged when it failed.
func startMeshScript(t *testing.T, o meshOptions) *meshScript {
	t.Helper()
	m := &meshScript{ports: freePorts(t, 7), dir: t.TempDir(), lines: make(chan string, 64), done: make(chan error, 1)}
	ports := m.ports
	where := "MESH_DIR=" + m.dir
	if o.ownDir {
		where, m.dir = "TMPDIR="+m.dir, ""
	}
	if o.busyBus {
		ln, err := net.Listen("tcp", hostPort(ports[0]))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
	}
	cmd := exec.Command("bash", filepath.Join("..", "examples", "mesh.sh"))
	cmd.Env = childEnv(
		"MESH_BIN="+narwhalBin,
		where,
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
	cmd.Stderr = &m.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	m.pgid = cmd.Process.Pid
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			m.out.Write([]byte(sc.Text() + "\n"))
			select {
			case m.lines <- sc.Text():
			default:
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		close(m.lines)
		m.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-m.pgid, syscall.SIGKILL) // whatever is left of the group
		for _, pid := range m.children {
			_ = syscall.Kill(pid, syscall.SIGKILL) // and of the processes it started
		}
		if t.Failed() {
			t.Logf("---- mesh.sh stdout:\n%s\n---- stderr:\n%s", m.out.String(), m.stderr.String())
			for _, name := range []string{"bus", "breaker", "r1", "r2", "p1", "d1"} {
				if b, err := os.ReadFile(filepath.Join(m.dir, name+".log")); err == nil {
					t.Logf("---- %s.log:\n%s", name, b)
				}
			}
		}
	})
	return m
}

// waitBanner waits for the script's banner, until its last line.
func (m *meshScript) waitBanner(t *testing.T) {
	t.Helper()
	deadline := time.After(meshScriptBound)
	for {
		select {
		case l, ok := <-m.lines:
			if !ok {
				t.Fatalf("mesh.sh ended before its banner")
			}
			if strings.HasPrefix(l, "Press Ctrl-C") {
				return
			}
		case <-deadline:
			t.Fatalf("no banner within %v", meshScriptBound)
		}
	}
}

// TestExampleMeshShowsOnlyTheFailedLog proves how examples/mesh.sh ends
// when one of its processes fails on its own (here router r1, killed):
// it stops the others as on Ctrl-C, with one line each, and shows the
// end of the failed one's log only, exiting 1.
func TestExampleMeshShowsOnlyTheFailedLog(t *testing.T) {
	m := startMeshScript(t, meshOptions{})
	m.waitBanner(t)
	m.children = childPIDs(t, m.pgid)
	r1 := -1
	for _, pid := range m.children {
		if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); err == nil && strings.Contains(string(b), hostPort(m.ports[1])) {
			r1 = pid
		}
	}
	if r1 < 0 {
		t.Fatalf("no process of mesh.sh listens on r1's %s", hostPort(m.ports[1]))
	}
	before := len(m.out.String())
	if err := syscall.Kill(r1, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-m.done:
		if exitCode(err) != 1 {
			t.Errorf("mesh.sh after r1 failed: %v, want exit status 1", err)
		}
	case <-time.After(meshScriptBound):
		t.Fatalf("mesh.sh still running %v after r1 failed", meshScriptBound)
	}
	got := m.out.String()[before:]
	log := filepath.Join(m.dir, "r1.log")
	for _, name := range []string{"r2", "breaker", "d2", "d1", "p2", "p1", "bus"} {
		if !strings.Contains(got, fmt.Sprintf("\n  %-8s stopped\n", name)) {
			t.Errorf("no line says %s stopped:\n%s", name, got)
		}
	}
	if !strings.Contains(got, "\n  r1       exited with status 137; the end of "+log+":\n    ") {
		t.Errorf("no line says r1 failed, followed by its log:\n%s", got)
	}
	if !strings.HasSuffix(got, "\nstopped\nlogs kept in "+m.dir+"\n") {
		t.Errorf("the stop does not end by naming the kept directory %s:\n%s", m.dir, got)
	}
	if n := strings.Count(got, "the end of "); n != 1 {
		t.Errorf("%d logs shown, want only r1's:\n%s", n, got)
	}
	if tail, _ := os.ReadFile(log); !strings.Contains(got, "    "+lastLine(string(tail))+"\n") {
		t.Errorf("r1's log's last line %q is not shown:\n%s", lastLine(string(tail)), got)
	}
	if !strings.Contains(m.stderr.String(), "mesh: a process exited on its own") {
		t.Errorf("stderr does not say a process exited on its own:\n%s", m.stderr.String())
	}
}

// TestExampleMeshBusyBusPort proves how examples/mesh.sh ends when its
// bus's port is taken: at once (the bus fails at once), exit status 1,
// the end of the bus's log shown once, naming the address in use, the
// variables that change the ports named, and the kept directory named.
func TestExampleMeshBusyBusPort(t *testing.T) {
	m := startMeshScript(t, meshOptions{busyBus: true})
	select {
	case err := <-m.done:
		if exitCode(err) != 1 {
			t.Errorf("mesh.sh with its bus port taken: %v, want exit status 1", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("mesh.sh still running 15s after it started with its bus port taken")
	}
	out, stderr := m.out.String(), m.stderr.String()
	inUse := hostPort(m.ports[0]) + ": the address is already in use"
	if n := strings.Count(out+stderr, inUse); n != 1 {
		t.Errorf("%q shown %d times, want once (the end of the bus's log):\n%s\n---- stderr:\n%s", inUse, n, out, stderr)
	}
	if !strings.Contains(out, "  bus      exited with status 1; the end of ") || !strings.HasSuffix(out, "\nstopped\nlogs kept in "+m.dir+"\n") {
		t.Errorf("stdout does not show the bus's failure and the kept directory %s:\n%s", m.dir, out)
	}
	if want := "mesh: bus exited before the bus was ready\nmesh: its port is taken: choose others with MESH_BUS_PORT"; !strings.HasPrefix(stderr, want) {
		t.Errorf("stderr %q, want it to start with %q", stderr, want)
	}
}

// lastLine is the last non-empty line of s.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return lines[len(lines)-1]
}

// childPIDs returns the processes whose parent is ppid, read from /proc.
func childPIDs(t *testing.T, ppid int) []int {
	t.Helper()
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // gone meanwhile
		}
		// pid (comm) state ppid …: comm may hold spaces and parentheses.
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 2 || f[1] != strconv.Itoa(ppid) {
			continue
		}
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(path)))
		if err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// portList is ports joined by spaces, as the script's overrides take them.
func portList(ports []int) string {
	s := make([]string, len(ports))
	for i, p := range ports {
		s[i] = strconv.Itoa(p)
	}
	return strings.Join(s, " ")
}

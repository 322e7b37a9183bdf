package bench

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// systemPrompt returns the system message of a trace body ("" when it
// has none).
func systemPrompt(t *testing.T, body []byte) string {
	t.Helper()
	var req struct {
		Messages []struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		t.Fatal(err)
	}
	for _, m := range req.Messages {
		if m.Role == "system" {
			return m.Content
		}
	}
	return ""
}

// TestNewShapesAreSeeded: every shape draws the same bytes from the same
// seed and other bytes from another (a comparison's variants, and two
// runs, send the same trace).
func TestNewShapesAreSeeded(t *testing.T) {
	for _, shape := range Shapes {
		w := testPrefixWorkload()
		w.Shape, w.FleetKVTokens = shape, 40
		if shape == ShapeHotTenant {
			w.Tenants = 1
		}
		a, err := NewTrace(w)
		if err != nil {
			t.Fatalf("%s: %v", shape, err)
		}
		b, _ := NewTrace(w)
		w.Seed++
		c, _ := NewTrace(w)
		differ := false
		for i := range a.Requests {
			if a.Requests[i].At != b.Requests[i].At || !bytes.Equal(a.Requests[i].Body, b.Requests[i].Body) {
				t.Fatalf("%s: request %d differs between two draws of one seed", shape, i)
			}
			differ = differ || !bytes.Equal(a.Requests[i].Body, c.Requests[i].Body) || a.Requests[i].At != c.Requests[i].At
		}
		if !differ {
			t.Fatalf("%s: another seed drew the same trace", shape)
		}
	}
}

// TestHotTenantSharesOneContext: every request of hot-tenant carries the
// one tenant's context, its users ask their own queries, and a second
// tenant is refused.
func TestHotTenantSharesOneContext(t *testing.T) {
	w := testPrefixWorkload()
	w.Shape, w.Tenants, w.UsersPerTenant = ShapeHotTenant, 1, 12
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 12*w.QueriesPerUser {
		t.Fatalf("%d requests", len(tr.Requests))
	}
	ctx := systemPrompt(t, tr.Requests[0].Body)
	if len(strings.Fields(ctx)) != w.ContextTokens {
		t.Fatalf("context %q", ctx)
	}
	users := map[int]bool{}
	for i, r := range tr.Requests {
		if got := systemPrompt(t, r.Body); got != ctx || r.Tenant != 0 {
			t.Fatalf("request %d: tenant %d, context %q, want the one shared context", i, r.Tenant, got)
		}
		users[r.User] = true
	}
	if len(users) != 12 {
		t.Fatalf("%d users", len(users))
	}
	w.Tenants = 2
	if _, err := NewTrace(w); err == nil || !strings.Contains(err.Error(), "one tenant") {
		t.Fatalf("two tenants: %v", err)
	}
}

// TestCachePressureExceedsCapacity: cache-pressure's distinct contexts
// total at least three times the fleet's KV capacity in tokens with the
// tenants CachePressureTenants gives (4 sims × 416 blocks × 16 tokens, the
// command's defaults), and one tenant fewer is refused.
func TestCachePressureExceedsCapacity(t *testing.T) {
	capacity := 4 * 416 * 16
	w := testPrefixWorkload()
	w.Shape, w.FleetKVTokens, w.ContextTokens = ShapeCachePressure, capacity, 512
	w.Tenants, w.UsersPerTenant, w.QueriesPerUser = CachePressureTenants(capacity, 512), 1, 2
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	contexts := map[string]bool{}
	total := 0
	for _, r := range tr.Requests {
		c := systemPrompt(t, r.Body)
		if !contexts[c] {
			contexts[c] = true
			total += len(strings.Fields(c))
		}
	}
	if len(contexts) != w.Tenants || total < 3*capacity {
		t.Fatalf("%d contexts of %d tokens in all, want %d tenants and ≥ %d tokens", len(contexts), total, w.Tenants, 3*capacity)
	}
	w.Tenants--
	if _, err := NewTrace(w); err == nil {
		t.Fatalf("%d tenants (%d tokens) accepted", w.Tenants, w.Tenants*512)
	}
	w.Tenants, w.FleetKVTokens = 200, 0
	if _, err := NewTrace(w); err == nil {
		t.Fatal("cache-pressure without the fleet's capacity accepted")
	}
}

// TestMixedHasOnOffPhases: mixed sends the tenants' shared-context
// requests and as many short chats without a system prompt, and arrivals
// fall in the on phases only, every phase of the trace's span getting
// some, at the asked mean rate.
func TestMixedHasOnOffPhases(t *testing.T) {
	w := testPrefixWorkload()
	w.Shape, w.Tenants, w.UsersPerTenant, w.QueriesPerUser = ShapeMixed, 4, 4, 10 // 160 shared, 160 chats
	w.Rate, w.BurstOn, w.BurstOff = 100, 200*time.Millisecond, 300*time.Millisecond
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 320 || w.Requests() != 320 {
		t.Fatalf("%d requests, want 320", len(tr.Requests))
	}
	chats := 0
	period := w.BurstOn + w.BurstOff
	perPhase := map[time.Duration]int{}
	for i, r := range tr.Requests {
		if r.At%period >= w.BurstOn {
			t.Fatalf("request %d arrives at %v, in an off phase", i, r.At)
		}
		if i > 0 && r.At < tr.Requests[i-1].At {
			t.Fatalf("arrivals out of order at %d", i)
		}
		perPhase[r.At/period]++
		if r.Tenant < 0 {
			chats++
			if systemPrompt(t, r.Body) != "" || len(r.Tokens) != w.QueryTokens+1 {
				t.Fatalf("chat %d: %d tokens, system %q", i, len(r.Tokens), systemPrompt(t, r.Body))
			}
		} else if len(strings.Fields(systemPrompt(t, r.Body))) != w.ContextTokens {
			t.Fatalf("request %d of tenant %d lacks its context", i, r.Tenant)
		}
	}
	if chats != 160 {
		t.Fatalf("%d chats, want 160", chats)
	}
	last := tr.Requests[len(tr.Requests)-1].At
	phases := int(last/period) + 1
	if len(perPhase) != phases {
		t.Fatalf("%d of %d on phases got arrivals", len(perPhase), phases)
	}
	// 320 requests at a mean of 100/s: about 3.2 s.
	if span := last.Seconds(); span < 2.4 || span > 4.2 {
		t.Fatalf("span %.2fs, want about 3.2 s", span)
	}
}

package meshview

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
)

// What each engine serves (R-API-2, R-API-3): its GET /v1/models, read
// at start, every ModelRefresh, and every second while the router cannot
// place on it.

// RefreshModels reads every engine's /v1/models once, bounded by ctx and 2
// seconds per engine. Engines that fail keep their last known list; what
// each call found is recorded and logged by noteModels.
func (v *View) RefreshModels(ctx context.Context) {
	var wg sync.WaitGroup
	for _, m := range v.Fleet().members {
		wg.Add(1)
		go func(m *Member) {
			defer wg.Done()
			v.refreshMember(ctx, m)
		}(m)
	}
	wg.Wait()
}

// refreshMember reads m's /v1/models once and records what it found; a
// call the router could not make for lack of its own resources records
// nothing (behaviour.md R-FAIL-9).
func (v *View) refreshMember(ctx context.Context, m *Member) {
	models, err := v.fetchModels(ctx, m)
	if err != nil && ctx.Err() != nil {
		return // the router is stopping: the engine is not to blame
	}
	if r := engines.RouterResource(err); r != "" {
		// The router ran out of something of its own (R-FAIL-9): the
		// engine keeps what was known of it; the next refresh asks again.
		v.log.Debug("GET /v1/models not sent: router out of local resources", "engine_id", m.ID, "kind", r, "err", err)
		return
	}
	v.noteModels(m, models, err)
}

// noteModels records the outcome of one /v1/models call of m — its list
// on success, its problem otherwise (see Member.problem) — and logs each
// change of the problem: a warning naming the engine, its URL and why it
// cannot be placed on (at start, for every engine that is unreachable or
// serves no model), and an info line when an engine is placeable (with
// its models) the first time or again. A credential refusal is logged by
// RefuseCredentials and leaves problem unset.
func (v *View) noteModels(m *Member, models []string, err error) {
	var problem *string
	var refused *engines.StatusError
	switch {
	case err != nil && errors.As(err, &refused) && refusal(refused.Status):
	case err != nil:
		p := modelsProblem(err)
		problem = &p
	case len(models) == 0:
		p := "serves no model (its GET /v1/models lists none)"
		problem = &p
	}
	first := m.models.Load() == nil && m.problem.Load() == nil
	if err == nil {
		m.SetModels(models)
		if v.listed != nil {
			for _, x := range models {
				v.listed(x)
			}
		}
	}
	prev := m.problem.Swap(problem)
	switch {
	case problem != nil && (prev == nil || *prev != *problem):
		attrs := []any{"engine_id", m.ID, "url", m.URL, "role", string(m.Role)}
		if err != nil {
			attrs = append(attrs, "err", err)
		}
		v.log.Warn("engine not placeable: "+*problem, attrs...)
	case problem == nil && err == nil && (first || prev != nil):
		v.log.Info("engine placeable", "engine_id", m.ID, "url", m.URL, "role", string(m.Role), "models", models)
	}
}

// modelsProblem says in a few words, without the engine's address (it is
// shown on /readyz and to clients), why a /v1/models call failed.
func modelsProblem(err error) string {
	var se *engines.StatusError
	var dns *net.DNSError
	var netErr net.Error
	switch {
	case errors.As(err, &se):
		return fmt.Sprintf("unreachable: GET /v1/models answers HTTP %d", se.Status)
	case errors.Is(err, engines.ErrNotModelList):
		return "unreachable: GET /v1/models does not answer a model list"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "unreachable: connection refused"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "unreachable: connection closed without an answer"
	case errors.As(err, &dns):
		return "unreachable: host not found"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return "unreachable: no answer to GET /v1/models within 2 s"
	case strings.Contains(err.Error(), "tls:"), strings.Contains(err.Error(), "x509:"):
		return "unreachable: TLS handshake failed"
	default:
		return "unreachable: GET /v1/models failed"
	}
}

func (v *View) fetchModels(ctx context.Context, m *Member) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	models, err := engines.ListModels(ctx, v.http, m.URL, m.Credential)
	var refused *engines.StatusError
	if errors.As(err, &refused) && refusal(refused.Status) {
		v.RefuseCredentials(m, refused.Status, "/v1/models")
	}
	if err == nil || errors.Is(err, engines.ErrNotModelList) {
		v.acceptCredentials(m) // the engine answered 200
	}
	if err != nil {
		return nil, fmt.Errorf("GET /v1/models: %w", err)
	}
	return engines.ModelIDs(models), nil
}

func (v *View) refreshLoop() {
	fast := time.NewTicker(time.Second)
	defer fast.Stop()
	last := time.Now()
	for {
		select {
		case <-v.base.Done():
			return
		case <-fast.C:
		}
		if time.Since(last) >= v.refresh {
			v.RefreshModels(v.base)
			last = time.Now()
			continue
		}
		// Engines the router cannot place on are asked every second, so
		// that one that comes up is placeable within a second.
		for _, m := range v.Fleet().members {
			if m.models.Load() == nil || m.refused.Load() || m.problem.Load() != nil {
				v.refreshMember(v.base, m)
			}
		}
	}
}

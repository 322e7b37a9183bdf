package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// This file is the simulator's side of SGLang's bootstrap protocol
// (Config.Connector "sglang"; docs/connectors.md). A router sends the same
// body to a prefill and a decode engine, with bootstrap_host and
// bootstrap_port (the prefill's bootstrap server) and bootstrap_room (one
// per choice). The prefill computes the prompt and serves its KV in each
// room on its bootstrap server (the side channel listener); the decode
// connects to bootstrap_host:bootstrap_port, waits there for each room's KV
// — at most Config.KVTimeout, as SGLang's decode waits — checks that it was
// computed for its own prompt, and only then generates.

// room is one bootstrap room: waited for by decodes, served by this
// prefill.
type room struct {
	ready   chan struct{} // closed when served
	digest  string
	served  bool
	created time.Time // when served
	waiters int
}

// getRoom returns the room id, created empty if absent; the caller holds
// k.mu.
func (k *kvStore) getRoom(id uint64) *room {
	r := k.rooms[id]
	if r == nil {
		r = &room{ready: make(chan struct{})}
		k.rooms[id] = r
	}
	return r
}

// serveRooms serves the KV of a prompt (its digest) in every room of ids;
// a room served already keeps its first KV.
func (k *kvStore) serveRooms(ids []uint64, digest string, now time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, id := range ids {
		r := k.getRoom(id)
		if r.served {
			continue
		}
		r.served, r.digest, r.created = true, digest, now
		close(r.ready)
		k.roomsHeld++
	}
}

// awaitRoom registers a waiter of room id and returns the room.
func (k *kvStore) awaitRoom(id uint64) *room {
	k.mu.Lock()
	defer k.mu.Unlock()
	r := k.getRoom(id)
	r.waiters++
	return r
}

// takeRoom hands a served room's KV to its waiter and forgets the room.
// It returns false when the room expired or another waiter took it.
func (k *kvStore) takeRoom(id uint64, r *room) (string, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	r.waiters--
	if k.rooms[id] != r || !r.served {
		return "", false
	}
	delete(k.rooms, id)
	k.roomsHeld--
	k.served++
	return r.digest, true
}

// leaveRoom unregisters a waiter that gave up; an unserved room nobody
// waits for is forgotten.
func (k *kvStore) leaveRoom(id uint64, r *room) {
	k.mu.Lock()
	defer k.mu.Unlock()
	r.waiters--
	if !r.served && r.waiters <= 0 && k.rooms[id] == r {
		delete(k.rooms, id)
	}
}

// expireRoomsLocked forgets rooms served longer than timeout ago that no
// decode took; the caller holds k.mu.
func (k *kvStore) expireRoomsLocked(now time.Time, timeout time.Duration) {
	for id, r := range k.rooms {
		if r.served && now.Sub(r.created) >= timeout {
			delete(k.rooms, id)
			k.roomsHeld--
			k.expired++
		}
	}
}

// bootstrapPull is the body of POST /bootstrap/pull on the bootstrap
// server.
type bootstrapPull struct {
	Room             *uint64 `json:"room"`
	ConsumerEngineID string  `json:"consumer_engine_id"`
}

// serveBootstrap is POST /bootstrap/pull on a prefill's bootstrap server:
// it waits until the room is served (or the decode gives up: its request
// ends) and answers {"room":…,"digest":…}; 410 when the room expired or
// was taken, 404 on an engine that serves no rooms.
func (s *Server) serveBootstrap(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Connector != ConnectorSGLang || s.cfg.Role != RolePrefill {
		writeError(w, http.StatusNotFound, "engine "+s.cfg.EngineID+" runs no bootstrap server")
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 64<<10))
	if err != nil {
		writeError(w, http.StatusBadRequest, "cannot read bootstrap request: "+err.Error())
		return
	}
	var req bootstrapPull
	if err := json.Unmarshal(body, &req); err != nil || req.Room == nil {
		writeError(w, http.StatusBadRequest, "invalid bootstrap request: want {\"room\":<integer>}")
		return
	}
	id := *req.Room
	rm := s.kv.awaitRoom(id)
	select {
	case <-rm.ready:
	case <-r.Context().Done():
		s.kv.leaveRoom(id, rm)
		return
	}
	digest, ok := s.kv.takeRoom(id, rm)
	if !ok {
		writeError(w, http.StatusGone, fmt.Sprintf("the KV of bootstrap room %d expired or was taken", id))
		return
	}
	out := strconv.AppendUint([]byte(`{"room":`), id, 10)
	out = append(out, `,"digest":`...)
	out = appendJSONString(out, digest)
	out = append(out, '}')
	w.Header()["Content-Type"] = jsonContentType
	_, _ = w.Write(out)
}

// parseBootstrap reads an sglang request's bootstrap fields. The prefill
// and the decode receive the same body, so the leg is the engine's role. A
// scalar room stands for rooms room, room+1, … (one per choice), as
// SGLang expands it; an array names one room per choice. A prefill
// computes one token only.
func (x *exchange) parseBootstrap() (int, string) {
	req := &x.req
	x.sglang = true
	x.prefillLeg = x.s.cfg.Role == RolePrefill
	x.decodeLeg = !x.prefillLeg
	if isNull(req.BootstrapRoom) {
		return http.StatusBadRequest, "bootstrap_room is required: an engine in disaggregation mode serves only requests a router paired (bootstrap_host, bootstrap_port, bootstrap_room)"
	}
	raw := bytes.TrimSpace(req.BootstrapRoom)
	if raw[0] == '[' {
		if err := json.Unmarshal(raw, &x.rooms); err != nil {
			return http.StatusBadRequest, "bootstrap_room must be an integer or a list of integers"
		}
		if len(x.rooms) != x.n {
			return http.StatusBadRequest, fmt.Sprintf("bootstrap_room lists %d rooms for n=%d", len(x.rooms), x.n)
		}
	} else {
		var first uint64
		if err := json.Unmarshal(raw, &first); err != nil {
			return http.StatusBadRequest, "bootstrap_room must be an integer or a list of integers"
		}
		for j := range x.n {
			x.rooms = append(x.rooms, first+uint64(j))
		}
	}
	if x.prefillLeg {
		x.maxTokens = 1
		return 0, ""
	}
	host, ok := firstOf[string](req.BootstrapHost)
	if !ok || host == "" {
		return http.StatusBadRequest, "bootstrap_host must be a host name or a list of them"
	}
	port, ok := firstOf[int](req.BootstrapPort)
	if !ok || port < 1 || port > 65535 {
		return http.StatusBadRequest, "bootstrap_port must be a port number or a list of them"
	}
	x.bootAddr = net.JoinHostPort(strings.Trim(host, "[]"), strconv.Itoa(port))
	return 0, ""
}

// firstOf reads raw as a T or a non-empty list of T and returns the
// (first) value.
func firstOf[T any](raw json.RawMessage) (T, bool) {
	var v T
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return v, false
	}
	if raw[0] == '[' {
		var list []T
		if json.Unmarshal(raw, &list) != nil || len(list) == 0 {
			return v, false
		}
		return list[0], true
	}
	return v, json.Unmarshal(raw, &v) == nil
}

// prepareSGLang is prepare for an sglang request: a decode waits for its
// rooms' KV; a prefill computes the prompt and serves it in its rooms —
// unless a fault strikes first (after_tokens 0: the KV never comes) or the
// room-unserved fault keeps it back.
func (x *exchange) prepareSGLang() bool {
	s := x.s
	if x.decodeLeg {
		if done, ok := x.pullFault(); done {
			return ok
		}
		reason, err := x.pullRooms()
		if err != nil {
			x.abort()
			return false
		}
		if reason != "" {
			s.count.kvPullFailures.Add(1)
			x.fail(http.StatusInternalServerError, "KV transfer failed: "+reason)
			return false
		}
		s.count.kvPulled.Add(1)
		x.cachedTokens = s.cache.lookup(x.hashes, x.tokens, x.promptTokens, s.cfg.BlockSize, false)
		return true
	}
	x.cachedTokens = s.cache.lookup(x.hashes, x.tokens, x.promptTokens, s.cfg.BlockSize, true)
	if !x.compute(x.promptTokens - x.cachedTokens) {
		x.abort()
		return false
	}
	if x.strikeBeforeHandoff() {
		return false
	}
	if _, ok := x.faults.get(fkRoomUnserved); !ok {
		s.kv.serveRooms(x.rooms, handoffDigest(x.kind, x.prompt), time.Now())
	}
	return true
}

// strikeBeforeHandoff strikes, on an sglang prefill, a silence, close,
// abort or error-object fault armed with after_tokens 0, before the rooms
// are served. True when one struck (the request is over).
func (x *exchange) strikeBeforeHandoff() bool {
	if x.stream {
		return x.midStreamFault(false) // matches after_tokens 0 only: nothing was emitted
	}
	for _, k := range midStreamKinds {
		f, ok := x.faults.get(k)
		if !ok || f.AfterTokens != 0 {
			continue
		}
		switch k {
		case fkSilence:
			if !x.hold(f, false) {
				x.abort()
				return true
			}
			panic(http.ErrAbortHandler)
		case fkClose, fkAbort:
			panic(http.ErrAbortHandler)
		case fkErrorObject:
			status := f.statusOr(http.StatusInternalServerError)
			if status < 100 || status > 599 {
				status = http.StatusInternalServerError
			}
			writeError(x.w, status, f.messageOr("simulated engine error"))
		}
		return true
	}
	return false
}

// errKVTimeout is a decode's wait for its room that outlived
// Config.KVTimeout.
var errKVTimeout = errors.New("kv timeout")

// pullRooms waits on the prefill's bootstrap server for every room's KV,
// at most Config.KVTimeout in all, and checks it was computed for this
// prompt. It returns "" on success, a failure reason for the "KV transfer
// failed: " message otherwise, or errKVCanceled when the request ended.
func (x *exchange) pullRooms() (string, error) {
	s := x.s
	ctx, cancel := context.WithTimeoutCause(x.ctx, s.cfg.KVTimeout, errKVTimeout)
	defer cancel()
	digest := handoffDigest(x.kind, x.prompt)
	url := "http://" + x.bootAddr + "/bootstrap/pull"
	for _, id := range x.rooms {
		body := strconv.AppendUint([]byte(`{"room":`), id, 10)
		body = append(body, `,"consumer_engine_id":`...)
		body = appendJSONString(body, s.cfg.EngineID)
		body = append(body, '}')
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return "invalid bootstrap address " + x.bootAddr + ": " + err.Error(), nil
		}
		req.Header["Content-Type"] = jsonContentType
		failed := func(err error) (string, error) {
			switch {
			case x.ctx.Err() != nil:
				return "", errKVCanceled
			case context.Cause(ctx) == errKVTimeout:
				return fmt.Sprintf("no KV arrived in bootstrap room %d within %v", id, s.cfg.KVTimeout), nil
			}
			return fmt.Sprintf("bootstrap server %s: %v", x.bootAddr, err), nil
		}
		resp, err := s.bootClient.Do(req)
		if err != nil {
			return failed(err)
		}
		out, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if err != nil {
			return failed(err)
		}
		if resp.StatusCode != http.StatusOK {
			if e, ok := schemas.ParseError(out); ok && e.Message != "" {
				return e.Message, nil
			}
			return fmt.Sprintf("bootstrap server %s answered HTTP %d", x.bootAddr, resp.StatusCode), nil
		}
		var got struct {
			Digest string `json:"digest"`
		}
		if err := json.Unmarshal(out, &got); err != nil {
			return "invalid answer from bootstrap server: " + err.Error(), nil
		}
		if got.Digest != digest {
			return fmt.Sprintf("prompt mismatch: the KV of bootstrap room %d was computed for a different prompt or endpoint", id), nil
		}
	}
	return "", nil
}

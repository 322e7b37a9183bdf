package sim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// BlockSize is the number of prompt tokens per simulated KV block: a
// producer holds ceil(prompt_tokens/BlockSize) blocks per handoff, as vLLM
// does with its default block size.
const BlockSize = 16

// tombstoneLimit bounds how many pulled or expired handoffs a producer
// remembers, so it can say "already pulled" or "expired" instead of
// "unknown request id".
const tombstoneLimit = 4096

// Side channel pull failures: each has its own HTTP status and message
// prefix, which the consumer puts after "KV transfer failed: ".
const (
	pullForeign  = "foreign engine id"
	pullUnknown  = "unknown request id"
	pullMismatch = "block ids mismatch"
	pullPulled   = "already pulled"
	pullExpired  = "expired"
)

// handoff is one prefill leg's KV blocks held by the producer.
type handoff struct {
	blocks  []int
	digest  string
	created time.Time
}

// tombstone remembers a handoff that is no longer held.
type tombstone struct {
	expired  bool   // else pulled
	consumer string // who pulled it
}

// kvStore is the producer side of the handoff: held blocks by
// remote_request_id, and the counters that go with them.
type kvStore struct {
	mu        sync.Mutex
	holds     map[string]*handoff
	tombs     map[string]tombstone
	tombRing  []string
	tombNext  int
	nextBlock int
	heldBlock int64
	// rooms are the SGLang bootstrap rooms (bootstrap.go): waited for by
	// decodes, served by this prefill.
	rooms     map[uint64]*room
	roomsHeld int // rooms served and not yet taken
	served    int64
	released  int64
	expired   int64
}

func (k *kvStore) init() {
	k.holds = make(map[string]*handoff)
	k.tombs = make(map[string]tombstone)
	k.rooms = make(map[uint64]*room)
	k.nextBlock = 1
}

// handoffDigest is what producer and consumer compare: a SHA-256 of the
// endpoint kind ("chat" or "completions") and the prompt text, hex.
func handoffDigest(kind endpointKind, prompt string) string {
	h := sha256.New()
	h.Write([]byte(kind.String()))
	h.Write([]byte{0})
	h.Write([]byte(prompt))
	return hex.EncodeToString(h.Sum(nil))
}

// hold allocates nBlocks block ids for a handoff keyed by id (suffixed
// "-1", "-2", … if id is taken) and returns the key used and the blocks.
func (k *kvStore) hold(id, digest string, nBlocks int, now time.Time) (string, []int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	key := id
	for seq := 1; ; seq++ {
		_, held := k.holds[key]
		_, gone := k.tombs[key]
		if !held && !gone {
			break
		}
		key = id + "-" + strconv.Itoa(seq)
	}
	blocks := make([]int, nBlocks)
	for i := range blocks {
		blocks[i] = k.nextBlock
		k.nextBlock++
	}
	k.holds[key] = &handoff{blocks: blocks, digest: digest, created: now}
	k.heldBlock += int64(nBlocks)
	return key, blocks
}

// drop removes a held handoff; the caller holds k.mu.
func (k *kvStore) drop(id string, h *handoff) {
	delete(k.holds, id)
	k.heldBlock -= int64(len(h.blocks))
}

// bury records a tombstone; the caller holds k.mu.
func (k *kvStore) bury(id string, t tombstone) {
	if len(k.tombRing) < tombstoneLimit {
		k.tombRing = append(k.tombRing, id)
	} else {
		delete(k.tombs, k.tombRing[k.tombNext])
		k.tombRing[k.tombNext] = id
		k.tombNext = (k.tombNext + 1) % tombstoneLimit
	}
	k.tombs[id] = t
}

// expireLocked releases h if it is older than timeout; the caller holds
// k.mu.
func (k *kvStore) expireLocked(id string, h *handoff, now time.Time, timeout time.Duration) bool {
	if now.Sub(h.created) < timeout {
		return false
	}
	k.drop(id, h)
	k.bury(id, tombstone{expired: true})
	k.expired++
	return true
}

// expire releases every handoff older than timeout.
func (k *kvStore) expire(now time.Time, timeout time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, h := range k.holds {
		k.expireLocked(id, h, now, timeout)
	}
	k.expireRoomsLocked(now, timeout)
}

// pullRequest is the body of POST /kv/pull on the side channel.
type pullRequest struct {
	RemoteEngineID   string          `json:"remote_engine_id"`
	RemoteRequestID  string          `json:"remote_request_id"`
	RemoteBlockIDs   json.RawMessage `json:"remote_block_ids"`
	ConsumerEngineID string          `json:"consumer_engine_id"`
}

// pull hands the blocks of a handoff to a consumer and releases them, or
// says why not with an HTTP status and a message.
func (k *kvStore) pull(engineID string, req *pullRequest, now time.Time, timeout time.Duration) (h *handoff, status int, msg string) {
	if req.RemoteEngineID != engineID {
		return nil, http.StatusMisdirectedRequest, fmt.Sprintf("%s: remote_engine_id %q is not this producer (%q)", pullForeign, req.RemoteEngineID, engineID)
	}
	id := req.RemoteRequestID
	k.mu.Lock()
	defer k.mu.Unlock()
	h, ok := k.holds[id]
	if ok && k.expireLocked(id, h, now, timeout) {
		ok = false
	}
	if !ok {
		if t, gone := k.tombs[id]; gone {
			if t.expired {
				return nil, http.StatusGone, fmt.Sprintf("%s: the KV blocks of %q were released after the %v abort timeout", pullExpired, id, timeout)
			}
			return nil, http.StatusConflict, fmt.Sprintf("%s: the KV blocks of %q were already pulled by consumer %q", pullPulled, id, t.consumer)
		}
		return nil, http.StatusNotFound, fmt.Sprintf("%s: no KV blocks held for remote_request_id %q (forged, or already released)", pullUnknown, id)
	}
	var ids []int
	if err := json.Unmarshal(req.RemoteBlockIDs, &ids); err != nil || !slices.Equal(ids, h.blocks) {
		return nil, http.StatusUnprocessableEntity, fmt.Sprintf("%s: remote_block_ids %s are not the blocks held for %q", pullMismatch, clip(req.RemoteBlockIDs), id)
	}
	k.drop(id, h)
	k.bury(id, tombstone{consumer: req.ConsumerEngineID})
	k.served++
	return h, http.StatusOK, ""
}

// release frees a held handoff early (POST /v1/kv/release). Block ids are
// checked only when given (not null).
func (k *kvStore) release(engineID string, req *pullRequest, now time.Time, timeout time.Duration) (status int, msg string) {
	if req.RemoteEngineID != engineID {
		return http.StatusNotFound, fmt.Sprintf("%s: remote_engine_id %q is not this producer (%q)", pullForeign, req.RemoteEngineID, engineID)
	}
	id := req.RemoteRequestID
	k.mu.Lock()
	defer k.mu.Unlock()
	h, ok := k.holds[id]
	if ok && k.expireLocked(id, h, now, timeout) {
		return http.StatusNotFound, fmt.Sprintf("%s: the KV blocks of %q were released after the %v abort timeout", pullExpired, id, timeout)
	}
	if !ok {
		return http.StatusNotFound, fmt.Sprintf("%s: no KV blocks held for remote_request_id %q", pullUnknown, id)
	}
	if raw := bytes.TrimSpace(req.RemoteBlockIDs); len(raw) > 0 && string(raw) != "null" {
		var ids []int
		if err := json.Unmarshal(raw, &ids); err != nil || !slices.Equal(ids, h.blocks) {
			return http.StatusNotFound, fmt.Sprintf("%s: remote_block_ids %s are not the blocks held for %q", pullMismatch, clip(raw), id)
		}
	}
	k.drop(id, h)
	k.released++
	return http.StatusOK, ""
}

// clip shortens raw JSON for an error message.
func clip(raw []byte) string {
	const limit = 64
	if len(raw) == 0 {
		return "null"
	}
	if len(raw) > limit {
		return string(raw[:limit]) + "…"
	}
	return string(raw)
}

// pullResponse is the side channel's answer to a successful pull.
type pullResponse struct {
	RemoteRequestID string `json:"remote_request_id"`
	BlockIDs        []int  `json:"block_ids"`
	Digest          string `json:"digest"`
}

// servePull is POST /kv/pull on the KV side channel (producer side).
func (s *Server) servePull(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		writeError(w, http.StatusBadRequest, "cannot read pull request: "+err.Error())
		return
	}
	var req pullRequest
	if err := json.Unmarshal(body, &req); err != nil {
		writeError(w, http.StatusBadRequest, "invalid pull request: "+err.Error())
		return
	}
	h, status, msg := s.kv.pull(s.cfg.EngineID, &req, time.Now(), s.cfg.KVTimeout)
	if status != http.StatusOK {
		writeError(w, status, msg)
		return
	}
	out, _ := json.Marshal(pullResponse{RemoteRequestID: req.RemoteRequestID, BlockIDs: h.blocks, Digest: h.digest})
	w.Header()["Content-Type"] = jsonContentType
	_, _ = w.Write(out)
}

// serveRelease is POST /v1/kv/release on the main API: body
// {"remote_engine_id","remote_request_id","remote_block_ids"}; 200
// {"released":true}, or 404 with a vLLM error body when nothing matching is
// held (R-OWN-6).
func (s *Server) serveRelease(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		writeError(w, http.StatusBadRequest, "cannot read release request: "+err.Error())
		return
	}
	var req pullRequest
	if err := json.Unmarshal(body, &req); err != nil {
		writeError(w, http.StatusBadRequest, "invalid release request: "+err.Error())
		return
	}
	s.record(r, "", body, true)
	if status, msg := s.kv.release(s.cfg.EngineID, &req, time.Now(), s.cfg.KVTimeout); status != http.StatusOK {
		writeError(w, status, msg)
		return
	}
	w.Header()["Content-Type"] = jsonContentType
	_, _ = w.Write([]byte(`{"released":true}`))
}

// expiryLoop releases expired handoffs until ctx is done.
func (s *Server) expiryLoop(ctx context.Context) {
	period := min(max(s.cfg.KVTimeout/4, 5*time.Millisecond), time.Second)
	pause.Every(ctx, period, func(now time.Time) { s.kv.expire(now, s.cfg.KVTimeout) })
}

// kvParams is kv_transfer_params as a request carries it. Only the two
// flags are typed; the descriptor fields stay raw so that a garbled
// descriptor fails the KV transfer instead of the JSON parse.
type kvParams struct {
	DoRemoteDecode  bool            `json:"do_remote_decode"`
	DoRemotePrefill bool            `json:"do_remote_prefill"`
	RemoteEngineID  json.RawMessage `json:"remote_engine_id"`
	RemoteRequestID json.RawMessage `json:"remote_request_id"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
	RemoteHost      json.RawMessage `json:"remote_host"`
	RemotePort      json.RawMessage `json:"remote_port"`
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

// errKVCanceled means the pull was cut short by the request's context.
var errKVCanceled = errors.New("kv pull canceled")

// pullKV is the consumer side of the handoff: it pulls the blocks named by
// the descriptor kv from the producer's side channel and checks they were
// computed for digest. It returns "" on success, a failure reason for the
// "KV transfer failed: " message otherwise, or errKVCanceled when ctx ended.
func (s *Server) pullKV(ctx context.Context, kv *kvParams, ownID, digest string) (string, error) {
	var host, engineID, requestID string
	var port int
	if isNull(kv.RemoteHost) || json.Unmarshal(kv.RemoteHost, &host) != nil || host == "" {
		return "invalid handoff descriptor: remote_host is missing or not a string", nil
	}
	if isNull(kv.RemotePort) || json.Unmarshal(kv.RemotePort, &port) != nil || port < 1 || port > 65535 {
		return "invalid handoff descriptor: remote_port is missing or not a port number", nil
	}
	if !isNull(kv.RemoteEngineID) && json.Unmarshal(kv.RemoteEngineID, &engineID) != nil {
		return "invalid handoff descriptor: remote_engine_id is not a string", nil
	}
	requestID = ownID // older vLLM omits remote_request_id: the ids are shared
	if !isNull(kv.RemoteRequestID) && json.Unmarshal(kv.RemoteRequestID, &requestID) != nil {
		return "invalid handoff descriptor: remote_request_id is not a string", nil
	}
	if isNull(kv.RemoteBlockIDs) {
		return "invalid handoff descriptor: remote_block_ids is missing", nil
	}
	body := make([]byte, 0, 128+len(kv.RemoteBlockIDs))
	body = append(body, `{"remote_engine_id":`...)
	body = appendJSONString(body, engineID)
	body = append(body, `,"remote_request_id":`...)
	body = appendJSONString(body, requestID)
	body = append(body, `,"remote_block_ids":`...)
	body = append(body, bytes.TrimSpace(kv.RemoteBlockIDs)...)
	body = append(body, `,"consumer_engine_id":`...)
	body = appendJSONString(body, s.cfg.EngineID)
	body = append(body, '}')

	addr := net.JoinHostPort(host, strconv.Itoa(port))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/kv/pull", bytes.NewReader(body))
	if err != nil {
		return "invalid handoff descriptor: " + err.Error(), nil
	}
	req.Header["Content-Type"] = jsonContentType
	resp, err := s.pullClient.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return "", errKVCanceled
		}
		return fmt.Sprintf("cannot reach producer side channel %s: %v", addr, err), nil
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		if ctx.Err() != nil {
			return "", errKVCanceled
		}
		return fmt.Sprintf("reading from producer side channel %s: %v", addr, err), nil
	}
	if resp.StatusCode != http.StatusOK {
		if e, ok := schemas.ParseError(out); ok && e.Message != "" {
			return e.Message, nil
		}
		return fmt.Sprintf("producer side channel %s answered HTTP %d", addr, resp.StatusCode), nil
	}
	var pr pullResponse
	if err := json.Unmarshal(out, &pr); err != nil {
		return "invalid answer from producer side channel: " + err.Error(), nil
	}
	if pr.Digest != digest {
		return fmt.Sprintf("prompt mismatch: the KV blocks of %q were computed for a different prompt or endpoint", requestID), nil
	}
	return "", nil
}

package chaos

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
)

// descriptorField is the top-level member of a prefill response that holds
// the handoff descriptor (vLLM's "Prefill response").
const descriptorField = "kv_transfer_params"

// changedShape is the descriptor change-connector-shape puts in place of
// the engine's: an LMCache-like object that carries none of nixl's fields.
var changedShape = []byte(`{"lmcache_key":"chaos"}`)

// corruptResponse replaces resp's JSON body with one whose top-level
// kv_transfer_params is corrupted by the descriptor fault k, and fixes the
// Content-Length. A compressed body, a body larger than maxInspectBody, and
// a body without a descriptor object pass unchanged. It returns an error
// only when the engine's body cannot be read.
func corruptResponse(resp *http.Response, k faultKind) error {
	if resp.Header.Get("Content-Encoding") != "" {
		return nil
	}
	orig := resp.Body
	body, err := io.ReadAll(io.LimitReader(orig, maxInspectBody+1))
	if err != nil {
		return err
	}
	if len(body) > maxInspectBody {
		resp.Body = readCloser{io.MultiReader(bytes.NewReader(body), orig), orig}
		return nil
	}
	_ = orig.Close()
	if changed, ok := corruptDescriptor(body, k); ok {
		body = changed
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	resp.ContentLength = int64(len(body))
	resp.Header.Set("Content-Length", strconv.Itoa(len(body)))
	return nil
}

// corruptDescriptor returns body with its top-level kv_transfer_params
// object corrupted by fault k (R-DESC-1, R-DESC-2, R-DESC-3); every other
// byte of body is kept. ok is false when body is not a JSON object or has
// no descriptor object, or (drop-engine-id, garble-block-ids) when the
// descriptor lacks the field to corrupt.
func corruptDescriptor(body []byte, k faultKind) (out []byte, ok bool) {
	start, end, found := descriptorSpan(body)
	if !found {
		return nil, false
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(body[start:end], &fields) != nil || fields == nil {
		return nil, false // null, or not an object
	}
	var desc []byte
	switch k {
	case kindChangeConnectorShape:
		desc = changedShape
	case kindDropEngineID:
		if _, has := fields["remote_engine_id"]; !has {
			return nil, false
		}
		delete(fields, "remote_engine_id")
		desc, _ = json.Marshal(fields) // RawMessages of a parsed object always marshal
	case kindGarbleBlockIDs:
		raw, has := fields["remote_block_ids"]
		if !has {
			return nil, false
		}
		fields["remote_block_ids"] = garbleBlockIDs(raw)
		desc, _ = json.Marshal(fields)
	default:
		return nil, false
	}
	out = make([]byte, 0, len(body)-(end-start)+len(desc))
	out = append(out, body[:start]...)
	out = append(out, desc...)
	out = append(out, body[end:]...)
	return out, true
}

// garbleBlockIDs turns a block id list into strings, each element's JSON
// text as a string: [17,18] becomes ["17","18"] and [[1],[2]] becomes
// ["[1]","[2]"]. A value that is no array or an empty one becomes ["x"].
func garbleBlockIDs(raw json.RawMessage) json.RawMessage {
	var ids []json.RawMessage
	if json.Unmarshal(raw, &ids) != nil || len(ids) == 0 {
		return json.RawMessage(`["x"]`)
	}
	garbled := make([]string, len(ids))
	for i, id := range ids {
		var compact bytes.Buffer
		if json.Compact(&compact, id) != nil {
			garbled[i] = "x"
			continue
		}
		garbled[i] = compact.String()
	}
	out, _ := json.Marshal(garbled)
	return out
}

// descriptorSpan finds the value of the top-level kv_transfer_params
// member of the JSON object body (the last one when repeated):
// body[start:end] is the value's JSON text.
func descriptorSpan(body []byte) (start, end int, found bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return 0, 0, false
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return 0, 0, false
		}
		key, _ := tok.(string)
		keyEnd := int(dec.InputOffset())
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return 0, 0, false
		}
		if key != descriptorField {
			continue
		}
		// The value starts after the ':' that follows the key, and any
		// white space around it.
		i := keyEnd
		for i < len(body) && (isJSONSpace(body[i]) || body[i] == ':') {
			i++
		}
		start, end, found = i, int(dec.InputOffset()), true
	}
	return start, end, found
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

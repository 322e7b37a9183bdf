package schemas

import (
	"encoding/json"
	"strconv"
)

// ErrorObject is the OpenAI/vLLM error object (behaviour.md R-API-3; vLLM's error
// body): {"message":…,"type":…,"param":null,"code":<int>}. Code is the
// HTTP status the error travels with.
type ErrorObject struct {
	// Message is the human-readable detail. Narwhal's own messages start
	// with the exact detail strings docs/behaviour.md gives.
	Message string `json:"message"`
	// Type is the error class, e.g. "BadRequestError" (see ErrorType).
	Type string `json:"type"`
	// Param names the offending request field, or null.
	Param *string `json:"param"`
	// Code is the HTTP status as an integer.
	Code int `json:"code"`
}

// ErrorResponse is the body of every error Narwhal returns:
// {"error": ErrorObject}. The same shape is the terminal SSE event of a
// stream that fails after commit (behaviour.md R-FAIL-5).
type ErrorResponse struct {
	Error ErrorObject `json:"error"`
}

// ErrorType returns the OpenAI/vLLM error type name for an HTTP status:
// 400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError,
// 404 NotFoundError, 408 and 504 TimeoutError, 413 RequestTooLargeError,
// 422 UnprocessableEntityError, 429 RateLimitError, 502 BadGatewayError,
// 503 ServiceUnavailableError, other 5xx InternalServerError, other 4xx
// BadRequestError.
func ErrorType(status int) string {
	switch status {
	case 400:
		return "BadRequestError"
	case 401:
		return "AuthenticationError"
	case 403:
		return "PermissionDeniedError"
	case 404:
		return "NotFoundError"
	case 408, 504:
		return "TimeoutError"
	case 413:
		return "RequestTooLargeError"
	case 422:
		return "UnprocessableEntityError"
	case 429:
		return "RateLimitError"
	case 502:
		return "BadGatewayError"
	case 503:
		return "ServiceUnavailableError"
	}
	if status >= 500 {
		return "InternalServerError"
	}
	return "BadRequestError"
}

// NewError returns the ErrorResponse for status and message, with the type
// from ErrorType and a null param.
func NewError(status int, message string) ErrorResponse {
	return ErrorResponse{Error: ErrorObject{Message: message, Type: ErrorType(status), Code: status}}
}

// AppendErrorJSON appends the JSON encoding of NewError(status, message) to
// dst and returns the extended slice. It never fails.
func AppendErrorJSON(dst []byte, status int, message string) []byte {
	dst = append(dst, `{"error":{"message":`...)
	dst = appendJSONString(dst, message)
	dst = append(dst, `,"type":"`...)
	dst = append(dst, ErrorType(status)...)
	dst = append(dst, `","param":null,"code":`...)
	dst = strconv.AppendInt(dst, int64(status), 10)
	dst = append(dst, "}}"...)
	return dst
}

func appendJSONString(dst []byte, s string) []byte {
	b, err := json.Marshal(s)
	if err != nil { // cannot happen for a string
		return append(dst, `""`...)
	}
	return append(dst, b...)
}

// ParseError reads an engine error body in either shape vLLM has used:
// {"error":{"message","type","param","code"}} or the older flat
// {"object":"error","message","type","param","code"}. The code may be an
// integer or a string; a code that is not an integer is returned as 0. ok is
// false when body holds neither shape.
func ParseError(body []byte) (obj ErrorObject, ok bool) {
	var wire struct {
		Error   *rawError `json:"error"`
		Object  string    `json:"object"`
		Message *string   `json:"message"`
		rawError
	}
	if err := json.Unmarshal(body, &wire); err != nil {
		return ErrorObject{}, false
	}
	var r *rawError
	switch {
	case wire.Error != nil:
		r = wire.Error
	case wire.Object == "error" || (wire.Message != nil && wire.Type != ""):
		r = &wire.rawError
		if wire.Message != nil {
			r.Message = *wire.Message
		}
	default:
		return ErrorObject{}, false
	}
	obj = ErrorObject{Message: r.Message, Type: r.Type, Param: r.Param}
	obj.Code = r.code()
	return obj, true
}

type rawError struct {
	Message string          `json:"message"`
	Type    string          `json:"type"`
	Param   *string         `json:"param"`
	Code    json.RawMessage `json:"code"`
}

func (r *rawError) code() int {
	if len(r.Code) == 0 {
		return 0
	}
	var n int
	if err := json.Unmarshal(r.Code, &n); err == nil {
		return n
	}
	var s string
	if err := json.Unmarshal(r.Code, &s); err == nil {
		if n, err := strconv.Atoi(s); err == nil {
			return n
		}
	}
	return 0
}

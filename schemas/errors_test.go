package schemas

import (
	"encoding/json"
	"testing"
)

func TestParseErrorShapes(t *testing.T) {
	cases := []struct {
		body string
		ok   bool
		code int
		msg  string
	}{
		{`{"error":{"message":"m","type":"BadRequestError","param":null,"code":400}}`, true, 400, "m"},
		{`{"object":"error","message":"old","type":"InternalServerError","param":null,"code":500}`, true, 500, "old"},
		{`{"error":{"message":"s","type":"X","code":"503"}}`, true, 503, "s"},
		{`{"error":{"message":"s","type":"X","code":"E1"}}`, true, 0, "s"},
		{`{"error":{"message":"s"}}`, true, 0, "s"},
		{`{"choices":[]}`, false, 0, ""},
		{`not json`, false, 0, ""},
		{``, false, 0, ""},
	}
	for _, c := range cases {
		obj, ok := ParseError([]byte(c.body))
		if ok != c.ok || obj.Code != c.code || obj.Message != c.msg {
			t.Errorf("%s: %+v %v", c.body, obj, ok)
		}
	}
}

func TestAppendErrorJSONRAPI3(t *testing.T) {
	b := AppendErrorJSON(nil, 404, `model "x" \ not found`)
	var e ErrorResponse
	if err := json.Unmarshal(b, &e); err != nil {
		t.Fatal(err)
	}
	if e.Error.Code != 404 || e.Error.Type != "NotFoundError" || e.Error.Param != nil || e.Error.Message != `model "x" \ not found` {
		t.Fatalf("%s", b)
	}
}

// FuzzParseError: the engine error parser never panics.
func FuzzParseError(f *testing.F) {
	f.Add([]byte(`{"error":{"message":"m","type":"t","param":null,"code":400}}`))
	f.Add([]byte(`{"object":"error","message":"m","code":"x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		obj, ok := ParseError(b)
		if !ok && obj != (ErrorObject{}) {
			t.Fatalf("not ok but %+v", obj)
		}
	})
}

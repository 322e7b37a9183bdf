package config

import (
	"errors"
	"fmt"
	"math"
	"os"
	"reflect"
	"strconv"
	"strings"

	"github.com/caarlos0/env/v11"
	"github.com/goccy/go-yaml"
	"github.com/goccy/go-yaml/ast"
	"github.com/goccy/go-yaml/parser"
)

// Load reads the configuration: Default, then the YAML file at path (none
// when path is ""), then the environment variables NARWHAL_<SECTION>_<KEY>,
// then Validate (behaviour.md §11). A fleet entry without a connector gets
// connector.DefaultName (EngineSpec.setDefaults). It returns an error when
// the file cannot be read, is not valid YAML, holds an unknown key or a
// value of the wrong type, when an environment variable does not parse, or
// when Validate fails; each error about a setting is a *KeyError naming its
// key.
func Load(path string) (*Config, error) {
	var data []byte
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("config: %w", err)
		}
		data = b
	}
	return load(data, env.ToMap(os.Environ()))
}

// Parse is Load with the YAML document given as bytes instead of a file
// name; the environment still applies. Empty yamlBytes give the defaults.
func Parse(yamlBytes []byte) (*Config, error) {
	return load(yamlBytes, env.ToMap(os.Environ()))
}

// load runs the pipeline of Load over data and the environment environ
// (name → value).
func load(data []byte, environ map[string]string) (*Config, error) {
	c := Default()
	if err := decodeYAML(data, &c); err != nil {
		return nil, err
	}
	for i := range c.Fleet {
		c.Fleet[i].setDefaults()
	}
	fromEnv, err := applyEnv(&c, environ)
	if err != nil {
		return nil, err
	}
	for i := range c.Auth.APIKeys {
		c.Auth.APIKeys[i].KeySHA256 = strings.ToLower(c.Auth.APIKeys[i].KeySHA256)
	}
	own := len(c.Auth.APIKeys)
	if err := loadAPIKeysFile(&c, fromEnv); err != nil {
		return nil, err
	}
	c.fileKeys = len(c.Auth.APIKeys) - own
	if err := resolveEngineKeys(&c, environ); err != nil {
		return nil, err
	}
	if err := loadEngineCAs(&c, fromEnv); err != nil {
		return nil, err
	}
	if err := c.Validate(); err != nil {
		// Name the variable behind every invalid value that came from the
		// environment, so the operator knows where to look.
		for _, e := range unjoin(err) {
			var ke *KeyError
			if errors.As(e, &ke) {
				ke.Env = fromEnv[ke.Key]
			}
		}
		return nil, err
	}
	return &c, nil
}

// unjoin returns the errors joined in err, or err alone.
func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// decodeYAML decodes one YAML document onto c, which holds the defaults:
// keys present in data replace them, keys absent keep them. Unknown keys
// and values of the wrong type are errors naming the key.
func decodeYAML(data []byte, c *Config) error {
	file, err := parser.ParseBytes(data, 0)
	if err != nil {
		return fmt.Errorf("config: yaml: %s", yaml.FormatError(err, false, false))
	}
	docs := 0
	for _, d := range file.Docs {
		if d.Body != nil && d.Body.Type() != ast.CommentType {
			docs++
		}
	}
	if docs > 1 {
		return fmt.Errorf("config: yaml: the file holds %d documents, want one", docs)
	}
	var root any
	if err := yaml.UnmarshalWithOptions(data, &root, yaml.UseOrderedMap()); err != nil {
		return fmt.Errorf("config: yaml: %s", yaml.FormatError(err, false, false))
	}
	if root == nil {
		return nil
	}
	if _, ok := root.(yaml.MapSlice); !ok {
		return fmt.Errorf("config: yaml: the top level must be a mapping, got %s", describe(root))
	}
	var errs []error
	decodeValue(reflect.ValueOf(c).Elem(), root, "", &errs)
	return errors.Join(errs...)
}

// decodeValue stores node, a value decoded by go-yaml with UseOrderedMap,
// into v, reporting problems under the dotted key path key.
func decodeValue(v reflect.Value, node any, key string, errs *[]error) {
	bad := func(format string, args ...any) {
		*errs = append(*errs, &KeyError{Key: key, Problem: fmt.Sprintf(format, args...)})
	}
	switch v.Kind() {
	case reflect.Struct:
		if node == nil { // an empty section keeps what it had
			return
		}
		m, ok := node.(yaml.MapSlice)
		if !ok {
			bad("must be a mapping, got %s", describe(node))
			return
		}
		names := yamlNames(v.Type())
		for _, item := range m {
			name := fmt.Sprint(item.Key)
			child := name
			if key != "" {
				child = key + "." + name
			}
			i := indexOf(names, name)
			if i < 0 || names[i] == "" || names[i] == "-" {
				*errs = append(*errs, &KeyError{Key: child, Problem: "unknown key (known keys here: " + strings.Join(known(names), ", ") + ")"})
				continue
			}
			decodeValue(v.Field(i), item.Value, child, errs)
		}
	case reflect.Pointer:
		if node == nil {
			v.SetZero()
			return
		}
		p := reflect.New(v.Type().Elem())
		decodeValue(p.Elem(), node, key, errs)
		v.Set(p)
	case reflect.Slice:
		if node == nil {
			v.SetZero()
			return
		}
		seq, ok := node.([]any)
		if !ok {
			bad("must be a list, got %s", describe(node))
			return
		}
		out := reflect.MakeSlice(v.Type(), len(seq), len(seq))
		for i, n := range seq {
			elemKey := key + "[" + strconv.Itoa(i) + "]"
			if n == nil {
				*errs = append(*errs, &KeyError{Key: elemKey, Problem: "must be a mapping, got null"})
				continue
			}
			decodeValue(out.Index(i), n, elemKey, errs)
		}
		v.Set(out)
	case reflect.String:
		s, ok := node.(string)
		if !ok {
			bad("must be a string, got %s (quote it)", describe(node))
			return
		}
		v.SetString(s)
	case reflect.Int:
		n, ok := asInt(node)
		if !ok {
			bad("must be an integer, got %s", describe(node))
			return
		}
		v.SetInt(n)
	case reflect.Bool:
		b, ok := node.(bool)
		if !ok {
			bad("must be true or false, got %s", describe(node))
			return
		}
		v.SetBool(b)
	case reflect.Float64:
		var f float64
		switch n := node.(type) {
		case uint64:
			f = float64(n)
		case int64:
			f = float64(n)
		case float64:
			f = n
		default:
			bad("must be a number, got %s", describe(node))
			return
		}
		v.SetFloat(f)
	default:
		bad("cannot be set (unsupported field type %s)", v.Type())
	}
}

// asInt returns node as an int when it is an integral number in range.
func asInt(node any) (int64, bool) {
	switch n := node.(type) {
	case uint64:
		if n <= math.MaxInt {
			return int64(n), true
		}
	case int64:
		if n >= math.MinInt && n <= math.MaxInt {
			return n, true
		}
	case float64:
		if n == math.Trunc(n) && n >= -(1<<53) && n <= 1<<53 {
			return int64(n), true
		}
	}
	return 0, false
}

// describe names the YAML kind and value of node for error messages.
func describe(node any) string {
	switch n := node.(type) {
	case nil:
		return "null"
	case string:
		return fmt.Sprintf("string %q", n)
	case bool:
		return fmt.Sprintf("boolean %v", n)
	case uint64, int64, float64:
		return fmt.Sprintf("number %v", n)
	case []any:
		return "a list"
	case yaml.MapSlice:
		return "a mapping"
	}
	return fmt.Sprintf("%T", node)
}

// yamlNames returns the YAML key of each field of the struct type t, by
// field index.
func yamlNames(t reflect.Type) []string {
	names := make([]string, t.NumField())
	for i := range names {
		names[i] = yamlName(t.Field(i))
	}
	return names
}

// known returns names without the fields YAML cannot set ("" and "-").
func known(names []string) []string {
	out := make([]string, 0, len(names))
	for _, n := range names {
		if n != "" && n != "-" {
			out = append(out, n)
		}
	}
	return out
}

func yamlName(f reflect.StructField) string {
	if !f.IsExported() {
		return ""
	}
	name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	return name
}

func indexOf(names []string, name string) int {
	for i, n := range names {
		if n == name {
			return i
		}
	}
	return -1
}

// applyEnv overrides the scalar settings of every section of c that has an
// envPrefix tag from environ, with github.com/caarlos0/env: the variable of
// a field is EnvPrefix + the section's envPrefix + the field's env tag. It
// returns which keys came from which variable (dotted key → variable name)
// and a *KeyError naming both for a value that does not parse.
func applyEnv(c *Config, environ map[string]string) (map[string]string, error) {
	fromEnv := make(map[string]string)
	var errs []error
	cv := reflect.ValueOf(c).Elem()
	ct := cv.Type()
	for i := range ct.NumField() {
		sf := ct.Field(i)
		sectionPrefix, ok := sf.Tag.Lookup("envPrefix")
		if !ok {
			continue
		}
		section := yamlName(sf)
		prefix := EnvPrefix + sectionPrefix
		st := sf.Type
		keyOf := make(map[string]string, st.NumField()) // variable → dotted key
		for j := range st.NumField() {
			f := st.Field(j)
			if tag := f.Tag.Get("env"); tag != "" {
				keyOf[prefix+tag] = section + "." + yamlName(f)
			}
		}
		opts := env.Options{
			Prefix:      prefix,
			Environment: environ,
			OnSet: func(name string, value any, isDefault bool) {
				if s, _ := value.(string); s != "" && !isDefault {
					fromEnv[keyOf[name]] = name
				}
			},
		}
		err := env.ParseWithOptions(cv.Field(i).Addr().Interface(), opts)
		if err == nil {
			continue
		}
		for _, e := range unjoin(err) {
			var pe env.ParseError
			f, found := reflect.StructField{}, false
			if errors.As(e, &pe) {
				f, found = st.FieldByName(pe.Name)
			}
			if !found {
				errs = append(errs, fmt.Errorf("config: environment: %w", e))
				continue
			}
			name := prefix + f.Tag.Get("env")
			raw := environ[name]
			problem := fmt.Sprintf("cannot parse %q", raw)
			switch f.Type.Kind() {
			case reflect.Float64:
				problem = fmt.Sprintf("must be a number, got %q", raw)
			case reflect.Int:
				problem = fmt.Sprintf("must be an integer, got %q", raw)
				if errors.Is(pe.Err, strconv.ErrRange) {
					problem = fmt.Sprintf("must be an integer in range, got %q", raw)
				}
			}
			errs = append(errs, &KeyError{Key: keyOf[name], Env: name, Problem: problem})
		}
	}
	return fromEnv, errors.Join(errs...)
}

package policy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"go.yaml.in/yaml/v3"
)

// KeyError is one problem in a configuration, named by the key path the
// user typed: admin.listen, listeners[1].write_buffer.low_water_mark.
type KeyError struct {
	// Path is the key path; empty for a problem with the file as a whole.
	Path string
	// Line is the 1-based line in the YAML source; 0 when unknown (a Config
	// built in code, or a key that is absent).
	Line int
	// Msg says what is wrong, including the offending value.
	Msg string
}

// Error returns "path: msg (line N)", leaving out the parts that are empty.
func (e *KeyError) Error() string {
	s := e.Msg
	if e.Path != "" {
		s = e.Path + ": " + s
	}
	if e.Line > 0 {
		s += " (line " + strconv.Itoa(e.Line) + ")"
	}
	return s
}

// Errors is every problem found in a configuration, in source order.
// Each element is a *KeyError.
type Errors []error

// Error returns one problem per line.
func (es Errors) Error() string {
	lines := make([]string, len(es))
	for i, e := range es {
		lines[i] = e.Error()
	}
	return strings.Join(lines, "\n")
}

// Unwrap lets errors.As find the individual *KeyError values.
func (es Errors) Unwrap() []error { return es }

// Load reads the configuration file at path and parses it with Parse.
// A file that cannot be read yields the *os.PathError; a file that can
// yields what Parse returns.
func Load(path string) (Config, error) {
	data, err := ReadFile(path)
	if err != nil {
		return Config{}, err
	}
	return Parse(data)
}

// ReadFile reads a configuration file, at most MaxConfigBytes and one byte
// more (Parse refuses that), so that a file of any size costs no more.
func ReadFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, MaxConfigBytes+1))
}

// Parse decodes a YAML configuration strictly and validates it.
//
// Decoding starts from DefaultConfig. The top-level defaults mapping
// overlays DefaultSettings key by key (a nested mapping such as
// keepalive: {idle: 5s} changes only idle), and every listener starts from
// a copy of the decoded defaults and overlays its own keys the same way.
// A listener's pool and transparent sections start from DefaultPool and
// DefaultTransparent (a listener without them keeps them zero), so that a
// key left out of either takes its default.
// An empty or null document is all defaults (and so fails validation: a
// config needs at least one listener).
//
// Unknown keys, duplicate keys, values of the wrong kind and unparsable
// durations or sizes are errors; so is everything Validate rejects. Every
// problem is collected: the error is an Errors holding one *KeyError per
// problem, in source order. With an error, the returned Config holds
// whatever decoded, for diagnostics only.
func Parse(data []byte) (Config, error) {
	if len(data) > MaxConfigBytes {
		return DefaultConfig(), Errors{&KeyError{Msg: fmt.Sprintf("the configuration is %d bytes, more than the %d a configuration may have (a ConfigMap's own limit)", len(data), MaxConfigBytes)}}
	}
	d := &decoder{lines: map[string]int{}, raw: map[string]string{}}
	c := d.document(data)
	if len(d.errs) > 0 {
		// A bad value stays at its default; validating it would report a
		// second, misleading problem. Validate the rest.
		bad := d.errs
		v := &validator{lines: d.lines, raw: d.raw}
		v.config(&c)
		for _, e := range v.errs {
			if !underAny(e.(*KeyError).Path, bad) {
				d.errs = append(d.errs, e)
			}
		}
		sortByLine(d.errs)
		return c, d.errs
	}
	v := &validator{lines: d.lines, raw: d.raw}
	v.config(&c)
	if len(v.errs) > 0 {
		sortByLine(v.errs)
		return c, v.errs
	}
	return c, nil
}

// underAny reports whether path is, or lies under, the path of one of errs.
func underAny(path string, errs Errors) bool {
	for _, e := range errs {
		p := e.(*KeyError).Path
		if p == "" || path == p ||
			(strings.HasPrefix(path, p) && (path[len(p)] == '.' || path[len(p)] == '[')) {
			return true
		}
	}
	return false
}

// sortByLine orders errs by source line, stably; problems without a line
// go last.
func sortByLine(errs Errors) {
	key := func(e error) int {
		if n := e.(*KeyError).Line; n > 0 {
			return n
		}
		return int(^uint(0) >> 1)
	}
	slices.SortStableFunc(errs, func(a, b error) int { return key(a) - key(b) })
}

// decoder walks a yaml.Node tree into Go values by reflection, so that every
// error can name the key path.
type decoder struct {
	errs Errors
	// lines maps the path of every key (and list element) present in the
	// source to its line. Validate uses it to tell a listener's own
	// settings from inherited ones, and to put lines on its errors.
	lines map[string]int
	// raw maps the path of every duration and size that decoded to the
	// text the source has for it, so that a message can quote it (a bare
	// -1 is -1, not -1ns).
	raw map[string]string
	// values counts the values decoded, each alias's as often as it is
	// used: past MaxConfigValues decoding stops (see visit).
	values int
}

// MaxConfigValues bounds the values a configuration may hold once its YAML
// aliases are expanded. Aliases make a file of a kilobyte stand for
// millions of values (each level multiplies), which would cost the
// running proxy, parsing a changed ConfigMap, more memory than it has.
// A configuration written out by hand or by a template holds far fewer.
const MaxConfigValues = 100_000

// MaxConfigBytes bounds a configuration file: a ConfigMap's own limit.
const MaxConfigBytes = 1 << 20

// visit counts one value decoded at path, and reports whether decoding
// goes on: past MaxConfigValues it stops, with one error.
func (d *decoder) visit(n *yaml.Node, path string) bool {
	d.values++
	if d.values == MaxConfigValues+1 {
		d.fail(path, n, "the configuration holds more than %d values once its YAML aliases are expanded; decoding stopped here (aliases that repeat lists of lists multiply)", MaxConfigValues)
	}
	return d.values <= MaxConfigValues
}

func (d *decoder) fail(path string, n *yaml.Node, format string, args ...any) {
	line := 0
	if n != nil {
		line = n.Line
	}
	d.errs = append(d.errs, &KeyError{Path: path, Line: line, Msg: fmt.Sprintf(format, args...)})
}

var yamlErrLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

func (d *decoder) document(data []byte) Config {
	c := DefaultConfig()
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if !errors.Is(err, io.EOF) {
			d.syntax(data, err)
		}
		return c
	}
	for {
		var extra yaml.Node
		err := dec.Decode(&extra)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			d.syntax(data, err)
			return c
		}
		if root := resolve(&extra); root != nil && !isNull(root) {
			d.fail("", root, "a second YAML document; the configuration is one document")
			return c
		}
	}
	root := resolve(&doc)
	if root == nil || isNull(root) {
		return c
	}
	if root.Kind != yaml.MappingNode {
		d.fail("", root, "the configuration must be a mapping, got %s", describe(root))
		return c
	}
	// defaults must be decoded before the listeners that start from it,
	// wherever the two keys appear in the file.
	var listeners *yaml.Node
	d.mapping(root, reflect.ValueOf(&c).Elem(), "", func(key string, val *yaml.Node) bool {
		if key != "listeners" {
			return false
		}
		listeners = val
		return true
	})
	if listeners != nil {
		c.Listeners = d.listeners(listeners, c.Defaults)
	}
	return c
}

// syntax reports a YAML syntax error at the line that has the problem.
//
// yaml.v3 does not say where it found the problem: its message carries the
// line of the enclosing construct's start when there is one (0-based for a
// parser error, so one line early), else the problem's own line (0-based
// for a parser error too). A mis-indented key on line 4 of a mapping that
// starts on line 2 is reported at line 1; a tab on line 4 inside a value
// that starts on line 3, at line 3. The error exposes nothing else, so
// yamlErrorLine finds the line by parsing prefixes of the document.
func (d *decoder) syntax(data []byte, err error) {
	reported, msg := splitYAMLError(err)
	line := yamlErrorLine(data, reported, msg)
	d.errs = append(d.errs, &KeyError{Line: line, Msg: "invalid YAML: " + msg + yamlHint(data, line, msg)})
}

// splitYAMLError returns the line yaml.v3 put in err's message (0 if none)
// and the problem without the "yaml: line N: " prefix.
func splitYAMLError(err error) (line int, msg string) {
	s := err.Error()
	if m := yamlErrLine.FindStringSubmatch(s); m != nil {
		line, _ = strconv.Atoi(m[1])
		return line, m[2]
	}
	return 0, strings.TrimPrefix(s, "yaml: ")
}

// yamlErrorLine returns the 1-based line of the syntax problem msg in data,
// which yaml.v3 reported at line reported: the last line of the shortest
// prefix of the document, cut at a line end, that fails with the same
// problem. Shorter prefixes parse, or fail for another reason (they end
// inside something left open), so that line is where the problem first
// shows: the mis-indented key, the tab, the line of a flow mapping or a
// quoted string that is never closed.
//
// Every prefix from that line on fails the same way (the parser stops at
// the problem, which the line holds), so a binary search finds it. It
// starts at yaml.v3's line, which is never after it (the start of the
// enclosing construct, or the problem's 0-based line); unless that line
// is the last or past it (the end of the file, where something opened
// earlier is still open): then the whole file is searched.
func yamlErrorLine(data []byte, reported int, msg string) int {
	// ends[i] is the offset just past line i+1's newline (or the end).
	var ends []int
	for i, b := range data {
		if b == '\n' {
			ends = append(ends, i+1)
		}
	}
	if len(ends) == 0 || ends[len(ends)-1] != len(data) {
		ends = append(ends, len(data))
	}
	fails := func(k int) bool {
		err := yamlStreamError(data[:ends[k-1]])
		if err == nil {
			return false
		}
		_, m := splitYAMLError(err)
		return m == msg
	}
	n := len(ends)
	if !fails(n) { // not the error this data gives: keep yaml.v3's line
		return reported
	}
	lo, hi := 0, n // fails(hi); lo is taken not to (0: the empty prefix)
	if reported >= 1 && reported < n {
		lo = reported - 1
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if fails(mid) {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}

// yamlStreamError parses every document of data and returns the first
// syntax error, or nil.
func yamlStreamError(data []byte) error {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var n yaml.Node
		err := dec.Decode(&n)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// yamlHint adds what a user can do about the commonest syntax errors:
// indentation with a tab, and a line indented unlike its neighbours.
// The indentation hint is left out when the line has flow brackets, whose
// stray closing bracket gives the same message.
func yamlHint(data []byte, line int, msg string) string {
	lines := bytes.Split(data, []byte("\n"))
	if line < 1 || line > len(lines) {
		return ""
	}
	l := lines[line-1]
	if indent := l[:len(l)-len(bytes.TrimLeft(l, " \t"))]; bytes.IndexByte(indent, '\t') >= 0 {
		return " (a tab in the indentation: YAML is indented with spaces)"
	}
	switch msg {
	case "did not find expected key", "did not find expected '-' indicator":
		if bytes.IndexAny(l, "{}[]") < 0 {
			return " (check this line's indentation against the lines above it)"
		}
	}
	return ""
}

// listeners decodes the listeners sequence; each element starts from defaults.
func (d *decoder) listeners(n *yaml.Node, defaults Settings) []Listener {
	const path = "listeners"
	n = resolve(n)
	if isNull(n) || (n.Kind == yaml.SequenceNode && len(n.Content) == 0) {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		d.fail(path, n, "expected a list of listeners, got %s", describe(n))
		return nil
	}
	// Grown as the items are decoded: the value bound (visit) stops a list
	// of many aliases of one listener before it costs their memory.
	out := make([]Listener, 0, min(len(n.Content), 64))
	for i, item := range n.Content {
		p := path + "[" + strconv.Itoa(i) + "]"
		if !d.visit(item, p) {
			return out
		}
		d.lines[p] = item.Line
		out = append(out, Listener{Settings: defaults})
		v := reflect.ValueOf(&out[i]).Elem()
		if m := resolve(item); m != nil && m.Kind == yaml.MappingNode {
			d.mapping(m, v, p, func(key string, _ *yaml.Node) bool {
				// The section's own defaults, then its keys overlay them.
				switch key {
				case "pool":
					out[i].Pool = DefaultPool()
				case "transparent":
					out[i].Transparent = DefaultTransparent()
				}
				return false
			})
			continue
		}
		d.value(item, v, p) // not a mapping: reports what it is
	}
	return out
}

// mapping overlays the keys of mapping node n onto struct v. Keys absent from
// n leave their field unchanged. hook, if not nil, may claim a known key
// (after the duplicate check) by returning true.
func (d *decoder) mapping(n *yaml.Node, v reflect.Value, path string, hook func(key string, val *yaml.Node) bool) {
	fields := fieldsOf(v.Type())
	seen := make(map[string]int, len(n.Content)/2)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.AliasNode {
			k = resolve(k)
		}
		if k.Kind != yaml.ScalarNode {
			d.fail(path, k, "a key must be a plain name, got %s", describe(k))
			continue
		}
		p := join(path, k.Value)
		if k.ShortTag() == "!!merge" {
			d.fail(p, k, "merge keys (<<) are not supported; listeners inherit defaults instead")
			continue
		}
		if first, dup := seen[k.Value]; dup {
			d.fail(p, k, "duplicate key (first at line %d)", first)
			continue
		}
		seen[k.Value] = k.Line
		index, ok := fields[k.Value]
		if !ok {
			d.fail(p, k, "unknown key")
			continue
		}
		d.lines[p] = k.Line
		if hook != nil && hook(k.Value, val) {
			continue
		}
		d.value(val, v.FieldByIndex(index), p)
	}
}

var (
	durationType   = reflect.TypeFor[Duration]()
	sizeType       = reflect.TypeFor[Size]()
	identitiesType = reflect.TypeFor[Identities]()
)

// identities decodes a list of strings into an Identities value.
func (d *decoder) identities(n *yaml.Node, v reflect.Value, path string) {
	switch {
	case isNull(n):
		v.SetString("")
	case n.Kind == yaml.SequenceNode:
		ids := make([]string, 0, len(n.Content))
		for i, item := range n.Content {
			p := path + "[" + strconv.Itoa(i) + "]"
			if !d.visit(item, p) {
				break
			}
			d.lines[p] = item.Line
			if item = resolve(item); item.Kind != yaml.ScalarNode || isNull(item) {
				d.fail(p, item, "expected a string, got %s", describe(item))
				continue
			}
			ids = append(ids, item.Value)
		}
		v.SetString(strings.Join(ids, "\n"))
	default:
		d.fail(path, n, "expected a list, got %s", describe(n))
	}
}

// value decodes n into v, which holds the value to overlay (a default).
func (d *decoder) value(n *yaml.Node, v reflect.Value, path string) {
	if !d.visit(n, path) {
		return
	}
	n = resolve(n)
	t := v.Type()
	switch {
	case t.Kind() == reflect.Struct:
		d.structure(n, v, path)
	case t.Kind() == reflect.Slice:
		d.list(n, v, path)
	case t == identitiesType:
		d.identities(n, v, path)
	default:
		d.scalar(n, v, path)
	}
}

// structure decodes a mapping into the struct v, key by key.
func (d *decoder) structure(n *yaml.Node, v reflect.Value, path string) {
	switch {
	case isNull(n): // "keepalive:" with nothing under it changes nothing.
	case n.Kind == yaml.MappingNode:
		d.mapping(n, v, path, nil)
	default:
		d.fail(path, n, "expected a mapping, got %s", describe(n))
	}
}

// list decodes a sequence into the slice v.
func (d *decoder) list(n *yaml.Node, v reflect.Value, path string) {
	switch {
	case isNull(n):
		v.SetZero()
	case n.Kind == yaml.SequenceNode:
		// A list replaces the default list; it is never merged with it.
		// At most the values the bound leaves (see visit) are made.
		k := min(len(n.Content), max(MaxConfigValues-d.values, 0)+1)
		s := reflect.MakeSlice(v.Type(), k, k)
		for i, item := range n.Content[:k] {
			p := path + "[" + strconv.Itoa(i) + "]"
			d.lines[p] = item.Line
			d.value(item, s.Index(i), p)
		}
		v.Set(s)
	default:
		d.fail(path, n, "expected a list, got %s", describe(n))
	}
}

// scalar decodes a scalar node into v: a Duration, a Size, a string, a
// bool, an integer or a float.
func (d *decoder) scalar(n *yaml.Node, v reflect.Value, path string) {
	t := v.Type()
	want := kindName(t)
	if n.Kind != yaml.ScalarNode {
		d.fail(path, n, "expected %s, got %s", want, describe(n))
		return
	}
	if isNull(n) {
		d.fail(path, n, "missing value (expected %s; leave the key out to use the default)", want)
		return
	}
	tag := n.ShortTag()
	switch {
	case t == durationType:
		d.duration(n, v, path, tag)
	case t == sizeType:
		size, err := ParseSize(n.Value)
		if err != nil {
			d.fail(path, n, "%v", err)
			return
		}
		v.SetInt(int64(size))
		d.raw[path] = n.Value
	case t.Kind() == reflect.String:
		v.SetString(n.Value)
	case t.Kind() == reflect.Bool:
		var b bool
		if tag != "!!bool" || n.Decode(&b) != nil {
			d.fail(path, n, "invalid boolean %q (use true or false)", n.Value)
			return
		}
		v.SetBool(b)
	case isInt(t.Kind()):
		var i int64
		if tag != "!!int" || n.Decode(&i) != nil || v.OverflowInt(i) {
			d.fail(path, n, "invalid integer %q", n.Value)
			return
		}
		v.SetInt(i)
	case isFloat(t.Kind()):
		// An integer is a number too: backoff_factor: 2.
		var f float64
		if (tag != "!!int" && tag != "!!float") || n.Decode(&f) != nil ||
			math.IsNaN(f) || math.IsInf(f, 0) || v.OverflowFloat(f) {
			d.fail(path, n, "invalid number %q (use a finite number such as 0.2)", n.Value)
			return
		}
		v.SetFloat(f)
	default:
		// TestDecoderSupportsEveryField keeps this unreachable.
		panic("policy: no decoder for " + t.String() + " at " + path)
	}
}

// duration decodes a Duration (tag is n's short tag).
func (d *decoder) duration(n *yaml.Node, v reflect.Value, path, tag string) {
	if tag == "!!int" {
		// A bare 0 disables; a negative integer is decoded (as
		// nanoseconds) for validation to reject with the source text;
		// a positive one has no unit.
		var i int64
		if err := n.Decode(&i); err == nil && i <= 0 {
			v.SetInt(i)
			d.raw[path] = n.Value
			return
		}
	}
	dur, err := ParseDuration(n.Value)
	if err != nil {
		d.fail(path, n, "%v", err)
		return
	}
	v.SetInt(int64(dur))
	d.raw[path] = n.Value
}

// supported reports whether value can decode into type t.
func supported(t reflect.Type) bool {
	switch {
	case t == durationType || t == sizeType:
		return true
	case t.Kind() == reflect.Struct:
		for _, index := range fieldsOf(t) {
			if !supported(t.FieldByIndex(index).Type) {
				return false
			}
		}
		return true
	case t.Kind() == reflect.Slice:
		return supported(t.Elem())
	}
	return t.Kind() == reflect.String || t.Kind() == reflect.Bool || isInt(t.Kind()) || isFloat(t.Kind())
}

func isInt(k reflect.Kind) bool {
	return k >= reflect.Int && k <= reflect.Int64
}

func isFloat(k reflect.Kind) bool {
	return k == reflect.Float32 || k == reflect.Float64
}

func kindName(t reflect.Type) string {
	switch {
	case t == durationType:
		return "a duration"
	case t == sizeType:
		return "a size"
	case t.Kind() == reflect.Bool:
		return "true or false"
	case isInt(t.Kind()):
		return "an integer"
	case isFloat(t.Kind()):
		return "a number"
	}
	return "a string"
}

// fieldsOf maps the YAML key of every field of struct type t to its index,
// with the fields of ",inline" structs at t's own level. Made once per
// type (a config of many listeners asks for the same ones again); the
// map returned is shared and must not be changed.
func fieldsOf(t reflect.Type) map[string][]int {
	if m, ok := fieldCache.Load(t); ok {
		return m.(map[string][]int)
	}
	m := makeFieldsOf(t)
	fieldCache.Store(t, m)
	return m
}

var fieldCache sync.Map // reflect.Type -> map[string][]int

func makeFieldsOf(t reflect.Type) map[string][]int {
	out := map[string][]int{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" {
			continue
		}
		if slices.Contains(strings.Split(opts, ","), "inline") {
			for k, index := range fieldsOf(f.Type) {
				out[k] = append([]int{i}, index...)
			}
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out[name] = []int{i}
	}
	return out
}

// fieldByPath returns the field of struct v named by a dotted key path
// relative to it, such as "keepalive.idle".
func fieldByPath(v reflect.Value, path string) reflect.Value {
	for key := range strings.SplitSeq(path, ".") {
		v = v.FieldByIndex(fieldsOf(v.Type())[key])
	}
	return v
}

// resolve follows aliases and unwraps a document node; nil stays nil.
func resolve(n *yaml.Node) *yaml.Node {
	for n != nil {
		switch {
		case n.Kind == yaml.AliasNode:
			n = n.Alias
		case n.Kind == yaml.DocumentNode && len(n.Content) == 1:
			n = n.Content[0]
		case n.Kind == yaml.DocumentNode || n.Kind == 0:
			return nil
		default:
			return n
		}
	}
	return nil
}

func isNull(n *yaml.Node) bool {
	return n == nil || (n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null")
}

// describe names what a node is, for "expected X, got Y" messages.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		if isNull(n) {
			return "nothing"
		}
		return strconv.Quote(n.Value)
	}
	return "an unexpected YAML node"
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

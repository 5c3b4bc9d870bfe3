package policy

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// doc joins lines into a YAML document, so that line numbers in the expected
// messages can be read off the test case.
func doc(lines ...string) string { return strings.Join(lines, "\n") + "\n" }

// okListener is a valid listener, used where a case needs one to be valid
// apart from what it tests.
const okListener = "  - {name: ok, listen: 127.0.0.1:1, upstream: up:1}"

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name string
		yaml string
		want string // the whole error, one problem per line
	}{
		{
			name: "unknown top-level key",
			yaml: doc(
				"listeners:",
				okListener,
				"bogus: 1",
			),
			want: "bogus: unknown key (line 3)",
		},
		{
			name: "unknown key in a listener",
			yaml: doc(
				"listeners:",
				okListener,
				"  - name: b",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    write_bufer: {high_water_mark: 1MiB}",
			),
			want: "listeners[1].write_bufer: unknown key (line 6)",
		},
		{
			name: "unknown key nested under a listener's setting",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    keepalive:",
				"      idel: 5s",
			),
			want: "listeners[0].keepalive.idel: unknown key (line 6)",
		},
		{
			name: "low water mark above high in a listener",
			yaml: doc(
				"listeners:",
				okListener,
				"  - name: c",
				"    listen: 127.0.0.1:3",
				"    upstream: up:3",
				"    write_buffer: {high_water_mark: 16MiB, low_water_mark: 32MiB}",
			),
			want: "listeners[1].write_buffer.low_water_mark: 32MiB must be below high_water_mark (16MiB) (line 6)",
		},
		{
			name: "low water mark equal to high under defaults",
			yaml: doc(
				"defaults:",
				"  write_buffer:",
				"    high_water_mark: 8MiB",
				"listeners:",
				okListener,
			),
			want: "defaults.write_buffer.low_water_mark: 8MiB must be below high_water_mark (8MiB) (line 2)",
		},
		{
			name: "listener lowers high water mark below the inherited low",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    write_buffer: {high_water_mark: 4MiB}",
			),
			want: "listeners[0].write_buffer.high_water_mark: 4MiB must be above low_water_mark (8MiB, from defaults) (line 5)",
		},
		{
			name: "bad duration",
			yaml: doc(
				"defaults:",
				"  write_timeout: 10 seconds",
				"listeners:",
				okListener,
			),
			want: `defaults.write_timeout: invalid duration "10 seconds" (use a Go duration such as 10s or 500ms) (line 2)`,
		},
		{
			name: "duration without a unit",
			yaml: doc(
				"drain_timeout: 10",
				"listeners:",
				okListener,
			),
			want: `drain_timeout: invalid duration "10" (use a Go duration such as 10s or 500ms) (line 1)`,
		},
		{
			name: "bad size",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    write_buffer: {high_water_mark: 1.5MiB}",
			),
			want: `listeners[0].write_buffer.high_water_mark: invalid size "1.5MiB" (use an integer with B, KiB, MiB or GiB, such as 16MiB; Kubernetes' Ki, Mi and Gi are the same units) (line 5)`,
		},
		{
			name: "bad integer",
			yaml: doc(
				"defaults:",
				"  keepalive: {count: three}",
				"listeners:",
				okListener,
			),
			want: `defaults.keepalive.count: invalid integer "three" (line 2)`,
		},
		{
			name: "missing upstream",
			yaml: doc(
				"listeners:",
				okListener,
				"  - name: b",
				"    listen: 127.0.0.1:2",
			),
			want: "listeners[1].upstream: required (or transparent.match for a transparent listener, pool for a pool listener, or ingress.local for a mesh ingress) (line 3)",
		},
		{
			name: "upstream and transparent together",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:2, upstream: db:1, transparent: {match: [{cidr: 10.0.0.0/8}]}}",
			),
			want: "listeners[0].upstream: a listener has either upstream or transparent, not both (line 2)",
		},
		{
			name: "bad transparent match",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:2, transparent: {match: [{cidr: 10.0.0.0/33, ports: [8098, 70000]}]}}",
			),
			want: `listeners[0].transparent.match[0].cidr: "10.0.0.0/33" is not a CIDR such as 10.0.0.0/8 or fd00::/8 (line 2)` + "\n" +
				"listeners[0].transparent.match[0].ports[1]: 70000 is not a port (1-65535) (line 2)",
		},
		{
			name: "negative upstream mark",
			yaml: doc(
				"defaults: {upstream_mark: -1}",
				"listeners:",
				okListener,
			),
			want: "defaults.upstream_mark: -1 must not be negative (0: no mark) (line 1)",
		},
		{
			name: "upstream with port 0",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:2, upstream: db:0}",
			),
			want: `listeners[0].upstream: "db:0" is not a host:port address: port 0 is not a port to dial (line 2)`,
		},
		{
			name: "upstream without port",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:2, upstream: db}",
			),
			want: `listeners[0].upstream: "db" is not a host:port address: missing port in address (line 2)`,
		},
		{
			name: "missing name and listen",
			yaml: doc(
				"listeners:",
				"  - upstream: up:2",
			),
			want: "listeners[0].name: required (line 2)\n" +
				"listeners[0].listen: required (line 2)",
		},
		{
			name: "bad listener name",
			yaml: doc(
				"listeners:",
				"  - {name: pinot server, listen: 127.0.0.1:2, upstream: up:2}",
			),
			want: `listeners[0].name: "pinot server" may contain only letters, digits, '_', '.' and '-' (line 2)`,
		},
		{
			name: "duplicate listener name",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1}",
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2}",
				"  - {name: a, listen: 127.0.0.1:3, upstream: up:3}",
			),
			want: `listeners[2].name: duplicate listener name "a" (also listeners[0]) (line 4)`,
		},
		{
			name: "duplicate listen address after normalising",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: '[::1]:80', upstream: up:1}",
				"  - {name: b, listen: '[::1]:080', upstream: up:2}",
				"  - {name: c, listen: ':0', upstream: up:3}",
				"  - {name: d, listen: ':0', upstream: up:4}",
			),
			want: `listeners[1].listen: duplicate listen address "[::1]:080" (also listeners[0]) (line 3)`,
		},
		{
			name: "bad listen port",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: '127.0.0.1:http', upstream: up:1}",
			),
			want: `listeners[0].listen: "127.0.0.1:http" is not a host:port address: port "http" is not a number from 0 to 65535 (line 2)`,
		},
		{
			name: "bad admin address",
			yaml: doc(
				"admin:",
				"  listen: localhost",
				"listeners:",
				okListener,
			),
			want: `admin.listen: "localhost" is not a host:port address: missing port in address (leave it empty to disable the admin server) (line 2)`,
		},
		{
			name: "admin port out of range",
			yaml: doc(
				"admin: {listen: '127.0.0.1:65536'}",
				"listeners:",
				okListener,
			),
			want: `admin.listen: "127.0.0.1:65536" is not a host:port address: port "65536" is not a number from 0 to 65535 (leave it empty to disable the admin server) (line 1)`,
		},
		{
			name: "bad log level and format",
			yaml: doc(
				"log: {level: verbose, format: text}",
				"listeners:",
				okListener,
			),
			want: `log.level: "verbose" is not one of debug, info, warn, error (line 1)` + "\n" +
				`log.format: "text" is not one of json, console (line 1)`,
		},
		{
			name: "bad limits",
			yaml: doc(
				"limits: {memory: 128MiB, memory_budget: 128MiB, max_links: -1}",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:2, upstream: up:2, max_links: -3}",
			),
			want: "limits.max_links: -1 is negative: use 0 to derive it (line 1)\n" +
				"limits.memory_budget: 128MiB must be below limits.memory (128MiB): the runtime needs room beside the links' buffers (line 1)\n" +
				"listeners[0].max_links: -3 is negative: use 0 for no limit of its own (line 3)",
		},
		{
			name: "negative memory",
			yaml: doc(
				"limits: {memory: -1, memory_budget: -2}",
				"listeners:",
				okListener,
			),
			want: "limits.memory: -1 is negative: use 0 to derive it (line 1)\n" +
				"limits.memory_budget: -2 is negative: use 0 to derive it (line 1)",
		},
		{
			name: "negative procs",
			yaml: doc(
				"limits: {procs: -2}",
				"listeners:",
				okListener,
			),
			want: "limits.procs: -2 is negative: use 0 for the Go runtime's default, 1 for one thread (line 1)",
		},
		{
			name: "bad on_overflow",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    write_buffer:",
				"      on_overflow: drop",
			),
			want: `listeners[0].write_buffer.on_overflow: "drop" is not one of reject, backpressure (line 6)`,
		},
		{
			name: "keepalive interval and count",
			yaml: doc(
				"defaults:",
				"  keepalive: {interval: 0s, count: 0}",
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    keepalive: {count: -1}",
			),
			want: "defaults.keepalive.interval: 0s must be positive when idle (10s) is positive (line 2)\n" +
				"defaults.keepalive.count: 0 must be positive when idle (10s) is positive (line 2)\n" +
				"listeners[0].keepalive.count: -1 must not be negative (line 7)",
		},
		{
			name: "listener turns keepalive on without an interval",
			yaml: doc(
				"defaults:",
				"  keepalive: {idle: 0s, interval: 0s}",
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    keepalive: {idle: 5s}",
			),
			want: "listeners[0].keepalive.idle: 5s needs a positive interval (0s, from defaults) (line 7)",
		},
		{
			name: "inherited bad defaults are reported once",
			yaml: doc(
				"defaults:",
				"  write_buffer: {low_water_mark: 32MiB, on_overflow: drop}",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1}",
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2, write_timeout: 1s}",
				"  - {name: c, listen: 127.0.0.1:3, upstream: up:3, write_buffer: {on_overflow: drop}}",
			),
			want: "defaults.write_buffer.on_overflow: \"drop\" is not one of reject, backpressure (line 2)\n" +
				"defaults.write_buffer.low_water_mark: 32MiB must be below high_water_mark (16MiB) (line 2)\n" +
				"listeners[2].write_buffer.on_overflow: \"drop\" is not one of reject, backpressure (line 6)",
		},
		{
			name: "values the kernel refuses",
			yaml: doc(
				"defaults:",
				"  keepalive: {idle: 32768s, interval: 10h, count: 200}",
				"  tcp_user_timeout: 600h",
				"  upstream_mark: 4294967296",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1, keepalive: {count: 127, idle: 32767s, interval: 1s}}",
			),
			want: "defaults.keepalive.count: 200 is above the kernel's limit of 127 (TCP_KEEPCNT) (line 2)\n" +
				"defaults.keepalive.idle: 9h6m8s is above the kernel's limit of 9h6m7s (TCP_KEEPIDLE) (line 2)\n" +
				"defaults.keepalive.interval: 10h0m0s is above the kernel's limit of 9h6m7s (TCP_KEEPINTVL) (line 2)\n" +
				"defaults.tcp_user_timeout: 600h0m0s is above the kernel's limit of 596h31m23.647s (a C int of milliseconds) (line 3)\n" +
				"defaults.upstream_mark: 4294967296 does not fit in SO_MARK's 32 bits (line 4)",
		},
		{
			name: "length field headers that cannot be",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1, framing: {type: length_field, length_field_offset: 1000000000}}",
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2, framing: {type: length_field, length_field_offset: 10, max_frame_length: 12}}",
				"  - {name: c, listen: 127.0.0.1:3, upstream: up:3, framing: {length_adjustment: 3000000000, initial_bytes_to_strip: 3000000000}}",
			),
			want: "listeners[0].framing.length_field_offset: 1000000000 is above 65528: the length field must lie within the first 65536 bytes of a frame (line 2)\n" +
				"listeners[1].framing.length_field_offset: a frame's header (length_field_offset 10 + length_field_length 4) is longer than max_frame_length (12B) (line 3)\n" +
				"listeners[2].framing.initial_bytes_to_strip: 3000000000 is above 2147483647 (line 4)\n" +
				"listeners[2].framing.length_adjustment: 3000000000 is outside ±2147483647 (line 4)",
		},
		{
			name: "bad framing type",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    framing: {type: netty}",
			),
			want: `listeners[0].framing.type: "netty" is not one of none, length_field, kafka, pinot (line 5)`,
		},
		{
			name: "bad length field parameters",
			yaml: doc(
				"defaults:",
				"  framing:",
				"    type: length_field",
				"    length_field_offset: -1",
				"    length_field_length: 5",
				"    length_adjustment: -4",
				"    initial_bytes_to_strip: -2",
				"    byte_order: middle",
				"listeners:",
				okListener,
			),
			want: "defaults.framing.length_field_offset: -1 must not be negative (line 4)\n" +
				"defaults.framing.length_field_length: 5 is not one of 1, 2, 3, 4, 8 (line 5)\n" +
				"defaults.framing.initial_bytes_to_strip: -2 must not be negative (line 7)\n" +
				`defaults.framing.byte_order: "middle" is not one of big, little (line 8)`,
		},
		{
			name: "length field parameters are checked even without framing",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:2, upstream: up:2, framing: {length_field_length: 0}}",
			),
			want: "listeners[0].framing.length_field_length: 0 is not one of 1, 2, 3, 4, 8 (line 2)",
		},
		{
			name: "max frame length with length_field framing",
			yaml: doc(
				"defaults:",
				"  framing: {max_frame_length: 0}",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1, framing: {type: length_field}}",
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2}",
				"  - name: c",
				"    listen: 127.0.0.1:3",
				"    upstream: up:3",
				"    framing: {type: length_field, max_frame_length: -1}",
			),
			want: "listeners[0].framing.type: \"length_field\" needs a positive max_frame_length (0B, from defaults) (line 4)\n" +
				"listeners[2].framing.max_frame_length: -1B must be positive when type is length_field (line 9)",
		},
		{
			name: "listener zeroes max frame length under length_field defaults",
			yaml: doc(
				"defaults:",
				"  framing: {type: length_field}",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1, framing: {max_frame_length: 0}}",
			),
			want: "listeners[0].framing.max_frame_length: 0B must be positive when type is length_field, from defaults (line 4)",
		},
		{
			name: "bad detector values",
			yaml: doc(
				"defaults:",
				"  detector:",
				"    probe: ping",
				"    probe_timeout: 0",
				"    initial_delay: -1s",
				"    backoff_factor: 0.5",
				"    jitter: 1",
				"    http: {port: 65536}",
				"listeners:",
				okListener,
			),
			want: `defaults.detector.probe: "ping" is not one of auto, connect, http, kafka (line 3)` + "\n" +
				"defaults.detector.probe_timeout: 0s must be positive (line 4)\n" +
				"defaults.detector.initial_delay: -1s must be positive (line 5)\n" +
				"defaults.detector.backoff_factor: 0.5 must be at least 1 (1 probes at a fixed interval) (line 6)\n" +
				"defaults.detector.jitter: 1 must be at least 0 and below 1 (line 7)\n" +
				"defaults.detector.http.port: 65536 is not a port number from 0 to 65535 (0 probes the endpoint's own port) (line 8)",
		},
		{
			name: "negative jitter and port in a listener",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    detector: {jitter: -0.1, http: {port: -1}}",
			),
			want: "listeners[0].detector.jitter: -0.1 must be at least 0 and below 1 (line 5)\n" +
				"listeners[0].detector.http.port: -1 is not a port number from 0 to 65535 (0 probes the endpoint's own port) (line 5)",
		},
		{
			name: "max delay below initial delay",
			yaml: doc(
				"defaults:",
				"  detector: {max_delay: 500ms}",
				"listeners:",
				okListener,
			),
			want: "defaults.detector.max_delay: 500ms must not be below initial_delay (1s) (line 2)",
		},
		{
			name: "listener raises initial delay above the inherited max delay",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    detector: {initial_delay: 2m}",
				"  - name: b",
				"    listen: 127.0.0.1:3",
				"    upstream: up:3",
				"    detector: {max_delay: 0}",
			),
			want: "listeners[0].detector.initial_delay: 2m0s must not be above max_delay (1m0s, from defaults) (line 5)\n" +
				"listeners[1].detector.max_delay: 0s must not be below initial_delay (1s, from defaults) (line 9)",
		},
		{
			name: "http probe path",
			yaml: doc(
				"defaults:",
				"  detector: {probe: http, http: {path: health}}",
				"listeners:",
				okListener,
			),
			want: `defaults.detector.http.path: "health" must start with "/" when probe is http (line 2)`,
		},
		{
			name: "listener turns on the http probe with a bad inherited path",
			yaml: doc(
				"defaults:",
				"  detector: {http: {path: ''}}",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1, detector: {probe: http}}",
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2, detector: {http: {path: x}}}",
				"  - {name: c, listen: 127.0.0.1:3, upstream: up:3, detector: {probe: http, http: {path: /ok}}}",
			),
			want: `listeners[0].detector.probe: "http" needs an http.path starting with "/" ("", from defaults) (line 4)`,
		},
		{
			name: "bad on_excluded",
			yaml: doc(
				"defaults:",
				"  on_excluded: drop",
				"listeners:",
				okListener,
			),
			want: `defaults.on_excluded: "drop" is not one of refuse, allow (line 2)`,
		},
		{
			name: "bad numbers",
			yaml: doc(
				"defaults:",
				"  detector:",
				"    backoff_factor: fast",
				"    jitter: .nan",
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    detector: {backoff_factor: '2', jitter: .inf}",
				"  - name: b",
				"    listen: 127.0.0.1:3",
				"    upstream: up:3",
				"    detector: {backoff_factor: 1e400, jitter: [0.1]}",
			),
			want: `defaults.detector.backoff_factor: invalid number "fast" (use a finite number such as 0.2) (line 3)` + "\n" +
				`defaults.detector.jitter: invalid number ".nan" (use a finite number such as 0.2) (line 4)` + "\n" +
				`listeners[0].detector.backoff_factor: invalid number "2" (use a finite number such as 0.2) (line 9)` + "\n" +
				`listeners[0].detector.jitter: invalid number ".inf" (use a finite number such as 0.2) (line 9)` + "\n" +
				`listeners[1].detector.backoff_factor: invalid number "1e400" (use a finite number such as 0.2) (line 13)` + "\n" +
				"listeners[1].detector.jitter: expected a number, got a list (line 13)",
		},
		{
			name: "bad disabled endpoints",
			yaml: doc(
				"listeners:",
				okListener,
				"endpoints:",
				"  disabled:",
				"    - 10.1.2.3:8098",
				"    - 10.1.2.3",
				"    - 10.1.2.3:0",
				"    - 10.1.2.3:08098",
				"    - ':8098'",
				"    - 'db:http'",
				"    - '[::1]:8098'",
				"    - '[::1]:8098'",
			),
			want: `endpoints.disabled[1]: "10.1.2.3" is not a host:port address: missing port in address (line 6)` + "\n" +
				`endpoints.disabled[2]: "10.1.2.3:0" is not a host:port address: port 0 is not a port to dial (line 7)` + "\n" +
				`endpoints.disabled[3]: duplicate endpoint "10.1.2.3:08098" (also endpoints.disabled[0]) (line 8)` + "\n" +
				`endpoints.disabled[4]: ":8098" is not a host:port address: missing host (line 9)` + "\n" +
				`endpoints.disabled[5]: "db:http" is not a host:port address: port "http" is not a number from 0 to 65535 (line 10)` + "\n" +
				`endpoints.disabled[7]: duplicate endpoint "[::1]:8098" (also endpoints.disabled[6]) (line 12)`,
		},
		{
			name: "disabled endpoints that are not a list",
			yaml: doc(
				"listeners:",
				okListener,
				"endpoints: {disabled: 10.1.2.3:8098}",
			),
			want: `endpoints.disabled: expected a list, got "10.1.2.3:8098" (line 3)`,
		},
		{
			name: "new keys: inherited bad defaults are reported once",
			yaml: doc(
				"defaults:",
				"  framing: {type: length_field, max_frame_length: 0}",
				"  detector: {probe: http, http: {path: x}, jitter: 1}",
				"  on_excluded: drop",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1}",
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2, on_excluded: drop, detector: {probe_timeout: 2s}}",
				"  - name: c",
				"    listen: 127.0.0.1:3",
				"    upstream: up:3",
				"    framing: {max_frame_length: 1MiB}",
				"    detector: {http: {path: /ok}, jitter: 0}",
				"    on_excluded: allow",
			),
			want: "defaults.framing.max_frame_length: 0B must be positive when type is length_field (line 2)\n" +
				"defaults.detector.jitter: 1 must be at least 0 and below 1 (line 3)\n" +
				`defaults.detector.http.path: "x" must start with "/" when probe is http (line 3)` + "\n" +
				`defaults.on_excluded: "drop" is not one of refuse, allow (line 4)` + "\n" +
				`listeners[1].on_excluded: "drop" is not one of refuse, allow (line 7)`,
		},
		{
			name: "pool with upstream",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:2, upstream: db:1, pool: {endpoints: [db:1]}}",
			),
			want: "listeners[0].upstream: a listener has either upstream or pool, not both (line 2)",
		},
		{
			name: "pool with transparent",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    transparent: {match: [{cidr: 10.0.0.0/8}]}",
				"    pool: {dns: db:1}",
			),
			want: "listeners[0].transparent: a listener has either transparent or pool, not both (line 4)",
		},
		{
			name: "upstream, transparent and pool",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: db:1",
				"    transparent: {match: [{cidr: 10.0.0.0/8}]}",
				"    pool: {dns: db:1}",
			),
			want: "listeners[0].upstream: a listener has one of upstream, transparent, pool and ingress, not upstream, transparent, pool (line 4)",
		},
		{
			name: "mesh keys",
			yaml: doc(
				"defaults:",
				"  mesh: {ping_interval: 2s, ping_timeout: 2s, fallback: maybe, sessions: 0, stream_window: 64KiB}",
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: db:1",
				"    mesh: {port: 70000, write_timeout: 5s}",
			),
			want: "defaults.mesh.fallback: \"maybe\" is not one of direct, refuse (line 2)\n" +
				"defaults.mesh.sessions: 0 must be at least 1 (line 2)\n" +
				"defaults.mesh.ping_timeout: 2s must be above ping_interval (2s) (line 2)\n" +
				"defaults.mesh.write_timeout: 2s must be below ping_timeout (2s): a stuck write must not outlive the heartbeat (line 2)\n" +
				"defaults.mesh.stream_window: 64KiB is below yamux's minimum of 256KiB (line 2)\n" +
				"listeners[0].mesh.port: 70000 is not a port (1-65535, or 0 for no mesh) (line 7)\n" +
				"listeners[0].mesh.write_timeout: 5s must be below ping_timeout (2s, from defaults): a stuck write must not outlive the heartbeat (line 7)",
		},
		{
			name: "ingress",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 0.0.0.0:15008",
				"    ingress: {local: 127.0.0.1, ports: [0], check_interval: -1s}",
				"    mesh: {port: 15008}",
				"  - name: b",
				"    listen: 127.0.0.1:3",
				"    upstream: db:1",
				"    ingress: {local: 127.0.0.1:1}",
				"    transparent: {match: [{cidr: 10.0.0.0/8, mesh: {port: -1}}]}",
			),
			want: "listeners[0].ingress.local: \"127.0.0.1\" is not a host:port address: missing port in address (line 4)\n" +
				"listeners[0].ingress.ports[0]: 0 is not a port (1-65535) (line 4)\n" +
				"listeners[0].ingress.check_interval: -1s must be positive (line 4)\n" +
				"listeners[0].mesh.port: an ingress listener serves the mesh; it does not reach through one (mesh.port 15008) (line 5)\n" +
				"listeners[1].upstream: a listener has one of upstream, transparent, pool and ingress, not upstream, transparent, ingress (line 8)",
		},
		{
			name: "ingress limits, allow and mesh tls",
			yaml: doc(
				"defaults:",
				"  mesh: {tls: {cert_file: /c, key_file: /k}}",
				"listeners:",
				"  - name: a",
				"    listen: 0.0.0.0:17400",
				"    ingress: {local: 127.0.0.1:1, allow: [10.0.0.0/8, nope, 1.2.3.4], max_sessions_per_peer: -1, max_sessions: -3, max_streams: -2}",
				"  - name: b",
				"    listen: 127.0.0.1:3",
				"    upstream: db:1",
				"    mesh: {tls: {peers: [\"spiffe://x/y\", \"\"]}}",
			),
			want: "defaults.mesh.tls: cert_file, key_file and ca_file go together: all three or none (line 2)\n" +
				"listeners[0].ingress.allow[1]: \"nope\" is not an IP address or CIDR (line 6)\n" +
				"listeners[0].ingress.max_sessions_per_peer: -1 is negative (0: the default) (line 6)\n" +
				"listeners[0].ingress.max_sessions: -3 is negative (0: the default) (line 6)\n" +
				"listeners[0].ingress.max_streams: -2 is negative (0: the default) (line 6)\n" +
				"listeners[1].mesh.tls.peers[1]: \"\" is not an identity (a spiffe:// URI or a DNS name) (line 10)",
		},
		{
			name: "empty pools",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, pool: {}}",
				"  - {name: b, listen: 127.0.0.1:2, pool: {endpoints: [], balance: least_links}}",
				"  - {name: c, listen: 127.0.0.1:3, pool: }",
				"  - {name: d, listen: 127.0.0.1:4, pool: {dns: ''}}",
			),
			want: "listeners[0].pool: a pool needs endpoints (at least one) or dns (line 2)\n" +
				"listeners[1].pool.endpoints: a pool needs endpoints (at least one) or dns (line 3)\n" +
				"listeners[2].pool: a pool needs endpoints (at least one) or dns (line 4)\n" +
				"listeners[3].pool.dns: a pool needs endpoints (at least one) or dns (line 5)",
		},
		{
			name: "bad pool endpoints",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    pool:",
				"      endpoints:",
				"        - db",
				"        - db:0",
				"        - ':8098'",
				"        - 'db:http'",
				"        - '[fd00::1]:8098'",
			),
			want: `listeners[0].pool.endpoints[0]: "db" is not a host:port address: missing port in address (line 6)` + "\n" +
				`listeners[0].pool.endpoints[1]: "db:0" is not a host:port address: port 0 is not a port to dial (line 7)` + "\n" +
				`listeners[0].pool.endpoints[2]: ":8098" is not a host:port address: missing host (line 8)` + "\n" +
				`listeners[0].pool.endpoints[3]: "db:http" is not a host:port address: port "http" is not a number from 0 to 65535 (line 9)`,
		},
		{
			name: "duplicate pool endpoint after normalising",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    pool:",
				"      endpoints: [a:80, b:80, a:080, '[::1]:9092', '[::1]:09092']",
				"  - {name: b, listen: 127.0.0.1:3, pool: {endpoints: [a:80]}}",
			),
			want: `listeners[0].pool.endpoints[2]: duplicate endpoint "a:080" (also listeners[0].pool.endpoints[0]) (line 5)` + "\n" +
				`listeners[0].pool.endpoints[4]: duplicate endpoint "[::1]:09092" (also listeners[0].pool.endpoints[3]) (line 5)`,
		},
		{
			name: "dns with endpoints",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    pool:",
				"      endpoints: [kafka-0:9092]",
				"      dns: kafka-headless:9092",
			),
			want: "listeners[0].pool.dns: a pool has either endpoints or dns, not both (line 6)",
		},
		{
			name: "bad dns",
			yaml: doc(
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, pool: {dns: pinot-server-headless}}",
				"  - {name: b, listen: 127.0.0.1:2, pool: {dns: 'pinot-server-headless:0'}}",
			),
			want: `listeners[0].pool.dns: "pinot-server-headless" is not a host:port address: missing port in address (line 2)` + "\n" +
				`listeners[1].pool.dns: "pinot-server-headless:0" is not a host:port address: port 0 is not a port to dial (line 3)`,
		},
		{
			name: "bad balance and refresh",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    pool:",
				"      dns: db:1",
				"      refresh: 0",
				"      balance: random",
				"  - {name: b, listen: 127.0.0.1:3, pool: {dns: db:1, refresh: -1s}}",
			),
			want: "listeners[0].pool.refresh: 0s must be positive (line 6)\n" +
				`listeners[0].pool.balance: "random" is not one of round_robin, least_links (line 7)` + "\n" +
				"listeners[1].pool.refresh: -1s must be positive (line 8)",
		},
		{
			name: "pool keys of the wrong kind",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    pool:",
				"      endpoints: db:1",
				"      fail_open: yes",
				"      refresh: 5",
				"      balnce: round_robin",
			),
			want: `listeners[0].pool.endpoints: expected a list, got "db:1" (line 5)` + "\n" +
				`listeners[0].pool.fail_open: invalid boolean "yes" (use true or false) (line 6)` + "\n" +
				`listeners[0].pool.refresh: invalid duration "5" (use a Go duration such as 10s or 500ms) (line 7)` + "\n" +
				"listeners[0].pool.balnce: unknown key (line 8)",
		},
		{
			name: "connect_attempts 0",
			yaml: doc(
				"defaults:",
				"  connect_attempts: 0",
				"listeners:",
				okListener,
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2, connect_attempts: -1}",
				"  - {name: c, listen: 127.0.0.1:3, upstream: up:3, connect_attempts: 1}",
			),
			want: "defaults.connect_attempts: 0 must be at least 1 (1: no retry) (line 2)\n" +
				"listeners[1].connect_attempts: -1 must be at least 1 (1: no retry) (line 5)",
		},
		{
			name: "max_destinations 0 and forget_excluded_after 0",
			yaml: doc(
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    transparent:",
				"      match: [{cidr: 10.0.0.0/8}]",
				"      max_destinations: 0",
				"      forget_excluded_after: 0",
				"      group_fail_open: 1",
			),
			want: "listeners[0].transparent.max_destinations: 0 must be at least 1 (line 6)\n" +
				"listeners[0].transparent.forget_excluded_after: 0s must be positive (line 7)\n" +
				`listeners[0].transparent.group_fail_open: invalid boolean "1" (use true or false) (line 8)`,
		},
		{
			name: "scalar where a mapping is expected",
			yaml: doc(
				"admin: 127.0.0.1:9901",
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
				"    keepalive: 5s",
			),
			want: "admin: expected a mapping, got \"127.0.0.1:9901\" (line 1)\n" +
				"listeners[0].keepalive: expected a mapping, got \"5s\" (line 6)",
		},
		{
			name: "mapping where a list or scalar is expected",
			yaml: doc(
				"log:",
				"  level: [debug]",
				"listeners:",
				"  name: a",
			),
			want: "log.level: expected a string, got a list (line 2)\n" +
				"listeners: expected a list of listeners, got a mapping (line 4)",
		},
		{
			name: "listener that is not a mapping",
			yaml: doc(
				"listeners:",
				"  - 127.0.0.1:1",
			),
			want: `listeners[0]: expected a mapping, got "127.0.0.1:1" (line 2)`,
		},
		{
			name: "key without a value",
			yaml: doc(
				"defaults:",
				"  write_timeout:",
				"listeners:",
				okListener,
			),
			want: "defaults.write_timeout: missing value (expected a duration; leave the key out to use the default) (line 2)",
		},
		{
			name: "duplicate key",
			yaml: doc(
				"log:",
				"  level: debug",
				"  level: info",
				"listeners:",
				okListener,
			),
			want: "log.level: duplicate key (first at line 2) (line 3)",
		},
		{
			name: "merge key",
			yaml: doc(
				"listeners:",
				"  - <<: {write_timeout: 1s}",
				"    name: a",
				"    listen: 127.0.0.1:2",
				"    upstream: up:2",
			),
			want: "listeners[0].<<: merge keys (<<) are not supported; listeners inherit defaults instead (line 2)",
		},
		{
			name: "document that is not a mapping",
			yaml: "- a\n- b\n",
			want: "the configuration must be a mapping, got a list (line 1)",
		},
		{
			name: "two documents",
			yaml: doc("listeners:", okListener, "---", "log: {level: debug}"),
			want: "a second YAML document; the configuration is one document (line 4)",
		},
		{
			name: "YAML syntax error",
			yaml: doc("listeners: [", "log: {"),
			want: "invalid YAML: did not find expected node content (line 1)", // the [ never closed
		},
		{
			name: "several errors at once, in source order",
			yaml: doc(
				"admin: {listen: nope}",
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:1",
				"    upstream: up:1",
				"    write_timeout: soon",
				"    write_buffer: {high_water_mark: 1MiB, low_water_mark: 2MiB}",
				"  - name: a",
				"    listen: 127.0.0.1:1",
				"    extra: true",
				"defaults:",
				"  connect_timeout: 1 second",
				"  keepalive: {count: -2}",
			),
			want: "admin.listen: \"nope\" is not a host:port address: missing port in address (leave it empty to disable the admin server) (line 1)\n" +
				"listeners[0].write_timeout: invalid duration \"soon\" (use a Go duration such as 10s or 500ms) (line 6)\n" +
				"listeners[0].write_buffer.low_water_mark: 2MiB must be below high_water_mark (1MiB) (line 7)\n" +
				"listeners[1].name: duplicate listener name \"a\" (also listeners[0]) (line 8)\n" +
				"listeners[1].upstream: required (or transparent.match for a transparent listener, pool for a pool listener, or ingress.local for a mesh ingress) (line 8)\n" +
				"listeners[1].listen: duplicate listen address \"127.0.0.1:1\" (also listeners[0]) (line 9)\n" +
				"listeners[1].extra: unknown key (line 10)\n" +
				"defaults.connect_timeout: invalid duration \"1 second\" (use a Go duration such as 10s or 500ms) (line 12)\n" +
				"defaults.keepalive.count: -2 must not be negative (line 13)",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("Parse succeeded; want error:\n%s", tc.want)
			}
			if got := err.Error(); got != tc.want {
				t.Fatalf("Parse error:\n%s\nwant:\n%s", got, tc.want)
			}
			var errs Errors
			if !errors.As(err, &errs) || len(errs) != strings.Count(tc.want, "\n")+1 {
				t.Fatalf("Parse error is %T with %d problems; want Errors with one per line", err, len(errs))
			}
			for _, e := range errs {
				if _, ok := e.(*KeyError); !ok {
					t.Errorf("problem %q is %T, want *KeyError", e, e)
				}
			}
		})
	}
}

func mustParse(t *testing.T, yaml string) Config {
	t.Helper()
	c, err := Parse([]byte(yaml))
	if err != nil {
		t.Fatalf("Parse:\n%v", err)
	}
	return c
}

func TestEmptyDocumentIsAllDefaults(t *testing.T) {
	for _, in := range []string{"", "\n", "# nothing here\n", "~\n", "null\n", "---\n", "{}\n", "listeners:\n", "listeners: []\n"} {
		c, err := Parse([]byte(in))
		if !reflect.DeepEqual(c, DefaultConfig()) {
			t.Errorf("Parse(%q) config = %+v, want DefaultConfig() %+v", in, c, DefaultConfig())
		}
		want := "listeners: at least one listener is required"
		if strings.HasPrefix(in, "listeners") {
			want += " (line 1)"
		}
		if err == nil || err.Error() != want {
			t.Errorf("Parse(%q) error = %v, want %q", in, err, want)
		}
	}
}

func TestListenerInheritsDefaults(t *testing.T) {
	c := mustParse(t, doc("listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}"))
	if want := DefaultSettings(); c.Listeners[0].Settings != want || c.Defaults != want {
		t.Fatalf("listener settings = %+v, defaults = %+v; want both %+v", c.Listeners[0].Settings, c.Defaults, want)
	}

	// Decoded defaults reach the listeners, wherever defaults appears.
	c = mustParse(t, doc(
		"listeners:",
		"  - {name: a, listen: 127.0.0.1:1, upstream: up:1}",
		"defaults:",
		"  write_timeout: 2s",
		"  write_buffer: {on_overflow: backpressure}",
	))
	want := DefaultSettings()
	want.WriteTimeout = Duration(2 * time.Second)
	want.WriteBuffer.OnOverflow = OverflowBackpressure
	if c.Defaults != want || c.Listeners[0].Settings != want {
		t.Fatalf("defaults = %+v, listener = %+v; want both %+v", c.Defaults, c.Listeners[0].Settings, want)
	}
}

func TestNestedOverlay(t *testing.T) {
	c := mustParse(t, doc(
		"defaults:",
		"  keepalive: {idle: 5s}",
		"listeners:",
		"  - {name: a, listen: 127.0.0.1:1, upstream: up:1, keepalive: {count: 7}}",
	))
	want := Keepalive{Idle: Duration(5 * time.Second), Interval: DefaultSettings().Keepalive.Interval, Count: DefaultSettings().Keepalive.Count}
	if c.Defaults.Keepalive != want {
		t.Errorf("defaults.keepalive = %+v, want %+v", c.Defaults.Keepalive, want)
	}
	want.Count = 7
	if c.Listeners[0].Keepalive != want {
		t.Errorf("listeners[0].keepalive = %+v, want %+v", c.Listeners[0].Keepalive, want)
	}
	// An empty nested mapping changes nothing.
	c = mustParse(t, doc("defaults: {keepalive: {}, write_buffer: }", "listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}"))
	if c.Defaults != DefaultSettings() {
		t.Errorf("defaults = %+v, want %+v", c.Defaults, DefaultSettings())
	}
}

func TestListenerOverrideDoesNotLeak(t *testing.T) {
	c := mustParse(t, doc(
		"defaults:",
		"  connect_timeout: 3s",
		"listeners:",
		"  - name: a",
		"    listen: 127.0.0.1:1",
		"    upstream: up:1",
		"    write_timeout: 1s",
		"    keepalive: {count: 9}",
		"    write_buffer: {high_water_mark: 64KiB, low_water_mark: 0}",
		"  - {name: b, listen: 127.0.0.1:2, upstream: up:2}",
	))
	defaults := DefaultSettings()
	defaults.ConnectTimeout = Duration(3 * time.Second)
	a := defaults
	a.WriteTimeout = Duration(time.Second)
	a.Keepalive.Count = 9
	a.WriteBuffer.HighWaterMark, a.WriteBuffer.LowWaterMark = 64*KiB, 0
	if c.Listeners[0].Settings != a {
		t.Errorf("listeners[0] = %+v, want %+v", c.Listeners[0].Settings, a)
	}
	if c.Listeners[1].Settings != defaults {
		t.Errorf("listeners[1] = %+v, want the defaults %+v", c.Listeners[1].Settings, defaults)
	}
	if c.Defaults != defaults {
		t.Errorf("defaults = %+v, want %+v", c.Defaults, defaults)
	}
}

func TestNewKeyDefaults(t *testing.T) {
	c := mustParse(t, doc("listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}"))
	for _, s := range []Settings{c.Defaults, c.Listeners[0].Settings} {
		wantFraming := Framing{Type: "none", LengthFieldOffset: 0, LengthFieldLength: 4, LengthAdjustment: 0,
			InitialBytesToStrip: 0, ByteOrder: "big", MaxFrameLength: 256 << 20}
		if s.Framing != wantFraming {
			t.Errorf("framing = %+v, want %+v", s.Framing, wantFraming)
		}
		wantUnanswered := Unanswered{Track: "auto", RequestTimeout: Duration(3 * time.Second), ConsecutiveTimeoutsThreshold: 1}
		if s.Unanswered != wantUnanswered {
			t.Errorf("unanswered = %+v, want %+v", s.Unanswered, wantUnanswered)
		}
		// auto: on for the protocol profiles only.
		for framing, want := range map[string]bool{"none": false, "length_field": false, "kafka": true, "pinot": true} {
			if got := s.Unanswered.Enabled(framing); got != want {
				t.Errorf("unanswered enabled for framing %s = %v, want %v", framing, got, want)
			}
		}
		wantDetector := Detector{Probe: "auto", ProbeTimeout: Duration(time.Second), InitialDelay: Duration(time.Second),
			BackoffFactor: 2, MaxDelay: Duration(time.Minute), Jitter: 0.2, HTTP: ProbeHTTP{Port: 0, Path: "/health"}}
		if s.Detector != wantDetector {
			t.Errorf("detector = %+v, want %+v", s.Detector, wantDetector)
		}
		if s.OnExcluded != "refuse" {
			t.Errorf("on_excluded = %q, want refuse", s.OnExcluded)
		}
	}
	if c.Endpoints.Disabled != nil {
		t.Errorf("endpoints.disabled = %q, want none", c.Endpoints.Disabled)
	}

	// length_field with only the type set is Pinot's and Kafka's transport:
	// a 4-byte big-endian length prefix counting the bytes after it.
	c = mustParse(t, doc("defaults: {framing: {type: length_field}}", "listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}"))
	want := Framing{Type: FramingLengthField, LengthFieldLength: 4, ByteOrder: ByteOrderBig, MaxFrameLength: 256 * MiB}
	if c.Defaults.Framing != want || c.Listeners[0].Framing != want {
		t.Errorf("framing = %+v, listener %+v; want both %+v", c.Defaults.Framing, c.Listeners[0].Framing, want)
	}
}

// limits.procs is 1 when the config says nothing, and what it says
// otherwise, 0 included (the Go runtime's default), also after a round
// trip through Effective.
func TestLimitsProcs(t *testing.T) {
	for _, tc := range []struct {
		limits string
		want   int
	}{{"", 1}, {"limits: {max_links: 9}", 1}, {"limits: {procs: 0}", 0}, {"limits: {procs: 4}", 4}} {
		c := mustParse(t, doc(tc.limits, "listeners:", okListener))
		if c.Limits.Procs != tc.want {
			t.Errorf("%q: limits.procs %d, want %d", tc.limits, c.Limits.Procs, tc.want)
		}
		out, err := c.Effective()
		if err != nil {
			t.Fatal(err)
		}
		if back := mustParse(t, string(out)); back.Limits.Procs != tc.want {
			t.Errorf("%q: limits.procs %d after Effective, want %d:\n%s", tc.limits, back.Limits.Procs, tc.want, out)
		}
	}
}

func TestNewKeysOverlayPerListener(t *testing.T) {
	c := mustParse(t, doc(
		"defaults:",
		"  framing: {type: length_field, max_frame_length: 64MiB}",
		"  detector: {probe: http, max_delay: 30s, http: {path: /ready}}",
		"  unanswered: {request_timeout: 0}",
		"listeners:",
		"  - name: a",
		"    listen: 127.0.0.1:1",
		"    upstream: up:1",
		"    framing: {length_field_offset: 2, length_field_length: 2, length_adjustment: -4, initial_bytes_to_strip: 4, byte_order: little}",
		"    detector: {backoff_factor: 1.5, jitter: 0, initial_delay: 500ms, http: {port: 8080}}",
		"    unanswered: {consecutive_timeouts_threshold: -1}",
		"    on_excluded: allow",
		"  - {name: b, listen: 127.0.0.1:2, upstream: up:2, framing: {type: none}, detector: {backoff_factor: 1}}",
		"endpoints:",
		"  disabled: ['10.1.2.3:8098', '[fd00::1]:8098', 'pinot-server-1.pinot-server-headless:8098']",
	))
	defaults := DefaultSettings()
	defaults.Framing.Type = FramingLengthField
	defaults.Framing.MaxFrameLength = 64 * MiB
	defaults.Detector.Probe = ProbeKindHTTP
	defaults.Detector.MaxDelay = Duration(30 * time.Second)
	defaults.Detector.HTTP.Path = "/ready"
	defaults.Unanswered.RequestTimeout = 0
	if c.Defaults != defaults {
		t.Errorf("defaults = %+v, want %+v", c.Defaults, defaults)
	}
	if c.Defaults.Unanswered.Enabled(FramingKafka) {
		t.Error("defaults.unanswered with request_timeout 0 is enabled")
	}

	a := defaults
	a.Framing = Framing{Type: FramingLengthField, LengthFieldOffset: 2, LengthFieldLength: 2, LengthAdjustment: -4,
		InitialBytesToStrip: 4, ByteOrder: ByteOrderLittle, MaxFrameLength: 64 * MiB}
	a.Detector.BackoffFactor = 1.5
	a.Detector.Jitter = 0
	a.Detector.InitialDelay = Duration(500 * time.Millisecond)
	a.Detector.HTTP = ProbeHTTP{Port: 8080, Path: "/ready"}
	a.Unanswered.ConsecutiveTimeoutsThreshold = -1
	a.OnExcluded = OnExcludedAllow
	if c.Listeners[0].Settings != a {
		t.Errorf("listeners[0] = %+v, want %+v", c.Listeners[0].Settings, a)
	}

	b := defaults
	b.Framing.Type = FramingNone
	b.Detector.BackoffFactor = 1
	if c.Listeners[1].Settings != b {
		t.Errorf("listeners[1] = %+v, want %+v", c.Listeners[1].Settings, b)
	}

	wantDisabled := []string{"10.1.2.3:8098", "[fd00::1]:8098", "pinot-server-1.pinot-server-headless:8098"}
	if !reflect.DeepEqual(c.Endpoints.Disabled, wantDisabled) {
		t.Errorf("endpoints.disabled = %q, want %q", c.Endpoints.Disabled, wantDisabled)
	}
}

func TestNumbers(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want float64
	}{
		{"2", 2}, {"1.5", 1.5}, {"1e1", 10}, {"1.0", 1}, {"0x2", 2},
	} {
		c := mustParse(t, doc("defaults: {detector: {backoff_factor: "+tc.in+"}}",
			"listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}"))
		if got := c.Defaults.Detector.BackoffFactor; got != tc.want {
			t.Errorf("backoff_factor: %s decoded to %v, want %v", tc.in, got, tc.want)
		}
	}
	for _, in := range []string{"two", "'2'", "true", ".nan", "-.inf", "1e999", "2s"} {
		_, err := Parse([]byte(doc("defaults: {detector: {backoff_factor: "+in+"}}",
			"listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}")))
		if err == nil || !strings.HasPrefix(err.Error(), "defaults.detector.backoff_factor: invalid number") {
			t.Errorf("backoff_factor: %s: error %v, want an invalid number", in, err)
		}
	}
}

func TestSizes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Size
	}{
		{"16MiB", 16 << 20}, {"64KiB", 64 << 10}, {"1GiB", 1 << 30}, {"512B", 512},
		{"1024", 1024}, {"0", 0}, {"'8MiB'", 8 << 20},
		// Kubernetes' spelling of the same binary units.
		{"16Mi", 16 << 20}, {"64Ki", 64 << 10}, {"1Gi", 1 << 30},
	} {
		c := mustParse(t, doc("defaults: {write_buffer: {high_water_mark: "+tc.in+", low_water_mark: 0}}",
			"listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}"))
		if got := c.Defaults.WriteBuffer.HighWaterMark; got != tc.want {
			t.Errorf("high_water_mark: %s decoded to %d, want %d", tc.in, got, tc.want)
		}
	}
	// 16M and 1G are decimal in Kubernetes (10^6, 10^9): not taken for
	// binary units; 16mi is no unit.
	for _, in := range []string{"1.5MiB", "16MB", "16 mib", "MiB", "ten", "true", "9999999999GiB", "16M", "1G", "16mi", "Mi", "1.5Gi"} {
		if s, err := ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) = %v, want an error", in, s)
		}
		_, err := Parse([]byte(doc("defaults: {write_buffer: {high_water_mark: " + in + "}}")))
		if err == nil || !strings.Contains(err.Error(), "defaults.write_buffer.high_water_mark: invalid size") {
			t.Errorf("high_water_mark: %s: error %v, want an invalid size", in, err)
		}
	}
}

func TestDurations(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration
	}{
		{"10s", 10 * time.Second}, {"500ms", 500 * time.Millisecond}, {"1m30s", 90 * time.Second},
		{"0", 0}, {"'0'", 0},
	} {
		c := mustParse(t, doc("drain_timeout: "+tc.in, "listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}"))
		if got := c.DrainTimeout.D(); got != tc.want {
			t.Errorf("drain_timeout: %s decoded to %v, want %v", tc.in, got, tc.want)
		}
	}
	for _, in := range []string{"10", "1.5", "10 seconds", "'10'", "true", "1d"} {
		_, err := Parse([]byte(doc("drain_timeout: "+in, "listeners:", "  - {name: a, listen: 127.0.0.1:1, upstream: up:1}")))
		if err == nil || !strings.HasPrefix(err.Error(), "drain_timeout: invalid duration") {
			t.Errorf("drain_timeout: %s: error %v, want an invalid duration", in, err)
		}
	}
}

// designExample is the example ConfigMap from the design, with explicit
// listeners only (pools and transparent listeners: poolExample): a
// defaults section that restates the defaults (but probe: connect, where
// the default is auto), a length_field listener, a listener overriding
// on_overflow, and an operator-disabled endpoint.
const designExample = `
admin:
  listen: 127.0.0.1:9901          # /metrics /healthz /readyz /v1/endpoints
log: {level: info, format: json}  # json | console
defaults:                         # any key here may be overridden per listener
  connect_timeout: 2s
  write_timeout: 10s
  tcp_user_timeout: 10s
  keepalive: {idle: 10s, interval: 5s, count: 3}
  write_buffer: {high_water_mark: 16MiB, low_water_mark: 8MiB, on_overflow: backpressure}  # or reject
  half_close_timeout: 30s
  framing: {type: none}           # or length_field: see below
  unanswered: {request_timeout: 3s, consecutive_timeouts_threshold: 5}
  detector: {probe: connect, probe_timeout: 1s, initial_delay: 1s, backoff_factor: 2, max_delay: 60s}
  on_excluded: refuse             # refuse new links to an excluded endpoint | allow
listeners:
  - name: pinot-server-0          # explicit: one listener, one upstream
    listen: 127.0.0.1:18098
    upstream: pinot-server-0.pinot-server-headless:8098
    framing: {type: length_field, length_field_offset: 0, length_field_length: 4,
              length_adjustment: 0, initial_bytes_to_strip: 0, byte_order: big,
              max_frame_length: 256MiB}
  - name: kafka
    listen: 127.0.0.1:19092
    upstream: kafka-headless.data.svc:9092
    write_buffer: {on_overflow: reject}
endpoints:
  disabled: [10.1.2.3:8098]       # operator-disabled: never routed to, not even fail-open
`

func TestDesignExample(t *testing.T) {
	c := mustParse(t, designExample)
	want := DefaultConfig()
	want.Defaults.Detector.Probe = ProbeKindConnect
	want.Defaults.Unanswered.ConsecutiveTimeoutsThreshold = 5 // DESIGN.md's starting value; the default is 1 now
	want.Listeners = []Listener{
		{Name: "pinot-server-0", Listen: "127.0.0.1:18098", Upstream: "pinot-server-0.pinot-server-headless:8098", Settings: want.Defaults},
		{Name: "kafka", Listen: "127.0.0.1:19092", Upstream: "kafka-headless.data.svc:9092", Settings: want.Defaults},
	}
	want.Listeners[0].Framing.Type = FramingLengthField
	want.Listeners[1].WriteBuffer.OnOverflow = OverflowReject
	want.Endpoints.Disabled = []string{"10.1.2.3:8098"}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("config:\n%+v\nwant:\n%+v", c, want)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte(designExample), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil || len(c.Listeners) != 2 {
		t.Fatalf("Load = %d listeners, %v; want 2, nil", len(c.Listeners), err)
	}
	if err := os.WriteFile(path, []byte("listeners: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path); err == nil || err.Error() != "listeners: at least one listener is required (line 1)" {
		t.Fatalf("Load of a config without listeners: %v", err)
	}
	if _, err := Load(filepath.Join(dir, "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Load of a missing file: %v, want os.ErrNotExist", err)
	}
}

// TestValidateBuiltConfig covers Validate on a Config built in code, where no
// source lines are known and a listener owns the settings that differ from
// the defaults.
func TestValidateBuiltConfig(t *testing.T) {
	c := DefaultConfig()
	c.Listeners = []Listener{{Name: "a", Listen: "127.0.0.1:1", Upstream: "up:1", Settings: c.Defaults}}
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate of a valid config: %v", err)
	}

	c.Defaults.WriteBuffer.LowWaterMark = 32 * MiB
	c.Listeners[0].Settings = c.Defaults // inherits the bad default
	c.Listeners = append(c.Listeners, Listener{Name: "b", Listen: "127.0.0.1:2", Upstream: "up:2", Settings: c.Defaults})
	c.Listeners[1].WriteBuffer.HighWaterMark = 24 * MiB // sets one key of the bad pair
	c.Listeners = append(c.Listeners, Listener{Name: "c", Listen: "127.0.0.1:3", Upstream: "up:3", Settings: c.Defaults})
	c.Listeners[2].WriteBuffer.HighWaterMark = 64 * MiB // fixes it
	want := "defaults.write_buffer.low_water_mark: 32MiB must be below high_water_mark (16MiB)\n" +
		"listeners[1].write_buffer.high_water_mark: 24MiB must be above low_water_mark (32MiB, from defaults)"
	if err := c.Validate(); err == nil || err.Error() != want {
		t.Fatalf("Validate:\n%v\nwant:\n%s", err, want)
	}

	// A listener built without settings has none of the defaults' values:
	// each zero value that is not valid is reported, once, under the listener.
	c = DefaultConfig()
	c.Admin.Listen = "" // empty disables the admin server
	c.Listeners = []Listener{{Name: "a", Listen: "127.0.0.1:1", Upstream: "up:1"}}
	want = `listeners[0].write_buffer.on_overflow: "" is not one of reject, backpressure` + "\n" +
		`listeners[0].framing.type: "" is not one of none, length_field, kafka, pinot` + "\n" +
		"listeners[0].framing.length_field_length: 0 is not one of 1, 2, 3, 4, 8\n" +
		`listeners[0].framing.byte_order: "" is not one of big, little` + "\n" +
		`listeners[0].detector.probe: "" is not one of auto, connect, http, kafka` + "\n" +
		"listeners[0].detector.probe_timeout: 0s must be positive\n" +
		"listeners[0].detector.initial_delay: 0s must be positive\n" +
		"listeners[0].detector.backoff_factor: 0 must be at least 1 (1 probes at a fixed interval)\n" +
		`listeners[0].unanswered.track: "" is not one of auto, on, off` + "\n" +
		`listeners[0].on_excluded: "" is not one of refuse, allow` + "\n" +
		"listeners[0].connect_attempts: 0 must be at least 1 (1: no retry)"
	if err := c.Validate(); err == nil || err.Error() != want {
		t.Fatalf("Validate:\n%v\nwant:\n%s", err, want)
	}

	// The new keys follow the same rule: inherited problems are reported
	// under defaults only; a listener that sets one key of a bad pair is
	// reported under that key.
	c = DefaultConfig()
	c.Defaults.Framing.Type = FramingLengthField
	c.Defaults.Framing.MaxFrameLength = 0
	c.Defaults.Detector.Jitter = 1.5
	c.Defaults.OnExcluded = "drop"
	c.Endpoints.Disabled = []string{"10.1.2.3:8098", "10.1.2.3:8098"}
	c.Listeners = []Listener{{Name: "a", Listen: "127.0.0.1:1", Upstream: "up:1", Settings: c.Defaults}}
	c.Listeners = append(c.Listeners, Listener{Name: "b", Listen: "127.0.0.1:2", Upstream: "up:2", Settings: c.Defaults})
	c.Listeners[1].Detector.InitialDelay = Duration(2 * time.Minute)
	c.Listeners[1].Detector.Probe = ProbeKindHTTP
	c.Listeners[1].Detector.HTTP.Path = "health"
	want = "defaults.framing.max_frame_length: 0B must be positive when type is length_field\n" +
		"defaults.detector.jitter: 1.5 must be at least 0 and below 1\n" +
		`defaults.on_excluded: "drop" is not one of refuse, allow` + "\n" +
		"listeners[1].detector.initial_delay: 2m0s must not be above max_delay (1m0s, from defaults)\n" +
		`listeners[1].detector.http.path: "health" must start with "/" when probe is http` + "\n" +
		`endpoints.disabled[1]: duplicate endpoint "10.1.2.3:8098" (also endpoints.disabled[0])`
	if err := c.Validate(); err == nil || err.Error() != want {
		t.Fatalf("Validate:\n%v\nwant:\n%s", err, want)
	}
}

func TestKeyErrorFormat(t *testing.T) {
	for _, tc := range []struct {
		err  KeyError
		want string
	}{
		{KeyError{Path: "a.b", Line: 3, Msg: "bad"}, "a.b: bad (line 3)"},
		{KeyError{Path: "a.b", Msg: "bad"}, "a.b: bad"},
		{KeyError{Msg: "bad"}, "bad"},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("%#v.Error() = %q, want %q", tc.err, got, tc.want)
		}
	}
	err := error(Errors{&KeyError{Path: "x", Msg: "one"}, &KeyError{Path: "y", Line: 2, Msg: "two"}})
	if got, want := err.Error(), "x: one\ny: two (line 2)"; got != want {
		t.Errorf("Errors.Error() = %q, want %q", got, want)
	}
	var ke *KeyError
	if !errors.As(err, &ke) || ke.Path != "x" {
		t.Errorf("errors.As(Errors, *KeyError) = %v", ke)
	}
}

// TestDecoderSupportsEveryField fails when a field is added to Config whose
// type the decoder cannot decode (it would panic on that key).
func TestDecoderSupportsEveryField(t *testing.T) {
	var check func(t reflect.Type, path string)
	check = func(typ reflect.Type, path string) {
		switch {
		case typ == durationType || typ == sizeType:
		case typ.Kind() == reflect.Struct:
			for key, index := range fieldsOf(typ) {
				check(typ.FieldByIndex(index).Type, join(path, key))
			}
		case typ.Kind() == reflect.Slice:
			check(typ.Elem(), path+"[]")
		case !supported(typ):
			t.Errorf("%s: decode.go cannot decode %s", path, typ)
		}
	}
	check(reflect.TypeFor[Config](), "")
	if !supported(reflect.TypeFor[Config]()) {
		t.Error("supported(Config) = false")
	}
}

// poolExample has every pool and transparent key, and connect_attempts at
// both levels.
const poolExample = `
defaults:
  connect_attempts: 2
listeners:
  - name: pinot-servers                # a pool of named replicas
    listen: 127.0.0.1:18098
    pool:
      endpoints: [pinot-server-0.pinot-server-headless:8098, pinot-server-1.pinot-server-headless:8098, 10.1.2.3:8098]
      refresh: 10s
      balance: least_links
      fail_open: true
  - name: kafka                        # every record of a headless Service
    listen: 127.0.0.1:19092
    pool: {dns: kafka-headless.data.svc:9092}
    connect_attempts: 1
  - name: out
    listen: 127.0.0.1:15001
    transparent:
      match: [{cidr: 10.0.0.0/8, ports: [8098]}]
      group_fail_open: true
      max_destinations: 512
      forget_excluded_after: 30m
  - name: explicit
    listen: 127.0.0.1:18099
    upstream: pinot-server-0.pinot-server-headless:8098
`

func TestPoolExample(t *testing.T) {
	c := mustParse(t, poolExample)
	want := DefaultConfig()
	want.Defaults.ConnectAttempts = 2
	want.Listeners = []Listener{
		{Name: "pinot-servers", Listen: "127.0.0.1:18098", Settings: want.Defaults, Pool: Pool{
			Endpoints: []string{"pinot-server-0.pinot-server-headless:8098", "pinot-server-1.pinot-server-headless:8098", "10.1.2.3:8098"},
			Refresh:   Duration(10 * time.Second), Balance: BalanceLeastLinks, FailOpen: true}},
		{Name: "kafka", Listen: "127.0.0.1:19092", Settings: want.Defaults, Pool: Pool{
			DNS: "kafka-headless.data.svc:9092", Refresh: Duration(5 * time.Second), Balance: BalanceRoundRobin}},
		{Name: "out", Listen: "127.0.0.1:15001", Settings: want.Defaults, Transparent: Transparent{
			Match: []Match{{CIDR: "10.0.0.0/8", Ports: []int{8098}}}, GroupFailOpen: true, MaxDestinations: 512,
			ForgetExcludedAfter: Duration(30 * time.Minute)}},
		{Name: "explicit", Listen: "127.0.0.1:18099", Upstream: "pinot-server-0.pinot-server-headless:8098", Settings: want.Defaults},
	}
	want.Listeners[1].ConnectAttempts = 1
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("config:\n%+v\nwant:\n%+v", c, want)
	}
	for i, kind := range []string{"pool", "pool", "transparent", "explicit"} {
		l := c.Listeners[i]
		if l.IsPool() != (kind == "pool") || l.IsTransparent() != (kind == "transparent") {
			t.Errorf("listeners[%d] (%s): IsPool %v, IsTransparent %v", i, kind, l.IsPool(), l.IsTransparent())
		}
	}
	if err := c.Validate(); err != nil {
		t.Errorf("Validate of a parsed config: %v", err)
	}
}

// A pool or transparent section starts from its defaults; a listener
// without one keeps it zero; connect_attempts overlays like every setting.
func TestPoolDefaults(t *testing.T) {
	c := mustParse(t, doc(
		"listeners:",
		"  - {name: a, listen: 127.0.0.1:1, pool: {endpoints: ['db:080']}}",
		"  - {name: b, listen: 127.0.0.1:2, transparent: {match: [{cidr: 10.0.0.0/8}]}}",
		"  - {name: c, listen: 127.0.0.1:3, upstream: up:3}",
	))
	if got, want := c.Defaults.ConnectAttempts, 3; got != want {
		t.Errorf("defaults.connect_attempts = %d, want %d", got, want)
	}
	for i, l := range c.Listeners {
		if l.Settings != DefaultSettings() {
			t.Errorf("listeners[%d] settings = %+v, want the defaults", i, l.Settings)
		}
	}
	wantPool := DefaultPool()
	wantPool.Endpoints = []string{"db:080"} // kept as written; the proxy normalises
	if !reflect.DeepEqual(c.Listeners[0].Pool, wantPool) || wantPool.Refresh != Duration(5*time.Second) ||
		wantPool.Balance != BalanceRoundRobin || wantPool.FailOpen {
		t.Errorf("pool = %+v, want %+v (refresh 5s, round_robin, fail_open off)", c.Listeners[0].Pool, wantPool)
	}
	wantT := DefaultTransparent()
	wantT.Match = []Match{{CIDR: "10.0.0.0/8"}}
	if !reflect.DeepEqual(c.Listeners[1].Transparent, wantT) || wantT.MaxDestinations != 4096 ||
		wantT.ForgetExcludedAfter != Duration(10*time.Minute) || wantT.GroupFailOpen {
		t.Errorf("transparent = %+v, want %+v (4096, 10m, group_fail_open off)", c.Listeners[1].Transparent, wantT)
	}
	if !reflect.ValueOf(c.Listeners[2].Pool).IsZero() || !reflect.ValueOf(c.Listeners[2].Transparent).IsZero() ||
		!reflect.ValueOf(c.Listeners[0].Transparent).IsZero() || !reflect.ValueOf(c.Listeners[1].Pool).IsZero() {
		t.Errorf("a listener without a pool or transparent section has one: %+v", c.Listeners)
	}
	if c.Listeners[2].IsPool() || c.Listeners[2].IsTransparent() {
		t.Errorf("explicit listener: IsPool %v, IsTransparent %v", c.Listeners[2].IsPool(), c.Listeners[2].IsTransparent())
	}

	// connect_attempts under defaults reaches every listener; a listener's
	// own value does not leak.
	c = mustParse(t, doc(
		"listeners:",
		"  - {name: a, listen: 127.0.0.1:1, pool: {dns: db:1}, connect_attempts: 1}",
		"  - {name: b, listen: 127.0.0.1:2, pool: {dns: db:2}}",
		"defaults: {connect_attempts: 5}",
	))
	if got := []int{c.Defaults.ConnectAttempts, c.Listeners[0].ConnectAttempts, c.Listeners[1].ConnectAttempts}; !reflect.DeepEqual(got, []int{5, 1, 5}) {
		t.Errorf("connect_attempts defaults, a, b = %v, want [5 1 5]", got)
	}
}

// The flags change with a reload (each config is parsed afresh), and
// deleting one reverts it to its default.
func TestPoolKeysRevertWhenDeleted(t *testing.T) {
	set := mustParse(t, doc(
		"defaults: {connect_attempts: 5}",
		"listeners:",
		"  - name: a",
		"    listen: 127.0.0.1:1",
		"    pool: {dns: db:1, refresh: 1s, balance: least_links, fail_open: true}",
		"    connect_attempts: 2",
		"  - name: b",
		"    listen: 127.0.0.1:2",
		"    transparent: {match: [{cidr: 10.0.0.0/8}], group_fail_open: true, max_destinations: 8, forget_excluded_after: 1m}",
	))
	if p := set.Listeners[0].Pool; !p.FailOpen || p.Balance != BalanceLeastLinks || p.Refresh != Duration(time.Second) ||
		set.Listeners[0].ConnectAttempts != 2 || !set.Listeners[1].Transparent.GroupFailOpen {
		t.Fatalf("set: %+v", set.Listeners)
	}
	deleted := mustParse(t, doc(
		"listeners:",
		"  - {name: a, listen: 127.0.0.1:1, pool: {dns: db:1}}",
		"  - {name: b, listen: 127.0.0.1:2, transparent: {match: [{cidr: 10.0.0.0/8}]}}",
	))
	wantPool := DefaultPool()
	wantPool.DNS = "db:1"
	wantT := DefaultTransparent()
	wantT.Match = []Match{{CIDR: "10.0.0.0/8"}}
	if !reflect.DeepEqual(deleted.Listeners[0].Pool, wantPool) || !reflect.DeepEqual(deleted.Listeners[1].Transparent, wantT) ||
		deleted.Listeners[0].ConnectAttempts != 3 || deleted.Defaults.ConnectAttempts != 3 {
		t.Errorf("after deleting the keys: %+v; want the defaults", deleted.Listeners)
	}
}

// TestValidateBuiltPool covers pool and transparent listeners built in
// code: a zero refresh, balance, max_destinations or forget_excluded_after
// is not set and means its default (as DefaultPool and DefaultTransparent
// spell out); a value that is set is checked.
func TestValidateBuiltPool(t *testing.T) {
	c := DefaultConfig()
	tr := DefaultTransparent()
	tr.Match = []Match{{CIDR: "10.0.0.0/8"}}
	c.Listeners = []Listener{
		{Name: "a", Listen: "127.0.0.1:1", Pool: Pool{Endpoints: []string{"a:80", "b:80"}}, Settings: c.Defaults},
		{Name: "b", Listen: "127.0.0.1:2", Pool: Pool{DNS: "db:1", Balance: BalanceLeastLinks, FailOpen: true}, Settings: c.Defaults},
		{Name: "c", Listen: "127.0.0.1:3", Transparent: Transparent{Match: tr.Match}, Settings: c.Defaults},
		{Name: "d", Listen: "127.0.0.1:4", Transparent: tr, Settings: c.Defaults},
	}
	c.Listeners[0].Pool = DefaultPool()
	c.Listeners[0].Pool.Endpoints = []string{"a:80", "b:80"}
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate of a valid config: %v", err)
	}
	c.Listeners[0].Pool = Pool{Endpoints: []string{"a:80"}} // zero refresh and balance: the defaults
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate of a pool with zero refresh and balance: %v", err)
	}

	c.Listeners = []Listener{
		{Name: "a", Listen: "127.0.0.1:1", Pool: Pool{Endpoints: []string{"a:80", "a:080"}, Refresh: Duration(-time.Second), Balance: "random"},
			Settings: c.Defaults},
		{Name: "b", Listen: "127.0.0.1:2", Transparent: Transparent{Match: tr.Match, MaxDestinations: -1, ForgetExcludedAfter: -1},
			Settings: c.Defaults},
		{Name: "c", Listen: "127.0.0.1:3", Pool: Pool{FailOpen: true}, Settings: c.Defaults},
		{Name: "d", Listen: "127.0.0.1:4", Upstream: "up:4", Pool: DefaultPool(), Settings: c.Defaults},
	}
	c.Listeners[1].ConnectAttempts = 0
	want := `listeners[0].pool.endpoints[1]: duplicate endpoint "a:080" (also listeners[0].pool.endpoints[0])` + "\n" +
		"listeners[0].pool.refresh: -1s must be positive\n" +
		`listeners[0].pool.balance: "random" is not one of round_robin, least_links` + "\n" +
		"listeners[1].transparent.max_destinations: -1 must be at least 1\n" +
		"listeners[1].transparent.forget_excluded_after: -1ns must be positive\n" +
		"listeners[1].connect_attempts: 0 must be at least 1 (1: no retry)\n" +
		"listeners[2].pool: a pool needs endpoints (at least one) or dns\n" +
		"listeners[3].upstream: a listener has either upstream or pool, not both"
	if err := c.Validate(); err == nil || err.Error() != want {
		t.Fatalf("Validate:\n%v\nwant:\n%s", err, want)
	}
}

// The configuration in force is shown as YAML (GET /v1/config): it reads
// back, through the strict decoder, as the very same configuration, every
// default filled in, durations and sizes in the config's own spelling.
func TestConfigMarshalsBack(t *testing.T) {
	for _, name := range []string{"minimal.yaml", "pinot-broker.yaml", "kafka-client.yaml"} {
		c, err := Load(filepath.Join("..", "examples", name))
		if err != nil {
			t.Fatal(err)
		}
		out, err := c.Effective()
		if err != nil {
			t.Fatal(err)
		}
		back, err := Parse(out)
		if err != nil {
			t.Fatalf("%s: the marshalled config does not parse: %v\n%s", name, err, out)
		}
		if len(back.Endpoints.Disabled) == 0 && c.Endpoints.Disabled == nil {
			back.Endpoints.Disabled = nil // [] and absent are the same list
		}
		if !reflect.DeepEqual(back, c) {
			t.Fatalf("%s: marshalled and parsed again:\n%+v\nwant:\n%+v\n%s", name, back, c, out)
		}
		for _, want := range []string{"drain_timeout: 15s", "high_water_mark: 16MiB", "shutdown_grace: 10s"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("%s: marshalled config lacks %q:\n%s", name, want, out)
			}
		}
	}
}

// GET /v1/config shows an ingress listener's defaults filled in (a 0 there
// reads as "no limit"), and the output parses back to the same limits.
func TestEffectiveFillsIngressDefaults(t *testing.T) {
	c := mustParse(t, doc("listeners:", "  - {name: in, listen: 127.0.0.1:17400, ingress: {local: 127.0.0.1:8098, max_streams: 50}}"))
	out, err := c.Effective()
	if err != nil {
		t.Fatal(err)
	}
	want := Ingress{Local: "127.0.0.1:8098", Ports: []int{}, Allow: []string{}, CheckInterval: DefaultCheckInterval, MaxSessionsPerPeer: DefaultMaxSessionsPerPeer,
		MaxSessions: DefaultMaxSessions, MaxStreamsPerSession: DefaultMaxStreamsPerSession, MaxStreams: 50}
	if got := mustParse(t, string(out)).Listeners[0].Ingress; !reflect.DeepEqual(got, want) {
		t.Fatalf("ingress after Effective %+v, want %+v:\n%s", got, want, out)
	}
	if c.Listeners[0].Ingress.MaxStreamsPerSession != 0 {
		t.Fatal("Effective changed the config it was called on")
	}
}

package pinotwire_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/apache/thrift/lib/go/thrift"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
)

// thriftRequestID reads p with apache/thrift's TCompactProtocol as an
// InstanceRequest whose field 1 (i64) comes first and field 2 (a struct)
// second, skipping everything else. ok: the library read the whole struct.
func thriftRequestID(p []byte) (id int64, ok bool) {
	ctx := context.Background()
	tp := thrift.NewTCompactProtocolConf(thrift.NewStreamTransportR(bytes.NewReader(p)), nil)
	if _, err := tp.ReadStructBegin(ctx); err != nil {
		return 0, false
	}
	_, typ, fid, err := tp.ReadFieldBegin(ctx)
	if err != nil || typ != thrift.I64 || fid != 1 {
		return 0, false
	}
	if id, err = tp.ReadI64(ctx); err != nil {
		return 0, false
	}
	_, typ, fid, err = tp.ReadFieldBegin(ctx)
	if err != nil || typ != thrift.STRUCT || fid != 2 {
		return 0, false
	}
	if thrift.Skip(ctx, tp, thrift.STRUCT, thrift.DEFAULT_RECURSION_DEPTH-1) != nil {
		return 0, false
	}
	for {
		_, typ, _, err := tp.ReadFieldBegin(ctx)
		if err != nil {
			return 0, false
		}
		if typ == thrift.STOP {
			return id, true
		}
		if thrift.Skip(ctx, tp, typ, thrift.DEFAULT_RECURSION_DEPTH-1) != nil {
			return 0, false
		}
	}
}

// structural reports an error about what an InstanceRequest must be or
// about the depth bound (both readers bound it, at slightly different
// levels), rather than about the compact encoding.
func structural(err error) bool {
	s := err.Error()
	return strings.Contains(s, "does not start") || strings.Contains(s, "does not follow") ||
		strings.Contains(s, "empty") || strings.Contains(s, "nested")
}

func requestSeeds(f *testing.F) {
	now := time.Unix(1_800_000_000, 0)
	for _, r := range []pinotsim.Request{
		{ID: 1234567890000000001, Table: "t_OFFLINE", TimeoutMs: 2500, Segments: []string{"s0", "s1"}, BrokerID: "b", CID: "c"},
		{ID: -1, Table: "t", Trace: true},
		{ID: 5, Table: "t_REALTIME", TimeoutMs: 1, SentAt: now, Deadline: now.Add(time.Second),
			Segments: pinotsim.SegmentsFor("t", 600)},
	} {
		f.Add(pinotsim.AppendRequest(nil, &r))
	}
	for _, name := range []string{"out of order fields", "legacy only", "legacy and query", "legacy fallback",
		"debug options only", "options without timeout"} {
		f.Add(thriftCases()[name].bytes(f))
	}
	f.Add([]byte{})
	f.Add([]byte{0x16})
	f.Add([]byte{0x16, 2, 0x1c, 0x0c, 0x22, 0xbb, 1, 0x88, 9, 't', 'i', 'm', 'e', 'o', 'u', 't', 'M', 's', 2, '4', '2', 0, 0, 0})
	f.Add([]byte{0x16, 2, 0x1c, 0xeb, 1, 0x88, 9, 't', 'i', 'm', 'e', 'o', 'u', 't', 'M', 's', 1, '7', 0, 0})
	f.Add(req(1, 0x19, 0xf7, 0xff, 0xff, 0xff, 0xff, 0x07))
	f.Add(req(1, cat(bytes.Repeat([]byte{0x1c}, 66), bytes.Repeat([]byte{0}, 66))...))
}

// FuzzParseRequest: ParseRequest never panics; it asks only for more than
// it has and at most MaxRequestPrefix; whatever prefix it starts from,
// following its needs gives the whole payload's answer; with the whole
// payload it never asks for more; and it agrees with apache/thrift on
// which payloads are well-formed and on their requestId.
func FuzzParseRequest(f *testing.F) {
	requestSeeds(f)
	f.Fuzz(func(t *testing.T, p []byte) {
		checkRequestPrefixes(t, p)
		r, _, err := pinotwire.ParseRequest(p, true)
		if (err == nil || err == pinotwire.ErrTooLong) && p[0] != 0x16 {
			t.Fatalf("answered %+v, %v for a payload starting %x", r, err, p[:min(len(p), 12)])
		}
		if r.Timeout < 0 || (!r.HasTimeout && r.Timeout != 0) || (err != nil && r.HasTimeout) {
			t.Fatalf("inconsistent %+v, %v", r, err)
		}
		if err != nil && err != pinotwire.ErrTooLong && !errors.Is(err, pinotwire.ErrNotRequest) {
			t.Fatalf("unexpected error %v", err)
		}
		// Where apache/thrift reads the payload as an InstanceRequest with
		// field 1 then field 2 (and it starts 0x16, as Pinot's do), ParseRequest
		// answers with the same id, unless the answer lies beyond its limit
		// or nesting hits its depth bound (both readers bound it, at levels a
		// little apart). So it rejects no encoding the library accepts; and as
		// this holds for every payload, any encoding error it reports is one
		// the library reports too.
		if id, ok := thriftRequestID(p); ok && p[0] == 0x16 {
			if err == pinotwire.ErrTooLong || (err != nil && structural(err)) {
				return
			}
			if err != nil || r.ID != id {
				t.Fatalf("thrift reads id %d, ParseRequest %+v, %v", id, r, err)
			}
		}
	})
}

// refResponseID walks a whole metadata section the simple way, as
// DataTableImplV4.deserializeMetadata reads it: ok false where the Java
// reader would fail (runs off the end, negative string length).
func refResponseID(m []byte) (id int64, found, ok bool) {
	if len(m) < 4 {
		return 0, false, false
	}
	if binary.BigEndian.Uint32(m) == 0 {
		return 0, false, true
	}
	if len(m) < 8 {
		return 0, false, false
	}
	n := int32(binary.BigEndian.Uint32(m[4:]))
	rest := m[8:]
	for range max(n, 0) {
		if len(rest) < 4 {
			return 0, false, false
		}
		key := int32(binary.BigEndian.Uint32(rest))
		rest = rest[4:]
		var size int
		switch pinotwire.MetadataKeyType(key) {
		case pinotwire.MetadataLong:
			if key == pinotwire.KeyRequestID && len(rest) >= 8 {
				return int64(binary.BigEndian.Uint64(rest)), true, true
			}
			size = 8
		case pinotwire.MetadataInt:
			size = 4
		case pinotwire.MetadataBoolean:
			size = 1
		case pinotwire.MetadataString:
			if len(rest) < 4 {
				return 0, false, false
			}
			l := int32(binary.BigEndian.Uint32(rest))
			if l < 0 {
				return 0, false, false
			}
			rest, size = rest[4:], int(l)
		default:
			return 0, false, true
		}
		if len(rest) < size {
			return 0, false, false
		}
		rest = rest[size:]
	}
	return 0, false, true
}

// FuzzResponseID: ResponseID never panics, follows the need protocol as
// ParseRequest does, and agrees with the simple reference on sections
// within MaxMetadataPrefix; MetadataOffset never panics and what it
// returns is within the limits it promises.
func FuzzResponseID(f *testing.F) {
	for _, es := range [][]pinotsim.Metadata{entries(1234567890000000001), withIDAt(entries(-3), 0), manyEntries(30)} {
		p, err := pinotsim.AppendDataTable(nil, es)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(p)
		f.Add(metadata(f, p))
	}
	f.Add(raw(2, ent(45, 1, 2, 3, 4), ent(14, long(5)...)))
	f.Add(raw(2, ent(0, int4(-1)...), ent(14, long(5)...)))
	f.Add(cat4(int4(0), int4(1), ent(14, long(5)...)))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, m []byte) {
		if off, err := pinotwire.MetadataOffset(m); err == nil {
			if off < pinotwire.ResponseHeaderLen || off > 1<<31-1-4 || len(m) < pinotwire.ResponseHeaderLen ||
				binary.BigEndian.Uint32(m) != 4 {
				t.Fatalf("MetadataOffset = %d for %x", off, m[:min(len(m), 52)])
			}
			if off <= int64(len(m)) {
				checkIDPrefixes(t, m[off:])
			}
		} else if !errors.Is(err, pinotwire.ErrNotDataTable) || off != 0 {
			t.Fatalf("MetadataOffset: %d, %v", off, err)
		}
		got := checkIDPrefixes(t, m)
		if len(m) > pinotwire.MaxMetadataPrefix {
			return
		}
		id, found, ok := refResponseID(m)
		switch {
		case !ok:
			if !errors.Is(got.err, pinotwire.ErrNotDataTable) {
				t.Fatalf("reference fails, ResponseID = %+v", got)
			}
		case got != (idResult{id, found, nil}):
			t.Fatalf("ResponseID = %+v, reference %d, %v", got, id, found)
		}
	})
}

package kafkawire

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// FuzzParseRequest checks, on any input, that ParseRequest
//   - does not panic;
//   - returns need == 0 or need in (len(b), MaxPrefix], with a zero Request
//     and no error when need > 0, and never asks for more when complete;
//   - follows the incremental protocol: starting from any prefix and feeding
//     a prefix of at least need bytes, it reaches the answer the whole input
//     gives (or, if need runs past the input, the whole input with
//     complete=true is an error), and every longer prefix gives that same
//     answer;
//   - returns a coherent Request.
func FuzzParseRequest(f *testing.F) {
	// Seeds: requests kmsg encodes, for every key at its lowest and
	// highest version and at the versions where the parsed layouts
	// change.
	cid := kmsg.StringPtr("seed-client")
	for k := int16(0); k <= maxKmsgKey; k++ {
		proto := kmsg.RequestForKey(k)
		if proto == nil {
			continue
		}
		for v := int16(0); v <= proto.MaxVersion(); v++ {
			if v != 0 && v != proto.MaxVersion() && k != keyProduce && k != keyFetch && k != keyJoinGroup &&
				k != keyInitProducerID && k != keyAddPartitionsToTxn {
				continue
			}
			for _, c := range bodyCases(k, v) {
				f.Add(encode(f, c.req, cid, int32(k)<<16|int32(v)), uint32(v))
			}
		}
	}
	f.Add(payload(1, 15, 1, clientID, []byte{2, 0, 3, 'a', 'b', 'c', 5, 0}, i32(500)), uint32(12))
	f.Add(payload(1, 15, 1, clientID, []byte{2, 5, 0, 0, 0}, i32(500)), uint32(0))
	f.Add(payload(0, 9, 1, clientID, noTags, []byte{0x81, 0x80, 0x80, 0x80, 0x80, 0x00}), uint32(20))
	f.Add(payload(0, 14, 1), uint32(3))
	f.Add([]byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01}, uint32(2))

	f.Fuzz(func(t *testing.T, data []byte, cut uint32) {
		full, fneed, ferr := ParseRequest(data, true)
		if fneed != 0 {
			t.Fatalf("complete: need %d", fneed)
		}
		checkShape(t, full, ferr)
		if r, need, err := ParseRequest(data, false); need == 0 && (r != full || err != ferr) {
			t.Fatalf("whole input, not complete: %+v, %v; complete: %+v, %v", r, err, full, ferr)
		}

		k := int(cut % uint32(len(data)+1))
		if r, need, err := ParseRequest(data[:k], true); need != 0 {
			t.Fatalf("complete %d bytes: need %d (%+v, %v)", k, need, r, err)
		}
		b := data[:k]
		for {
			r, need, err := ParseRequest(b, false)
			if need != 0 {
				if err != nil || r != (Request{}) {
					t.Fatalf("%d bytes: need %d with %+v, %v", len(b), need, r, err)
				}
				if need <= len(b) || need > MaxPrefix {
					t.Fatalf("%d bytes: need %d", len(b), need)
				}
				if need > len(data) {
					// Every successful parse reads at least need
					// bytes, so the whole input cannot succeed. It
					// may fail on a field past len(b) before it runs
					// out of bytes, hence either error.
					if ferr != ErrNotKafka && ferr != ErrTooLong {
						t.Fatalf("%d bytes need %d of %d, but complete gave %+v, %v", len(b), need, len(data), full, ferr)
					}
					return
				}
				// Feed exactly need bytes, or (depending on cut) more.
				if cut&1 != 0 {
					need += (len(data) - need) / 2
				}
				b = data[:need]
				continue
			}
			checkShape(t, r, err)
			if r != full || err != ferr {
				t.Fatalf("decided at %d bytes: %+v, %v; whole input: %+v, %v", len(b), r, err, full, ferr)
			}
			for _, n := range []int{len(b), (len(b) + len(data)) / 2, len(data)} {
				for _, complete := range []bool{false, true} {
					r2, need2, err2 := ParseRequest(data[:n], complete)
					if r2 != r || need2 != 0 || err2 != err {
						t.Fatalf("decided at %d bytes as %+v, %v; %d bytes (complete=%v): %+v, %d, %v", len(b), r, err, n, complete, r2, need2, err2)
					}
				}
			}
			return
		}
	})
}

// checkShape checks that a decided result is coherent.
func checkShape(t *testing.T, r Request, err error) {
	t.Helper()
	switch err {
	case nil:
	case ErrUnknownVersion:
		if r.APIKey != keyProduce || r.APIVersion <= apis[keyProduce].maxVersion ||
			r.NoResponse || r.Hold != 0 || r.HoldUnknown || r.RebalanceTimeout != 0 || r.SASLRaw ||
			r.TxnTimeout != 0 || r.TxnBound || r.TxnID != 0 {
			t.Fatalf("ErrUnknownVersion with %+v", r)
		}
		return
	case ErrNotKafka, ErrTooLong:
		if r != (Request{}) {
			t.Fatalf("%v with %+v", err, r)
		}
		return
	default:
		t.Fatalf("unexpected error %v", err)
	}
	if r.APIKey < 0 || r.APIVersion < 0 {
		t.Fatalf("negative key or version: %+v", r)
	}
	if r.Hold < 0 || r.RebalanceTimeout < 0 || r.TxnTimeout < 0 {
		t.Fatalf("negative duration: %+v", r)
	}
	if r.NoResponse && (r.APIKey != keyProduce || r.Hold != 0) {
		t.Fatalf("NoResponse: %+v", r)
	}
	if r.HoldUnknown && (r.Hold != 0 || r.NoResponse) {
		t.Fatalf("HoldUnknown: %+v", r)
	}
	if r.APIKey == keyJoinGroup && !r.HoldUnknown && r.Hold != GroupHold(r.RebalanceTimeout) || r.RebalanceTimeout != 0 && r.APIKey != keyJoinGroup {
		t.Fatalf("RebalanceTimeout: %+v", r)
	}
	if r.TxnTimeout != 0 && (r.APIKey != keyInitProducerID || r.Hold < max(r.TxnTimeout, transactionMaxTimeout)) {
		t.Fatalf("TxnTimeout: %+v", r)
	}
	if r.TxnBound && (r.Hold != transactionMaxTimeout ||
		r.APIKey != keyAddOffsetsToTxn && r.APIKey != keyEndTxn && (r.APIKey != keyAddPartitionsToTxn || r.APIVersion >= 4)) {
		t.Fatalf("TxnBound: %+v", r)
	}
	if r.TxnID != 0 && r.TxnTimeout == 0 && !r.TxnBound {
		t.Fatalf("TxnID without TxnTimeout or TxnBound: %+v", r)
	}
	if r.SASLRaw && (r.APIKey != keySaslHandshake || r.APIVersion != 0) {
		t.Fatalf("SASLRaw: %+v", r)
	}
}

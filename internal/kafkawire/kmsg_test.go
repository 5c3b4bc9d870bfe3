package kafkawire

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// These tests encode requests with franz-go's kmsg, the way franz-go's client
// writes them (kmsg.RequestFormatter.AppendRequest writes the size, the
// request header and then the body with the request's AppendTo), and check
// what ParseRequest reads back.

// maxKmsgKey is above the highest key kmsg v1.15.1 knows (94), so the loops
// below notice if a kmsg upgrade adds keys.
const maxKmsgKey = 100

// TestAPITableMatchesKmsg checks the hard-coded api table against kmsg: the
// same set of keys, the same highest version, and for every version the same
// answer to "is it flexible".
func TestAPITableMatchesKmsg(t *testing.T) {
	for k := int16(0); k <= maxKmsgKey; k++ {
		req := kmsg.RequestForKey(k)
		a, ok := lookup(k)
		if req == nil {
			if ok {
				t.Errorf("key %d: in the table but unknown to kmsg", k)
			}
			continue
		}
		if !ok {
			t.Errorf("key %d (%T): known to kmsg but not in the table", k, req)
			continue
		}
		if a.maxVersion != req.MaxVersion() {
			t.Errorf("key %d (%T): table max version %d, kmsg %d", k, req, a.maxVersion, req.MaxVersion())
		}
		for v := int16(0); v <= req.MaxVersion(); v++ {
			req.SetVersion(v)
			hv, ok := requestHeaderVersion(k, v)
			if !ok {
				t.Fatalf("key %d v%d: no header version", k, v)
			}
			if got, want := hv == 2, req.IsFlexible(); got != want {
				t.Errorf("key %d (%T) v%d: header v%d, kmsg IsFlexible %v", k, req, v, hv, want)
			}
			if hv == 0 && !(k == keyControlledShutdown && v == 0) {
				t.Errorf("key %d v%d: header v0", k, v)
			}
		}
	}
	if _, ok := requestHeaderVersion(int16(len(apis)), 0); ok {
		t.Errorf("key %d: header version for an unknown key", len(apis))
	}
	if hv, _ := requestHeaderVersion(keyControlledShutdown, 0); hv != 0 {
		t.Errorf("ControlledShutdown v0: header v%d, want 0", hv)
	}
}

// encode returns the payload (the bytes after the 4-byte size) of req as
// franz-go's client writes it, with client_id clientID (nil = null).
func encode(t testing.TB, req kmsg.Request, clientID *string, corr int32) []byte {
	t.Helper()
	if req.Key() == keyControlledShutdown && req.GetVersion() == 0 {
		// franz-go's formatter returns after the header for this one
		// request (ControlledShutdown v0, header v0, is broker-internal
		// and franz-go never sends it), leaving the size and the body
		// unwritten. Write header v0 and the body here.
		p := binary.BigEndian.AppendUint16(nil, uint16(req.Key()))
		p = binary.BigEndian.AppendUint16(p, uint16(req.GetVersion()))
		p = binary.BigEndian.AppendUint32(p, uint32(corr))
		return req.AppendTo(p)
	}
	f := &kmsg.RequestFormatter{}
	if clientID != nil {
		f = kmsg.NewRequestFormatter(kmsg.FormatterClientID(*clientID))
	}
	frame := f.AppendRequest(nil, req, corr)
	if size := int(binary.BigEndian.Uint32(frame)); size != len(frame)-4 {
		t.Fatalf("frame size %d, payload %d bytes", size, len(frame)-4)
	}
	return frame[4:]
}

// headerLen is the request header length of req as the test models it
// independently of the parser: 8 fixed bytes, then (unless header v0)
// client_id as INT16 length + bytes, then (flexible) an empty tagged-field
// section, one 0 byte, which is what franz-go and the Java client write.
func headerLen(req kmsg.Request, clientID *string) int {
	if req.Key() == 7 && req.GetVersion() == 0 {
		return 8
	}
	n := 10
	if clientID != nil {
		n += len(*clientID)
	}
	if req.IsFlexible() {
		n++
	}
	return n
}

// uvarintLen is the size of x as an UNSIGNED_VARINT.
func uvarintLen(x int) int {
	n := 1
	for x >= 0x80 {
		x >>= 7
		n++
	}
	return n
}

// stringLen is the encoded size of a (nullable) string field.
func stringLen(s *string, compact bool) int {
	switch {
	case compact && s == nil:
		return 1
	case compact:
		return uvarintLen(len(*s)+1) + len(*s)
	case s == nil:
		return 2
	default:
		return 2 + len(*s)
	}
}

func ms(v int32) time.Duration {
	if v < 0 {
		return 0
	}
	return time.Duration(v) * time.Millisecond
}

// kcase is one request built with kmsg, the Request ParseRequest must return
// for it, and end, the number of payload bytes that decide it.
type kcase struct {
	name string
	req  kmsg.Request
	want Request
	// bodyEnd is how many body bytes are read (the header is added later).
	bodyEnd int
}

var (
	strNull  *string
	strEmpty = kmsg.StringPtr("")
)

// bodyCases returns the requests to test for key k at version v: several
// distinctive fillings for the APIs whose body is read, the kmsg default for
// the others. want holds only the body-derived fields.
func bodyCases(k, v int16) []kcase {
	newReq := func() kmsg.Request {
		r := kmsg.RequestForKey(k)
		r.SetVersion(v)
		return r
	}
	var cs []kcase
	switch k {
	case keyProduce:
		txn300 := kmsg.StringPtr(strings.Repeat("t", 300))
		for _, acks := range []int16{0, 1, -1} {
			for _, timeout := range []int32{30_000 + int32(v), 0, -5, 1<<31 - 1} {
				for _, txn := range []*string{strNull, strEmpty, txn300} {
					req := newReq().(*kmsg.ProduceRequest)
					req.Acks = acks
					req.TimeoutMillis = timeout
					req.TransactionID = txn
					topic := kmsg.NewProduceRequestTopic()
					topic.Topic = "events"
					part := kmsg.NewProduceRequestTopicPartition()
					part.Records = []byte("not really a record batch")
					topic.Partitions = append(topic.Partitions, part)
					req.Topics = append(req.Topics, topic)
					var want Request
					if acks == 0 {
						want.NoResponse = true
					} else {
						want.Hold = ms(timeout)
					}
					end := 6
					if v >= 3 {
						end += stringLen(txn, v >= 9)
					} else if txn != nil {
						continue // v0-2 have no transactional_id
					}
					cs = append(cs, kcase{fmt.Sprintf("acks=%d/timeout=%d/txn=%v", acks, timeout, describe(txn)), req, want, end})
				}
			}
		}
	case keyFetch:
		for _, wait := range []int32{500 + int32(v), 0, -1, 1<<31 - 1} {
			req := newReq().(*kmsg.FetchRequest)
			req.ReplicaID = -1
			req.MaxWaitMillis = wait
			req.MinBytes = 1
			req.SessionEpoch = -1
			topic := kmsg.NewFetchRequestTopic()
			topic.Topic = "events"
			topic.TopicID = [16]byte{1, 2, 3}
			part := kmsg.NewFetchRequestTopicPartition()
			part.FetchOffset = 42
			if v >= 17 {
				part.ReplicaDirectoryID = [16]byte{9} // a tagged field
			}
			topic.Partitions = append(topic.Partitions, part)
			req.Topics = append(req.Topics, topic)
			if v >= 12 {
				req.ClusterID = kmsg.StringPtr("cluster-a") // tag 0
			}
			if v >= 15 {
				req.ReplicaState.ID = 3 // tag 1
				req.ReplicaState.Epoch = 7
			}
			end := 4
			if v <= 14 {
				end = 8
			}
			cs = append(cs, kcase{fmt.Sprintf("max_wait=%d", wait), req, Request{Hold: ms(wait)}, end})
		}
	case keyJoinGroup:
		for _, group := range []string{"", "group-a", strings.Repeat("g", 300)} {
			for _, rebalance := range []int32{300_000 + int32(v), -1} {
				req := newReq().(*kmsg.JoinGroupRequest)
				req.Group = group
				req.SessionTimeoutMillis = 45_000
				req.RebalanceTimeoutMillis = rebalance
				req.ProtocolType = "consumer"
				proto := kmsg.NewJoinGroupRequestProtocol()
				proto.Name = "range"
				proto.Metadata = []byte{0, 1}
				req.Protocols = append(req.Protocols, proto)
				timeout := rebalance
				end := stringLen(&group, v >= 6) + 8
				if v == 0 {
					timeout = req.SessionTimeoutMillis
					end -= 4
				}
				want := Request{Hold: GroupHold(ms(timeout)), RebalanceTimeout: ms(timeout)}
				cs = append(cs, kcase{fmt.Sprintf("group=%d/rebalance=%d", len(group), rebalance), req, want, end})
			}
		}
	case keyAlterPartitionReassignments, keyListPartitionReassignments, keyUpdateFeatures:
		for _, timeout := range []int32{61_000 + int32(v), -7} {
			req := newReq()
			switch req := req.(type) {
			case *kmsg.AlterPartitionAssignmentsRequest:
				req.TimeoutMillis = timeout
				topic := kmsg.NewAlterPartitionAssignmentsRequestTopic()
				topic.Topic = "events"
				req.Topics = append(req.Topics, topic)
			case *kmsg.ListPartitionReassignmentsRequest:
				req.TimeoutMillis = timeout
			case *kmsg.UpdateFeaturesRequest:
				req.TimeoutMillis = timeout
				fu := kmsg.NewUpdateFeaturesRequestFeatureUpdate()
				fu.Feature = "metadata.version"
				req.FeatureUpdates = append(req.FeatureUpdates, fu)
			}
			cs = append(cs, kcase{fmt.Sprintf("timeout=%d", timeout), req, Request{Hold: ms(timeout)}, 4})
		}
	case keyInitProducerID:
		for _, txn := range []*string{strNull, strEmpty, kmsg.StringPtr("txn-a"), kmsg.StringPtr(strings.Repeat("t", 300))} {
			for _, timeout := range []int32{60_000 + int32(v), 0, -1, 1<<31 - 1} {
				req := newReq().(*kmsg.InitProducerIDRequest)
				req.TransactionalID = txn
				req.TransactionTimeoutMillis = timeout
				req.ProducerID, req.ProducerEpoch = 7, 3
				var want Request
				switch {
				case txn == nil:
					want.Hold = 5 * time.Second // an idempotent producer's: no transaction log write
				case timeout > 0:
					want = Request{Hold: max(ms(timeout), 15*time.Minute), TxnTimeout: ms(timeout), TxnID: fnv1a(*txn)}
				default:
					want.Hold = 15 * time.Minute
				}
				cs = append(cs, kcase{fmt.Sprintf("txn=%s/timeout=%d", describe(txn), timeout), req, want, stringLen(txn, v >= 2) + 4})
			}
		}
	case keyAddPartitionsToTxn, keyAddOffsetsToTxn, keyEndTxn:
		if k == keyAddPartitionsToTxn && v >= 4 {
			// Brokers', for many transactions: only the 8 fixed bytes
			// are read.
			req := newReq().(*kmsg.AddPartitionsToTxnRequest)
			txn := kmsg.NewAddPartitionsToTxnRequestTransaction()
			txn.TransactionalID = "txn-a"
			req.Transactions = append(req.Transactions, txn)
			cs = append(cs, kcase{"transactions", req, Request{Hold: 15 * time.Minute}, -1})
			break
		}
		for _, txn := range []string{"", "txn-a", strings.Repeat("t", 300)} {
			req := newReq()
			switch req := req.(type) {
			case *kmsg.AddPartitionsToTxnRequest:
				req.TransactionalID, req.ProducerID, req.ProducerEpoch = txn, 7, 3
				topic := kmsg.NewAddPartitionsToTxnRequestTopic()
				topic.Topic = "events"
				topic.Partitions = []int32{0, 1}
				req.Topics = append(req.Topics, topic)
			case *kmsg.AddOffsetsToTxnRequest:
				req.TransactionalID, req.ProducerID, req.ProducerEpoch, req.Group = txn, 7, 3, "group-a"
			case *kmsg.EndTxnRequest:
				req.TransactionalID, req.ProducerID, req.ProducerEpoch, req.Commit = txn, 7, 3, true
			}
			want := Request{Hold: 15 * time.Minute, TxnBound: true, TxnID: fnv1a(txn)}
			cs = append(cs, kcase{fmt.Sprintf("txn=%d bytes", len(txn)), req, want, stringLen(&txn, req.IsFlexible())})
		}
	default:
		// Only the 8 fixed header bytes are read: bodyEnd is set to -1
		// and the caller uses 8 as the end.
		var want Request
		switch {
		case slices.Contains([]int16{keyOffsetCommit, keyTxnOffsetCommit, keyHeartbeat, keyLeaveGroup,
			keyDeleteGroups, keyOffsetDelete, keyConsumerGroupHeartbeat, keyShareGroupHeartbeat,
			keyStreamsGroupHeartbeat}, k) || k == keyOffsetFetch && v >= 7:
			want.Hold = 5 * time.Second // a group coordinator write
		case slices.Contains([]int16{keyCreateACLs, keyDeleteACLs, keyAlterConfigs, keyIncrementalAlterConfigs,
			keyAlterClientQuotas, keyAlterUserScramCredentials, keyCreateDelegationToken,
			keyRenewDelegationToken, keyExpireDelegationToken}, k):
			want.Hold = time.Minute // forwarded to the controller
		case k == keyListOffsets && v < 10:
			want.Hold = 30 * time.Second // a remote (tiered) timestamp lookup
		case k == keySyncGroup || k == keyCreateTopics || k == keyDeleteTopics ||
			k == keyDeleteRecords || k == keyCreatePartitions || k == keyElectLeaders ||
			k == keyShareFetch || k == keyAddRaftVoter || k == keySaslAuthenticate || k == keyShareAcknowledge ||
			k == keyDescribeShareGroupOffsets || k == keyAlterShareGroupOffsets || k == keyDeleteShareGroupOffsets ||
			k == keyStreamsGroupTopologyUpdate:
			want.HoldUnknown = true
		case k == keyListOffsets && v >= 10:
			want.HoldUnknown = true
		case k == keySaslHandshake && v == 0:
			want.SASLRaw = true
		}
		cs = append(cs, kcase{"default", newReq(), want, -1})
	}
	return cs
}

// fnv1a is the TxnID of transactional id s, by the standard library's
// FNV-1a (the parser has its own loop).
func fnv1a(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return h.Sum64()
}

func describe(s *string) string {
	if s == nil {
		return "null"
	}
	return fmt.Sprintf("%d bytes", len(*s))
}

// clientIDs are the client_id values every request is encoded with: null,
// empty, typical, and long (32 000 bytes, within the INT16 length).
var clientIDs = []*string{nil, kmsg.StringPtr(""), kmsg.StringPtr("consumer-1"), kmsg.StringPtr(strings.Repeat("c", 32_000))}

// corrIDs are the correlation ids used, in turn.
var corrIDs = []int32{0, 1, -1, 2147483640, -2147483648, 0x01020304}

// TestParseKmsgRequests encodes every request kmsg knows, at every version,
// with each client id, and checks the parse of the whole payload and the
// incremental protocol.
func TestParseKmsgRequests(t *testing.T) {
	n := 0
	for k := int16(0); k <= maxKmsgKey; k++ {
		proto := kmsg.RequestForKey(k)
		if proto == nil {
			continue
		}
		for v := int16(0); v <= proto.MaxVersion(); v++ {
			for _, c := range bodyCases(k, v) {
				for _, cid := range clientIDs {
					corr := corrIDs[n%len(corrIDs)]
					n++
					name := fmt.Sprintf("%T/v%d/%s/client=%s/corr=%d", c.req, v, c.name, describe(cid), corr)
					payload := encode(t, c.req, cid, corr)
					hdr := headerLen(c.req, cid)

					// The test's model of the header must agree with
					// kmsg: the body must decode from hdr on.
					back := kmsg.RequestForKey(k)
					back.SetVersion(v)
					if err := back.ReadFrom(payload[hdr:]); err != nil {
						t.Fatalf("%s: kmsg cannot read the body at offset %d: %v", name, hdr, err)
					}

					want := c.want
					want.APIKey, want.APIVersion, want.CorrelationID = k, v, corr
					end := 8
					if c.bodyEnd >= 0 {
						end = hdr + c.bodyEnd
					}
					checkPayload(t, name, payload, want, end)
				}
			}
		}
	}
	t.Logf("%d encoded requests checked", n)
}

// checkPayload checks ParseRequest on payload, whose first end bytes decide
// it as want:
//   - the whole payload, complete or not, and exactly the first end bytes,
//     complete or not, give want;
//   - the first end-1 bytes ask for exactly end bytes, or (complete) are
//     ErrNotKafka;
//   - starting from shorter prefixes, feeding payload[:need] until need == 0
//     gives want, and every need lies in (len(b), end].
//
// Starting prefixes are all lengths up to end when end is at most 1024, else
// (the 32 000-byte client id) a sample: the first and last 512 lengths and
// every 509th.
func checkPayload(t *testing.T, name string, payload []byte, want Request, end int) {
	t.Helper()
	expect := func(b []byte, complete bool) {
		t.Helper()
		r, need, err := ParseRequest(b, complete)
		if err != nil || need != 0 || r != want {
			t.Fatalf("%s: ParseRequest(%d of %d bytes, %v) = %+v, %d, %v; want %+v", name, len(b), len(payload), complete, r, need, err, want)
		}
	}
	expect(payload, true)
	expect(payload, false)
	expect(payload[:end], true)
	expect(payload[:end], false)

	if r, need, err := ParseRequest(payload[:end-1], false); err != nil || need != end || r != (Request{}) {
		t.Fatalf("%s: ParseRequest(%d bytes, false) = %+v, %d, %v; want need %d", name, end-1, r, need, err, end)
	}
	if _, need, err := ParseRequest(payload[:end-1], true); err != ErrNotKafka || need != 0 {
		t.Fatalf("%s: ParseRequest(%d bytes, true) = %d, %v; want ErrNotKafka", name, end-1, need, err)
	}

	starts := func(yield func(int) bool) {
		for s := 0; s < end; s++ {
			if s >= 512 && s < end-512 && s%509 != 0 {
				continue
			}
			if !yield(s) {
				return
			}
		}
	}
	for s := range starts {
		b := payload[:s]
		for steps := 0; ; steps++ {
			r, need, err := ParseRequest(b, false)
			if err != nil {
				t.Fatalf("%s: from %d bytes, ParseRequest(%d bytes) error %v", name, s, len(b), err)
			}
			if need == 0 {
				if r != want {
					t.Fatalf("%s: from %d bytes, got %+v, want %+v", name, s, r, want)
				}
				break
			}
			if need <= len(b) || need > end || need > MaxPrefix {
				t.Fatalf("%s: from %d bytes, ParseRequest(%d bytes) need %d, want in (%d, %d]", name, s, len(b), need, len(b), end)
			}
			if steps > 16 {
				t.Fatalf("%s: from %d bytes, no answer after %d calls", name, s, steps)
			}
			if s%7 == 0 && need < len(payload) {
				// Any longer prefix must do as well as exactly need.
				need += (len(payload) - need) / 2
			}
			b = payload[:need]
		}
		if s%5 == 0 && s > 0 {
			if _, need, err := ParseRequest(payload[:s], true); err != ErrNotKafka || need != 0 {
				t.Fatalf("%s: ParseRequest(%d bytes, true) = %d, %v; want ErrNotKafka", name, s, need, err)
			}
		}
	}
}

// TestParseKmsgUnknownVersions checks versions above what kmsg (and so this
// package) knows: Produce is ErrUnknownVersion, everything else HoldUnknown,
// decided from the 8 fixed header bytes alone.
func TestParseKmsgUnknownVersions(t *testing.T) {
	for k := int16(0); k <= maxKmsgKey+5; k++ {
		var versions []int16
		if req := kmsg.RequestForKey(k); req != nil {
			versions = []int16{req.MaxVersion() + 1, req.MaxVersion() + 2, 0x7fff}
		} else {
			versions = []int16{0, 1, 0x7fff} // unknown key
		}
		for _, v := range versions {
			payload := binary.BigEndian.AppendUint16(nil, uint16(k))
			payload = binary.BigEndian.AppendUint16(payload, uint16(v))
			payload = binary.BigEndian.AppendUint32(payload, 77)
			payload = append(payload, 0xff, 0xff, 0xff) // never read
			hdr := Request{APIKey: k, APIVersion: v, CorrelationID: 77}
			r, need, err := ParseRequest(payload[:8], false)
			if k == keyProduce {
				if err != ErrUnknownVersion || need != 0 || r != hdr {
					t.Errorf("Produce v%d: %+v, %d, %v; want header and ErrUnknownVersion", v, r, need, err)
				}
				continue
			}
			want := hdr
			want.HoldUnknown = true
			if err != nil || need != 0 || r != want {
				t.Errorf("key %d v%d: %+v, %d, %v; want %+v", k, v, r, need, err, want)
			}
			if _, need, _ := ParseRequest(payload[:7], false); need != 8 {
				t.Errorf("key %d v%d: 7 bytes need %d, want 8", k, v, need)
			}
		}
	}
}

// TestSpecificValues pins a few requests to literal expectations, so that a
// shared mistake in the test oracle and the parser cannot hide.
func TestSpecificValues(t *testing.T) {
	cid := kmsg.StringPtr("rdkafka")

	fetch := kmsg.NewPtrFetchRequest()
	fetch.SetVersion(17)
	fetch.MaxWaitMillis = 500
	fetch.ReplicaState.ID = 5
	p := encode(t, fetch, cid, 9)
	if r, need, err := ParseRequest(p, false); err != nil || need != 0 || r != (Request{APIKey: 1, APIVersion: 17, CorrelationID: 9, Hold: 500 * time.Millisecond}) {
		t.Errorf("Fetch v17: %+v, %d, %v", r, need, err)
	}
	// Payload: 8 fixed bytes, client_id (2+7), tag count (1), max_wait
	// (4). Before the client_id length is known, 2+1+4 more bytes are
	// certain; once it is, all 22.
	for _, step := range [][2]int{{0, 8}, {7, 8}, {8, 15}, {9, 15}, {10, 22}, {21, 22}} {
		if _, need, _ := ParseRequest(p[:step[0]], false); need != step[1] {
			t.Errorf("Fetch v17 from %d bytes: need %d, want %d", step[0], need, step[1])
		}
	}

	produce := kmsg.NewPtrProduceRequest()
	produce.SetVersion(11)
	produce.Acks = 0
	produce.TimeoutMillis = 1500
	produce.TransactionID = kmsg.StringPtr("tx")
	p = encode(t, produce, cid, -3)
	if r, _, err := ParseRequest(p, true); err != nil || r != (Request{APIKey: 0, APIVersion: 11, CorrelationID: -3, NoResponse: true}) {
		t.Errorf("Produce v11 acks=0: %+v, %v", r, err)
	}
	produce.Acks = -1
	p = encode(t, produce, cid, -3)
	if r, _, err := ParseRequest(p, true); err != nil || r != (Request{APIKey: 0, APIVersion: 11, CorrelationID: -3, Hold: 1500 * time.Millisecond}) {
		t.Errorf("Produce v11 acks=-1: %+v, %v", r, err)
	}

	join := kmsg.NewPtrJoinGroupRequest()
	join.SetVersion(0)
	join.Group = "g"
	join.SessionTimeoutMillis = 10_000
	p = encode(t, join, cid, 1)
	if r, _, err := ParseRequest(p, true); err != nil || r != (Request{APIKey: 11, CorrelationID: 1, Hold: GroupHold(10 * time.Second), RebalanceTimeout: 10 * time.Second}) {
		t.Errorf("JoinGroup v0: %+v, %v", r, err)
	}

	// Transactions: the hash of "tx" is FNV-1a's, worked out by hand.
	const tx = 0x08c84807b56ada21
	init := kmsg.NewPtrInitProducerIDRequest()
	init.TransactionalID = kmsg.StringPtr("tx")
	init.TransactionTimeoutMillis = 2000
	for _, v := range []int16{1, 4} { // header v1 and v2, compact string
		init.SetVersion(v)
		p = encode(t, init, cid, 5)
		want := Request{APIKey: 22, APIVersion: v, CorrelationID: 5, Hold: 15 * time.Minute, TxnTimeout: 2 * time.Second, TxnID: tx}
		if r, _, err := ParseRequest(p, true); err != nil || r != want {
			t.Errorf("InitProducerId v%d: %+v, %v; want %+v", v, r, err, want)
		}
	}
	init.TransactionalID = nil // an idempotent producer's
	p = encode(t, init, cid, 5)
	if r, _, err := ParseRequest(p, true); err != nil || r != (Request{APIKey: 22, APIVersion: 4, CorrelationID: 5, Hold: 5 * time.Second}) {
		t.Errorf("InitProducerId v4 without a transactional id: %+v, %v", r, err)
	}
	end := kmsg.NewPtrEndTxnRequest()
	end.TransactionalID = "tx"
	for _, v := range []int16{0, 3} {
		end.SetVersion(v)
		p = encode(t, end, cid, 6)
		if r, _, err := ParseRequest(p, true); err != nil || r != (Request{APIKey: 26, APIVersion: v, CorrelationID: 6, Hold: 15 * time.Minute, TxnBound: true, TxnID: tx}) {
			t.Errorf("EndTxn v%d: %+v, %v", v, r, err)
		}
	}

	meta := kmsg.NewPtrMetadataRequest()
	meta.SetVersion(12)
	p = encode(t, meta, cid, 2)
	for n := 0; n < 8; n++ {
		if _, need, err := ParseRequest(p[:n], false); need != 8 || err != nil {
			t.Errorf("Metadata from %d bytes: need %d, %v; want 8", n, need, err)
		}
	}
	if r, need, err := ParseRequest(p[:8], false); err != nil || need != 0 || r != (Request{APIKey: 3, APIVersion: 12, CorrelationID: 2}) {
		t.Errorf("Metadata from 8 bytes: %+v, %d, %v", r, need, err)
	}

	sasl := kmsg.NewPtrSASLHandshakeRequest()
	sasl.Mechanism = "PLAIN"
	for v := int16(0); v <= 1; v++ {
		sasl.SetVersion(v)
		r, _, err := ParseRequest(encode(t, sasl, cid, 4), true)
		if err != nil || r.SASLRaw != (v == 0) || r.HoldUnknown || r.Hold != 0 {
			t.Errorf("SaslHandshake v%d: %+v, %v", v, r, err)
		}
	}
}

// TestHeaderTaggedFields parses flexible requests whose header carries
// tagged fields (kmsg writes none), as a future client might send them.
func TestHeaderTaggedFields(t *testing.T) {
	fetch := kmsg.NewPtrFetchRequest()
	fetch.SetVersion(17)
	fetch.MaxWaitMillis = 250
	body := fetch.AppendTo(nil)
	want := Request{APIKey: 1, APIVersion: 17, CorrelationID: 5, Hold: 250 * time.Millisecond}

	head := []byte{0, 1, 0, 17, 0, 0, 0, 5, 0, 2, 'i', 'd'}
	cases := []struct {
		name string
		tags []byte
		err  error
	}{
		{"none", []byte{0}, nil},
		{"two", []byte{2, 0, 3, 'a', 'b', 'c', 5, 0}, nil},
		{"multi-byte tag and size", append([]byte{1, 0x80, 0x01, 0x81, 0x01}, bytes.Repeat([]byte{'x'}, 129)...), nil},
		{"padded count", []byte{0x80, 0x80, 0x80, 0x80, 0x00}, nil},
		{"out of order", []byte{2, 5, 0, 0, 0}, ErrNotKafka},
		{"duplicate", []byte{2, 3, 1, 'a', 3, 1, 'b'}, ErrNotKafka},
		{"six-byte count", []byte{0x80, 0x80, 0x80, 0x80, 0x80, 0x00}, ErrNotKafka},
		{"count over 32 bits", []byte{0xff, 0xff, 0xff, 0xff, 0x1f}, ErrNotKafka},
		{"count over MaxInt32", []byte{0x80, 0x80, 0x80, 0x80, 0x08}, ErrNotKafka},
		{"size over MaxInt32", []byte{1, 0, 0xff, 0xff, 0xff, 0xff, 0x0f}, ErrNotKafka},
		{"count too large for MaxPrefix", []byte{0xff, 0xff, 0xff, 0xff, 0x07}, ErrTooLong},
		{"count just too large for MaxPrefix", []byte{0x80, 0x80, 0x04}, ErrTooLong}, // 65536 fields: 128 KiB + the rest
		{"size beyond MaxPrefix", []byte{1, 0, 0x80, 0x80, 0x08}, ErrTooLong},        // 128 KiB + the bytes before it
	}
	for _, c := range cases {
		payload := append(append(append([]byte(nil), head...), c.tags...), body...)
		for _, complete := range []bool{true, false} {
			r, need, err := ParseRequest(payload, complete)
			if c.err != nil {
				if err != c.err || need != 0 || r != (Request{}) {
					t.Errorf("%s (complete=%v): %+v, %d, %v; want %v", c.name, complete, r, need, err, c.err)
				}
				continue
			}
			if err != nil || need != 0 || r != want {
				t.Errorf("%s (complete=%v): %+v, %d, %v; want %+v", c.name, complete, r, need, err, want)
			}
		}
		if c.err == nil {
			checkPayload(t, c.name, payload, want, len(head)+len(c.tags)+4)
		}
	}
}

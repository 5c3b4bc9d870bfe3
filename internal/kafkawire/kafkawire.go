// Package kafkawire reads, without copying or allocating, the few fields of a
// Kafka request that a passive liveness tracker needs: the request header
// (api_key, api_version, correlation_id), whether the broker answers at all,
// and how long the broker may legitimately hold the request before answering.
//
// The proxy frames the client→broker stream itself (INT32 size, then the
// payload) and hands ParseRequest a prefix of each request payload; responses
// are paired with requests by ResponseCorrelationID, the first four payload
// bytes of every response, in every response header version.
//
// Field layouts come from the Kafka message definitions
// (clients/src/main/resources/common/message/*.json in apache/kafka, the
// definitions "RequestHeader", "ProduceRequest", "FetchRequest",
// "JoinGroupRequest", ...) and were checked, version by version, against the
// encoders generated from them in franz-go's kmsg v1.15.1; the tests encode
// every request kmsg knows and parse it back.
package kafkawire

import (
	"encoding/binary"
	"errors"
	"math"
	"time"
)

// Request is what the proxy reads from one request's payload.
type Request struct {
	// APIKey, APIVersion and CorrelationID are the first three request
	// header fields (RequestHeader: request_api_key INT16,
	// request_api_version INT16, correlation_id INT32). They sit at the same
	// offsets in every header version. The broker copies CorrelationID into
	// the response.
	APIKey        int16
	APIVersion    int16
	CorrelationID int32

	// NoResponse: the broker sends no response by protocol. The only such
	// request is Produce with acks=0: the broker answers it with nothing
	// (and closes the connection if the request failed), and the Java
	// producer does not wait for an answer. Such a request must never be
	// tracked.
	NoResponse bool

	// Hold is how long the broker may legitimately hold the request before
	// answering, read from the request's own fields:
	//   - Fetch: max_wait_ms (the broker answers when min_bytes have
	//     accumulated or max_wait_ms has passed);
	//   - Produce with acks != 0: timeout_ms ("the timeout to await a
	//     response", the time the broker waits for the acks);
	//   - JoinGroup: GroupHold of rebalance_timeout_ms (v0 has no such
	//     field and the broker uses session_timeout_ms in its place): the
	//     coordinator waits up to the largest rebalance timeout of all the
	//     group's members, not this one's, so the hold is at least
	//     GroupRebalanceFloor, plus GroupLapse;
	//   - AlterPartitionReassignments (45), ListPartitionReassignments (46),
	//     UpdateFeatures (57): timeout_ms, their first body field;
	//   - requests the group coordinator answers after a write to the
	//     offsets log (OffsetCommit, TxnOffsetCommit, Heartbeat,
	//     LeaveGroup, DeleteGroups, OffsetDelete, ConsumerGroupHeartbeat,
	//     ShareGroupHeartbeat, StreamsGroupHeartbeat; OffsetFetch v7+, which
	//     with require_stable waits for pending offsets to be written),
	//     and an InitProducerId without a
	//     transactional id (an idempotent producer's: no transaction log
	//     write): 5s, the broker default of offsets.commit.timeout.ms, the
	//     coordinator's timeout for every write; these requests carry no
	//     timeout field;
	//   - requests the transaction coordinator answers after a write to the
	//     transaction log (InitProducerId with a transactional id,
	//     AddPartitionsToTxn, AddOffsetsToTxn, EndTxn): the coordinator
	//     appends with acks=all and, as its timeout, the transaction's own
	//     timeout (TransactionStateManager.appendTransactionToLog: the
	//     new metadata's txnTimeoutMs), which an InitProducerId set, up to
	//     the broker's transaction.max.timeout.ms. Without the connection's
	//     history that is all a parser can bound it by: 15 min, the
	//     default of transaction.max.timeout.ms (see TxnBound for how the
	//     caller narrows it). An InitProducerId's hold is the longer of its
	//     own transaction_timeout_ms and those 15 min, not its own alone:
	//     when the transactional id's previous transaction is still open
	//     (a producer restarted mid-transaction), the coordinator first
	//     aborts it, with that transaction's timeout, set by an earlier
	//     InitProducerId, maybe another client's, and answers only then.
	//   - admin requests a KRaft broker forwards to the active
	//     controller (CreateAcls, DeleteAcls, AlterConfigs,
	//     IncrementalAlterConfigs, AlterClientQuotas,
	//     AlterUserScramCredentials, the delegation-token requests): 60 s,
	//     how long it retries while the controller quorum elects a leader;
	//   - ListOffsets v0-9: 30 s, remote.list.offsets.request.timeout.ms,
	//     for a timestamp lookup in a tiered topic's remote segments (v10+
	//     carries its own timeout_ms, after the topics: HoldUnknown);
	//
	// Hold is 0 for every other request (none wait by protocol), when
	// NoResponse or HoldUnknown is set, and when the field is negative.
	Hold time.Duration

	// HoldUnknown: the broker may hold the request for a time this parser
	// does not read, so the caller must never judge it overdue. It is set
	// for:
	//   - SyncGroup (14): the coordinator parks it until the group leader's
	//     SyncGroup arrives, up to the group's rebalance timeout; the caller
	//     can bound it by the RebalanceTimeout of the JoinGroup sent on the
	//     same connection;
	//   - APIs whose wait field lies after variable-length data and is not
	//     read: ListOffsets (2) v10+ and CreateTopics (19), DeleteTopics
	//     (20), DeleteRecords (21), CreatePartitions (37), ElectLeaders (43)
	//     timeout_ms (after their topic or partition arrays), AddRaftVoter
	//     (80) timeout_ms (after cluster_id), ShareFetch (78) max_wait_ms
	//     (after group_id, member_id and share_session_epoch);
	//   - APIs that wait on something with no bound the proxy knows:
	//     SaslAuthenticate (36: the broker's callback, an LDAP server or
	//     an OAuth key fetch), the share group's acknowledgements and
	//     offsets (79, 90-92: writes and reads of the share coordinator)
	//     and StreamsGroupTopologyDescriptionUpdate (93: a plugin);
	//   - an api_key this package does not know, or a version above the
	//     highest this package knows for that key (a newer version may add a
	//     wait field, as ListOffsets v10 did).
	HoldUnknown bool

	// RebalanceTimeout is a JoinGroup's rebalance_timeout_ms (v0:
	// session_timeout_ms, which v0 uses instead), 0 for other requests or
	// when negative. It lets the caller bound a later SyncGroup of the same
	// member.
	RebalanceTimeout time.Duration

	// TxnTimeout is an InitProducerId's transaction_timeout_ms when it
	// names a transactional id (0 for other requests, for a null
	// transactional id, and when not positive, which the broker rejects at
	// once). Once the InitProducerId succeeds, the coordinator writes that
	// transaction's log records with this timeout (see Hold), so the caller
	// can bound the later requests of the same transactional id (TxnBound,
	// TxnID) sent on the same connection.
	TxnTimeout time.Duration

	// TxnBound: the transaction coordinator holds the request for at most
	// the timeout of the transaction it names (AddPartitionsToTxn v0-3,
	// AddOffsetsToTxn, EndTxn): the caller can bound it by the largest
	// TxnTimeout of the InitProducerIds with the same TxnID sent on the
	// same connection. A producer whose InitProducerId another client's
	// superseded since (a newer epoch, perhaps with a longer timeout) is
	// fenced at once, without a write. Hold is the bound without it,
	// transaction.max.timeout.ms. AddPartitionsToTxn v4+, which brokers
	// send for many transactions at once, is not TxnBound.
	TxnBound bool

	// TxnID identifies the transactional id of an InitProducerId with a
	// TxnTimeout or of a TxnBound request: a 64-bit FNV-1a hash of its
	// bytes, 0 for other requests. Two requests of one transactional id
	// have the same TxnID.
	TxnID uint64

	// SASLRaw: the request is a SaslHandshake (17) v0. Once the broker
	// accepts it, the client and broker exchange raw SASL tokens: still
	// size-prefixed, but with no Kafka header, and a client token may get no
	// answer at all. The caller must stop tracking the connection after
	// this request. (From v1 the tokens travel in SaslAuthenticate requests,
	// which are ordinary request/response pairs.)
	SASLRaw bool
}

// MaxPrefix is the most payload bytes ParseRequest ever asks for. A request
// whose needed fields end beyond it gets ErrTooLong.
//
// The longest prefix a well-formed request needs is a header with the
// longest client_id (an INT16 length, so at most 32767 bytes) followed by a
// body string of at most 32767 bytes (Produce transactional_id or JoinGroup
// group_id: the broker rejects longer strings, even in compact form) and 8
// bytes of fixed fields: about 64 KiB. (The transactional_id that
// InitProducerId, AddPartitionsToTxn, AddOffsetsToTxn and EndTxn start
// with is such a string too.) MaxPrefix leaves another 64 KiB for
// tagged fields in the request header: RequestHeader defines none, and
// franz-go and the Java client write an empty section.
const MaxPrefix = 128 << 10

var (
	// ErrNotKafka reports bytes that cannot be a Kafka request header:
	// a negative api_key or api_version, a client_id length below -1, a
	// string length out of range, a null non-nullable string, an unsigned
	// varint longer than 5 bytes or above math.MaxInt32, tagged fields out
	// of order, or a complete payload that ends before the fields it must
	// contain.
	ErrNotKafka = errors.New("kafkawire: not a Kafka request")

	// ErrTooLong reports a request whose needed fields end beyond MaxPrefix.
	ErrTooLong = errors.New("kafkawire: request header too long")

	// ErrUnknownVersion reports a Produce request of a version above the
	// highest this package knows. Whether the broker will answer it (acks
	// != 0) cannot be told without assuming a layout, so the caller should
	// stop tracking the connection: a request that may get no response
	// would desynchronise the response FIFO. r still carries APIKey,
	// APIVersion and CorrelationID.
	ErrUnknownVersion = errors.New("kafkawire: unknown Produce request version")
)

// Read bounds and conversions.
const (
	// maxString is the longest string the broker accepts, in both the
	// INT16-length and the compact form: the generated Java readers throw
	// "string field ... had invalid length" above 0x7fff.
	maxString = 0x7fff
	// headerFixed is the size of api_key, api_version and correlation_id.
	headerFixed = 8
)

// ParseRequest reads b, the first bytes of one request payload (the bytes
// after the 4-byte size). complete reports whether b is the whole payload.
//
// It returns need > len(b) when it needs the first need payload bytes to
// decide: the caller collects at least that many and calls again with the
// longer prefix. need is never more than MaxPrefix, and never more than any
// well-formed request that starts with b is long, so for such requests it is
// never more than the payload. (If need is beyond the payload, the request is
// malformed: calling with the whole payload and complete=true gives
// ErrNotKafka.) need asks at once for every byte that a well-formed request
// certainly needs, so a caller that feeds exactly need bytes needs few calls.
// With complete true ParseRequest never asks for more: missing bytes are
// ErrNotKafka.
//
// On success need == 0. The answer depends only on the bytes read, so any
// longer prefix of the same payload, complete or not, gives the same answer.
// On error r is the zero Request, except with ErrUnknownVersion, where it
// carries the three fixed header fields.
//
// Most requests are decided from the 8 fixed header bytes (api_key,
// api_version, correlation_id). Produce, Fetch, JoinGroup,
// AlterPartitionReassignments, ListPartitionReassignments, UpdateFeatures,
// InitProducerId, AddPartitionsToTxn v0-3, AddOffsetsToTxn and EndTxn also
// need the rest of the header (client_id, tagged fields) and their first
// body fields.
//
// ParseRequest does not allocate and does not retain b.
func ParseRequest(b []byte, complete bool) (r Request, need int, err error) {
	p := parser{b: b, complete: complete}
	r, ok := p.parse()
	if !ok {
		if p.err == ErrUnknownVersion {
			return r, 0, p.err
		}
		return Request{}, p.need, p.err
	}
	return r, 0, nil
}

// ResponseCorrelationID returns the correlation id at the start of a
// response payload (ResponseHeader: correlation_id INT32, first in every
// version), ok false if len(b) < 4.
func ResponseCorrelationID(b []byte) (id int32, ok bool) {
	if len(b) < 4 {
		return 0, false
	}
	return int32(binary.BigEndian.Uint32(b)), true
}

// LooksLikeTLS reports whether b, the first bytes of a connection (before any
// framing: b starts where the 4-byte size would), are a TLS handshake record:
// content type 22 (0x16) and a record-layer version from 0x0300 (SSL 3.0) to
// 0x0304 (TLS 1.3). It needs 3 bytes and returns false with fewer.
//
// Read as a Kafka size, 0x1603xxxx is over 369 MB, far above the broker's
// socket.request.max.bytes default of 100 MiB, so no request the broker would
// accept starts this way.
func LooksLikeTLS(b []byte) bool {
	return len(b) >= 3 && b[0] == 0x16 && b[1] == 0x03 && b[2] <= 0x04
}

// parser reads b front to back.
//
// Every read first calls have with the size n of the field (or run of fixed
// fields) it reads next and the minimum size rest of the fields after it that
// ParseRequest also needs. When the n bytes are missing, have asks for n+rest:
// every well-formed request consistent with the bytes read so far has them,
// so a caller feeding exactly need bytes never waits for bytes that such a
// request lacks, and gets its answer in few calls. (A malformed request may be
// asked for a few bytes past the field that proves it malformed; the caller
// gets the error from the longer prefix or, at the end of the payload, from
// complete=true.)
type parser struct {
	b        []byte
	pos      int
	complete bool
	need     int
	err      error
}

// have reports whether the n bytes from p.pos are present; rest is the
// minimum size of the needed fields that follow them. It fails with
// ErrTooLong when n+rest bytes from p.pos run past MaxPrefix (checked first,
// so that the answer does not depend on how many bytes b holds), with
// ErrNotKafka when complete, and otherwise sets need.
func (p *parser) have(n, rest int) bool {
	if n+rest > MaxPrefix-p.pos {
		p.err = ErrTooLong
		return false
	}
	if n <= len(p.b)-p.pos {
		return true
	}
	if p.complete {
		p.err = ErrNotKafka
		return false
	}
	p.need = p.pos + n + rest
	return false
}

func (p *parser) fail() bool {
	p.err = ErrNotKafka
	return false
}

func (p *parser) int16() int16 {
	v := int16(binary.BigEndian.Uint16(p.b[p.pos:]))
	p.pos += 2
	return v
}

func (p *parser) int32() int32 {
	v := int32(binary.BigEndian.Uint32(p.b[p.pos:]))
	p.pos += 4
	return v
}

// uvarint reads an UNSIGNED_VARINT (LEB128: 7 bits a byte, least significant
// group first, high bit set on all but the last byte) followed by at least
// rest needed bytes. Like the Java reader (ByteUtils.readUnsignedVarint) it
// accepts at most 5 bytes; it also rejects values that do not fit in 31 bits,
// which Java reads as negative ints and which no count, tag, size or length
// may hold.
func (p *parser) uvarint(rest int) (int, bool) {
	var v uint32
	for i := 0; i < 5; i++ {
		if !p.have(1, rest) {
			return 0, false
		}
		c := p.b[p.pos]
		p.pos++
		v |= uint32(c&0x7f) << (7 * i)
		if c < 0x80 {
			if v > math.MaxInt32 || (i == 4 && c > 0x0f) {
				return 0, p.fail()
			}
			return int(v), true
		}
	}
	return 0, p.fail() // a sixth byte would follow
}

// header skips client_id and, in header v2, the tagged fields, leaving p.pos
// at the first body byte. body is the minimum size of the body fields that
// are read.
//
// RequestHeader: client_id is a NULLABLE_STRING (INT16 length, -1 = null)
// in header v1 and v2 alike: its "flexibleVersions" is "none", so that any
// broker can read the header of any ApiVersions request. Header v2 adds a
// tagged-field section.
func (p *parser) header(flexible bool, body int) bool {
	tags := 0
	if flexible {
		tags = 1 // at least the count
	}
	if !p.have(2, tags+body) {
		return false
	}
	n := int(p.int16())
	switch {
	case n < -1:
		return p.fail()
	case n == -1:
		n = 0
	}
	if !p.have(n, tags+body) {
		return false
	}
	p.pos += n
	if flexible {
		return p.tags(body)
	}
	return true
}

// tags skips a tagged-field section followed by at least rest needed bytes:
// an UNSIGNED_VARINT count, then per field an UNSIGNED_VARINT tag, an
// UNSIGNED_VARINT size and size bytes. Tags must be strictly increasing, the
// order in which every Kafka writer emits them.
func (p *parser) tags(rest int) bool {
	count, ok := p.uvarint(rest)
	if !ok {
		return false
	}
	// Each field takes at least 2 bytes (a tag and a size).
	if count > (MaxPrefix-p.pos-rest)/2 {
		p.err = ErrTooLong
		return false
	}
	last := -1
	for i := count - 1; i >= 0; i-- {
		after := 2*i + rest // the fields after this one, then rest
		tag, ok := p.uvarint(1 + after)
		if !ok {
			return false
		}
		if tag <= last {
			return p.fail()
		}
		last = tag
		size, ok := p.uvarint(after)
		if !ok {
			return false
		}
		if size > MaxPrefix { // also keeps size+after from overflowing
			p.err = ErrTooLong
			return false
		}
		if !p.have(size, after) {
			return false
		}
		p.pos += size
	}
	return true
}

// stringLen reads the length of a string followed by at least rest needed
// bytes, and returns the number of bytes of the string (0 when null) without
// skipping them. Not compact: STRING or NULLABLE_STRING, an INT16 length,
// -1 = null. Compact (flexible versions): COMPACT_STRING or
// COMPACT_NULLABLE_STRING, an UNSIGNED_VARINT length+1, 0 = null.
func (p *parser) stringLen(compact, nullable bool, rest int) (int, bool) {
	n, ok := p.stringLenOrNull(compact, nullable, rest)
	return max(n, 0), ok
}

// stringLenOrNull is stringLen, but returns -1 for a null string.
func (p *parser) stringLenOrNull(compact, nullable bool, rest int) (int, bool) {
	var n int
	if compact {
		l, ok := p.uvarint(rest)
		if !ok {
			return 0, false
		}
		n = l - 1
	} else {
		if !p.have(2, rest) {
			return 0, false
		}
		n = int(p.int16())
		if n < -1 {
			return 0, p.fail()
		}
	}
	switch {
	case n == -1 && !nullable:
		// The Java readers throw "non-nullable field ... was serialized
		// as null".
		return 0, p.fail()
	case n == -1:
		return -1, true
	case n > maxString:
		return 0, p.fail()
	}
	return n, true
}

// minStringLen is the size of the shortest string length field.
func minStringLen(compact bool) int {
	if compact {
		return 1
	}
	return 2
}

// millis converts a millisecond field, counting a negative value as 0.
func millis(ms int32) time.Duration {
	if ms < 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

func (p *parser) parse() (Request, bool) {
	if !p.have(headerFixed, 0) {
		return Request{}, false
	}
	key, version := p.int16(), p.int16()
	if key < 0 || version < 0 {
		// No API has a negative key or version; the broker rejects the
		// request.
		return Request{}, p.fail()
	}
	r := Request{APIKey: key, APIVersion: version, CorrelationID: p.int32()}

	api, known := lookup(key)
	if !known || version > api.maxVersion {
		if key == keyProduce {
			// Whether a response comes (acks) cannot be read without
			// assuming the layout of an unknown version.
			p.err = ErrUnknownVersion
			return r, false
		}
		r.HoldUnknown = true
		return r, true
	}
	hv, _ := requestHeaderVersion(key, version)
	flexible := hv == 2

	switch key {
	case keyProduce:
		return p.produce(r, flexible)
	case keyFetch:
		return p.fetch(r, flexible)
	case keyJoinGroup:
		return p.joinGroup(r, flexible)
	case keyAlterPartitionReassignments, keyListPartitionReassignments, keyUpdateFeatures:
		// timeout_ms INT32 is the first body field in every version
		// (AlterPartitionReassignmentsRequest v0-1,
		// ListPartitionReassignmentsRequest v0, UpdateFeaturesRequest
		// v0-2); all are flexible from v0.
		if !p.header(flexible, 4) || !p.have(4, 0) {
			return r, false
		}
		r.Hold = millis(p.int32())
	case keyInitProducerID:
		return p.initProducerID(r, flexible)
	case keyAddPartitionsToTxn, keyAddOffsetsToTxn, keyEndTxn:
		return p.txnRequest(r, flexible)
	default:
		fixedHold(&r)
	}
	return r, true
}

// fixedHold sets what r's api key and version alone say of how long the
// broker may hold it: the requests with no body field parse reads.
func fixedHold(r *Request) {
	switch r.APIKey {
	case keyOffsetCommit, keyTxnOffsetCommit, keyHeartbeat, keyLeaveGroup, keyDeleteGroups, keyOffsetDelete,
		keyConsumerGroupHeartbeat, keyShareGroupHeartbeat, keyStreamsGroupHeartbeat:
		// No timeout field: the group coordinator answers once its write
		// to the offsets log is replicated, or fails it after
		// offsets.commit.timeout.ms (the coordinator runtime's default
		// timeout for every write).
		r.Hold = offsetsCommitTimeout
	case keyOffsetFetch:
		// v7 added require_stable: with it (the Java consumer always sets
		// it, librdkafka under its default read_committed) the new group
		// coordinator (Kafka 4.0+) runs it as a write, so that it waits
		// for pending offsets to be committed
		// (GroupCoordinatorService.fetchOffsets). Before v7, a read.
		if r.APIVersion >= 7 {
			r.Hold = offsetsCommitTimeout
		}
	case keyCreateACLs, keyDeleteACLs, keyAlterConfigs, keyIncrementalAlterConfigs, keyAlterClientQuotas,
		keyAlterUserScramCredentials, keyCreateDelegationToken, keyRenewDelegationToken, keyExpireDelegationToken:
		// No timeout field: a KRaft broker forwards these to the active
		// controller and retries for up to a minute while the quorum
		// elects one (KafkaApis.forwardToController, the forwarding
		// channel's retry timeout).
		r.Hold = controllerForwardTimeout
	case keySyncGroup, keyCreateTopics, keyDeleteTopics, keyDeleteRecords,
		keyCreatePartitions, keyElectLeaders, keyShareFetch, keyAddRaftVoter,
		keySaslAuthenticate, keyShareAcknowledge, keyDescribeShareGroupOffsets, keyAlterShareGroupOffsets,
		keyDeleteShareGroupOffsets, keyStreamsGroupTopologyUpdate:
		r.HoldUnknown = true
	case keyListOffsets:
		// ListOffsetsRequest v10+ ends with timeout_ms, after the topics.
		// Before it, a timestamp lookup in a tiered topic's remote
		// segments is parked for remote.list.offsets.request.timeout.ms
		// (ReplicaManager.fetchOffset, when the request gives none).
		if r.HoldUnknown = r.APIVersion >= 10; !r.HoldUnknown {
			r.Hold = remoteListOffsetsTimeout
		}
	case keySaslHandshake:
		r.SASLRaw = r.APIVersion == 0
	}
}

// offsetsCommitTimeout is the broker default of offsets.commit.timeout.ms.
const offsetsCommitTimeout = 5 * time.Second

// controllerForwardTimeout is how long a KRaft broker retries forwarding a
// request to the active controller (its forwarding channel's retry
// timeout, 60 s).
const controllerForwardTimeout = time.Minute

// remoteListOffsetsTimeout is the broker default of
// remote.list.offsets.request.timeout.ms.
const remoteListOffsetsTimeout = 30 * time.Second

// transactionMaxTimeout is the broker default of transaction.max.timeout.ms,
// the longest transaction timeout an InitProducerId may set (the broker
// rejects a longer one with INVALID_TRANSACTION_TIMEOUT).
const transactionMaxTimeout = 15 * time.Minute

// GroupLapse is added to a member's rebalance timeout to bound how long the
// coordinator may hold its JoinGroup or SyncGroup (GroupHold): it delays
// a new group's first rebalance by group.initial.rebalance.delay.ms (3 s
// by default) and a SyncGroup waits for the group's write. The Java
// client allows the same 5 s beyond the rebalance timeout
// (AbstractCoordinator.JOIN_GROUP_TIMEOUT_LAPSE).
const GroupLapse = 5 * time.Second

// GroupRebalanceFloor is the least rebalance timeout GroupHold assumes of
// a group: the coordinator holds a join until every member has rejoined,
// for up to the LARGEST rebalance timeout among the group's members, not
// the joining member's own, and one link sees only its own member's. The
// Java client's and librdkafka's default (max.poll.interval.ms) is 5
// minutes: a franz-go member (60 s by default) in a group with Java
// members may wait that long on a healthy coordinator.
const GroupRebalanceFloor = 5 * time.Minute

// GroupHold is how long the coordinator may hold a JoinGroup, or the
// SyncGroup after it, of a member that joined with this rebalance
// timeout.
func GroupHold(rebalance time.Duration) time.Duration {
	return max(rebalance, GroupRebalanceFloor) + GroupLapse
}

// produce reads ProduceRequest: v0-2 acks INT16, timeout_ms INT32; v3-8
// transactional_id NULLABLE_STRING first; v9+ (flexible, header v2)
// transactional_id COMPACT_NULLABLE_STRING first. The prefix is the same up
// to v13 (v13 replaced the topic name by a topic id, later in the body).
func (p *parser) produce(r Request, flexible bool) (Request, bool) {
	const ackTimeout = 6 // acks INT16, timeout_ms INT32
	if r.APIVersion < 3 {
		if !p.header(false, ackTimeout) || !p.have(ackTimeout, 0) {
			return r, false
		}
	} else {
		if !p.header(flexible, minStringLen(flexible)+ackTimeout) {
			return r, false
		}
		n, ok := p.stringLen(flexible, true, ackTimeout)
		if !ok || !p.have(n+ackTimeout, 0) {
			return r, false
		}
		p.pos += n
	}
	acks := p.int16()
	timeout := p.int32()
	if acks == 0 {
		r.NoResponse = true
		return r, true
	}
	r.Hold = millis(timeout)
	return r, true
}

// fetch reads FetchRequest: replica_id INT32 (v0-14), then max_wait_ms
// INT32. From v15 the replica id moved into the ReplicaState tagged field,
// which, like every tagged field, is written after the struct's untagged
// fields, so max_wait_ms is the first body field. Flexible (header v2) from
// v12; the prefix is unchanged through v18.
func (p *parser) fetch(r Request, flexible bool) (Request, bool) {
	n := 4
	if r.APIVersion <= 14 {
		n = 8
	}
	if !p.header(flexible, n) || !p.have(n, 0) {
		return r, false
	}
	p.pos += n - 4
	r.Hold = millis(p.int32())
	return r, true
}

// joinGroup reads JoinGroupRequest: group_id STRING (v6+: COMPACT_STRING),
// session_timeout_ms INT32, then from v1 rebalance_timeout_ms INT32. v0 has
// no rebalance timeout; the definition says the session timeout is used in
// its place. Flexible (header v2) from v6; the prefix is unchanged through
// v9.
func (p *parser) joinGroup(r Request, flexible bool) (Request, bool) {
	timeouts := 4
	if r.APIVersion >= 1 {
		timeouts = 8
	}
	if !p.header(flexible, minStringLen(flexible)+timeouts) {
		return r, false
	}
	n, ok := p.stringLen(flexible, false, timeouts)
	if !ok || !p.have(n+timeouts, 0) {
		return r, false
	}
	p.pos += n
	timeout := p.int32() // session_timeout_ms
	if r.APIVersion >= 1 {
		timeout = p.int32() // rebalance_timeout_ms
	}
	r.RebalanceTimeout = millis(timeout)
	r.Hold = GroupHold(r.RebalanceTimeout)
	return r, true
}

// initProducerID reads InitProducerIdRequest: transactional_id
// NULLABLE_STRING (v2+: COMPACT_NULLABLE_STRING), then
// transaction_timeout_ms INT32. Flexible (header v2) from v2; v3 added
// producer_id and producer_epoch after them, so the prefix is unchanged
// through v5. A null transactional_id is an idempotent producer's: the
// broker allocates a producer id and writes no transaction log record.
func (p *parser) initProducerID(r Request, flexible bool) (Request, bool) {
	const timeout = 4 // transaction_timeout_ms INT32
	if !p.header(flexible, minStringLen(flexible)+timeout) {
		return r, false
	}
	n, ok := p.stringLenOrNull(flexible, true, timeout)
	null := n < 0
	n = max(n, 0)
	if !ok || !p.have(n+timeout, 0) {
		return r, false
	}
	id := txnID(p.b[p.pos : p.pos+n])
	p.pos += n
	ms := millis(p.int32())
	if null {
		r.Hold = offsetsCommitTimeout
		return r, true
	}
	if ms > 0 {
		r.TxnTimeout, r.TxnID = ms, id
	}
	r.Hold = max(ms, transactionMaxTimeout)
	return r, true
}

// txnRequest reads the transactional_id that AddPartitionsToTxn v0-3,
// AddOffsetsToTxn and EndTxn start with: STRING (v3+, flexible, header v2:
// COMPACT_STRING). AddPartitionsToTxn v4+ (KIP-890, sent by brokers)
// starts with an array of transactions instead, each with its own
// transactional id and timeout: it gets transaction.max.timeout.ms.
func (p *parser) txnRequest(r Request, flexible bool) (Request, bool) {
	r.Hold = transactionMaxTimeout
	if r.APIKey == keyAddPartitionsToTxn && r.APIVersion >= 4 {
		return r, true
	}
	if !p.header(flexible, minStringLen(flexible)) {
		return r, false
	}
	n, ok := p.stringLen(flexible, false, 0)
	if !ok || !p.have(n, 0) {
		return r, false
	}
	r.TxnBound, r.TxnID = true, txnID(p.b[p.pos:p.pos+n])
	p.pos += n
	return r, true
}

// txnID hashes a transactional id: 64-bit FNV-1a.
func txnID(b []byte) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for _, c := range b {
		h ^= uint64(c)
		h *= prime
	}
	return h
}

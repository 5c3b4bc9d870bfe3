package kafkawire

import "errors"

// Quota throttling (KIP-219). A broker that throttles a client for a quota
// sends the response at once, carrying throttle_time_ms, and then reads
// nothing more from that connection for as long ("throttle by muting the
// channel", KafkaApis), for the response versions where the response's
// shouldClientThrottle is true. Clients that follow KIP-219 send nothing to
// the broker meanwhile; a client that does sees its next request wait out
// the throttle. For older versions the broker delays the response itself
// instead, and the connection is not muted after it.

// MaxThrottleWindow is the most response payload bytes ResponseThrottle
// ever asks for: a Produce or ApiVersions response whose throttle comes
// later than that is not read.
const MaxThrottleWindow = MaxPrefix

// ErrNoThrottle reports a response whose throttle this package does not
// read: its version carries none that the broker applies after it, or its
// layout is not read (the delegation-token APIs, an ApiVersions response
// with an error, a Produce version newer than this package knows).
var ErrNoThrottle = errors.New("kafkawire: no throttle read from this response")

// Where a response's throttle_time_ms is.
const (
	throttleNone        = iota // no throttle applied after the response, or not read
	throttleFirst              // the first body field
	throttleAfterError         // after an INT16 error_code (OffsetDelete)
	throttleProduce            // after the responses (Produce)
	throttleAPIVersions        // after error_code and api_keys (ApiVersions)
)

// throttleInfo says, for one api_key, from which response version the
// broker applies the throttle after the response (shouldClientThrottle)
// and where the field is.
type throttleInfo struct {
	after  int16 // first version; the field is there in every version from it
	layout uint8
}

// throttles is indexed by api_key (TestThrottleTableMatchesKmsg checks it,
// and every layout, against franz-go's kmsg for every key and version).
// Keys absent from it (inter-broker and KRaft APIs without a throttle,
// SaslHandshake, SaslAuthenticate) have no throttle to read.
var throttles = [...]throttleInfo{
	0:  {6, throttleProduce},     // Produce
	1:  {8, throttleFirst},       // Fetch
	2:  {3, throttleFirst},       // ListOffsets
	3:  {6, throttleFirst},       // Metadata
	8:  {4, throttleFirst},       // OffsetCommit
	9:  {4, throttleFirst},       // OffsetFetch
	10: {2, throttleFirst},       // FindCoordinator
	11: {3, throttleFirst},       // JoinGroup
	12: {2, throttleFirst},       // Heartbeat
	13: {2, throttleFirst},       // LeaveGroup
	14: {2, throttleFirst},       // SyncGroup
	15: {2, throttleFirst},       // DescribeGroups
	16: {2, throttleFirst},       // ListGroups
	18: {2, throttleAPIVersions}, // ApiVersions
	19: {3, throttleFirst},       // CreateTopics
	20: {2, throttleFirst},       // DeleteTopics
	21: {1, throttleFirst},       // DeleteRecords
	22: {1, throttleFirst},       // InitProducerId
	23: {2, throttleFirst},       // OffsetForLeaderEpoch (applied after from v0; the field from v2)
	24: {1, throttleFirst},       // AddPartitionsToTxn
	25: {1, throttleFirst},       // AddOffsetsToTxn
	26: {1, throttleFirst},       // EndTxn
	28: {1, throttleFirst},       // TxnOffsetCommit
	29: {1, throttleFirst},       // DescribeAcls
	30: {1, throttleFirst},       // CreateAcls
	31: {1, throttleFirst},       // DeleteAcls
	32: {2, throttleFirst},       // DescribeConfigs
	33: {1, throttleFirst},       // AlterConfigs
	34: {1, throttleFirst},       // AlterReplicaLogDirs
	35: {1, throttleFirst},       // DescribeLogDirs
	37: {1, throttleFirst},       // CreatePartitions
	// 38-41, the delegation-token APIs: the throttle comes after the
	// token's fields; not read.
	42: {1, throttleFirst},      // DeleteGroups
	43: {0, throttleFirst},      // ElectLeaders
	44: {0, throttleFirst},      // IncrementalAlterConfigs
	45: {0, throttleFirst},      // AlterPartitionReassignments
	46: {0, throttleFirst},      // ListPartitionReassignments
	47: {0, throttleAfterError}, // OffsetDelete
	48: {0, throttleFirst},      // DescribeClientQuotas
	49: {0, throttleFirst},      // AlterClientQuotas
	50: {0, throttleFirst},      // DescribeUserScramCredentials
	51: {0, throttleFirst},      // AlterUserScramCredentials
	56: {0, throttleFirst},      // AlterPartition
	57: {0, throttleFirst},      // UpdateFeatures
	59: {0, throttleFirst},      // FetchSnapshot
	60: {0, throttleFirst},      // DescribeCluster
	61: {0, throttleFirst},      // DescribeProducers
	62: {0, throttleFirst},      // BrokerRegistration
	63: {0, throttleFirst},      // BrokerHeartbeat
	64: {0, throttleFirst},      // UnregisterBroker
	65: {0, throttleFirst},      // DescribeTransactions
	66: {0, throttleFirst},      // ListTransactions
	67: {0, throttleFirst},      // AllocateProducerIds
	68: {0, throttleFirst},      // ConsumerGroupHeartbeat
	69: {0, throttleFirst},      // ConsumerGroupDescribe
	70: {0, throttleFirst},      // ControllerRegistration
	71: {0, throttleFirst},      // GetTelemetrySubscriptions
	72: {0, throttleFirst},      // PushTelemetry
	73: {0, throttleFirst},      // AssignReplicasToDirs
	74: {0, throttleFirst},      // ListConfigResources
	75: {0, throttleFirst},      // DescribeTopicPartitions
	76: {0, throttleFirst},      // ShareGroupHeartbeat
	77: {0, throttleFirst},      // ShareGroupDescribe
	78: {0, throttleFirst},      // ShareFetch
	79: {0, throttleFirst},      // ShareAcknowledge
	80: {0, throttleFirst},      // AddRaftVoter
	81: {0, throttleFirst},      // RemoveRaftVoter
	82: {0, throttleFirst},      // UpdateRaftVoter
	88: {0, throttleFirst},      // StreamsGroupHeartbeat
	89: {0, throttleFirst},      // StreamsGroupDescribe
	90: {0, throttleFirst},      // DescribeShareGroupOffsets
	91: {0, throttleFirst},      // AlterShareGroupOffsets
	92: {0, throttleFirst},      // DeleteShareGroupOffsets
	93: {0, throttleFirst},      // StreamsGroupTopologyDescriptionUpdate
	94: {0, throttleFirst},      // UnregisterController
}

// throttleLayout is where a response of key and version carries a
// throttle the broker applies after sending it, throttleNone if it
// carries none or this package does not read it. A version newer than
// the package knows keeps its key's layout when the throttle is the first
// body field (new fields are appended or tagged); otherwise it is not
// read.
func throttleLayout(key, version int16) uint8 {
	if key < 0 || int(key) >= len(throttles) {
		return throttleNone
	}
	t := throttles[key]
	if t.layout == throttleNone || version < t.after {
		return throttleNone
	}
	if a, _ := lookup(key); version > a.maxVersion && t.layout != throttleFirst {
		return throttleNone
	}
	return t.layout
}

// ThrottleAfter reports whether a response of this api_key and version
// may carry a throttle that the broker applies after sending it, and that
// ResponseThrottle reads.
func ThrottleAfter(key, version int16) bool {
	return throttleLayout(key, version) != throttleNone
}

// responseHeaderFlexible reports whether the response header of key and
// version is v1 (with a tagged-field section). ApiVersions responses use
// header v0 in every version, so that a client can read one whatever
// version it asked for.
func responseHeaderFlexible(key, version int16) bool {
	a, ok := lookup(key)
	if !ok || key == keyAPIVersions {
		return false
	}
	return a.flexibleFrom != never && version >= a.flexibleFrom
}

const keyAPIVersions = 18

// ResponseThrottle reads throttle_time_ms from b, the first bytes of the
// payload of a response (its correlation id first) to a request of this
// api_key and version, for which ThrottleAfter is true. complete says
// that b is the whole payload. It returns need > len(b) when it needs the
// first need bytes: the throttle's own when it is at a fixed offset, and
// MaxThrottleWindow (the whole payload, as much of it as the caller has)
// when it follows a body that has to be walked, so that a caller never
// walks a large response more than twice; ErrNoThrottle
// when the response carries no throttle this package reads; ErrNotKafka
// when b cannot be such a response; ErrTooLong when the throttle lies
// past MaxThrottleWindow. A negative throttle reads as 0.
// ResponseThrottle does not allocate and does not retain b.
func ResponseThrottle(key, version int16, b []byte, complete bool) (ms int32, need int, err error) {
	layout := throttleLayout(key, version)
	if layout == throttleNone {
		return 0, 0, ErrNoThrottle
	}
	p := parser{b: b, complete: complete}
	ms, ok := p.throttle(key, version, layout)
	switch {
	case p.err != nil:
		return 0, 0, p.err
	case !ok && (layout == throttleProduce || layout == throttleAPIVersions):
		return 0, max(p.need, MaxThrottleWindow), nil
	case !ok:
		return 0, p.need, nil
	case ms < 0:
		ms = 0
	}
	return ms, 0, nil
}

func (p *parser) throttle(key, version int16, layout uint8) (int32, bool) {
	flexible := responseHeaderFlexible(key, version)
	tags := 0
	if flexible {
		tags = 1
	}
	if !p.have(4, tags+4) { // correlation_id
		return 0, false
	}
	p.pos += 4
	if flexible && !p.tags(4) {
		return 0, false
	}
	switch layout {
	case throttleAfterError:
		if !p.have(2, 4) {
			return 0, false
		}
		p.pos += 2
	case throttleProduce:
		if !p.produceResponses(version) {
			return 0, false
		}
	case throttleAPIVersions:
		if !p.apiKeys(version >= apis[keyAPIVersions].flexibleFrom) {
			return 0, false
		}
	}
	if !p.have(4, 0) {
		return 0, false
	}
	return p.int32(), true
}

// count reads a non-nullable array's element count followed by at
// least rest needed bytes: an INT32, or in flexible versions a
// COMPACT_ARRAY's UNSIGNED_VARINT count+1. Null (-1, or 0 compact) is
// malformed: no array this package walks is nullable, and the Java
// readers refuse it ("non-nullable field ... was serialized as null").
func (p *parser) count(compact bool, rest int) (int, bool) {
	if compact {
		n, ok := p.uvarint(rest)
		if ok && n == 0 {
			return 0, p.fail()
		}
		return n - 1, ok
	}
	if !p.have(4, rest) {
		return 0, false
	}
	n := p.int32()
	if n < 0 {
		return 0, p.fail()
	}
	return int(n), true
}

// skipString skips a string followed by at least rest needed bytes.
func (p *parser) skipString(compact, nullable bool, rest int) bool {
	n, ok := p.stringLen(compact, nullable, rest)
	if !ok || !p.have(n, rest) {
		return false
	}
	p.pos += n
	return true
}

// produceResponses skips a ProduceResponse's responses (ProduceResponse.json):
// per topic its name (v13+: its topic_id) and partitions, per partition index, error_code,
// base_offset, log_append_time_ms (v2+), log_start_offset (v5+),
// record_errors and error_message (v8+), and in flexible versions (v9+) a
// tagged-field section per partition, per record error and per topic. The
// throttle follows.
func (p *parser) produceResponses(version int16) bool {
	f := version >= apis[keyProduce].flexibleFrom
	topics, ok := p.count(f, 4)
	if !ok {
		return false
	}
	fixed := 4 + 2 + 8 // index, error_code, base_offset
	if version >= 2 {
		fixed += 8
	}
	if version >= 5 {
		fixed += 8
	}
	for range topics {
		if version >= 13 { // topic_id, a UUID, instead of the name
			if !p.have(16, 4) {
				return false
			}
			p.pos += 16
		} else if !p.skipString(f, false, 4) {
			return false
		}
		parts, ok := p.count(f, 4)
		if !ok {
			return false
		}
		for range parts {
			if !p.have(fixed, 4) {
				return false
			}
			p.pos += fixed
			if version >= 8 {
				errs, ok := p.count(f, 4)
				if !ok {
					return false
				}
				for range errs {
					if !p.have(4, 4) { // batch_index
						return false
					}
					p.pos += 4
					if !p.skipString(f, true, 4) || (f && !p.tags(4)) {
						return false
					}
				}
				if !p.skipString(f, true, 4) { // error_message
					return false
				}
			}
			if f && !p.tags(4) {
				return false
			}
		}
		if f && !p.tags(4) {
			return false
		}
	}
	return true
}

// apiKeys skips an ApiVersionsResponse's error_code and api_keys (each
// api_key, min_version, max_version, and in flexible versions a
// tagged-field section). A response with an error is not read: a broker
// answers a version it does not support with error 35 in the v0 layout.
func (p *parser) apiKeys(flexible bool) bool {
	if !p.have(2, 5) {
		return false
	}
	if p.int16() != 0 {
		p.err = ErrNoThrottle
		return false
	}
	n, ok := p.count(flexible, 4)
	if !ok {
		return false
	}
	for range n {
		if !p.have(6, 4) {
			return false
		}
		p.pos += 6
		if flexible && !p.tags(4) {
			return false
		}
	}
	return true
}

package kafkawire

// Kafka API keys whose request this package reads beyond the correlation id,
// or treats specially. Names follow the Kafka message definitions
// (clients/src/main/resources/common/message/<Name>Request.json).
const (
	keyProduce                     = 0
	keyFetch                       = 1
	keyListOffsets                 = 2
	keyControlledShutdown          = 7
	keyOffsetCommit                = 8
	keyOffsetFetch                 = 9
	keyJoinGroup                   = 11
	keyHeartbeat                   = 12
	keyLeaveGroup                  = 13
	keySyncGroup                   = 14
	keySaslHandshake               = 17
	keyCreateTopics                = 19
	keyDeleteTopics                = 20
	keyDeleteRecords               = 21
	keyInitProducerID              = 22
	keyAddPartitionsToTxn          = 24
	keyAddOffsetsToTxn             = 25
	keyEndTxn                      = 26
	keyTxnOffsetCommit             = 28
	keyCreateACLs                  = 30
	keyDeleteACLs                  = 31
	keyAlterConfigs                = 33
	keyCreateDelegationToken       = 38
	keyRenewDelegationToken        = 39
	keyExpireDelegationToken       = 40
	keyCreatePartitions            = 37
	keyDeleteGroups                = 42
	keyElectLeaders                = 43
	keyIncrementalAlterConfigs     = 44
	keyAlterPartitionReassignments = 45
	keyListPartitionReassignments  = 46
	keyOffsetDelete                = 47
	keySaslAuthenticate            = 36
	keyAlterClientQuotas           = 49
	keyAlterUserScramCredentials   = 51
	keyUpdateFeatures              = 57
	keyConsumerGroupHeartbeat      = 68
	keyShareGroupHeartbeat         = 76
	keyShareFetch                  = 78
	keyShareAcknowledge            = 79
	keyAddRaftVoter                = 80
	keyStreamsGroupHeartbeat       = 88
	keyDescribeShareGroupOffsets   = 90
	keyAlterShareGroupOffsets      = 91
	keyDeleteShareGroupOffsets     = 92
	keyStreamsGroupTopologyUpdate  = 93
)

// never is the flexibleFrom value of an API that has no flexible version
// ("flexibleVersions": "none").
const never = -1

// apiInfo is what this package knows about one api_key.
type apiInfo struct {
	// maxVersion is the highest request version whose layout this package
	// knows: the one franz-go's kmsg v1.15.1 (MaxVersion) encodes. A newer
	// version may have added a field that lets the broker hold the request,
	// as ListOffsets v10 added timeout_ms, so ParseRequest reports such a
	// request as HoldUnknown (or, for Produce, ErrUnknownVersion).
	maxVersion int16
	// flexibleFrom is the first flexible version (KIP-482), the N of the
	// message definition's "flexibleVersions": "N+", or never. Every
	// flexibleVersions value in the Kafka message definitions is open-ended,
	// so a version above maxVersion is flexible exactly when it is >= N.
	flexibleFrom int16
}

// apis is indexed by api_key. It lists every key franz-go's kmsg v1.15.1
// knows (0 through 94, no gaps); TestAPITableMatchesKmsg checks both columns
// against kmsg for every key and version.
var apis = [...]apiInfo{
	0:  {13, 9},    // Produce
	1:  {18, 12},   // Fetch
	2:  {11, 6},    // ListOffsets
	3:  {13, 9},    // Metadata
	4:  {7, 4},     // LeaderAndIsr
	5:  {4, 2},     // StopReplica
	6:  {8, 6},     // UpdateMetadata
	7:  {3, 3},     // ControlledShutdown (v0 uses request header v0)
	8:  {10, 8},    // OffsetCommit
	9:  {10, 6},    // OffsetFetch
	10: {6, 3},     // FindCoordinator
	11: {9, 6},     // JoinGroup
	12: {4, 4},     // Heartbeat
	13: {5, 4},     // LeaveGroup
	14: {5, 4},     // SyncGroup
	15: {6, 5},     // DescribeGroups
	16: {5, 3},     // ListGroups
	17: {1, never}, // SaslHandshake
	18: {5, 3},     // ApiVersions
	19: {7, 5},     // CreateTopics
	20: {6, 4},     // DeleteTopics
	21: {2, 2},     // DeleteRecords
	22: {5, 2},     // InitProducerId
	23: {4, 4},     // OffsetForLeaderEpoch
	24: {5, 3},     // AddPartitionsToTxn
	25: {4, 3},     // AddOffsetsToTxn
	26: {5, 3},     // EndTxn
	27: {2, 1},     // WriteTxnMarkers
	28: {6, 3},     // TxnOffsetCommit
	29: {3, 2},     // DescribeAcls
	30: {3, 2},     // CreateAcls
	31: {3, 2},     // DeleteAcls
	32: {4, 4},     // DescribeConfigs
	33: {2, 2},     // AlterConfigs
	34: {2, 2},     // AlterReplicaLogDirs
	35: {5, 2},     // DescribeLogDirs
	36: {2, 2},     // SaslAuthenticate
	37: {3, 2},     // CreatePartitions
	38: {3, 2},     // CreateDelegationToken
	39: {2, 2},     // RenewDelegationToken
	40: {2, 2},     // ExpireDelegationToken
	41: {3, 2},     // DescribeDelegationToken
	42: {3, 2},     // DeleteGroups
	43: {2, 2},     // ElectLeaders
	44: {1, 1},     // IncrementalAlterConfigs
	45: {1, 0},     // AlterPartitionReassignments
	46: {0, 0},     // ListPartitionReassignments
	47: {0, never}, // OffsetDelete
	48: {1, 1},     // DescribeClientQuotas
	49: {1, 1},     // AlterClientQuotas
	50: {0, 0},     // DescribeUserScramCredentials
	51: {0, 0},     // AlterUserScramCredentials
	52: {2, 0},     // Vote
	53: {1, 1},     // BeginQuorumEpoch
	54: {1, 1},     // EndQuorumEpoch
	55: {2, 0},     // DescribeQuorum
	56: {3, 0},     // AlterPartition
	57: {2, 0},     // UpdateFeatures
	58: {0, 0},     // Envelope
	59: {1, 0},     // FetchSnapshot
	60: {2, 0},     // DescribeCluster
	61: {0, 0},     // DescribeProducers
	62: {4, 0},     // BrokerRegistration
	63: {2, 0},     // BrokerHeartbeat
	64: {0, 0},     // UnregisterBroker
	65: {0, 0},     // DescribeTransactions
	66: {2, 0},     // ListTransactions
	67: {0, 0},     // AllocateProducerIds
	68: {1, 0},     // ConsumerGroupHeartbeat
	69: {1, 0},     // ConsumerGroupDescribe
	70: {0, 0},     // ControllerRegistration
	71: {0, 0},     // GetTelemetrySubscriptions
	72: {0, 0},     // PushTelemetry
	73: {0, 0},     // AssignReplicasToDirs
	74: {1, 0},     // ListConfigResources
	75: {0, 0},     // DescribeTopicPartitions
	76: {1, 0},     // ShareGroupHeartbeat
	77: {1, 0},     // ShareGroupDescribe
	78: {2, 0},     // ShareFetch
	79: {2, 0},     // ShareAcknowledge
	80: {1, 0},     // AddRaftVoter
	81: {0, 0},     // RemoveRaftVoter
	82: {0, 0},     // UpdateRaftVoter
	83: {0, 0},     // InitializeShareGroupState
	84: {0, 0},     // ReadShareGroupState
	85: {1, 0},     // WriteShareGroupState
	86: {0, 0},     // DeleteShareGroupState
	87: {1, 0},     // ReadShareGroupStateSummary
	88: {1, 0},     // StreamsGroupHeartbeat
	89: {1, 0},     // StreamsGroupDescribe
	90: {1, 0},     // DescribeShareGroupOffsets
	91: {0, 0},     // AlterShareGroupOffsets
	92: {0, 0},     // DeleteShareGroupOffsets
	93: {0, 0},     // StreamsGroupTopologyDescriptionUpdate
	94: {0, 0},     // UnregisterController
}

// lookup returns what this package knows about key, ok false for an unknown
// key.
func lookup(key int16) (apiInfo, bool) {
	if key < 0 || int(key) >= len(apis) {
		return apiInfo{}, false
	}
	return apis[key], true
}

// requestHeaderVersion returns the request header version (0, 1 or 2) that a
// request of this api_key and api_version uses, ok false for an unknown key.
//
// The rule is the Kafka generator's (ApiMessageTypeGenerator,
// requestHeaderVersion): header v2 when the version is flexible, else v1;
// the one exception is ControlledShutdown v0, which predates client_id and
// uses header v0.
func requestHeaderVersion(key, version int16) (int, bool) {
	a, ok := lookup(key)
	if !ok {
		return 0, false
	}
	switch {
	case key == keyControlledShutdown && version == 0:
		return 0, true
	case a.flexibleFrom != never && version >= a.flexibleFrom:
		return 2, true
	default:
		return 1, true
	}
}

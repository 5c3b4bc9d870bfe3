// Package pinotwire reads the two payloads of Apache Pinot's single-stage
// broker→server transport, the Netty connection between a broker's
// ServerChannels and a server's QueryServer, for a proxy that sees the
// stream as length-prefixed frames (LengthFieldBasedFrameDecoder with a
// 4-byte big-endian length that excludes itself, in both directions):
//
//   - broker→server: a Thrift InstanceRequest (request.thrift) serialized
//     with TCompactProtocol. ParseRequest returns its requestId and the
//     remaining budget the broker sends as the query option timeoutMs.
//   - server→broker: a DataTable V4 (DataTableImplV4). MetadataOffset and
//     ResponseID find the REQUEST_ID metadata entry, which comes after the
//     data sections, without the proxy holding the whole response.
//
// The readers work on a window of the payload: they take the first bytes of
// it and either answer or say how long a prefix they need to go on (never
// more than a fixed limit). They never copy, allocate or panic.
package pinotwire

//go:build linux

package main

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
)

// Wire protocol shared by the bench client and the bench server.
//
// Every message is a frame: a 4-byte big-endian length, then that many bytes
// of payload (the framing Pinot and Kafka use). A request payload starts
// with an 8-byte head, then a 4-byte big-endian number: the payload length
// of the response the server must send back. The rest of the request
// payload is filler the server reads and discards. A response payload
// starts with bytes 4 to 8 of the request's head and is zeros after them.
//
// The head makes the requests readable by livenessproxy's protocol
// profiles, so that a framed run costs what a real one does:
//   - kafka: api_key 3 (Metadata), version 6, a correlation id; the
//     response starts with the correlation id, and the client_id length
//     the header reads next is the response length's top half (0). From
//     version 6 on the broker mutes a connection after a throttled
//     Metadata response, so the profile reads the throttle (0, the
//     zeros after the correlation id) from every response, as it does
//     for a current client's Fetch and Produce;
//   - pinot: a Thrift compact InstanceRequest with only its requestId
//     (0x16, zigzag varint, stop);
//   - none and length_field: zeros.
//
// So one server serves every scenario: request/response (200 B in, 2 KiB
// out), and bulk (1 MiB in, a 4-byte acknowledgement frame out).

const (
	hdrLen = 4
	// headLen is the request head before the response length.
	headLen = 8
	// minRequest is the shortest request payload: head and response length.
	minRequest = headLen + 4
	// maxRequest bounds what the server accepts (bulk frames are 1 MiB).
	maxRequest = 16 << 20
	// maxResponse bounds what a request may ask for.
	maxResponse = 1 << 20
)

// requestHead is the framing whose head every request carries: the
// livenessproxy framing of the run (-lp-framing). Every path gets the same
// requests.
var requestHead = "none"

// zeros is the source of every payload byte.
var zeros = make([]byte, maxResponse)

// makeRequest returns a complete request frame with a payload of payloadLen
// bytes asking for a response payload of respLen bytes, with the head of
// the given framing.
func makeRequest(payloadLen, respLen int, framing string) []byte {
	payloadLen = max(payloadLen, minRequest)
	b := make([]byte, hdrLen+payloadLen)
	binary.BigEndian.PutUint32(b[0:4], uint32(payloadLen))
	head := b[hdrLen : hdrLen+headLen]
	switch framing {
	case "kafka":
		binary.BigEndian.PutUint16(head[0:2], 3)    // Metadata
		binary.BigEndian.PutUint16(head[2:4], 6)    // version 6
		binary.BigEndian.PutUint32(head[4:8], 4242) // correlation id
	case "pinot":
		head[0], head[1], head[2] = 0x16, 0x02, 0x00 // requestId 1, stop
	}
	binary.BigEndian.PutUint32(b[hdrLen+headLen:], uint32(respLen))
	return b
}

// readResponse consumes one response frame and checks its length.
func readResponse(r *bufio.Reader, respLen int) error {
	var hdr [hdrLen]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return err
	}
	n := int(binary.BigEndian.Uint32(hdr[:]))
	if n != respLen {
		return fmt.Errorf("protocol: response payload %d B, want %d B", n, respLen)
	}
	if _, err := r.Discard(n); err != nil {
		return err
	}
	return nil
}

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
// of payload (the framing Pinot and Kafka use). A request payload starts with
// a 4-byte big-endian number: the payload length of the response the server
// must send back. The rest of the request payload is filler the server reads
// and discards. A response is a frame of zero bytes of the requested length.
//
// So one server serves every scenario: request/response (200 B in, 2 KiB
// out), and bulk (1 MiB in, an empty 4-byte acknowledgement frame out).

const (
	hdrLen = 4
	// maxRequest bounds what the server accepts (bulk frames are 1 MiB).
	maxRequest = 16 << 20
	// maxResponse bounds what a request may ask for.
	maxResponse = 1 << 20
)

// zeros is the source of every payload byte.
var zeros = make([]byte, maxResponse)

// makeRequest returns a complete request frame with a payload of payloadLen
// bytes asking for a response payload of respLen bytes.
func makeRequest(payloadLen, respLen int) []byte {
	if payloadLen < 4 {
		payloadLen = 4
	}
	b := make([]byte, hdrLen+payloadLen)
	binary.BigEndian.PutUint32(b[0:4], uint32(payloadLen))
	binary.BigEndian.PutUint32(b[4:8], uint32(respLen))
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

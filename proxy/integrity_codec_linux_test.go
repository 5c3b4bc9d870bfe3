package proxy

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
)

// integCodec makes and reads one profile's frames for
// TestDataPlaneIntegrity: the requests a plan sends and the answers its
// server gives, well-formed for the profile's protocol.
type integCodec interface {
	// hello is what a connection sends before its first request, naming
	// it (nil: the first request frame names it).
	hello(p *integPlan) []byte
	helloLen() int
	request(p *integPlan, seq int) []byte
	// response is the answer to request seq (nil: none, by protocol);
	// answers reports whether there is one.
	response(p *integPlan, seq int) []byte
	answers(p *integPlan, seq int) bool
	// hdrLen is how many bytes of a frame tell its whole length, frameLen.
	hdrLen() int
	frameLen(hdr []byte) int
	// connOf names the connection from its hello or first request frame.
	connOf(first []byte) (uint32, error)
	// respSeq is the request an answer frame answers.
	respSeq(frame []byte) (int, error)
	// ordered: answers come in the order of their requests.
	ordered() bool
	// maxPayload is the largest payload a frame can carry.
	maxPayload() int
}

// integIDSeq is the payload head of the opaque and length_field codecs:
// the connection and the request.
func integIDSeq(p *integPlan, seq int, body []byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, p.id)
	b = binary.BigEndian.AppendUint32(b, uint32(seq))
	return append(b, body...)
}

// lfCodec is the length_field framing (the opaque profile uses it with
// its defaults, and a hello): frame = offset bytes, the length field,
// then value+adjust bytes of payload.
type lfCodec struct {
	offset, length int
	adjust         int
	little         bool
	withHello      bool
}

func (c *lfCodec) hello(p *integPlan) []byte {
	if !c.withHello {
		return nil
	}
	return binary.BigEndian.AppendUint32([]byte("LPIT"), p.id)
}

func (c *lfCodec) helloLen() int {
	if c.withHello {
		return 8
	}
	return 0
}

func (c *lfCodec) hdrLen() int { return c.offset + c.length }

func (c *lfCodec) maxPayload() int {
	if c.length >= 4 {
		return 8 << 20
	}
	return min(1<<(8*c.length)-1+c.adjust, 8<<20)
}

// frame frames payload, its head bytes drawn from salt.
func (c *lfCodec) frame(payload []byte, salt []byte) []byte {
	b := append([]byte(nil), salt[:c.offset]...)
	v := uint64(len(payload) - c.adjust)
	field := make([]byte, c.length)
	for i := range c.length {
		shift := 8 * i
		if c.little {
			field[i] = byte(v >> shift)
		} else {
			field[c.length-1-i] = byte(v >> shift)
		}
	}
	return append(append(b, field...), payload...)
}

func (c *lfCodec) frameLen(hdr []byte) int {
	var v uint64
	field := hdr[c.offset : c.offset+c.length]
	for i := range field {
		if c.little {
			v |= uint64(field[i]) << (8 * i)
		} else {
			v = v<<8 | uint64(field[i])
		}
	}
	return c.hdrLen() + int(int64(v)+int64(c.adjust))
}

func (c *lfCodec) request(p *integPlan, seq int) []byte {
	body := integBytes(p.seed, 1, uint64(seq), max(p.reqSize[seq]-8, 0)+8)
	return c.frame(integIDSeq(p, seq, body[8:]), body)
}

func (c *lfCodec) response(p *integPlan, seq int) []byte {
	body := integBytes(p.seed, 2, uint64(seq), max(p.respSize[seq]-8, 0)+8)
	return c.frame(integIDSeq(p, seq, body[8:]), body)
}

func (c *lfCodec) payload(frame []byte) []byte { return frame[c.hdrLen():] }

func (c *lfCodec) connOf(first []byte) (uint32, error) {
	if c.withHello {
		if string(first[:4]) != "LPIT" {
			return 0, fmt.Errorf("hello %q", first)
		}
		return binary.BigEndian.Uint32(first[4:]), nil
	}
	if p := c.payload(first); len(p) >= 8 {
		return binary.BigEndian.Uint32(p), nil
	}
	return 0, fmt.Errorf("first frame of %d bytes", len(first))
}

func (c *lfCodec) respSeq(frame []byte) (int, error) {
	p := c.payload(frame)
	if len(p) < 8 {
		return 0, fmt.Errorf("answer of %d bytes", len(frame))
	}
	return int(binary.BigEndian.Uint32(p[4:])), nil
}

func (*lfCodec) ordered() bool { return true }

func (*lfCodec) answers(*integPlan, int) bool { return true }

// newLFCodec draws a length_field framing and sets it in s.
func newLFCodec(r *rand.Rand, s *policy.Settings) *lfCodec {
	c := &lfCodec{offset: []int{0, 0, 2, 5}[r.IntN(4)], length: []int{1, 2, 3, 4, 4, 8}[r.IntN(6)], little: r.IntN(2) == 0}
	switch r.IntN(3) {
	case 1:
		c.adjust = -(c.offset + c.length) // the length counts the whole frame
	case 2:
		c.adjust = 3
	}
	s.Framing.Type = policy.FramingLengthField
	s.Framing.LengthFieldOffset, s.Framing.LengthFieldLength = c.offset, c.length
	s.Framing.LengthAdjustment = c.adjust
	s.Framing.ByteOrder = policy.ByteOrderBig
	if c.little {
		s.Framing.ByteOrder = policy.ByteOrderLittle
	}
	s.Unanswered.Track = policy.TrackOn // else the proxy does not follow the frames
	return c
}

func (c *lfCodec) String() string {
	return "offset=" + strconv.Itoa(c.offset) + " length=" + strconv.Itoa(c.length) +
		" adjust=" + strconv.Itoa(c.adjust) + " little=" + strconv.FormatBool(c.little)
}

// be32 is the 4-byte big-endian length framing of kafka and pinot.
type be32 struct{}

func (be32) hello(*integPlan) []byte { return nil }
func (be32) helloLen() int           { return 0 }
func (be32) hdrLen() int             { return 4 }
func (be32) frameLen(hdr []byte) int { return 4 + int(binary.BigEndian.Uint32(hdr)) }
func (be32) maxPayload() int         { return 8 << 20 }
func framed4(payload []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(payload))), payload...)
}
func (pinotCodec) ordered() bool                { return false }
func (pinotCodec) answers(*integPlan, int) bool { return true }
func (pinotCodec) String() string               { return "InstanceRequests, DataTable answers out of order" }

// pinotCodec: InstanceRequests (a random brokerId makes them of any size,
// behind the query options the proxy reads) and DataTable answers (the
// variable section holds the size), answered out of order.
type pinotCodec struct{ be32 }

func (pinotCodec) request(p *integPlan, seq int) []byte {
	req := pinotsim.Request{ID: int64(p.id)<<32 | int64(seq), Table: "lpit",
		BrokerID: string(integBytes(p.seed, 1, uint64(seq), p.reqSize[seq]))}
	if p.kind[seq] != 0 {
		req.TimeoutMs = 8000 + int64(p.kind[seq])*500
	}
	return framed4(pinotsim.AppendRequest(nil, &req))
}

func (pinotCodec) response(p *integPlan, seq int) []byte {
	t := pinotsim.DataTable{Variable: integBytes(p.seed, 2, uint64(seq), p.respSize[seq]),
		Metadata: []pinotsim.Metadata{{Key: pinotsim.KeyRequestID, Value: strconv.FormatInt(int64(p.id)<<32|int64(seq), 10)}}}
	b, err := t.Append(nil)
	if err != nil {
		panic(err)
	}
	return framed4(b)
}

func (pinotCodec) connOf(first []byte) (uint32, error) {
	id, err := pinotsim.RequestID(first[4:])
	return uint32(id >> 32), err
}

func (pinotCodec) respSeq(frame []byte) (int, error) {
	id, err := pinotsim.ResponseID(frame[4:])
	return int(uint32(id)), err
}

// kafkaCodec: Produce (acks 0, 1 or all; the records make it of any
// size), Fetch (a short max_wait; the answer's record batches make it of
// any size) and Metadata requests, flexible versions, answered in order;
// a Produce with acks=0 gets no answer.
type kafkaCodec struct{ be32 }

func (kafkaCodec) ordered() bool { return true }

func (kafkaCodec) String() string { return "Produce v9, Fetch v12, Metadata v9, answers in order" }

func (kafkaCodec) answers(p *integPlan, seq int) bool { return kafkaKind(p, seq) != '0' }

// integClientID names a connection in its Kafka requests' client id.
func integClientID(id uint32) string { return fmt.Sprintf("lpit-%08x", id) }

// kafkaKind is what request seq is: 'p' produce, '0' produce acks=0, 'f'
// fetch, 'm' metadata.
func kafkaKind(p *integPlan, seq int) byte {
	k := p.kind[seq]
	switch {
	case k == 0:
		return '0'
	case k%4 == 0 || p.reqSize[seq] > 300:
		return 'p'
	case k%4 == 2:
		return 'm'
	}
	return 'f'
}

func (kafkaCodec) request(p *integPlan, seq int) []byte {
	var r kmsg.Request
	switch kafkaKind(p, seq) {
	case '0', 'p':
		pr := kmsg.NewPtrProduceRequest()
		pr.Acks, pr.TimeoutMillis = -1, 5000
		if kafkaKind(p, seq) == '0' {
			pr.Acks = 0
		} else if p.kind[seq]%2 == 1 {
			pr.Acks = 1
		}
		part := kmsg.NewProduceRequestTopicPartition()
		part.Records = integBytes(p.seed, 1, uint64(seq), p.reqSize[seq])
		pr.Topics = []kmsg.ProduceRequestTopic{{Topic: "lpit", Partitions: []kmsg.ProduceRequestTopicPartition{part}}}
		r = pr
	case 'f':
		fr := kmsg.NewPtrFetchRequest()
		fr.MaxWaitMillis, fr.MinBytes = int32(p.kind[seq])*10, 1
		r = fr
	default:
		r = kmsg.NewPtrMetadataRequest()
	}
	return kafkaRequest(r, integClientID(p.id), int32(seq))
}

// kafkaRequest frames r (a flexible version) with a request header v2.
func kafkaRequest(r kmsg.Request, clientID string, corr int32) []byte {
	r.SetVersion(map[int16]int16{0: 9, 1: 12, 3: 9}[r.Key()])
	b := binary.BigEndian.AppendUint32(nil, 0)
	b = binary.BigEndian.AppendUint16(b, uint16(r.Key()))
	b = binary.BigEndian.AppendUint16(b, uint16(r.GetVersion()))
	b = binary.BigEndian.AppendUint32(b, uint32(corr))
	b = binary.BigEndian.AppendUint16(b, uint16(len(clientID)))
	b = append(b, clientID...)
	b = append(b, 0) // no tagged fields
	b = r.AppendTo(b)
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b
}

func (kafkaCodec) response(p *integPlan, seq int) []byte {
	var r kmsg.Response
	switch kafkaKind(p, seq) {
	case '0':
		return nil
	case 'p':
		pr := kmsg.NewPtrProduceResponse()
		part := kmsg.NewProduceResponseTopicPartition()
		part.BaseOffset = int64(seq)
		pr.Topics = []kmsg.ProduceResponseTopic{{Topic: "lpit", Partitions: []kmsg.ProduceResponseTopicPartition{part}}}
		r = pr
	case 'f':
		fr := kmsg.NewPtrFetchResponse()
		part := kmsg.NewFetchResponseTopicPartition()
		part.RecordBatches = integBytes(p.seed, 2, uint64(seq), p.respSize[seq])
		fr.Topics = []kmsg.FetchResponseTopic{{Topic: "lpit", Partitions: []kmsg.FetchResponseTopicPartition{part}}}
		r = fr
	default:
		r = kmsg.NewPtrMetadataResponse()
	}
	r.SetVersion(map[int16]int16{0: 9, 1: 12, 3: 9}[r.Key()])
	b := binary.BigEndian.AppendUint32(nil, 0)
	b = binary.BigEndian.AppendUint32(b, uint32(seq))
	b = append(b, 0) // response header v1: no tagged fields
	b = r.AppendTo(b)
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b
}

func (kafkaCodec) connOf(first []byte) (uint32, error) {
	if len(first) < 14 {
		return 0, fmt.Errorf("request of %d bytes", len(first))
	}
	n := int(binary.BigEndian.Uint16(first[12:]))
	if len(first) < 14+n {
		return 0, fmt.Errorf("client id of %d bytes in a request of %d", n, len(first))
	}
	var id uint32
	if _, err := fmt.Sscanf(string(first[14:14+n]), "lpit-%08x", &id); err != nil {
		return 0, err
	}
	return id, nil
}

func (kafkaCodec) respSeq(frame []byte) (int, error) {
	if len(frame) < 8 {
		return 0, fmt.Errorf("answer of %d bytes", len(frame))
	}
	return int(binary.BigEndian.Uint32(frame[4:])), nil
}

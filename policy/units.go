package policy

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Duration is a time.Duration written in YAML as a Go duration: 10s, 500ms, 1m30s.
// A bare 0 is accepted, and disables the mechanism it controls; a negative
// value is decoded (a bare negative integer as nanoseconds) and rejected by
// validation.
type Duration time.Duration

// D returns the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// Enabled reports whether the value is positive.
func (d Duration) Enabled() bool { return d > 0 }

func (d Duration) String() string { return time.Duration(d).String() }

// MarshalYAML writes the duration as the config does: 10s, 1m30s.
func (d Duration) MarshalYAML() (any, error) { return d.String(), nil }

// ParseDuration parses a duration as written in the config.
func ParseDuration(s string) (Duration, error) {
	s = strings.TrimSpace(s)
	if s == "0" || s == "-1" {
		n, _ := strconv.Atoi(s)
		return Duration(n), nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("invalid duration %q (use a Go duration such as 10s or 500ms)", s)
	}
	return Duration(v), nil
}

// Size is a byte count written in YAML as 16MiB, 64KiB, 512B or a plain integer.
// 0 disables the mechanism it controls; a negative value is decoded and
// rejected by validation.
type Size int64

// Byte size units (binary).
const (
	B   Size = 1
	KiB Size = 1 << 10
	MiB Size = 1 << 20
	GiB Size = 1 << 30
)

// sizeUnits are the suffixes ParseSize takes, longest first within a
// unit: the IEC ones, then Kubernetes' spelling of the same binary units
// (16Mi is 16MiB), then plain bytes. String writes the first three.
var sizeUnits = []struct {
	suffix string
	mult   Size
}{{"GiB", GiB}, {"MiB", MiB}, {"KiB", KiB}, {"Gi", GiB}, {"Mi", MiB}, {"Ki", KiB}, {"B", B}}

func (s Size) String() string {
	for _, u := range sizeUnits[:3] {
		if s != 0 && s%u.mult == 0 {
			return strconv.FormatInt(int64(s/u.mult), 10) + u.suffix
		}
	}
	return strconv.FormatInt(int64(s), 10) + "B"
}

// MarshalYAML writes the size as the config does: 16MiB.
func (s Size) MarshalYAML() (any, error) { return s.String(), nil }

// ParseSize parses a size as written in the config.
func ParseSize(str string) (Size, error) {
	t := strings.TrimSpace(str)
	mult := B
	for _, u := range sizeUnits {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n > int64((1<<62)/mult) || n < -int64((1<<62)/mult) {
		return 0, fmt.Errorf("invalid size %q (use an integer with B, KiB, MiB or GiB, such as 16MiB; Kubernetes' Ki, Mi and Gi are the same units)", str)
	}
	return Size(n) * mult, nil
}

//go:build !linux

package proxy

import "errors"

// epollSet has no implementation off Linux: the parker is not made, and
// idle links keep their goroutines.
type epollSet struct{}

func newEpollSet() (*epollSet, error) {
	return nil, errors.New("parking idle links needs Linux's epoll")
}

func (*epollSet) run(func(uint64)) error { return nil }

func (*epollSet) watch(int, uint64) error { return errors.ErrUnsupported }

func (*epollSet) watchEnd(int, uint64) error { return errors.ErrUnsupported }

func (*epollSet) close() {}

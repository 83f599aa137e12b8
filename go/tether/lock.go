package tether

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
)

// AcquireOptions are Acquire's optional parts.
type AcquireOptions struct {
	// Payload is kept with the hold, e.g. the device plan a scheduler chose
	// for the pod; whoever reads the holder reads it.
	Payload []byte
	// Wait is how long to wait in the lock's FIFO queue. 0: do not wait;
	// a held lock answers FAILED_PRECONDITION naming its holder.
	Wait time.Duration
	// LeaseID attaches the hold to a TTL lease (GrantLease): it ends when
	// the lease does.
	LeaseID uint64
	// OnQueued, if set, is told the queue position when the acquire waits.
	OnQueued func(position uint32)
}

type acquireRequest struct {
	RequestID     *requestID `json:"requestId"`
	Key           LockKey    `json:"key"`
	Pod           Pod        `json:"pod"`
	Payload       []byte     `json:"payload,omitempty"`
	WaitTimeoutMs uint64     `json:"waitTimeoutMs,string"`
	LeaseID       uint64     `json:"leaseId,string"`
}

type acquireResponse struct {
	State         string `json:"state"`
	Hold          *Hold  `json:"hold"`
	QueuePosition uint32 `json:"queuePosition"`
}

// Acquire takes key for pod, waiting in FIFO order for up to opts.Wait, and
// returns the hold with its fencing token. The wait keeps its place across
// a leader change (the retried request has the same id); cancelling ctx
// gives the place up. A wait that runs out answers DEADLINE_EXCEEDED.
func (c *Client) Acquire(ctx context.Context, key LockKey, pod Pod, opts AcquireOptions) (*Hold, error) {
	id, done := c.nextRequestID()
	defer done()
	body, err := json.Marshal(acquireRequest{
		RequestID:     id,
		Key:           key,
		Pod:           pod,
		Payload:       opts.Payload,
		WaitTimeoutMs: uint64(opts.Wait / time.Millisecond),
		LeaseID:       opts.LeaseID,
	})
	if err != nil {
		return nil, err
	}
	var hold *Hold
	err = c.retrying(ctx, func(i int, alive func()) error {
		response, err := c.post(ctx, i, "/v1/lock/acquire", body)
		if err != nil {
			return err
		}
		alive() // the stream is open: its budget counts from now
		err = lines(response, func(raw json.RawMessage) (bool, error) {
			alive()
			var answer acquireResponse
			if err := json.Unmarshal(raw, &answer); err != nil {
				return false, badAnswer("an acquire's answer: %v", err)
			}
			switch answer.State {
			case "GRANTED":
				hold = answer.Hold
				return true, nil
			case "QUEUED":
				if opts.OnQueued != nil {
					opts.OnQueued(answer.QueuePosition)
				}
				return false, nil
			default:
				return false, badAnswer("an acquire answered state %q", answer.State)
			}
		})
		if errors.Is(err, io.ErrUnexpectedEOF) {
			// The replica went away mid-wait: ask again, same id.
			return fmt.Errorf("tether: the acquire's stream ended early: %w", err)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if hold == nil {
		return nil, errors.New("tether: an acquire was granted without a hold")
	}
	return hold, nil
}

// Release gives up pod's hold on key (token: the hold's fencing token) and
// returns the hold it was handed to, if anyone waited.
func (c *Client) Release(ctx context.Context, key LockKey, podUID string, token uint64, outcome Outcome) (*Hold, error) {
	id, done := c.nextRequestID()
	defer done()
	request := struct {
		RequestID *requestID `json:"requestId"`
		Key       LockKey    `json:"key"`
		PodUID    string     `json:"podUid"`
		Token     uint64     `json:"token,string"`
		Outcome   Outcome    `json:"outcome,omitempty"`
	}{id, key, podUID, token, outcome}
	var response struct {
		NextHolder *Hold `json:"nextHolder"`
	}
	if err := c.call(ctx, "/v1/lock/release", request, &response); err != nil {
		return nil, err
	}
	return response.NextHolder, nil
}

// Holder is key's hold (nil when free), read linearizably from the leader.
func (c *Client) Holder(ctx context.Context, key LockKey) (*Hold, error) {
	var response struct {
		Hold *Hold `json:"hold"`
	}
	err := c.call(ctx, "/v1/lock/holder", struct {
		Key LockKey `json:"key"`
	}{key}, &response)
	return response.Hold, err
}

// Get is key's holder and queue.
func (c *Client) Get(ctx context.Context, key LockKey) (*LockState, error) {
	var response struct {
		Lock LockState `json:"lock"`
	}
	err := c.call(ctx, "/v1/lock/get", struct {
		Key LockKey `json:"key"`
	}{key}, &response)
	return &response.Lock, err
}

// Withdraw ends pod's wait on key, or gives back the hold it got: what a
// caller does once it gave up on an acquire (idempotent). Once every
// replica reads log format 9, only what this client queued or was granted:
// a wait or hold another client's acquire of the pod took over is kept.
func (c *Client) Withdraw(ctx context.Context, key LockKey, podUID string) error {
	id, done := c.nextRequestID()
	defer done()
	request := struct {
		RequestID *requestID `json:"requestId"`
		Key       LockKey    `json:"key"`
		PodUID    string     `json:"podUid"`
	}{id, key, podUID}
	var response json.RawMessage
	return c.call(ctx, "/v1/lock/withdraw", request, &response)
}

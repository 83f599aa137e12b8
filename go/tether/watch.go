package tether

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// WatchOptions choose what a watch sends.
type WatchOptions struct {
	// Start is the first revision to send; nil = from now on.
	Start *Revision
	// KeyPrefix keeps only keys with this prefix, e.g. "node/".
	KeyPrefix string
	// Kinds keeps only these event kinds, e.g. "NodeReady" (empty = all).
	Kinds []string
}

// Watcher is an open watch. Next blocks for the next events; across a
// replica going away it resumes from where it was, gap-free.
type Watcher struct {
	client  *Client
	ctx     context.Context
	cancel  context.CancelFunc
	options WatchOptions
	batches chan watchBatch
}

type watchBatch struct {
	events []Event
	err    error
}

type watchResponse struct {
	Events []Event   `json:"events"`
	Next   *Revision `json:"next"`
}

// Watch opens a watch; Close it when done.
func (c *Client) Watch(ctx context.Context, options WatchOptions) *Watcher {
	ctx, cancel := context.WithCancel(ctx)
	w := &Watcher{client: c, ctx: ctx, cancel: cancel, options: options, batches: make(chan watchBatch, 16)}
	go w.run()
	return w
}

// Next returns the next events, or the error that ended the watch (an
// OUT_OF_RANGE *Error when Start was older than what is retained: re-read
// the state, then watch from now; ctx's error once it ends).
func (w *Watcher) Next() ([]Event, error) {
	select {
	case batch, ok := <-w.batches:
		if !ok {
			return nil, w.ctx.Err()
		}
		return batch.events, batch.err
	case <-w.ctx.Done():
		return nil, w.ctx.Err()
	}
}

// Close ends the watch.
func (w *Watcher) Close() { w.cancel() }

func (w *Watcher) run() {
	defer close(w.batches)
	start := w.options.Start
	err := w.client.retrying(w.ctx, func(i int, alive func()) error {
		body, err := json.Marshal(struct {
			Start     *Revision `json:"start,omitempty"`
			Kinds     []string  `json:"kinds,omitempty"`
			KeyPrefix string    `json:"keyPrefix,omitempty"`
		}{start, w.options.Kinds, w.options.KeyPrefix})
		if err != nil {
			return err
		}
		response, err := w.client.post(w.ctx, i, "/v1/watch/watch", body)
		if err != nil {
			return err
		}
		alive() // the stream is open: its budget counts from now
		err = lines(response, func(raw json.RawMessage) (bool, error) {
			alive()
			var answer watchResponse
			if err := json.Unmarshal(raw, &answer); err != nil {
				return false, badAnswer("a watch answer: %v", err)
			}
			if answer.Next != nil {
				start = answer.Next
			}
			if len(answer.Events) == 0 {
				return false, nil
			}
			select {
			case w.batches <- watchBatch{events: answer.Events}:
				return false, nil
			case <-w.ctx.Done():
				return true, nil
			}
		})
		if errors.Is(err, io.ErrUnexpectedEOF) && w.ctx.Err() == nil {
			return fmt.Errorf("tether: the watch stream ended: %w", err)
		}
		if w.ctx.Err() != nil {
			return nil
		}
		return err
	})
	if err != nil && w.ctx.Err() == nil {
		select {
		case w.batches <- watchBatch{err: err}:
		case <-w.ctx.Done():
		}
	}
}

package tether

import (
	"context"
	"time"
)

// AssignOptions are Assign's optional parts.
type AssignOptions struct {
	// Lifetime is how long the pin outlives its stopped pod; 0 = for ever.
	Lifetime time.Duration
	// Labels are kept with the pin.
	Labels map[string]string
}

// Assign pins key to the first of candidates that can take it (an existing
// pin is returned as it is, created false).
func (c *Client) Assign(ctx context.Context, key PinKey, candidates []string, podUID string, opts AssignOptions) (*Pin, bool, error) {
	id, done := c.nextRequestID()
	defer done()
	request := struct {
		RequestID  *requestID        `json:"requestId"`
		Key        PinKey            `json:"key"`
		Candidates []string          `json:"candidates"`
		PodUID     string            `json:"podUid"`
		LifetimeMs uint64            `json:"lifetimeMs,string"`
		Labels     map[string]string `json:"labels,omitempty"`
	}{id, key, candidates, podUID, uint64(opts.Lifetime / time.Millisecond), opts.Labels}
	var response struct {
		Pin     *Pin `json:"pin"`
		Created bool `json:"created"`
	}
	err := c.call(ctx, "/v1/pin/assign", request, &response)
	return response.Pin, response.Created, err
}

// ReleasePin removes the pin and returns it (nil if there was none).
func (c *Client) ReleasePin(ctx context.Context, key PinKey, reason string) (*Pin, error) {
	id, done := c.nextRequestID()
	defer done()
	request := struct {
		RequestID *requestID `json:"requestId"`
		Key       PinKey     `json:"key"`
		Reason    string     `json:"reason"`
	}{id, key, reason}
	var response struct {
		Released *Pin `json:"released"`
	}
	err := c.call(ctx, "/v1/pin/release", request, &response)
	return response.Released, err
}

// GetPin is the pin of key, or nil.
func (c *Client) GetPin(ctx context.Context, key PinKey) (*Pin, error) {
	var response struct {
		Pin *Pin `json:"pin"`
	}
	err := c.call(ctx, "/v1/pin/get", struct {
		Key PinKey `json:"key"`
	}{key}, &response)
	return response.Pin, err
}

package tether

import (
	"context"
	"errors"
	"time"
)

// ErrLeaseGone is KeepAlive's answer for a lease that expired or was
// revoked: what was attached to it has been released.
var ErrLeaseGone = errors.New("tether: the lease no longer exists")

// GrantLease starts a TTL lease; holds attached to it (AcquireOptions.
// LeaseID) end when it is not kept alive for ttl.
func (c *Client) GrantLease(ctx context.Context, ttl time.Duration) (uint64, error) {
	id, done := c.nextRequestID()
	defer done()
	request := struct {
		RequestID *requestID `json:"requestId"`
		TTLMs     uint64     `json:"ttlMs,string"`
	}{id, uint64(ttl / time.Millisecond)}
	var response struct {
		LeaseID uint64 `json:"leaseId,string"`
	}
	err := c.call(ctx, "/v1/lease/grant", request, &response)
	return response.LeaseID, err
}

// KeepAlive restarts the lease's TTL and returns it; ErrLeaseGone when the
// lease has ended.
func (c *Client) KeepAlive(ctx context.Context, leaseID uint64) (time.Duration, error) {
	request := struct {
		LeaseID uint64 `json:"leaseId,string"`
	}{leaseID}
	var response struct {
		TTLMs uint64 `json:"ttlMs,string"`
	}
	if err := c.call(ctx, "/v1/lease/keep-alive", request, &response); err != nil {
		return 0, err
	}
	if response.TTLMs == 0 {
		return 0, ErrLeaseGone
	}
	return time.Duration(response.TTLMs) * time.Millisecond, nil
}

// KeepAliveEvery renews the lease every interval (a third of its TTL is
// usual) until ctx ends (nil) or the lease is gone or cannot be renewed
// (the error).
func (c *Client) KeepAliveEvery(ctx context.Context, leaseID uint64, interval time.Duration) error {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		if _, err := c.KeepAlive(ctx, leaseID); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

// RevokeLease ends the lease now, releasing what was attached to it.
func (c *Client) RevokeLease(ctx context.Context, leaseID uint64) error {
	id, done := c.nextRequestID()
	defer done()
	request := struct {
		RequestID *requestID `json:"requestId"`
		LeaseID   uint64     `json:"leaseId,string"`
	}{id, leaseID}
	var response struct{}
	return c.call(ctx, "/v1/lease/revoke", request, &response)
}

// Package nodelock offers HAMi's node-lock operations on Tether: the lock a
// GPU-sharing scheduler takes on a node at Bind, and that the node's device
// plugin reads (to learn which pod the kubelet's Allocate is for) and
// releases.
//
// Where HAMi's annotation lock refuses a second pod with "node ... has been
// locked within 5m", LockNode waits in a FIFO queue; the owner is the pod's
// UID, not its namespace/name; a lock whose pod is deleted or fails is
// released by Tether's Kubernetes bridge within moments, not after five
// minutes; and every lock carries a fencing token.
//
// The calls keep HAMi's names and arguments (the lock name is accepted and,
// as in HAMi, one lock per node serves every vendor), with a context first
// and the pod as a Pod:
//
//	locks := nodelock.New(client)
//	lock, err := locks.LockNode(ctx, nodeName, "NVIDIA", nodelock.PodOf(pod.UID, pod.Namespace, pod.Name))
//	err = locks.ReleaseNodeLock(ctx, nodeName, "NVIDIA", nodelock.PodOf(...), false)
package nodelock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"tether.io/go/tether"
)

// DefaultScope is the lock scope of node locks: the one Tether's own
// scheduler extender and device plugin use.
const DefaultScope = "gpu-bind"

// Pod is the pod a node lock is taken for.
type Pod = tether.Pod

// PodOf is a Pod from a Kubernetes pod's UID, namespace and name.
func PodOf(uid, namespace, name string) Pod {
	return Pod{UID: uid, Namespace: namespace, Name: name}
}

// Lock is a node lock as its holder sees it.
type Lock struct {
	Node string
	Pod  Pod
	// Token is the fencing token: it rises with every grant of this
	// node's lock.
	Token uint64
	// Payload is what the scheduler stored with the lock (e.g. the device
	// plan), for the device plugin.
	Payload []byte
}

// Locks takes and releases node locks through a Tether client.
type Locks struct {
	client *tether.Client
	// Scope is the lock scope (DefaultScope unless changed).
	Scope string
	// Wait is how long LockNode waits in the node's queue (default 30s;
	// a shorter context deadline wins).
	Wait time.Duration
}

// New node locks over client.
func New(client *tether.Client) *Locks {
	return &Locks{client: client, Scope: DefaultScope, Wait: 30 * time.Second}
}

func (l *Locks) key(node string) tether.LockKey {
	return tether.LockKey{Scope: l.Scope, Name: node}
}

// LockNode locks node for pod, waiting in FIFO order behind earlier pods
// (for Wait, or until ctx ends). Taking a lock the pod already holds
// returns that hold. payload (optional) is stored with the lock.
func (l *Locks) LockNode(ctx context.Context, node, lockName string, pod Pod, payload ...byte) (*Lock, error) {
	if node == "" || pod.UID == "" {
		return nil, errors.New("nodelock: a node name and the pod's UID are required")
	}
	wait := l.Wait
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < wait {
		wait = time.Until(deadline)
	}
	if wait < 0 {
		wait = 0
	}
	hold, err := l.client.Acquire(ctx, l.key(node), pod, tether.AcquireOptions{Payload: payload, Wait: wait})
	if err != nil {
		return nil, fmt.Errorf("nodelock: locking node %s for pod %s/%s: %w", node, pod.Namespace, pod.Name, err)
	}
	return lockOf(node, hold), nil
}

// ReleaseNodeLock releases node's lock if pod holds it. With
// skipOwnerCheck it releases whoever holds it (what HAMi does to a lock it
// found expired or dangling; Tether releases those itself, so this is for
// operators and device plugins correcting a node). A free lock, or one
// held by another pod without skipOwnerCheck, is left as it is: nil, as in
// HAMi.
func (l *Locks) ReleaseNodeLock(ctx context.Context, node, lockName string, pod Pod, skipOwnerCheck bool) error {
	for attempt := 0; attempt < 3; attempt++ {
		hold, err := l.client.Holder(ctx, l.key(node))
		if err != nil {
			return fmt.Errorf("nodelock: reading node %s's lock: %w", node, err)
		}
		if hold == nil || (!skipOwnerCheck && hold.Pod.UID != pod.UID) {
			return nil
		}
		_, err = l.client.Release(ctx, l.key(node), hold.Pod.UID, hold.Token, tether.Allocated)
		if err == nil {
			return nil
		}
		// The lock moved on between the read and the release (its pod was
		// deleted, say): read it again.
		if tether.CodeOf(err) != tether.CodeFailedPrecondition {
			return fmt.Errorf("nodelock: releasing node %s: %w", node, err)
		}
	}
	return fmt.Errorf("nodelock: node %s's lock kept changing hands; not released", node)
}

// Release gives back the lock LockNode returned, with the outcome of the
// bind it protected.
func (l *Locks) Release(ctx context.Context, lock *Lock, outcome tether.Outcome) error {
	_, err := l.client.Release(ctx, l.key(lock.Node), lock.Pod.UID, lock.Token, outcome)
	if err != nil {
		return fmt.Errorf("nodelock: releasing node %s: %w", lock.Node, err)
	}
	return nil
}

// Holder is node's lock (nil when free): what a device plugin reads to
// learn which pod an Allocate serves.
func (l *Locks) Holder(ctx context.Context, node string) (*Lock, error) {
	hold, err := l.client.Holder(ctx, l.key(node))
	if err != nil || hold == nil {
		return nil, err
	}
	return lockOf(node, hold), nil
}

func lockOf(node string, hold *tether.Hold) *Lock {
	return &Lock{Node: node, Pod: hold.Pod, Token: hold.Token, Payload: hold.Payload}
}

package tether_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"tether.io/go/internal/testcluster"
	"tether.io/go/tether"
)

func newClient(t *testing.T, endpoints []string) *tether.Client {
	t.Helper()
	client, err := tether.New(tether.Config{Endpoints: endpoints, RetryTimeout: testcluster.Deadline})
	if err != nil {
		t.Fatal(err)
	}
	return client
}

func key(name string) tether.LockKey { return tether.LockKey{Scope: "gpu-bind", Name: name} }

func pod(uid string) tether.Pod {
	return tether.Pod{UID: uid, Namespace: "default", Name: "pod-" + uid}
}

func TestLocksLeasesAndPinsOnOneReplica(t *testing.T) {
	cluster := testcluster.Start(t, 1)
	client := newClient(t, cluster.Endpoints())
	ctx, cancel := context.WithTimeout(context.Background(), testcluster.Deadline)
	defer cancel()

	first, err := client.Acquire(ctx, key("node-a"), pod("p1"), tether.AcquireOptions{Payload: []byte("gpu-0")})
	if err != nil {
		t.Fatal(err)
	}
	if first.Pod.UID != "p1" || first.Token == 0 || string(first.Payload) != "gpu-0" {
		t.Fatalf("granted %+v", first)
	}

	// A second pod waits in the queue and is granted when the first
	// releases, with a higher token.
	queued := make(chan uint32, 1)
	granted := make(chan *tether.Hold, 1)
	failed := make(chan error, 1)
	go func() {
		hold, err := client.Acquire(ctx, key("node-a"), pod("p2"), tether.AcquireOptions{
			Wait:     30 * time.Second,
			OnQueued: func(position uint32) { queued <- position },
		})
		if err != nil {
			failed <- err
			return
		}
		granted <- hold
	}()
	select {
	case position := <-queued:
		if position != 1 {
			t.Fatalf("queued at %d", position)
		}
	case err := <-failed:
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("the second acquire never queued")
	}
	// Without waiting, a held lock is refused naming its holder.
	_, err = client.Acquire(ctx, key("node-a"), pod("p3"), tether.AcquireOptions{})
	if tether.CodeOf(err) != tether.CodeFailedPrecondition {
		t.Fatalf("a held lock without waiting: %v", err)
	}
	next, err := client.Release(ctx, key("node-a"), "p1", first.Token, tether.Allocated)
	if err != nil {
		t.Fatal(err)
	}
	if next == nil || next.Pod.UID != "p2" {
		t.Fatalf("handed to %+v", next)
	}
	select {
	case hold := <-granted:
		if hold.Token <= first.Token {
			t.Fatalf("token %d after %d", hold.Token, first.Token)
		}
	case err := <-failed:
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("the waiter never heard of its grant")
	}
	holder, err := client.Holder(ctx, key("node-a"))
	if err != nil || holder == nil || holder.Pod.UID != "p2" {
		t.Fatalf("holder %+v, %v", holder, err)
	}
	free, err := client.Holder(ctx, key("node-free"))
	if err != nil || free != nil {
		t.Fatalf("a free lock: %+v, %v", free, err)
	}

	// Bad input is refused with what is wrong, and changes nothing.
	_, err = client.Acquire(ctx, tether.LockKey{}, pod("p4"), tether.AcquireOptions{})
	var api *tether.Error
	if !errors.As(err, &api) || api.Code != tether.CodeInvalidArgument || api.Status != 400 || api.Message == "" {
		t.Fatalf("an empty key: %v", err)
	}

	// A hold on a TTL lease ends with the lease.
	lease, err := client.GrantLease(ctx, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if ttl, err := client.KeepAlive(ctx, lease); err != nil || ttl != 5*time.Second {
		t.Fatalf("keep-alive: %v, %v", ttl, err)
	}
	if _, err := client.Acquire(ctx, key("node-l"), pod("p5"), tether.AcquireOptions{LeaseID: lease}); err != nil {
		t.Fatal(err)
	}
	if err := client.RevokeLease(ctx, lease); err != nil {
		t.Fatal(err)
	}
	if hold, err := client.Holder(ctx, key("node-l")); err != nil || hold != nil {
		t.Fatalf("after the lease's revoke: %+v, %v", hold, err)
	}
	if _, err := client.KeepAlive(ctx, lease); !errors.Is(err, tether.ErrLeaseGone) {
		t.Fatalf("keep-alive of a revoked lease: %v", err)
	}

	// Pins.
	pinKey := tether.PinKey{Set: "slurm-workers", Member: "worker-0"}
	pin, created, err := client.Assign(ctx, pinKey, []string{"node-x"}, "p6", tether.AssignOptions{Lifetime: time.Minute})
	if err != nil || !created || pin.Node != "node-x" {
		t.Fatalf("assign: %+v %v %v", pin, created, err)
	}
	if got, err := client.GetPin(ctx, pinKey); err != nil || got == nil || got.PodUID != "p6" {
		t.Fatalf("get pin: %+v, %v", got, err)
	}
	if released, err := client.ReleasePin(ctx, pinKey, "test done"); err != nil || released == nil {
		t.Fatalf("release pin: %+v, %v", released, err)
	}
}

func TestWatchSeesGrantsFromARevision(t *testing.T) {
	cluster := testcluster.Start(t, 1)
	client := newClient(t, cluster.Endpoints())
	ctx, cancel := context.WithTimeout(context.Background(), testcluster.Deadline)
	defer cancel()
	hold, err := client.Acquire(ctx, key("node-w"), pod("w1"), tether.AcquireOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// From revision 1: the grant made before the watch opened comes first.
	watch := client.Watch(ctx, tether.WatchOptions{Start: &tether.Revision{Index: 1}, KeyPrefix: "lock/gpu-bind/node-w"})
	defer watch.Close()
	for {
		events, err := watch.Next()
		if err != nil {
			t.Fatal(err)
		}
		for _, event := range events {
			if event.Kind == "LockGranted" && event.Token == hold.Token {
				if event.Key != "lock/gpu-bind/node-w" || event.Pod == nil || event.Pod.UID != "w1" {
					t.Fatalf("event %+v", event)
				}
				return
			}
		}
	}
}

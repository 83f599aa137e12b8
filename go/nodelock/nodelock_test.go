package nodelock_test

import (
	"context"
	"testing"
	"time"

	"tether.io/go/internal/testcluster"
	"tether.io/go/nodelock"
	"tether.io/go/tether"
)

// A scheduler locks a node for one pod, a second pod waits behind it, the
// leader is killed, and the device plugin's release (through the new
// leader) hands the node to the waiting pod, with a higher token.
func TestANodeLockPassesToTheNextPodThroughALeaderChange(t *testing.T) {
	cluster := testcluster.Start(t, 3)
	client, err := tether.New(tether.Config{Endpoints: cluster.Endpoints(), RetryTimeout: testcluster.Deadline})
	if err != nil {
		t.Fatal(err)
	}
	locks := nodelock.New(client)
	locks.Wait = testcluster.Deadline
	ctx, cancel := context.WithTimeout(context.Background(), 2*testcluster.Deadline)
	defer cancel()
	podA := nodelock.PodOf("uid-a", "default", "a")
	podB := nodelock.PodOf("uid-b", "default", "b")

	first, err := locks.LockNode(ctx, "gpu-node-1", "NVIDIA", podA, []byte("plan-a")...)
	if err != nil {
		t.Fatal(err)
	}
	second := make(chan *nodelock.Lock, 1)
	failed := make(chan error, 1)
	go func() {
		lock, err := locks.LockNode(ctx, "gpu-node-1", "NVIDIA", podB)
		if err != nil {
			failed <- err
			return
		}
		second <- lock
	}()
	// Until pod b waits in the node's queue.
	for deadline := time.Now().Add(testcluster.Deadline); ; {
		state, err := client.Get(ctx, tether.LockKey{Scope: nodelock.DefaultScope, Name: "gpu-node-1"})
		if err == nil && len(state.Waiters) == 1 && state.Waiters[0].Pod.UID == "uid-b" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod b never queued: %+v, %v", state, err)
		}
		time.Sleep(20 * time.Millisecond)
	}

	leader := cluster.WaitLeader()
	cluster.Kill(leader)
	t.Logf("killed the leader, replica %d", leader)

	// The device plugin reads the holder, then releases it.
	holder, err := locks.Holder(ctx, "gpu-node-1")
	if err != nil || holder == nil || holder.Pod.UID != "uid-a" || string(holder.Payload) != "plan-a" {
		t.Fatalf("holder after the leader change: %+v, %v", holder, err)
	}
	// Another pod's release leaves the lock alone.
	if err := locks.ReleaseNodeLock(ctx, "gpu-node-1", "NVIDIA", podB, false); err != nil {
		t.Fatal(err)
	}
	if err := locks.ReleaseNodeLock(ctx, "gpu-node-1", "NVIDIA", podA, false); err != nil {
		t.Fatal(err)
	}
	var next *nodelock.Lock
	select {
	case next = <-second:
	case err := <-failed:
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("pod b never got the node")
	}
	if next.Pod.UID != "uid-b" || next.Token <= first.Token {
		t.Fatalf("pod b's lock %+v after pod a's token %d", next, first.Token)
	}
	if err := locks.Release(ctx, next, tether.Allocated); err != nil {
		t.Fatal(err)
	}
	if holder, err := locks.Holder(ctx, "gpu-node-1"); err != nil || holder != nil {
		t.Fatalf("after both: %+v, %v", holder, err)
	}
}

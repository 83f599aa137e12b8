// Package testcluster starts real tetherd processes for this module's
// tests: the binary the TETHERD environment variable names, replicas on
// loopback ports, data in the test's temporary directory. Every process is
// killed when its test ends, and with the test process if that dies first
// (Linux's parent-death signal). A failed test prints each replica's log.
package testcluster

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Deadline bounds every wait of these tests: generous, for a loaded
// two-core machine.
const Deadline = 60 * time.Second

// Replica is one tetherd process.
type Replica struct {
	ID   uint64
	HTTP string // http://127.0.0.1:PORT
	args []string
	log  string
	cmd  *exec.Cmd
}

// Cluster is a set of replicas started together.
type Cluster struct {
	t        testing.TB
	binary   string
	Replicas []*Replica
}

// Binary is the tetherd to run; the test is skipped without one, and fails
// under CI=true (where skipping would hide the tests).
func Binary(t testing.TB) string {
	binary := os.Getenv("TETHERD")
	if binary == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("TETHERD is not set: ./dev test sets it to the tetherd it built")
		}
		t.Skip("SKIPPED: set TETHERD to a tetherd binary to run the tests against real replicas")
	}
	return binary
}

// nextPort walks this process's stretch of ports (freePort).
var nextPort atomic.Uint32

// freePort returns a loopback port that was free a moment ago, below
// Linux's ephemeral range (32768+), where bind(0) and outgoing connections
// never land: a port bind(0) handed out, closed and passed to tetherd can
// be handed to another process of a parallel test run before tetherd binds
// it (seen: a replica's peer port answered another server's HTTP 404 and
// the cluster never formed). Each process walks its own stretch, from its
// pid, as the chaos harness's replica ports do (chaos-tests/src/cluster.rs).
func freePort(t testing.TB) int {
	const low, span = 20000, 12000
	offset := uint32(os.Getpid()) * 397
	for i := 0; i < span; i++ {
		port := low + int((offset+nextPort.Add(1))%span)
		listener, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			listener.Close()
			return port
		}
	}
	t.Fatalf("no free loopback port in %d..%d", low, low+span)
	return 0
}

// Start runs n replicas forming one cluster and waits until each knows the
// leader. extra flags go to every replica.
func Start(t testing.TB, n int, extra ...string) *Cluster {
	t.Helper()
	c := &Cluster{t: t, binary: Binary(t)}
	dir := t.TempDir()
	type ports struct{ grpc, http int }
	all := make([]ports, n)
	members := make([]string, n)
	for i := range all {
		all[i] = ports{freePort(t), freePort(t)}
		members[i] = fmt.Sprintf("%d=127.0.0.1:%d", i+1, all[i].grpc)
	}
	for i, p := range all {
		id := uint64(i + 1)
		args := append([]string{
			fmt.Sprintf("--node-id=%d", id),
			fmt.Sprintf("--listen=127.0.0.1:%d", p.grpc),
			fmt.Sprintf("--http-listen=127.0.0.1:%d", p.http),
			"--data-dir=" + filepath.Join(dir, fmt.Sprintf("data-%d", id)),
			"--initial-members=" + strings.Join(members, ","),
			"--election-timeout=750ms",
			"--heartbeat-interval=100ms",
		}, extra...)
		r := &Replica{
			ID:   id,
			HTTP: fmt.Sprintf("http://127.0.0.1:%d", p.http),
			args: args,
			log:  filepath.Join(dir, fmt.Sprintf("tetherd-%d.log", id)),
		}
		c.Replicas = append(c.Replicas, r)
		c.spawn(r)
	}
	t.Cleanup(func() {
		for _, r := range c.Replicas {
			c.Kill(r.ID)
		}
		if t.Failed() {
			for _, r := range c.Replicas {
				text, _ := os.ReadFile(r.log)
				lines := strings.Split(string(text), "\n")
				if len(lines) > 40 {
					lines = lines[len(lines)-40:]
				}
				t.Logf("tetherd %d log tail:\n%s", r.ID, strings.Join(lines, "\n"))
			}
		}
	})
	c.WaitLeader()
	return c
}

func (c *Cluster) spawn(r *Replica) {
	log, err := os.OpenFile(r.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		c.t.Fatalf("log file: %v", err)
	}
	cmd := exec.Command(c.binary, r.args...)
	cmd.Stdout = log
	cmd.Stderr = log
	cmd.SysProcAttr = dieWithParent()
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("starting %s: %v", c.binary, err)
	}
	log.Close()
	r.cmd = cmd
}

// Endpoints are the replicas' HTTP addresses.
func (c *Cluster) Endpoints() []string {
	var out []string
	for _, r := range c.Replicas {
		out = append(out, r.HTTP)
	}
	return out
}

// Kill stops replica id at once (SIGKILL), as a crash would.
func (c *Cluster) Kill(id uint64) {
	r := c.Replicas[id-1]
	if r.cmd == nil {
		return
	}
	_ = r.cmd.Process.Kill()
	_ = r.cmd.Wait()
	r.cmd = nil
}

// Restart starts a killed replica again on its data.
func (c *Cluster) Restart(id uint64) {
	c.spawn(c.Replicas[id-1])
}

type health struct {
	NodeID uint64 `json:"node_id"`
	State  string `json:"state"`
	Leader uint64 `json:"leader"`
}

func healthOf(endpoint string) (*health, error) {
	client := http.Client{Timeout: 2 * time.Second}
	response, err := client.Get(endpoint + "/health")
	if err != nil {
		return nil, err
	}
	defer response.Body.Close()
	var h health
	if err := json.NewDecoder(response.Body).Decode(&h); err != nil {
		return nil, err
	}
	return &h, nil
}

// WaitLeader waits until every running replica names the same leader and
// that replica says it leads; returns its id.
func (c *Cluster) WaitLeader() uint64 {
	c.t.Helper()
	deadline := time.Now().Add(Deadline)
	for {
		var leader uint64
		agreed := true
		for _, r := range c.Replicas {
			if r.cmd == nil {
				continue
			}
			h, err := healthOf(r.HTTP)
			if err != nil || h.Leader == 0 || (leader != 0 && h.Leader != leader) {
				agreed = false
				break
			}
			leader = h.Leader
			if h.NodeID == leader && h.State != "Leader" {
				agreed = false
				break
			}
		}
		if agreed && leader != 0 && c.Replicas[leader-1].cmd != nil {
			return leader
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("no leader agreed on within %v", Deadline)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

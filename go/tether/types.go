package tether

// The messages of Tether's HTTP/JSON API: the proto3 JSON mapping of the
// tether.v1 gRPC messages (lowerCamelCase names, 64-bit integers as
// strings, fields at their default left out). Only the fields this package
// uses or returns are declared; the server's OpenAPI document
// (GET /openapi.json) lists every one.

// LockKey names a lock: {gpu-bind, node-7}.
type LockKey struct {
	Scope string `json:"scope"`
	Name  string `json:"name"`
}

// Pod owns holds, waits and pins. The UID is the identity; namespace and
// name are labels for people.
type Pod struct {
	UID       string `json:"uid"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
}

// Hold is a granted lock.
type Hold struct {
	Pod Pod `json:"pod"`
	// Token is the fencing token: strictly increasing per lock. Pass it on
	// to whatever the hold protects, and back to Release.
	Token       uint64 `json:"token,string"`
	GrantedAtMs uint64 `json:"grantedAtMs,string"`
	Payload     []byte `json:"payload"`
	ClientID    string `json:"clientId"`
	LeaseID     uint64 `json:"leaseId,string"`
}

// Waiter is a queued acquire.
type Waiter struct {
	Pod        Pod    `json:"pod"`
	QueuedAtMs uint64 `json:"queuedAtMs,string"`
	DeadlineMs uint64 `json:"deadlineMs,string"`
}

// LockState is a lock with its holder and queue.
type LockState struct {
	Key       LockKey  `json:"key"`
	Holder    *Hold    `json:"holder"`
	Waiters   []Waiter `json:"waiters"`
	LastToken uint64   `json:"lastToken,string"`
}

// Header says which replica answered and from which state.
type Header struct {
	AppliedIndex uint64 `json:"appliedIndex,string"`
	NodeID       uint64 `json:"nodeId,string"`
	LeaderID     uint64 `json:"leaderId,string"`
	Linearizable bool   `json:"linearizable"`
	ClusterID    string `json:"clusterId"`
}

// Outcome is what became of the bind a hold protected.
type Outcome string

// The outcomes a release reports.
const (
	Allocated Outcome = "ALLOCATED"
	Failed    Outcome = "FAILED"
)

// PinKey names a pin: {slurm-workers, worker-3}.
type PinKey struct {
	Set    string `json:"set"`
	Member string `json:"member"`
}

// Pin ties a member to a node.
type Pin struct {
	Key        PinKey            `json:"key"`
	Node       string            `json:"node"`
	PinnedAtMs uint64            `json:"pinnedAtMs,string"`
	PodUID     string            `json:"podUid"`
	Labels     map[string]string `json:"labels"`
	// LifetimeMs is how long the pin outlives its stopped pod; 0 = for ever.
	LifetimeMs uint64 `json:"lifetimeMs,string"`
}

// Revision is a position in the event stream.
type Revision struct {
	Index uint64 `json:"index,string"`
	Sub   uint32 `json:"sub"`
}

// Event is one change, as the watch stream and history report it.
type Event struct {
	Revision   Revision          `json:"revision"`
	TimeMs     uint64            `json:"timeMs,string"`
	Kind       string            `json:"kind"`
	Key        string            `json:"key"`
	Pod        *Pod              `json:"pod"`
	Token      uint64            `json:"token,string"`
	Reason     string            `json:"reason"`
	Node       string            `json:"node"`
	Payload    []byte            `json:"payload"`
	Attributes map[string]string `json:"attributes"`
}

// requestID makes a write exactly-once across retries.
type requestID struct {
	ClientID        string `json:"clientId"`
	Sequence        uint64 `json:"sequence,string"`
	FirstIncomplete uint64 `json:"firstIncomplete,string"`
}

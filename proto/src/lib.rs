//! `tether-proto`: the `tether.v1` gRPC contract.
//!
//! Wire types only, no logic. The `.proto` files live in `tether/v1/`;
//! `build.rs` compiles them with protox and tonic-prost-build, and keeps
//! the descriptors ([`FILE_DESCRIPTOR_SET`]).
//!
//! # Layout
//! - `tether/v1/common.proto` — request ids, pods, lock keys, response headers.
//! - `tether/v1/lock.proto` — `LockService`.
//! - `tether/v1/lease.proto` — `LeaseService` (pod revokes, TTL leases).
//! - `tether/v1/pin.proto` — `PinService` (pins, affinity).
//! - `tether/v1/node.proto` — `NodeService` (the node registry).
//! - `tether/v1/watch.proto` — `WatchService` (event stream, history).
//! - `tether/v1/cluster.proto` — `ClusterService` (status, membership).
//! - `tether/v1/raft.proto` — internal `RaftService` between replicas.

/// Generated code of the `tether.v1` package.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tether.v1");
}

pub use v1::*;

/// The compiled `tether.v1` descriptors (a serialized
/// `google.protobuf.FileDescriptorSet`): what the HTTP/JSON gateway maps
/// JSON bodies with and describes its routes from.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tether.v1.bin"));

/// gRPC metadata key carrying the leader's node id on an `UNAVAILABLE`
/// answer from a follower.
pub const LEADER_ID_METADATA: &str = "x-tether-leader-id";
/// gRPC metadata key carrying the leader's client address on an
/// `UNAVAILABLE` answer from a follower.
pub const LEADER_ADDR_METADATA: &str = "x-tether-leader-addr";

/// gRPC metadata key carrying the oldest retained revision's log index on an
/// `OUT_OF_RANGE` answer to a watch from a compacted revision.
pub const COMPACT_REVISION_METADATA: &str = "x-tether-compact-revision";

/// gRPC metadata key carrying the answering replica's cluster id, on every
/// response (once the replica knows it), and on every Raft message a
/// replica sends.
pub const CLUSTER_ID_METADATA: &str = "x-tether-cluster-id";
/// gRPC metadata key a client sets on its requests once it has seen a
/// cluster id: a replica of another cluster refuses the request, before
/// doing anything, with `FAILED_PRECONDITION` and
/// [`WRONG_CLUSTER_METADATA`].
pub const EXPECT_CLUSTER_METADATA: &str = "x-tether-expect-cluster";
/// gRPC metadata key marking a refusal because the request was meant for
/// another cluster (its value: the refusing replica's cluster id).
pub const WRONG_CLUSTER_METADATA: &str = "x-tether-wrong-cluster";
/// Pin label naming the owning pod's namespace. A pin names only its
/// owner's UID; one that also carries this label and
/// [`POD_NAME_LABEL`] lets the bridge confirm the pod gone with a GET even
/// when it never saw the pod (it was deleted while the bridge was down).
pub const POD_NAMESPACE_LABEL: &str = "tether.io/pod-namespace";
/// Pin label naming the owning pod (see [`POD_NAMESPACE_LABEL`]).
pub const POD_NAME_LABEL: &str = "tether.io/pod-name";

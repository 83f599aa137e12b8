//! `tether-embed`: Tether where GPU binds happen.
//!
//! HAMi-style GPU sharing serializes binds per node with a lock the scheduler
//! takes at Bind and the device plugin releases in `Allocate` — the kubelet
//! tells `Allocate` nothing about the pod, so the lock is also how the plugin
//! learns which pod it serves. This crate is that hand-off, on Tether:
//!
//! - [`extender`]: scheduler-extender `filter` and `bind` verbs. Bind reads
//!   the pod, acquires `gpu-bind/<node>` for the pod UID with the pod's
//!   `Allocate` calls as payload (waiting in Tether's FIFO queue, not
//!   reject-and-retry), claims free devices of the node (as many as its
//!   `status.allocatable` says) in Tether, binds the pod through the
//!   Kubernetes API, and on any failure releases with outcome `failed` (the
//!   Unreserve path). Pods that ask for no managed resource are bound
//!   without a lock.
//! - [`device_plugin`]: a kubelet device plugin (v1beta1 over a unix socket)
//!   whose `Allocate` calls (one per container) read
//!   `Holder(gpu-bind/<its node>)`, answer from the plan, and the last one
//!   corrects the pod's claim to the devices the kubelet gave and releases
//!   with the token. No holder → a clear refusal, never a guess.
//! - [`kubelet`]: the kubelet's `Allocate` calls for a pod, derived from
//!   its device manager's algorithm.
//! - [`accounting`]: which devices of a node live pods hold, kept as pins.
//! - [`device_view`]: the extender's copy of every node's claims and
//!   published devices, kept current from Tether's event stream, so the
//!   filter (inside kube-scheduler's serial cycle) reads memory.
//! - [`requeue`]: asking kube-scheduler again about pods the filter refused
//!   for want of devices, once devices free up on their nodes.
//! - [`node_objects`]: the node object under each name, which a bind's
//!   lock and claims are taken for.
//! - [`plan`]: the device plan carried as the hold's payload.
//! - [`metrics`]: what both count, for `/metrics`.
//! - [`kind`]: device kinds: a node may carry several, each with its own
//!   node lock, claims and plugin; a pod asking for two takes both locks
//!   in one order (HAMi-core #246).
//! - [`inventory`]: the devices the plugin advertises (`--devices nvidia`
//!   or `fake:N`), their health and topology, and what a container gets.
//! - [`nvidia`]: a node's NVIDIA GPUs read under its host root: device
//!   ids (UUIDs), health, NUMA nodes, and what a container is handed (CDI
//!   names, `NVIDIA_VISIBLE_DEVICES`, device nodes).
//!
//! # Layout
//! - `extender/` (the bind, `filter.rs`, `claim.rs`), `device_view.rs`, `requeue.rs`, `device_plugin.rs`,
//!   `kubelet.rs`, `accounting.rs`, `plan.rs`, `metrics.rs`, `inventory.rs`, `kind.rs`,
//!   `nvidia.rs` — the logic above.
//! - `bin/tether-extender.rs`, `bin/tether-device-plugin.rs` — the binaries.

pub mod accounting;
pub mod attempts;
pub mod cli;
pub mod cpu_time;
pub mod device_plugin;
pub mod device_view;
pub mod extender;
pub mod inventory;
pub mod kind;
pub mod kubelet;
pub mod metrics;
pub mod node_objects;
pub mod nvidia;
pub mod plan;
pub mod requeue;

/// The fixture host roots of the tests (`tests/fixtures/`), shared with
/// the integration tests.
#[cfg(test)]
#[path = "../tests/fixtures/mod.rs"]
mod test_fixtures;

/// The generated kubelet device-plugin API (v1beta1).
pub mod v1beta1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1beta1");
}

/// A future that resolves on SIGTERM (what the kubelet sends a pod it
/// stops) or SIGINT. The handlers are installed by this call, not when the
/// future is first polled: a SIGTERM that arrives before then must not
/// kill the process with the default action.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let interrupt = signal(SignalKind::interrupt());
    async move {
        match (term, interrupt) {
            (Ok(mut term), Ok(mut interrupt)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = interrupt.recv() => {}
                }
            }
            (term, interrupt) => {
                let err = term.err().or(interrupt.err());
                tracing::warn!(?err, "cannot listen for SIGTERM; stopping on Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("stopping on a signal");
    }
}

//! `tether-embed`: Tether where GPU binds happen.
//!
//! HAMi-style GPU sharing serializes binds per node with a lock the scheduler
//! takes at Bind and the device plugin releases in `Allocate` — the kubelet
//! tells `Allocate` nothing about the pod, so the lock is also how the plugin
//! learns which pod it serves. This crate is that hand-off, on Tether:
//!
//! - [`extender`]: a scheduler-extender `bind` verb. It acquires
//!   `gpu-bind/<node>` for the pod UID with the device plan as payload
//!   (waiting in Tether's FIFO queue, not reject-and-retry), binds the pod
//!   through the Kubernetes API, and on any failure releases with outcome
//!   `failed` (the Unreserve path).
//! - [`device_plugin`]: a kubelet device plugin (v1beta1 over a unix socket)
//!   whose `Allocate` reads `Holder(gpu-bind/<its node>)`, answers from the
//!   plan, and releases with the token. No holder → a clear refusal, never a
//!   guess.
//! - [`plan`]: the device plan carried as the hold's payload.
//!
//! # Layout
//! - `extender.rs`, `device_plugin.rs`, `plan.rs` — the logic above.
//! - `bin/tether-extender.rs`, `bin/tether-device-plugin.rs` — the binaries.

pub mod device_plugin;
pub mod extender;
pub mod plan;

/// The generated kubelet device-plugin API (v1beta1).
pub mod v1beta1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1beta1");
}

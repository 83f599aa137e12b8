//! `tether-k8s-bridge`: Kubernetes reality into Tether commands.
//!
//! The bridge watches Pods and Nodes and tells Tether what it must know: a
//! pod that holds, waits for or is pinned by something is bound and
//! starting, running, terminal or gone; a node joined, changed readiness,
//! labels or schedulability, or is gone. Nothing is reported gone from the
//! bridge's cache alone: only on a delete event, a terminal phase or a GET
//! that answers 404 or another UID (`orphans.rs`). Its decisions are pure functions,
//! tested directly; the Kubernetes and Tether I/O around them is thin.
//!
//! Every command it sends is idempotent (a repeated report changes nothing),
//! so two bridge replicas running at once reach the same outcome as one: no
//! leader election is needed.
//!
//! # Layout
//! - `model.rs` — the parts of Pods and Nodes the bridge looks at, and the
//!   commands it sends.
//! - `mapping.rs` — one watch event (old and new object) → commands.
//! - `orphans.rs` — after a (re)list and on resync: what Tether knows that
//!   the bridge's cache lacks (deletes missed while the bridge was down or
//!   the watch broke), as candidates confirmed by GET before any report.
//! - `reconcile.rs` — level-triggered: the reports cached pods and nodes
//!   are due until Tether has acknowledged them (a lost report is sent
//!   again, with back-off, not dropped).
//! - `interest.rs` — the pod UIDs Tether cares about, from its state and
//!   event stream; pods outside it produce nothing.
//! - `tombstones.rs` — recently deleted pods, so a bind that lands after its
//!   pod's deletion is released at once rather than at the next resync.
//! - `config.rs` — the `tether-bridge` flags.
//! - `bridge.rs` — the run-time loop: kube-rs watchers, the Tether event
//!   watch, periodic resync, sending commands.

pub mod bridge;
pub mod config;
pub mod interest;
pub mod mapping;
pub mod model;
pub mod orphans;
pub mod reconcile;
pub mod tombstones;

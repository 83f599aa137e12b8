//! `tether-chaos`: workloads that drive a Tether cluster, a harness that runs
//! real `tetherd` processes on loopback, and latency statistics. Today it
//! serves the `tether-bench` binary; fault injection and history checkers
//! build on the same pieces.
//!
//! # Layout
//! - `cluster.rs` — N `tetherd` processes in temp dirs, killed on drop.
//! - `workload.rs` — lock workloads: uncontended pairs, contended hand-over.
//! - `stats.rs` — latency samples and percentiles.
//! - `bin/tether-bench.rs` — runs the workloads and prints the table.

pub mod cluster;
pub mod etcd;
pub mod stats;
pub mod workload;

//! `tether-chaos`: drives real `tetherd` processes through faults and checks
//! what clients saw; also the workloads and harness of `tether-bench`.
//!
//! # Layout
//! - `cluster.rs` — N `tetherd` processes in temp dirs: kill, restart,
//!   pause, membership changes, per-link network faults.
//! - `proxy.rs` — the fault-injecting TCP proxy of one directed link.
//! - `schedule.rs` — seeded fault schedules.
//! - `workers/` — the chaos workload's clients (one file per worker) and the
//!   fenced shadow resource.
//! - `abandon.rs` — queued acquires whose caller goes away, and callers
//!   that come back for their wait.
//! - `claims.rs` — device claims corrected by `Reclaim`, racing.
//! - `keeper.rs` — a hold on a TTL lease kept alive, with a waiter behind
//!   it (the `leases` checker's workload).
//! - `sessions.rs` — one device plugin opening ever new sessions, and the
//!   bridge beside it (the `sessions` checker's workload).
//! - `storm.rs` — the retry storm: duplicates, reconnects and a forging
//!   caller under one client session.
//! - `history.rs` — operations as invoke / ok / fail / unknown.
//! - `checkers/` — one checker per file (see its module doc for the table).
//! - `runner.rs` — one schedule: workload, faults, heal, collect, check.
//! - `driver.rs` — many schedules across clusters, summed up.
//! - `trace.rs` — pod-lifecycle trace replay through the bridge's logic.
//! - `workload.rs`, `stats.rs`, `etcd.rs`, `chart.rs` — the benchmark's
//!   workloads, latency statistics, the etcd side of the comparison and its
//!   SVG charts.
//! - `bin/tether-chaos.rs`, `bin/tether-bench.rs`, `bin/tether-scale.rs` —
//!   the chaos program, the benchmark and the scale run.

pub mod abandon;
pub mod chart;
pub mod checkers;
pub mod claims;
pub mod cluster;
pub mod driver;
pub mod etcd;
pub mod history;
pub mod keeper;
pub mod procfs;
pub mod proxy;
pub mod retry;
pub mod rng;
pub mod runner;
pub mod schedule;
pub mod sessions;
pub mod stats;
pub mod storm;
#[cfg(feature = "trace")]
pub mod trace;
pub mod workers;
pub mod workload;

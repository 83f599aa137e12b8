//! `tether-server`: one Tether replica.
//!
//! # Layout
//! - `sm/` — the replicated state machine: domain types, commands (one file
//!   each), events. Pure and deterministic.
//! - `store/` — RocksDB log store and state machine for openraft.
//! - `raft/` — openraft type configuration.

pub mod raft;
pub mod sm;
pub mod store;

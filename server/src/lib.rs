//! `tether-server`: one Tether replica.
//!
//! A replica is an openraft node whose log and state machine live in one
//! RocksDB database, serving the `tether.v1` gRPC API, and an HTTP port for
//! the probes, `/metrics` and the same API with JSON bodies.
//!
//! # Layout
//! - `config.rs` — the `tetherd` flags (each also a `TETHER_*` variable).
//! - `node.rs` — wiring only: store, Raft, the replica core, gRPC and HTTP.
//! - `sm/` — the replicated state machine: domain types, commands (one file
//!   each), events. Pure and deterministic.
//! - `store/` — RocksDB log store and state machine for openraft.
//! - `raft/` — openraft type configuration, its start, the replica network
//!   and the one dialer of other replicas (`dial.rs`).
//! - `replica/` — the replica core between the handlers and Raft: writes
//!   (batched, stamped), linearizable reads, the wait lifecycle, membership
//!   and leader transfer, the leader's sweeper and the other tasks, the
//!   Raft service the other replicas call. Only it and `raft/` name
//!   openraft's types.
//! - `api/` — gRPC handlers (decode, validate, authorize, call the core,
//!   convert), validation and wire conversions, session admission
//!   (`sessions.rs`).
//! - `auth.rs` — who is calling (certificate or development token) and what
//!   each role may do.
//! - `error.rs` — API errors and their mapping to gRPC status codes.
//! - `gateway/` — the HTTP/JSON API: each public gRPC method as
//!   `POST /v1/{service}/{method}`, calling the gRPC handlers in process;
//!   the proto3 JSON mapping (`json.rs`) and the OpenAPI document
//!   (`openapi.rs`).
//! - `http.rs`, `metrics.rs` — the HTTP port: probes, `/metrics`, the
//!   gateway's routes, TLS (axum through
//!   `tether-http`; counters and histograms in a `prometheus-client`
//!   registry, and the gRPC timing layer).
//! - `statefulset.rs` — identity and bootstrap by ordinal (`--statefulset`).
//! - `cluster_id.rs` — the cluster's id, and the checks that keep clusters apart.
//! - `testing.rs` — in-process test clusters (feature `testing`: for
//!   tests, never in `tetherd`'s product build).
//! - `fuzzing.rs` — the fuzz targets (feature `testing`), run by
//!   `bin/tether-fuzz.rs` (stable, bounded, in CI) and by cargo-fuzz in
//!   `fuzz/`.

pub mod api;
pub mod auth;
pub mod cluster_id;
pub mod config;
pub mod error;
#[cfg(any(test, feature = "testing"))]
pub mod fuzzing;
pub mod gateway;
pub mod http;
pub mod metrics;
pub mod node;
pub mod raft;
pub mod replica;
pub mod sm;
pub mod statefulset;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use config::Config;
pub use node::Node;

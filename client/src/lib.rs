//! `tether-client`: the Tether client library and the `lockctl` CLI.
//!
//! The client takes a list of endpoints (any replicas), finds and follows the
//! leader (a follower answers writes with `UNAVAILABLE` and the leader's
//! address), retries with backoff, and gives every mutating call a
//! `(client_id, sequence)` request id that its retries reuse, so a retry after
//! a timeout or a leader change is applied once.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tether_client::Error> {
//! use std::time::Duration;
//! use tether_client::{Client, Options, parse_lock_key};
//! use tether_proto::{Outcome, Pod};
//!
//! let client = Client::new(["127.0.0.1:7420"], Options::default())?;
//! let key = parse_lock_key("gpu-bind/node-1")?;
//! let pod = Pod { uid: "6f1c2d9e-3b7a-4c1e-9f0a-2b5d8e7c1a4f".into(), namespace: "ml".into(), name: "train-0".into() };
//! let held = client.acquire(&key, &pod, b"gpu0".to_vec(), Duration::from_secs(30), 0).await?;
//! println!("fencing token {}", held.token());
//! // ... bind the pod; normally the device plugin reads the holder and
//! // releases with the token. Here we release ourselves:
//! held.release(Outcome::Allocated).await?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - `client.rs` — [`Client`]: leader following, retries, every API call.
//! - `hold.rs` — [`Held`]: a granted hold and its release.
//! - `blocking.rs` — [`blocking::Client`] for callers without an async runtime.
//! - `error.rs` — [`Error`]: what the caller should do about a failure.
//! - `watch.rs` — [`Watcher`]: a watch that resumes from its last revision.
//! - `selector.rs` — parsing of label selectors, affinity terms, pin keys.
//! - `deadline.rs` — one deadline for a caller's whole operation.
//! - `cluster.rs` — keeps a client to the one cluster whose id it saw first.
//! - `security.rs` — the credential flags (TLS, bearer token) every binary shares.
//! - `bin/lockctl/` — the admin CLI.

pub mod blocking;
mod client;
pub mod cluster;
pub mod deadline;
mod error;
mod hold;
pub mod security;
pub mod selector;
mod watch;

pub use client::{
    AcquireProgress, Client, Conn, Credentials, InFlight, MAX_CLIENT_ID_PREFIX_LEN, Options,
    parse_lock_key,
};
pub use error::{Error, Result};
pub use hold::Held;
pub use security::{ConnectArgs, SecurityArgs};
pub use tether_proto as proto;
pub use tether_tls;
pub use watch::{WatchUpdate, Watcher};

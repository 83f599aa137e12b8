//! Mutual TLS for Tether, shared by the replica (`tetherd`), the client
//! library and the tools built on it.
//!
//! - [`TlsMaterial`] reads a certificate, its key and the trusted CA from
//!   files in cert-manager's layout (`tls.crt`, `tls.key`, `ca.crt`) and
//!   reads them again when they change, so a rotated certificate is used
//!   for new connections without a restart.
//! - [`incoming`] accepts connections for a tonic server, TLS or plain, and
//!   hands each one over with its [`PeerInfo`] (the caller's certificate
//!   identity), which tonic puts into every request's extensions.
//! - [`lazy_channel`] dials a replica over TLS with the same material.
//! - [`identity_of`] reads the name a certificate carries (a `tether:` URI
//!   SAN, else the subject's common name); roles are built from it by the
//!   server.

mod client;
mod identity;
mod material;
mod server;
#[cfg(feature = "testing")]
pub mod testing;

pub use client::lazy_channel;
pub use identity::{PeerIdentity, identity_of};
pub use material::{TlsError, TlsFiles, TlsMaterial};
pub use server::{Conn, PeerInfo, incoming, incoming_http};

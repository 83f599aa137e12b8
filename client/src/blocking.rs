//! A blocking client for callers that do not run an async runtime (a device
//! plugin written around threads, a shell tool). It owns a small
//! current-thread Tokio runtime and blocks on the async [`crate::Client`].
//!
//! ```no_run
//! use std::time::Duration;
//! use tether_client::blocking::Client;
//! use tether_client::{Options, parse_lock_key};
//! use tether_client::proto::Outcome;
//!
//! let client = Client::new(["127.0.0.1:7420"], Options::default())?;
//! let key = parse_lock_key("gpu-bind/node-1")?;
//! // In Allocate: who is this for, and with what plan?
//! if let Some(hold) = client.holder(&key)? {
//!     let pod_uid = hold.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default();
//!     client.release(&key, &pod_uid, hold.token, Outcome::Allocated)?;
//! }
//! # Ok::<(), tether_client::Error>(())
//! ```
//!
//! Do not call it from inside an async runtime: blocking there would stall
//! that runtime's thread (Tokio refuses with a panic).

use std::time::Duration;

use tether_proto as pb;

use crate::error::{Error, Result};
use crate::{Options, client};

/// The blocking client.
pub struct Client {
    runtime: tokio::runtime::Runtime,
    inner: client::Client,
}

impl Client {
    /// A client for these endpoints.
    pub fn new(
        endpoints: impl IntoIterator<Item = impl Into<String>>,
        options: Options,
    ) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Other(format!("cannot start the client runtime: {e}")))?;
        let inner = client::Client::new(endpoints, options)?;
        Ok(Self { runtime, inner })
    }

    /// The async client behind this one.
    pub fn async_client(&self) -> &client::Client {
        &self.inner
    }

    /// See [`crate::Client::acquire`]; returns the hold (token, payload).
    pub fn acquire(
        &self,
        key: &pb::LockKey,
        pod: &pb::Pod,
        payload: Vec<u8>,
        wait: Duration,
    ) -> Result<pb::Hold> {
        self.runtime
            .block_on(self.inner.acquire(key, pod, payload, wait, 0))
            .map(|held| held.into_inner())
    }

    /// See [`crate::Client::release`].
    pub fn release(
        &self,
        key: &pb::LockKey,
        pod_uid: &str,
        token: u64,
        outcome: pb::Outcome,
    ) -> Result<Option<pb::Hold>> {
        self.runtime
            .block_on(self.inner.release(key, pod_uid, token, outcome))
    }

    /// See [`crate::Client::holder`] (linearizable).
    pub fn holder(&self, key: &pb::LockKey) -> Result<Option<pb::Hold>> {
        self.runtime.block_on(self.inner.holder(key))
    }

    /// See [`crate::Client::get`].
    pub fn get(&self, key: &pb::LockKey) -> Result<pb::LockState> {
        self.runtime.block_on(self.inner.get(key))
    }

    /// See [`crate::Client::revoke_pod`].
    pub fn revoke_pod(&self, pod_uid: &str, reason: &str) -> Result<pb::RevokePodResponse> {
        self.runtime
            .block_on(self.inner.revoke_pod(pod_uid, reason))
    }

    /// See [`crate::Client::get_pin`].
    pub fn get_pin(&self, key: &pb::PinKey) -> Result<Option<pb::Pin>> {
        self.runtime.block_on(self.inner.get_pin(key))
    }

    /// See [`crate::Client::report_pod`].
    pub fn report_pod(&self, pod_uid: &str, phase: pb::PodPhase) -> Result<pb::ReportPodResponse> {
        self.runtime.block_on(self.inner.report_pod(pod_uid, phase))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_cluster_gives_a_retryable_error_not_a_hang() {
        let options = Options {
            call_timeout: Duration::from_millis(200),
            retry_timeout: Duration::from_millis(300),
            ..Options::default()
        };
        let client = Client::new(["127.0.0.1:1"], options).unwrap();
        let err = client
            .holder(&pb::LockKey {
                scope: "gpu-bind".into(),
                name: "n1".into(),
            })
            .unwrap_err();
        assert!(err.is_retryable(), "{err}");
    }
}

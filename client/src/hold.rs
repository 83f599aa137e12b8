//! [`Held`]: what a granted acquire returns — the hold (fencing token,
//! payload) and the way to release it.
//!
//! ```no_run
//! # async fn demo(client: tether_client::Client, key: tether_client::proto::LockKey, pod: tether_client::proto::Pod) -> Result<(), tether_client::Error> {
//! use std::time::Duration;
//! use tether_client::proto::Outcome;
//! let held = client.acquire(&key, &pod, b"plan".to_vec(), Duration::from_secs(30), 0).await?;
//! // Writes to the protected resource carry the token; a stale one is refused there.
//! let token = held.token();
//! # let _ = token;
//! if let Some(next) = held.release(Outcome::Failed).await? {
//!     println!("handed to the next waiter with token {}", next.token);
//! }
//! # Ok(()) }
//! ```

use std::ops::Deref;

use tether_proto as pb;

use crate::client::Client;
use crate::error::Result;

/// A granted hold on a lock. Dropping it does **not** release the lock: a
/// scheduler's hold must outlive the bind and is released by the device
/// plugin (with the token) or by revoking the pod. Call [`Held::release`] to
/// give it up here.
#[derive(Clone)]
pub struct Held {
    client: Client,
    key: pb::LockKey,
    hold: pb::Hold,
}

impl Held {
    pub(crate) fn new(client: Client, key: pb::LockKey, hold: pb::Hold) -> Self {
        Self { client, key, hold }
    }

    /// The fencing token: present it with every write the hold protects.
    pub fn token(&self) -> u64 {
        self.hold.token
    }

    /// The payload stored with the hold.
    pub fn payload(&self) -> &[u8] {
        &self.hold.payload
    }

    /// The lock.
    pub fn key(&self) -> &pb::LockKey {
        &self.key
    }

    /// The holding pod's UID.
    pub fn pod_uid(&self) -> &str {
        self.hold.pod.as_ref().map_or("", |p| p.uid.as_str())
    }

    /// Releases the hold with an outcome; returns the next holder, granted in
    /// the same log entry, if anyone waited.
    pub async fn release(self, outcome: pb::Outcome) -> Result<Option<pb::Hold>> {
        self.client
            .release(&self.key, self.pod_uid(), self.token(), outcome)
            .await
    }

    /// The wire hold.
    pub fn into_inner(self) -> pb::Hold {
        self.hold
    }
}

impl Deref for Held {
    type Target = pb::Hold;

    fn deref(&self) -> &pb::Hold {
        &self.hold
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("key", &self.key)
            .field("hold", &self.hold)
            .finish()
    }
}

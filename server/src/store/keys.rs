//! Key layout of the `log`, `sm` and `events` column families.

use crate::sm::{LockKey, PinKey, Revision};

/// `log` key of a log index: big-endian so RocksDB's order is index order.
pub fn log_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

/// Log index of a `log` key.
pub fn log_index(key: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&key[..8]);
    u64::from_be_bytes(bytes)
}

/// `events` key of a revision.
pub fn event_key(revision: Revision) -> [u8; 12] {
    let mut key = [0u8; 12];
    key[..8].copy_from_slice(&revision.index.to_be_bytes());
    key[8..].copy_from_slice(&revision.sub.to_be_bytes());
    key
}

/// The revision of an `events` key (None if it is not one).
pub fn event_revision(key: &[u8]) -> Option<Revision> {
    let index = u64::from_be_bytes(key.get(..8)?.try_into().ok()?);
    let sub = u32::from_be_bytes(key.get(8..12)?.try_into().ok()?);
    Some(Revision { index, sub })
}

/// Prefix of lock records in `sm`.
pub const LOCK_PREFIX: &[u8] = b"l/";
/// Prefix of TTL lease records in `sm`.
pub const LEASE_PREFIX: &[u8] = b"t/";
/// Prefix of dedupe session records in `sm` ([`crate::sm::ClientSession`]).
pub const SESSION_PREFIX: &[u8] = b"c/";
/// Prefix of dedupe session records written by builds of formats up to 5
/// ([`crate::store::compat::ClientSessionV2`]): read, and moved under
/// [`SESSION_PREFIX`], when a replica of this build opens the database.
pub const SESSION_V2_PREFIX: &[u8] = b"s/";
/// `sm` key of the last applied log id.
pub const LAST_APPLIED: &[u8] = b"m/last_applied";
/// `sm` key of the last applied membership.
pub const MEMBERSHIP: &[u8] = b"m/membership";
/// `sm` key of the committed time.
pub const NOW: &[u8] = b"m/now";

/// `sm` key of a lock. Names cannot contain NUL (validated at the edge), so
/// NUL separates scope from name.
pub fn lock_key(key: &LockKey) -> Vec<u8> {
    let mut out = LOCK_PREFIX.to_vec();
    out.extend_from_slice(key.scope.as_bytes());
    out.push(0);
    out.extend_from_slice(key.name.as_bytes());
    out
}

/// `sm` key of a TTL lease.
pub fn lease_key(id: u64) -> Vec<u8> {
    let mut out = LEASE_PREFIX.to_vec();
    out.extend_from_slice(&id.to_be_bytes());
    out
}

/// `sm` key of a client session.
pub fn session_key(client_id: &str) -> Vec<u8> {
    let mut out = SESSION_PREFIX.to_vec();
    out.extend_from_slice(client_id.as_bytes());
    out
}

/// Prefix of pin records in `sm`.
pub const PIN_PREFIX: &[u8] = b"p/";
/// Prefix of node registry records in `sm`.
pub const NODE_PREFIX: &[u8] = b"n/";
/// Prefix of pod phase records in `sm`.
pub const POD_PREFIX: &[u8] = b"o/";

/// `sm` key of a pin (NUL separates set from member; names are validated to
/// contain none).
pub fn pin_key(key: &PinKey) -> Vec<u8> {
    let mut out = PIN_PREFIX.to_vec();
    out.extend_from_slice(key.set.as_bytes());
    out.push(0);
    out.extend_from_slice(key.member.as_bytes());
    out
}

/// `sm` key of a node.
pub fn node_key(name: &str) -> Vec<u8> {
    let mut out = NODE_PREFIX.to_vec();
    out.extend_from_slice(name.as_bytes());
    out
}

/// `sm` key of a pod's phase.
pub fn pod_key(uid: &str) -> Vec<u8> {
    let mut out = POD_PREFIX.to_vec();
    out.extend_from_slice(uid.as_bytes());
    out
}

/// Splits `a\0b` into its two parts.
pub fn split_pair(rest: &[u8]) -> (String, String) {
    let split = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    (
        String::from_utf8_lossy(&rest[..split]).into_owned(),
        String::from_utf8_lossy(rest.get(split + 1..).unwrap_or_default()).into_owned(),
    )
}

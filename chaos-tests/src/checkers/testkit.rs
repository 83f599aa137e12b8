//! Builders for the checkers' unit tests: hand-made logs and histories with
//! and without the flaw each checker looks for.

use tether_client::proto as pb;

use crate::history::{Call, Op, Outcome, Value};

/// An event of `kind` on `key` for pod `uid` at revision `index`.0.
pub fn event(kind: &str, key: &str, uid: &str, token: u64, index: u64) -> pb::Event {
    pb::Event {
        kind: kind.into(),
        key: key.into(),
        pod: Some(pb::Pod {
            uid: uid.into(),
            ..Default::default()
        }),
        token,
        revision: Some(pb::Revision { index, sub: 0 }),
        ..Default::default()
    }
}

/// A queued event at `position`.
pub fn queued(key: &str, uid: &str, position: u32, index: u64) -> pb::Event {
    let mut e = event("LockQueued", key, uid, 0, index);
    e.attributes.insert("position".into(), position.to_string());
    e
}

/// A completed acquire that was granted `token`.
pub fn granted(id: usize, key: &str, uid: &str, token: u64, span: (u64, u64)) -> Op {
    Op {
        id,
        process: id as u64,
        key: key.into(),
        call: Call::Acquire {
            uid: uid.into(),
            wait_ms: 0,
        },
        invoke_us: span.0,
        complete_us: Some(span.1),
        outcome: Outcome::Ok(Value::Granted(token)),
    }
}

/// A completed release answered "released".
pub fn released(id: usize, key: &str, uid: &str, token: u64, span: (u64, u64)) -> Op {
    Op {
        id,
        process: id as u64,
        key: key.into(),
        call: Call::Release {
            uid: uid.into(),
            token,
        },
        invoke_us: span.0,
        complete_us: Some(span.1),
        outcome: Outcome::Ok(Value::Released),
    }
}

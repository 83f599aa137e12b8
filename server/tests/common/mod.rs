//! Helpers of this crate's integration tests over [`tether_server::testing`].

#![allow(dead_code)]

pub mod http;

use std::time::Duration;

use tether_client::proto as pb;
use tether_client::{Client, Options};
pub use tether_server::testing::{Cluster, DEADLINE};

/// A client of the whole cluster.
pub fn client(cluster: &Cluster) -> Client {
    Client::new(
        cluster.endpoints(),
        Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        },
    )
    .unwrap()
}

/// A client that talks to one replica only (no leader following).
pub fn client_of(cluster: &Cluster, id: u64) -> Client {
    let options = Options {
        retry_timeout: Duration::from_millis(1),
        ..Options::default()
    };
    Client::new([cluster.addrs[&id].to_string()], options).unwrap()
}

/// A test pod.
pub fn pod(uid: &str) -> pb::Pod {
    pb::Pod {
        uid: uid.to_string(),
        namespace: "default".into(),
        name: format!("pod-{uid}"),
    }
}

/// A lock key in the `gpu-bind` scope.
pub fn lock(name: &str) -> pb::LockKey {
    pb::LockKey {
        scope: "gpu-bind".into(),
        name: name.to_string(),
    }
}

/// An Acquire of lock `gpu-bind/node-<index>` at log index `index`, stamped
/// with leader time `time_ms`.
pub fn acquire_entry(index: u64, time_ms: u64) -> tether_server::raft::Entry {
    use openraft::EntryPayload;
    use tether_server::sm::command::Acquire;
    use tether_server::sm::{Command, LockKey, Pod, Request};
    let command = Command::Acquire(Acquire {
        key: LockKey::new("gpu-bind", format!("node-{index}")),
        pod: Pod {
            uid: format!("u{index}"),
            ..Default::default()
        },
        payload: vec![],
        wait_ms: 0,
        lease_id: 0,
        client_id: "c".into(),
        queue_limit: 10,
    });
    tether_server::raft::Entry {
        log_id: tether_server::raft::log_id(1, 1, index),
        payload: EntryPayload::Normal(Request::new(None, time_ms, command)),
    }
}

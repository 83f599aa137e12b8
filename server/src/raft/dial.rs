//! The one way a replica dials another: Raft's messages
//! ([`super::network`]), a leader transfer's `TimeoutNow`, a follower's
//! `EndWait` to the leader, and the StatefulSet bootstrap's status probes
//! all take their connection from one [`PeerDialer`]. It knows the
//! `--peer-dial` overrides, the replicas' TLS, and what every message to a
//! replica carries: the target's id, the cluster id, and the replica token
//! of a cluster run with `--auth-tokens` ([`PeerDialer::mark`]). Before it
//! there were three dialers; one of them sent neither token nor TLS, and on
//! a cluster with tokens every leader transfer was refused.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_proto::RaftRequest;
use tether_proto::raft_service_client::RaftServiceClient;
use tether_tls::TlsMaterial;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use crate::cluster_id::ClusterIdCell;
use crate::config::PeerDial;

/// Metadata naming the replica a Raft message is meant for: a replica
/// refuses messages meant for another id (an address taken over by a new
/// member must not answer for the old one).
pub const TARGET_METADATA: &str = "x-tether-target-node";

/// Response metadata: the newest log format the answering replica reads,
/// so that a leader writes entries of a new format only once every member
/// can read them ([`super::network::PeerFormats`]).
pub const FORMAT_METADATA: &str = "x-tether-format";

/// How long a connection attempt to another replica may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Dials the other replicas: one lazily connected channel per address,
/// shared by every caller (a tonic channel reconnects on its own after a
/// failure, and clones share it).
pub struct PeerDialer {
    /// Addresses that replace the membership's for some targets.
    dial: PeerDial,
    /// Mutual TLS to the other replicas, when on.
    tls: Option<Arc<TlsMaterial>>,
    /// Sent as `authorization` with every message (`Auth::peer_authorization`:
    /// the replica token of a cluster run with `--auth-tokens`).
    authorization: Option<MetadataValue<Ascii>>,
    /// This replica's cluster id, named on every message so that a replica
    /// of another cluster refuses it.
    cluster_id: Arc<ClusterIdCell>,
    /// The channel of each address dialed so far.
    channels: Mutex<BTreeMap<String, Channel>>,
}

impl PeerDialer {
    /// A dialer using `dial`'s address for the replicas it names and the
    /// membership address for the rest.
    pub fn new(
        dial: PeerDial,
        tls: Option<Arc<TlsMaterial>>,
        authorization: Option<MetadataValue<Ascii>>,
        cluster_id: Arc<ClusterIdCell>,
    ) -> Self {
        Self {
            dial,
            tls,
            authorization,
            cluster_id,
            channels: Mutex::default(),
        }
    }

    /// The address dialed for replica `target`, whose membership address
    /// is `addr`.
    pub fn dialed<'a>(&'a self, target: u64, addr: &'a str) -> &'a str {
        self.dial.get(&target).map_or(addr, String::as_str)
    }

    /// The channel to `addr` (an address as dialed), created on first use;
    /// None when `addr` is no valid address. Calls on it are bounded by
    /// their callers.
    pub fn channel(&self, addr: &str) -> Option<Channel> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(channel) = channels.get(addr) {
            return Some(channel.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .ok()?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5));
        let channel = match &self.tls {
            Some(tls) => tether_tls::lazy_channel(endpoint, tls.clone(), CONNECT_TIMEOUT),
            None => endpoint.connect_lazy(),
        };
        channels.insert(addr.to_string(), channel.clone());
        Some(channel)
    }

    /// A Raft-service client of replica `target`, whose membership address
    /// is `addr`; None when the address cannot be dialed.
    pub fn raft_client(&self, target: u64, addr: &str) -> Option<RaftServiceClient<Channel>> {
        self.channel(self.dialed(target, addr))
            .map(RaftServiceClient::new)
    }

    /// Marks `request` as a message to replica `target` from this
    /// replica's cluster (when its id is known), with this replica's
    /// authorization (when the cluster runs with tokens). The receiver's
    /// checks are `replica::peer_service`'s. Returns the cluster id named.
    pub fn mark<T>(&self, request: &mut tonic::Request<T>, target: u64) -> Option<String> {
        let cluster_id = self.cluster_id.get();
        let metadata = request.metadata_mut();
        if let Ok(target) = target.to_string().parse() {
            metadata.insert(TARGET_METADATA, target);
        }
        if let Some(authorization) = &self.authorization {
            metadata.insert(crate::auth::AUTHORIZATION, authorization.clone());
        }
        if let Some(Ok(value)) = cluster_id.as_deref().map(str::parse) {
            metadata.insert(crate::cluster_id::METADATA, value);
        }
        cluster_id
    }

    /// This replica's cluster id, once known.
    pub fn cluster_id(&self) -> Option<String> {
        self.cluster_id.get()
    }

    /// `data` as a message of this replica to replica `target`, marked.
    pub fn message(&self, target: u64, data: Vec<u8>) -> tonic::Request<RaftRequest> {
        let mut request = tonic::Request::new(RaftRequest { data });
        self.mark(&mut request, target);
        request
    }

    /// Drops the channels of addresses not in `keep`; returns how many are
    /// left.
    pub fn keep_only(&self, keep: &BTreeSet<&str>) -> usize {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        channels.retain(|addr, _| keep.contains(addr.as_str()));
        channels.len()
    }

    /// The addresses with a channel (tests).
    pub fn dialed_addresses(&self) -> Vec<String> {
        let channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        channels.keys().cloned().collect()
    }
}

//! openraft's network over the internal `RaftService` (tonic). Messages are
//! openraft's own types in the log's postcard encoding.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tether_proto::raft_service_client::RaftServiceClient;
use tether_proto::{RaftReply, RaftRequest};
use tonic::transport::{Channel, Endpoint};

use super::TypeConfig;
use crate::api::raft::FORMAT_METADATA;
use crate::config::PeerDial;
use crate::store::{decode, encode};
use tether_tls::TlsMaterial;

/// The newest log format each other replica said it reads, learned from
/// the answers to Raft messages (metadata [`FORMAT_METADATA`]). A replica of
/// a build older than that metadata sends none and counts as format 2.
#[derive(Debug, Default)]
pub struct PeerFormats {
    formats: Mutex<BTreeMap<u64, u16>>,
}

/// Format assumed for a replica whose answers carry no format.
const FORMAT_OF_OLDER_BUILDS: u16 = 2;

impl PeerFormats {
    fn record(&self, peer: u64, format: u16) {
        self.formats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer, format);
    }

    /// Whether every one of `peers` has answered since this replica started
    /// and reads `format`: only then may this leader write entries of it.
    pub fn all_read(&self, peers: impl IntoIterator<Item = u64>, format: u16) -> bool {
        let formats = self.formats.lock().unwrap_or_else(|p| p.into_inner());
        peers
            .into_iter()
            .all(|peer| formats.get(&peer).is_some_and(|f| *f >= format))
    }
}

/// How many of a message's `entries` to send instead, when its `bytes` are
/// over `limit` (the receiver would refuse it, and openraft would send it
/// again unchanged, for ever): proportionally fewer, with a tenth to spare,
/// at least one. None when it fits, or when it is one entry (which fits: the
/// replica refuses to start with `--max-request-bytes` over a quarter of the
/// message limit, and batches are bounded by it too).
fn fewer_entries(entries: usize, bytes: usize, limit: usize) -> Option<u64> {
    if bytes <= limit || entries <= 1 {
        return None;
    }
    let fitting = (entries as u128 * limit as u128 * 9 / 10 / bytes as u128) as u64;
    Some(fitting.clamp(1, entries as u64 - 1))
}

/// Creates one [`PeerClient`] per target replica.
#[derive(Clone, Default)]
pub struct Network {
    /// Addresses that replace the membership's for some targets
    /// (`--peer-dial`).
    dial: Arc<PeerDial>,
    /// Mutual TLS to the other replicas, when on.
    tls: Option<Arc<TlsMaterial>>,
    /// What each peer reads, filled in by the clients.
    formats: Arc<PeerFormats>,
    /// Largest Raft message a peer accepts, in bytes.
    message_limit: usize,
}

impl Network {
    /// A network dialing `dial`'s address for the replicas it names and the
    /// membership address for the rest, recording the peers' formats in
    /// `formats` and keeping messages within `message_limit` bytes.
    pub fn new(
        dial: PeerDial,
        tls: Option<Arc<TlsMaterial>>,
        formats: Arc<PeerFormats>,
        message_limit: usize,
    ) -> Self {
        Self {
            dial: Arc::new(dial),
            tls,
            formats,
            message_limit,
        }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> PeerClient {
        let addr = self.dial.get(&target).unwrap_or(&node.addr);
        PeerClient::new(
            target,
            addr,
            self.tls.clone(),
            self.formats.clone(),
            self.message_limit,
        )
    }
}

/// Sends Raft RPCs to one replica over a lazily connected channel.
pub struct PeerClient {
    target: u64,
    addr: String,
    client: Option<RaftServiceClient<Channel>>,
    formats: Arc<PeerFormats>,
    message_limit: usize,
}

/// Bytes a `RaftRequest` adds around its `data` (field tag and length), so
/// that a message just under the limit by its data is not just over it.
const RAFT_REQUEST_FRAMING: usize = 16;

/// Which `RaftService` method to call.
#[derive(Clone, Copy)]
enum Rpc {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

impl PeerClient {
    fn new(
        target: u64,
        addr: &str,
        tls: Option<Arc<TlsMaterial>>,
        formats: Arc<PeerFormats>,
        message_limit: usize,
    ) -> Self {
        let client = Endpoint::from_shared(format!("http://{addr}"))
            .ok()
            .map(|e| {
                let e = e
                    .connect_timeout(Duration::from_secs(1))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(5));
                match tls {
                    Some(tls) => tether_tls::lazy_channel(e, tls, Duration::from_secs(1)),
                    None => e.connect_lazy(),
                }
            })
            .map(RaftServiceClient::new);
        Self {
            target,
            addr: addr.to_string(),
            client,
            formats,
            message_limit,
        }
    }

    /// Sends `request`; `entries` is the number of log entries it carries
    /// (AppendEntries), so that one too big for a Raft message is sent again
    /// with fewer.
    async fn call<Req, Resp, Err>(
        &mut self,
        rpc: Rpc,
        request: &Req,
        entries: usize,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<u64, BasicNode, Err>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        Err: std::error::Error + DeserializeOwned,
    {
        let Some(client) = self.client.as_mut() else {
            let msg = format!(
                "replica {} has an invalid address {:?}",
                self.target, self.addr
            );
            return Err(RPCError::Unreachable(Unreachable::new(
                &std::io::Error::other(msg),
            )));
        };
        let data = encode(request);
        let message_bytes = data.len() + RAFT_REQUEST_FRAMING;
        if let Some(hint) = fewer_entries(entries, message_bytes, self.message_limit) {
            // openraft sends at most `hint` entries per message for a while.
            return Err(RPCError::PayloadTooLarge(
                PayloadTooLarge::new_entries_hint(hint),
            ));
        }
        let mut req = tonic::Request::new(RaftRequest { data });
        req.set_timeout(option.hard_ttl());
        // The receiver refuses messages meant for another id (see
        // `api::raft::RaftApi::check_target`).
        if let Ok(target) = self.target.to_string().parse() {
            req.metadata_mut()
                .insert(crate::api::raft::TARGET_METADATA, target);
        }
        let result = match rpc {
            Rpc::AppendEntries => client.append_entries(req).await,
            Rpc::Vote => client.vote(req).await,
            Rpc::InstallSnapshot => client.install_snapshot(req).await,
        };
        let reply: RaftReply = match result {
            Ok(resp) => {
                let format = resp
                    .metadata()
                    .get(FORMAT_METADATA)
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(FORMAT_OF_OLDER_BUILDS);
                self.formats.record(self.target, format);
                resp.into_inner()
            }
            Err(status) => {
                // Connection failures make the peer unreachable (openraft backs
                // off); other statuses are network errors (retried at once).
                let err = std::io::Error::other(format!(
                    "RPC to replica {} at {}: {}",
                    self.target, self.addr, status
                ));
                return Err(match status.code() {
                    tonic::Code::Unavailable => RPCError::Unreachable(Unreachable::new(&err)),
                    _ => RPCError::Network(NetworkError::new(&err)),
                });
            }
        };
        if !reply.error.is_empty() {
            let err: Err = decode(&reply.error).map_err(|e| {
                RPCError::Network(NetworkError::new(&std::io::Error::other(e.to_string())))
            })?;
            return Err(RPCError::RemoteError(openraft::error::RemoteError::new(
                self.target,
                err,
            )));
        }
        decode(&reply.data).map_err(|e| {
            RPCError::Network(NetworkError::new(&std::io::Error::other(e.to_string())))
        })
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        let entries = rpc.entries.len();
        self.call(Rpc::AppendEntries, &rpc, entries, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        self.call(Rpc::InstallSnapshot, &rpc, 0, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.call(Rpc::Vote, &rpc, 0, &option).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_append_too_big_for_one_message_is_split() {
        assert_eq!(fewer_entries(300, 1_000, 64), Some(17));
        assert_eq!(fewer_entries(300, 64, 64), None, "fits exactly");
        assert_eq!(fewer_entries(1, 1_000, 64), None, "one entry is sent as is");
        assert_eq!(fewer_entries(2, 10_000, 64), Some(1), "at least one");
        assert_eq!(fewer_entries(300, 65, 64), Some(265), "always fewer");
    }

    #[test]
    fn the_framing_margin_covers_a_raft_request_up_to_the_limit() {
        use prost::Message;
        // A protobuf bytes field adds a tag and a varint length; the limit
        // is 64 MiB, so the largest data that can be sent is just under it.
        for len in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            crate::raft::MAX_RAFT_MESSAGE_BYTES,
        ] {
            let request = RaftRequest { data: vec![0; len] };
            assert!(
                request.encoded_len() <= len + RAFT_REQUEST_FRAMING,
                "{len} bytes of data encode to {}",
                request.encoded_len()
            );
        }
    }

    #[test]
    fn a_new_format_is_written_only_once_every_peer_said_it_reads_it() {
        let formats = PeerFormats::default();
        // No peers (a single replica): nothing to wait for.
        assert!(formats.all_read([], 3));
        // A peer that has not answered yet may be of an older build.
        formats.record(2, 3);
        assert!(!formats.all_read([2, 3], 3));
        // One that answered without the metadata is an older build.
        formats.record(3, FORMAT_OF_OLDER_BUILDS);
        assert!(!formats.all_read([2, 3], 3));
        assert!(formats.all_read([2, 3], 2));
        // Upgraded and restarted: it answers with the new format.
        formats.record(3, 3);
        assert!(formats.all_read([2, 3], 3));
    }
}

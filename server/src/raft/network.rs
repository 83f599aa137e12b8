//! openraft's network over the internal `RaftService` (tonic). Messages are
//! openraft's own types in the log's postcard encoding, in their 0.9
//! layouts (so that replicas of the 0.9 build and of this one understand
//! each other during a rolling upgrade). AppendEntries, the message of every
//! commit and heartbeat, go over a gRPC stream per replication session,
//! pipelined: openraft's next request goes out before the answer to the
//! previous one is back ([`PeerClient::stream_append`]). Votes and
//! snapshots (in 0.9's chunks) are unary calls.

use openraft::async_runtime::WatchReceiver as _;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use openraft::BasicNode;
use openraft::base::{BoxFuture, BoxStream};
use openraft::error::decompose::DecomposeResult;
use openraft::error::{NetworkError, RPCError, RaftError, Unreachable};
use openraft::error::{ReplicationClosed, StreamingError};
use openraft::network::{Backoff, RaftNetworkV2};
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, StreamAppendResult, VoteRequest,
    VoteResponse,
};
use openraft_legacy::network_v1::{
    Adapter, InstallSnapshotError, InstallSnapshotRequest, InstallSnapshotResponse, RaftNetwork,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tether_proto::raft_service_client::RaftServiceClient;
use tether_proto::{RaftReply, RaftRequest};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::transport::Channel;

use super::dial::{FORMAT_METADATA, PeerDialer};
use super::{LogId, TypeConfig, Vote};
use crate::metrics::{Metrics, RaftAppend};
use crate::store::{decode, encode};

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
        self.newest_all_read(peers)
            .is_none_or(|newest| newest >= format)
    }

    /// The other members (voters and learners) of `raft`'s current
    /// membership, `id` being this replica.
    fn other_members(raft: &crate::raft::Raft, id: u64) -> Vec<u64> {
        let metrics = raft.metrics();
        let metrics = metrics.borrow_watched();
        metrics
            .membership_config
            .membership()
            .nodes()
            .map(|(peer, _)| *peer)
            .filter(|peer| *peer != id)
            .collect()
    }

    /// [`PeerFormats::newest_all_read`] over the other members of `raft`.
    pub fn newest_members_read(&self, raft: &crate::raft::Raft, id: u64) -> Option<u16> {
        self.newest_all_read(Self::other_members(raft, id))
    }

    /// The oldest format that another member of `raft` has said it reads,
    /// over the members that have answered since this replica started (None
    /// if none has). Unlike [`PeerFormats::newest_members_read`], a member
    /// that has not answered does not count: for a format whose entries fix
    /// a safety bug, a member that is down must not hold the fix back
    /// (`Replica::request`).
    pub fn oldest_member_known(&self, raft: &crate::raft::Raft, id: u64) -> Option<u16> {
        let formats = self.formats.lock().unwrap_or_else(|p| p.into_inner());
        Self::other_members(raft, id)
            .into_iter()
            .filter_map(|peer| formats.get(&peer).copied())
            .min()
    }

    /// The newest format every one of `peers` reads: None without peers,
    /// and 0 if one of them has not answered since this replica started.
    pub fn newest_all_read(&self, peers: impl IntoIterator<Item = u64>) -> Option<u16> {
        let formats = self.formats.lock().unwrap_or_else(|p| p.into_inner());
        peers
            .into_iter()
            .map(|peer| formats.get(&peer).copied().unwrap_or(0))
            .min()
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

/// When each address last refused the AppendEntries stream (a replica of
/// an older build, during a rolling upgrade). Shared by every client of a
/// [`Network`]: openraft makes fresh clients for each read round's
/// heartbeats, and each would otherwise ask for the stream again, a wasted
/// round trip per read.
#[derive(Debug, Default)]
struct StreamRefusals {
    refused_at: Mutex<BTreeMap<String, Instant>>,
}

/// How long AppendEntries stay unary after an address refused the stream.
const STREAM_RETRY_AFTER: Duration = Duration::from_secs(60);

impl StreamRefusals {
    /// Whether AppendEntries to `addr` should try the stream: it has not
    /// refused it within [`STREAM_RETRY_AFTER`].
    fn may_stream(&self, addr: &str) -> bool {
        let refused_at = self.refused_at.lock().unwrap_or_else(|p| p.into_inner());
        refused_at
            .get(addr)
            .is_none_or(|at| at.elapsed() >= STREAM_RETRY_AFTER)
    }

    fn refused(&self, addr: &str) {
        self.refused_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr.to_string(), Instant::now());
    }

    /// `addr` served a stream (upgraded since it refused, perhaps).
    fn accepted(&self, addr: &str) {
        self.refused_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(addr);
    }
}

/// Creates [`PeerClient`]s. openraft asks for a new one per replication
/// stream and, for every linearizable read, one per voter (the read's
/// heartbeat round); they share one connection per address, kept here, so
/// that a read does not open a TCP connection to each voter.
#[derive(Clone)]
pub struct Network {
    /// This replica's id.
    own: u64,
    /// How the other replicas are dialed (one channel per address).
    dialer: Arc<PeerDialer>,
    /// What each peer reads, filled in by the clients.
    formats: Arc<PeerFormats>,
    /// Largest Raft message a peer accepts, in bytes.
    message_limit: usize,
    /// Where the clients count how they sent AppendEntries.
    metrics: Arc<Metrics>,
    /// Addresses that refused the AppendEntries stream lately.
    stream_refusals: Arc<StreamRefusals>,
}

impl Network {
    /// Replica `own`'s network, dialing through `dialer`, recording the
    /// peers' formats in `formats`, keeping messages within `message_limit`
    /// bytes and counting AppendEntries streams in `metrics`.
    pub fn new(
        own: u64,
        dialer: Arc<PeerDialer>,
        formats: Arc<PeerFormats>,
        message_limit: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            own,
            dialer,
            formats,
            message_limit,
            metrics,
            stream_refusals: Arc::default(),
        }
    }

    /// Drops the cached connections, and stream refusals, of addresses at
    /// which none of `members` (the membership's nodes, learners included)
    /// is dialed: replicas removed, or moved to other addresses. Clients
    /// still holding such a connection keep it until openraft drops them.
    pub fn forget_departed<'a>(&self, members: impl IntoIterator<Item = (&'a u64, &'a BasicNode)>) {
        let dialed: std::collections::BTreeSet<&str> = members
            .into_iter()
            .map(|(id, node)| self.dialer.dialed(*id, &node.addr))
            .collect();
        self.dialer.keep_only(&dialed);
        self.stream_refusals
            .refused_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|addr, _| dialed.contains(addr.as_str()));
    }
}

/// What openraft talks to a peer through: [`PeerClient`]'s pipelined
/// AppendEntries stream, and openraft-legacy's adapter for the rest of the
/// 0.9 messages (votes; snapshots sent in chunks).
pub struct PeerLink {
    link: Adapter<TypeConfig, PeerClient, std::io::Cursor<Vec<u8>>>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerLink;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> PeerLink {
        PeerLink {
            link: Adapter::new(self.client(target, node)),
        }
    }
}

impl RaftNetworkV2<TypeConfig> for PeerLink {
    type SnapshotData = std::io::Cursor<Vec<u8>>;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        RaftNetworkV2::append_entries(&mut self.link, rpc, option).await
    }

    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<'s, Result<AppendResults<'s>, RPCError<TypeConfig>>>
    where
        S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        Box::pin(self.link.inner_mut().stream_append(input, option))
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        RaftNetworkV2::vote(&mut self.link, rpc, option).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: crate::raft::Snapshot,
        cancel: impl std::future::Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        RaftNetworkV2::full_snapshot(&mut self.link, vote, snapshot, cancel, option).await
    }

    fn backoff(&self) -> Option<Backoff> {
        RaftNetworkV2::backoff(&self.link)
    }
}

/// The answers of a pipelined AppendEntries stream, in request order.
pub type AppendResults<'s> =
    BoxStream<'s, Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>>;

/// Most AppendEntries messages sent on a stream and not yet answered; the
/// next waits for an answer. Enough for every batch the leader forms while
/// one is being synced and replicated.
const PIPELINE_DEPTH: usize = 64;

/// How long an AppendEntries stream the leader stopped waiting for is still
/// read in the background, so that it ends as the follower answers it and
/// not by a reset (RST_STREAM). openraft gives every heartbeat one
/// heartbeat interval (100 ms) and drops it then, and each read round and
/// heartbeat opens a stream of its own on the connection every append to
/// that follower shares. A follower too slow to accept streams for a
/// moment (starved of CPU, stopped, catching up) counts the resets of
/// streams it had not accepted yet, and past 20 (h2's limit against
/// "rapid reset" floods) it ends the whole connection with GOAWAY
/// ENHANCE_YOUR_CALM, and every append in flight on it. Closed instead
/// (the request side ended, the answers read), such a stream costs the
/// follower one late answer. After this grace a stream is reset after all.
const LATE_ANSWER_GRACE: Duration = Duration::from_secs(10);

/// The answers of an AppendEntries stream. Dropped before their end, they
/// are read to it in the background (for up to [`LATE_ANSWER_GRACE`]), so
/// that the stream closes rather than being reset; dropping the request
/// side beside it has ended the stream's requests.
struct Replies(Option<tonic::Streaming<RaftReply>>);

impl Replies {
    async fn message(&mut self) -> Result<Option<RaftReply>, Status> {
        match self.0.as_mut() {
            Some(replies) => replies.message().await,
            None => Ok(None),
        }
    }
}

impl Drop for Replies {
    fn drop(&mut self) {
        if let Some(replies) = self.0.take() {
            drain_in_background(replies);
        }
    }
}

/// Reads what is left of `replies` in a task of its own, for up to
/// [`LATE_ANSWER_GRACE`] (outside a runtime, shutting down, drops them).
fn drain_in_background(mut replies: tonic::Streaming<RaftReply>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = tokio::time::timeout(LATE_ANSWER_GRACE, async {
                while let Ok(Some(_)) = replies.message().await {}
            })
            .await;
        });
    }
}

/// Opens an AppendEntries stream in a task of its own: a caller that stops
/// waiting (openraft's timeout drops it) leaves the opening to go on, and
/// the stream it opens is then drained ([`Replies`]), instead of being
/// reset before the follower has accepted it.
async fn open_stream(
    mut client: RaftServiceClient<Channel>,
    request: tonic::Request<ReceiverStream<RaftRequest>>,
) -> Result<tonic::Response<Replies>, Status> {
    let (opened, waiting) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let response =
            tokio::time::timeout(LATE_ANSWER_GRACE, client.append_entries_stream(request))
                .await
                .unwrap_or_else(|_| {
                    Err(Status::deadline_exceeded(
                        "the AppendEntries stream did not open",
                    ))
                })
                .map(|response| response.map(|replies| Replies(Some(replies))));
        // Nobody waits any more: the stream, if it opened, is drained as
        // the answer is dropped.
        let _ = opened.send(response);
    });
    waiting
        .await
        .unwrap_or_else(|_| Err(Status::internal("the stream's opening task ended")))
}

/// The last log id an AppendEntries covers: its last entry's, or the one
/// it follows when it carries none (a heartbeat).
fn last_covered(rpc: &AppendEntriesRequest<TypeConfig>) -> Option<LogId> {
    rpc.entries
        .last()
        .map(|entry| entry.log_id)
        .or(rpc.prev_log_id)
}

/// `rpc` as consecutive requests of at most `fitting` entries each, for a
/// request too big for one message (openraft 0.9 was told to send fewer,
/// `PayloadTooLarge`; 0.10 has no such answer). Each part follows the
/// previous one and commits no further than its own last entry: the
/// follower cannot yet know that the rest matches.
fn split_request(
    rpc: AppendEntriesRequest<TypeConfig>,
    fitting: usize,
) -> Vec<AppendEntriesRequest<TypeConfig>> {
    let AppendEntriesRequest {
        vote,
        prev_log_id,
        leader_commit,
        mut entries,
    } = rpc;
    let mut parts = Vec::new();
    let mut prev = prev_log_id;
    while !entries.is_empty() {
        let rest = entries.split_off(fitting.clamp(1, entries.len()));
        let part = std::mem::replace(&mut entries, rest);
        let last = part.last().map(|entry| entry.log_id);
        parts.push(AppendEntriesRequest {
            vote,
            prev_log_id: prev,
            leader_commit: leader_commit.min(last),
            entries: part,
        });
        prev = last;
    }
    parts
}

/// `rpc` encoded as messages of at most `limit` bytes each (with their
/// framing), split again while a part is still too big (entries differ in
/// size, the split's estimate does not), each with the log ids it follows
/// and covers. A single entry always fits (`--max-request-bytes` is at
/// most a quarter of the limit).
fn encode_to_fit(
    rpc: AppendEntriesRequest<TypeConfig>,
    limit: usize,
    out: &mut Vec<(Option<LogId>, Option<LogId>, Vec<u8>)>,
) {
    let data = encode(&rpc);
    match fewer_entries(rpc.entries.len(), data.len() + RAFT_REQUEST_FRAMING, limit) {
        None => out.push((rpc.prev_log_id, last_covered(&rpc), data)),
        Some(fitting) => {
            for part in split_request(rpc, fitting as usize) {
                encode_to_fit(part, limit, out);
            }
        }
    }
}

/// One request of a pipelined stream as sent: the log ids each of its
/// messages follows and covers (several when it was split).
struct Sent {
    parts: Vec<(Option<LogId>, Option<LogId>)>,
}

impl Network {
    /// A client to replica `target` at `node`'s address.
    fn client(&self, target: u64, node: &BasicNode) -> PeerClient {
        PeerClient {
            own: self.own,
            target,
            addr: self.dialer.dialed(target, &node.addr).to_string(),
            client: self.dialer.raft_client(target, &node.addr),
            formats: self.formats.clone(),
            message_limit: self.message_limit,
            metrics: self.metrics.clone(),
            append_stream: None,
            stream_refusals: self.stream_refusals.clone(),
            dialer: self.dialer.clone(),
        }
    }
}

/// Decodes a `VoteRequest` from a replica of either build: openraft 0.10
/// appended `leadership_transfer`, which a 0.9 replica does not send
/// (postcard is positional, so the field's serde default does not apply).
pub fn decode_vote_request(data: &[u8]) -> Result<VoteRequest<TypeConfig>, postcard::Error> {
    decode(data).or_else(|newer| {
        #[derive(serde::Deserialize)]
        struct VoteRequestV09 {
            vote: Vote,
            last_log_id: Option<LogId>,
        }
        match postcard::from_bytes::<VoteRequestV09>(data) {
            Ok(old) => Ok(VoteRequest {
                vote: old.vote,
                last_log_id: old.last_log_id,
                leadership_transfer: false,
            }),
            Err(_) => Err(newer),
        }
    })
}

/// Sends Raft RPCs to one replica over a lazily connected channel.
pub struct PeerClient {
    /// The sending replica's id.
    own: u64,
    target: u64,
    addr: String,
    client: Option<RaftServiceClient<Channel>>,
    formats: Arc<PeerFormats>,
    message_limit: usize,
    metrics: Arc<Metrics>,
    /// The open AppendEntries stream, if any.
    append_stream: Option<AppendStream>,
    /// Addresses that said they have no AppendEntries stream: to them,
    /// AppendEntries go as unary calls for a while.
    stream_refusals: Arc<StreamRefusals>,
    /// Marks every message (target, cluster id, authorization).
    dialer: Arc<PeerDialer>,
}

/// One AppendEntries stream to a follower. A request's answer is the next
/// message on `replies`, so there is never more than one request without
/// its answer; `awaiting_reply` marks that one, so that a call abandoned
/// midway (openraft times its calls out by dropping them) leaves a stream
/// that is thrown away rather than one whose next message answers an
/// older request.
struct AppendStream {
    requests: mpsc::Sender<RaftRequest>,
    replies: Replies,
    awaiting_reply: bool,
    /// The cluster id named when the stream was opened.
    cluster_id: Option<String>,
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

// The helpers return openraft's `RPCError`, which `RaftNetwork`'s methods
// must return; boxing it here would only be undone there.
#[allow(clippy::result_large_err)]
impl PeerClient {
    /// A partition for tests (failpoints builds): with
    /// `raft-cut-off=return(N)` every Raft message to or from replica N
    /// fails as unreachable, in a process whose replicas all run in it.
    fn cut_off<Err: std::error::Error>(&self) -> Result<(), RPCError<TypeConfig, Err>> {
        if is_cut_off(self.own, self.target) {
            return Err(RPCError::Unreachable(Unreachable::new(
                &std::io::Error::other(format!(
                    "failpoint raft-cut-off: replica {} or {} is cut off",
                    self.own, self.target
                )),
            )));
        }
        Ok(())
    }

    /// The client, or why there is none.
    fn client<Err: std::error::Error>(
        &mut self,
    ) -> Result<&mut RaftServiceClient<Channel>, RPCError<TypeConfig, Err>> {
        match self.client.as_mut() {
            Some(client) => Ok(client),
            None => {
                let msg = format!(
                    "replica {} has an invalid address {:?}",
                    self.target, self.addr
                );
                Err(RPCError::Unreachable(Unreachable::new(
                    &std::io::Error::other(msg),
                )))
            }
        }
    }

    /// The metadata naming the target and this replica's cluster; the
    /// receiver refuses messages meant for another id or from another
    /// cluster ([`PeerDialer::mark`]). Returns the cluster id named.
    fn name_target<T>(&self, request: &mut tonic::Request<T>) -> Option<String> {
        self.dialer.mark(request, self.target)
    }

    /// Notes the log format the target's answer says it reads.
    fn record_format(&self, metadata: &tonic::metadata::MetadataMap) {
        let format = metadata
            .get(FORMAT_METADATA)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(FORMAT_OF_OLDER_BUILDS);
        self.formats.record(self.target, format);
    }

    /// A failed call as openraft's error: connection failures make the
    /// peer unreachable (openraft backs off); other statuses are network
    /// errors (retried at once).
    fn status_error<Err: std::error::Error>(&self, status: &Status) -> RPCError<TypeConfig, Err> {
        let err = std::io::Error::other(format!(
            "RPC to replica {} at {}: {}",
            self.target, self.addr, status
        ));
        match status.code() {
            tonic::Code::Unavailable => RPCError::Unreachable(Unreachable::new(&err)),
            _ => RPCError::Network(NetworkError::new(&err)),
        }
    }

    /// The receiver's answer: its value, or the error it sent back.
    fn decode_reply<Resp, Err>(&self, reply: RaftReply) -> Result<Resp, RPCError<TypeConfig, Err>>
    where
        Resp: DeserializeOwned,
        Err: std::error::Error + DeserializeOwned,
    {
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

    /// Opens an AppendEntries stream to the target with `first` as its
    /// first message: queued before the call, it goes out with the
    /// stream's headers instead of a round trip later.
    async fn open_append_stream(&mut self, first: RaftRequest) -> Result<AppendStream, Status> {
        // One request waits at most: the next is sent after its answer.
        let (requests, outgoing) = mpsc::channel(1);
        requests
            .try_send(first)
            .map_err(|_| Status::internal("a new stream's queue is full"))?;
        let mut request = tonic::Request::new(ReceiverStream::new(outgoing));
        let cluster_id = self.name_target(&mut request);
        let Some(client) = self.client.clone() else {
            return Err(Status::unavailable("no client"));
        };
        let response = open_stream(client, request).await?;
        self.metrics
            .raft_append(self.target, RaftAppend::StreamOpened);
        self.stream_refusals.accepted(&self.addr);
        self.record_format(response.metadata());
        Ok(AppendStream {
            requests,
            replies: response.into_inner(),
            awaiting_reply: false,
            cluster_id,
        })
    }

    /// Sends `data` (an encoded AppendEntries) on the stream, opening one if
    /// there is none, and waits up to `ttl` for its answer. Any failure
    /// throws the stream away; the next call opens a new one.
    async fn exchange_on_stream(
        &mut self,
        data: Vec<u8>,
        ttl: Duration,
    ) -> Result<RaftReply, Status> {
        let deadline = tokio::time::Instant::now() + ttl;
        let timed_out = || Status::deadline_exceeded(format!("no answer within {ttl:?}"));
        if self
            .append_stream
            .as_ref()
            .is_some_and(|stream| stream.awaiting_reply)
        {
            // The previous call was abandoned before its answer came.
            self.append_stream = None;
        }
        if self
            .append_stream
            .as_ref()
            .is_some_and(|stream| stream.cluster_id.is_none() && self.dialer.cluster_id().is_some())
        {
            // Opened before this replica knew its cluster id: reopen, so
            // the follower learns it (and checks it) from the new stream's
            // metadata.
            self.append_stream = None;
        }
        // A new stream carries the message from the start.
        let unsent = if self.append_stream.is_none() {
            let first = RaftRequest { data };
            let opened = tokio::time::timeout_at(deadline, self.open_append_stream(first))
                .await
                .map_err(|_| timed_out())??;
            self.append_stream = Some(opened);
            None
        } else {
            Some(RaftRequest { data })
        };
        let Some(stream) = self.append_stream.as_mut() else {
            return Err(Status::internal("no AppendEntries stream"));
        };
        stream.awaiting_reply = true;
        let exchange = async {
            if let Some(request) = unsent {
                stream
                    .requests
                    .send(request)
                    .await
                    .map_err(|_| Status::unavailable("the AppendEntries stream is closed"))?;
            }
            match stream.replies.message().await? {
                Some(reply) => Ok(reply),
                None => Err(Status::unavailable(
                    "the replica ended the AppendEntries stream",
                )),
            }
        };
        let result = tokio::time::timeout_at(deadline, exchange)
            .await
            .unwrap_or_else(|_| Err(timed_out()));
        match &result {
            Ok(_) => stream.awaiting_reply = false,
            Err(_) => self.append_stream = None,
        }
        result
    }

    /// Sends one AppendEntries: over the stream, or as a unary call to a
    /// target that does not have the stream; in several when it is too big
    /// for one message.
    async fn append(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: &RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig, RaftError<TypeConfig>>>
    {
        let data = encode(&rpc);
        if let Some(fitting) = fewer_entries(
            rpc.entries.len(),
            data.len() + RAFT_REQUEST_FRAMING,
            self.message_limit,
        ) {
            return Box::pin(self.append_in_parts(rpc, fitting as usize, option)).await;
        }
        // A client with its stream open need not ask.
        if self.append_stream.is_none() && !self.stream_refusals.may_stream(&self.addr) {
            return self.unary_append(data, option).await;
        }
        self.client::<RaftError<TypeConfig>>()?;
        match self
            .exchange_on_stream(data.clone(), option.hard_ttl())
            .await
        {
            Ok(reply) => self.decode_reply(reply),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                self.stream_refused();
                self.unary_append(data, option).await
            }
            Err(status) => Err(self.status_error(&status)),
        }
    }

    /// The target answered that it has no AppendEntries stream (a build
    /// older than it): AppendEntries go to it as unary calls for a while.
    fn stream_refused(&self) {
        tracing::info!(
            target = self.target,
            "replica has no AppendEntries stream (an older build): \
             sending AppendEntries as unary calls"
        );
        self.stream_refusals.refused(&self.addr);
    }

    /// Sends an AppendEntries too big for one message as consecutive ones
    /// of at most `fitting` entries (each split again if still too big),
    /// one after another. openraft 0.9 was told to send fewer
    /// (`PayloadTooLarge`); 0.10 has no such answer. The answer is the last
    /// part's, or the first that is not a success: what the follower
    /// accepted up to there is a prefix of the request.
    async fn append_in_parts(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        fitting: usize,
        option: &RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig, RaftError<TypeConfig>>>
    {
        for part in split_request(rpc, fitting) {
            match self.append(part, option).await? {
                AppendEntriesResponse::Success => {}
                other => return Ok(other),
            }
        }
        Ok(AppendEntriesResponse::Success)
    }

    /// Sends one encoded AppendEntries as a unary call, to a target without
    /// the stream.
    async fn unary_append(
        &mut self,
        data: Vec<u8>,
        option: &RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig, RaftError<TypeConfig>>>
    {
        self.metrics.raft_append(self.target, RaftAppend::Unary);
        self.call_encoded(Rpc::AppendEntries, data, option).await
    }

    /// Sends `request` as a unary call.
    async fn call<Req, Resp, Err>(
        &mut self,
        rpc: Rpc,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<TypeConfig, Err>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        Err: std::error::Error + DeserializeOwned,
    {
        self.call_encoded(rpc, encode(request), option).await
    }

    /// Sends an encoded request as a unary call.
    async fn call_encoded<Resp, Err>(
        &mut self,
        rpc: Rpc,
        data: Vec<u8>,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<TypeConfig, Err>>
    where
        Resp: DeserializeOwned,
        Err: std::error::Error + DeserializeOwned,
    {
        let mut req = tonic::Request::new(RaftRequest { data });
        req.set_timeout(option.hard_ttl());
        self.name_target(&mut req);
        let client = self.client()?;
        let result = match rpc {
            Rpc::AppendEntries => client.append_entries(req).await,
            Rpc::Vote => client.vote(req).await,
            Rpc::InstallSnapshot => client.install_snapshot(req).await,
        };
        match result {
            Ok(resp) => {
                self.record_format(resp.metadata());
                self.decode_reply(resp.into_inner())
            }
            Err(status) => Err(self.status_error(&status)),
        }
    }
}

impl PeerClient {
    /// Sends openraft's AppendEntries as they come, on a gRPC stream of
    /// their own, without waiting for each answer before the next request
    /// (at most [`PIPELINE_DEPTH`] unanswered); the answers come back in
    /// order. The follower hands them to openraft as a stream too
    /// (`peer_service`), so a leader's batches are appended and synced on
    /// the follower while the next are on the wire. A replica of a build
    /// that had no stream gets them one at a time, as unary calls.
    ///
    /// The session ends (openraft starts another) at the first answer that
    /// is not a full success, an error, a cut-off (`raft-cut-off`), or an
    /// answer not back within the option's TTL of the wait for it.
    async fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> Result<AppendResults<'s>, RPCError<TypeConfig>>
    where
        S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        self.cut_off()?;
        if !self.stream_refusals.may_stream(&self.addr) {
            return Ok(self.append_one_at_a_time(input, option));
        }
        let client = self.client()?.clone();
        let (requests, outgoing) = mpsc::channel::<RaftRequest>(PIPELINE_DEPTH);
        let (sent_tx, sent_rx) = mpsc::unbounded_channel::<Sent>();
        // Dropped with the answers' stream: the sending task stops with it.
        let (session, ended) = tokio::sync::oneshot::channel::<()>();
        let mut request = tonic::Request::new(ReceiverStream::new(outgoing));
        self.name_target(&mut request);
        tokio::spawn(send_appends(
            input,
            requests,
            sent_tx,
            ended,
            self.message_limit,
            (self.own, self.target),
        ));
        let response = match open_stream(client, request).await {
            Ok(response) => response,
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                self.stream_refused();
                return Err(self.status_error(&status));
            }
            Err(status) => return Err(self.status_error(&status)),
        };
        self.metrics
            .raft_append(self.target, RaftAppend::StreamOpened);
        self.stream_refusals.accepted(&self.addr);
        self.record_format(response.metadata());
        let answers = PipelinedAnswers {
            replies: response.into_inner(),
            sent: sent_rx,
            ttl: option.hard_ttl(),
            target: self.target,
            addr: self.addr.clone(),
            own: self.own,
            _session: session,
        };
        Ok(Box::pin(futures::stream::unfold(
            Some(answers),
            |answers| async move {
                let mut answers = answers?;
                let (result, go_on) = answers.next().await?;
                Some((result, go_on.then_some(answers)))
            },
        )))
    }

    /// openraft's AppendEntries one after another, as unary calls (a
    /// replica without the stream), until one is not a full success.
    fn append_one_at_a_time<'s, S>(&'s mut self, input: S, option: RPCOption) -> AppendResults<'s>
    where
        S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        Box::pin(futures::stream::unfold(Some((self, input)), move |state| {
            let option = option.clone();
            async move {
                let (client, mut input) = state?;
                let rpc = input.next().await?;
                let (prev, last) = (rpc.prev_log_id, last_covered(&rpc));
                match client.append(rpc, &option).await.decompose_infallible() {
                    Ok(AppendEntriesResponse::Success) => {
                        Some((Ok(Ok(last)), Some((client, input))))
                    }
                    Ok(other) => Some((Ok(other.into_stream_result(prev, last)), None)),
                    Err(err) => Some((Err(err), None)),
                }
            }
        }))
    }
}

/// Encodes openraft's requests onto a pipelined stream (splitting one too
/// big for a message), telling the answers' reader what each was, until
/// the input ends, the answers' stream is dropped (`ended`), or a cut-off.
async fn send_appends<S>(
    mut input: S,
    requests: mpsc::Sender<RaftRequest>,
    sent: mpsc::UnboundedSender<Sent>,
    mut ended: tokio::sync::oneshot::Receiver<()>,
    message_limit: usize,
    (own, target): (u64, u64),
) where
    S: futures::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
{
    loop {
        let rpc = tokio::select! {
            next = input.next() => match next {
                Some(rpc) => rpc,
                None => return,
            },
            _ = &mut ended => return,
        };
        if is_cut_off(own, target) {
            return;
        }
        let mut messages = Vec::new();
        encode_to_fit(rpc, message_limit, &mut messages);
        let parts = messages
            .iter()
            .map(|(prev, last, _)| (*prev, *last))
            .collect();
        if sent.send(Sent { parts }).is_err() {
            return;
        }
        for (_, _, data) in messages {
            tokio::select! {
                queued = requests.send(RaftRequest { data }) => if queued.is_err() { return },
                _ = &mut ended => return,
            }
        }
    }
}

/// Reads the answers of a pipelined stream, one request's at a time.
struct PipelinedAnswers {
    replies: Replies,
    sent: mpsc::UnboundedReceiver<Sent>,
    ttl: Duration,
    target: u64,
    addr: String,
    own: u64,
    /// Held while the answers are read; dropping it stops the sender.
    _session: tokio::sync::oneshot::Sender<()>,
}

impl PipelinedAnswers {
    /// The next request's result, and whether the session goes on; None
    /// once the sender has stopped and every request was answered.
    async fn next(
        &mut self,
    ) -> Option<(
        Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>,
        bool,
    )> {
        let sent = self.sent.recv().await?;
        let mut covered = None;
        for (prev, last) in sent.parts {
            let response = match self.next_reply().await {
                Ok(response) => response,
                Err(err) => return Some((Err(err), false)),
            };
            match response {
                AppendEntriesResponse::Success => covered = last,
                AppendEntriesResponse::PartialSuccess(matching) if matching == last => {
                    covered = last
                }
                other => return Some((Ok(other.into_stream_result(prev, last)), false)),
            }
        }
        Some((Ok(Ok(covered)), true))
    }

    async fn next_reply(
        &mut self,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        let failed = |message: String| {
            let err = std::io::Error::other(format!(
                "AppendEntries stream to replica {} at {}: {message}",
                self.target, self.addr
            ));
            RPCError::Network(NetworkError::new(&err))
        };
        let reply = match tokio::time::timeout(self.ttl, self.replies.message()).await {
            Err(_) => return Err(failed(format!("no answer within {:?}", self.ttl))),
            Ok(Err(status)) if status.code() == tonic::Code::Unavailable => {
                let err = std::io::Error::other(format!(
                    "AppendEntries stream to replica {} at {}: {status}",
                    self.target, self.addr
                ));
                return Err(RPCError::Unreachable(Unreachable::new(&err)));
            }
            Ok(Err(status)) => return Err(failed(status.to_string())),
            Ok(Ok(None)) => return Err(failed("the replica ended the stream".into())),
            Ok(Ok(Some(reply))) => reply,
        };
        if is_cut_off(self.own, self.target) {
            let err = std::io::Error::other("failpoint raft-cut-off");
            return Err(RPCError::Unreachable(Unreachable::new(&err)));
        }
        if !reply.error.is_empty() {
            // A fatal error on the follower (its core stopped); its body is
            // 0.9's or 0.10's shape, read as text only.
            return Err(failed(format!(
                "the replica answered with an error ({} bytes)",
                reply.error.len()
            )));
        }
        decode(&reply.data).map_err(|e| failed(format!("undecodable answer: {e}")))
    }
}

/// Whether the `raft-cut-off` failpoint cuts messages between `own` and
/// `target` off (failpoints builds; always false otherwise).
fn is_cut_off(own: u64, target: u64) -> bool {
    let cut = fail::eval("raft-cut-off", |arg| {
        arg.and_then(|id| id.trim().parse::<u64>().ok())
    });
    matches!(cut, Some(Some(id)) if id == own || id == target)
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig, RaftError<TypeConfig>>>
    {
        self.cut_off()?;
        self.append(rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<TypeConfig>,
        RPCError<TypeConfig, RaftError<TypeConfig, InstallSnapshotError>>,
    > {
        self.cut_off()?;
        self.call(Rpc::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig, RaftError<TypeConfig>>> {
        self.cut_off()?;
        self.call(Rpc::Vote, &rpc, &option).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PeerDial;
    use openraft::Vote;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tether_proto::raft_service_server::{RaftService, RaftServiceServer};
    use tokio_stream::StreamExt;

    /// A follower that answers each AppendEntries with `PartialSuccess` up
    /// to the request's `prev_log_id`, so a test can tell which request an
    /// answer belongs to; holds the answer back `delay_first` for the first
    /// streamed message; or, as a replica of an older build, has no stream.
    struct FakeFollower {
        has_stream: bool,
        delay_first: Duration,
        /// Answers a stream's messages only once this many have arrived
        /// (or the stream ended): 1 answers each as it comes.
        answer_in_groups_of: usize,
        streams_opened: AtomicUsize,
        unary_calls: AtomicUsize,
        /// The leader-side address of every stream and call.
        callers: Mutex<Vec<std::net::SocketAddr>>,
        /// A streamed AppendEntries after this index blocks the thread it
        /// is answered on this long: on a server of one thread
        /// ([`serve_on_one_thread`]) the whole replica stops, reading
        /// nothing from its connections, as one starved of CPU.
        stall: Option<(u64, Duration)>,
        /// Set once a stall began.
        stalled: Arc<std::sync::atomic::AtomicBool>,
    }

    impl FakeFollower {
        fn new(has_stream: bool, delay_first: Duration) -> Arc<Self> {
            Arc::new(FakeFollower {
                has_stream,
                delay_first,
                answer_in_groups_of: 1,
                streams_opened: AtomicUsize::new(0),
                unary_calls: AtomicUsize::new(0),
                callers: Mutex::default(),
                stall: None,
                stalled: Arc::default(),
            })
        }

        fn note_caller<T>(&self, request: &tonic::Request<T>) {
            if let Some(addr) = request.remote_addr() {
                self.callers.lock().unwrap().push(addr);
            }
        }
    }

    fn answer(request: &RaftRequest) -> RaftReply {
        let rpc: AppendEntriesRequest<TypeConfig> = decode(&request.data).unwrap();
        let response = AppendEntriesResponse::<TypeConfig>::PartialSuccess(rpc.prev_log_id);
        RaftReply {
            data: encode(&response),
            error: Vec::new(),
        }
    }

    #[tonic::async_trait]
    impl RaftService for FakeFollower {
        type AppendEntriesStreamStream =
            Pin<Box<dyn futures::Stream<Item = Result<RaftReply, Status>> + Send>>;

        async fn append_entries(
            &self,
            request: tonic::Request<RaftRequest>,
        ) -> Result<tonic::Response<RaftReply>, Status> {
            self.note_caller(&request);
            self.unary_calls.fetch_add(1, Ordering::SeqCst);
            Ok(tonic::Response::new(answer(request.get_ref())))
        }

        async fn append_entries_stream(
            &self,
            request: tonic::Request<tonic::Streaming<RaftRequest>>,
        ) -> Result<tonic::Response<Self::AppendEntriesStreamStream>, Status> {
            self.note_caller(&request);
            if !self.has_stream {
                return Err(Status::unimplemented("no such method"));
            }
            let opened = self.streams_opened.fetch_add(1, Ordering::SeqCst);
            let delay = if opened == 0 {
                self.delay_first
            } else {
                Duration::ZERO
            };
            let grouped = futures::StreamExt::flat_map(
                futures::StreamExt::chunks(request.into_inner(), self.answer_in_groups_of),
                futures::stream::iter,
            );
            let (stall, stalled) = (self.stall, self.stalled.clone());
            let replies = futures::StreamExt::then(grouped, move |message| {
                let stalled = stalled.clone();
                async move {
                    tokio::time::sleep(delay).await;
                    message.map(|m| {
                        let rpc: AppendEntriesRequest<TypeConfig> = decode(&m.data).unwrap();
                        if let Some((index, blocked)) = stall
                            && rpc.prev_log_id.map(|l| l.index) == Some(index)
                        {
                            stalled.store(true, Ordering::SeqCst);
                            // Blocking on purpose: the stall of the whole
                            // server.
                            std::thread::sleep(blocked);
                        }
                        answer(&m)
                    })
                }
            });
            Ok(tonic::Response::new(Box::pin(replies)))
        }

        async fn vote(
            &self,
            _: tonic::Request<RaftRequest>,
        ) -> Result<tonic::Response<RaftReply>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn install_snapshot(
            &self,
            _: tonic::Request<RaftRequest>,
        ) -> Result<tonic::Response<RaftReply>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn timeout_now(
            &self,
            _: tonic::Request<RaftRequest>,
        ) -> Result<tonic::Response<RaftReply>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn end_wait(
            &self,
            _: tonic::Request<RaftRequest>,
        ) -> Result<tonic::Response<RaftReply>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    /// Serves `follower` on a loopback port; its address.
    async fn serve_at(follower: Arc<FakeFollower>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RaftServiceServer::from_arc(follower))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr.to_string()
    }

    /// Serves `follower` on a loopback port from a runtime of one thread
    /// of its own (for the life of the test process); its address.
    fn serve_on_one_thread(follower: Arc<FakeFollower>) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                tonic::transport::Server::builder()
                    .add_service(RaftServiceServer::from_arc(follower))
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                    .await
            })
        });
        addr
    }

    fn network_dialing(dial: PeerDial) -> Network {
        Network::new(
            0,
            Arc::new(PeerDialer::new(dial, None, None, Arc::default())),
            Arc::default(),
            crate::raft::MAX_RAFT_MESSAGE_BYTES,
            Arc::default(),
        )
    }

    fn network() -> Network {
        network_dialing(PeerDial::default())
    }

    /// A client of a new network to replica 2 at `addr`.
    async fn client_to(addr: &str) -> PeerClient {
        network().client(2, &BasicNode::new(addr))
    }

    /// Serves `follower` on a loopback port; a client to it.
    async fn serve(follower: Arc<FakeFollower>) -> PeerClient {
        client_to(&serve_at(follower).await).await
    }

    fn append_after(index: u64) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(1, 1),
            prev_log_id: Some(crate::raft::log_id(1, 1, index)),
            leader_commit: None,
            entries: Vec::new(),
        }
    }

    fn answered_up_to(response: AppendEntriesResponse<TypeConfig>) -> u64 {
        match response {
            AppendEntriesResponse::PartialSuccess(Some(log_id)) => log_id.index,
            other => panic!("unexpected answer {other:?}"),
        }
    }

    const GENEROUS: Duration = Duration::from_secs(30);

    /// Sends `count` AppendEntries to replica 2 at `addr`, each from a new
    /// client of one network, as openraft does for read rounds.
    async fn appends_from_fresh_clients(addr: &str, count: u64) {
        let network = network();
        for index in 1..=count {
            let mut client = network.client(2, &BasicNode::new(addr));
            let response = client
                .append_entries(append_after(index), RPCOption::new(GENEROUS))
                .await
                .unwrap();
            assert_eq!(answered_up_to(response), index);
        }
    }

    #[tokio::test]
    async fn appends_share_one_stream() {
        let follower = FakeFollower::new(true, Duration::ZERO);
        let mut client = serve(follower.clone()).await;
        for index in 1..=5 {
            let response = client
                .append_entries(append_after(index), RPCOption::new(GENEROUS))
                .await
                .unwrap();
            assert_eq!(answered_up_to(response), index);
        }
        assert_eq!(follower.streams_opened.load(Ordering::SeqCst), 1);
        assert_eq!(follower.unary_calls.load(Ordering::SeqCst), 0);
        assert_eq!(client.metrics.raft_appends(2, RaftAppend::StreamOpened), 1);
        assert_eq!(client.metrics.raft_appends(2, RaftAppend::Unary), 0);
    }

    #[tokio::test]
    async fn a_call_abandoned_before_its_answer_does_not_answer_the_next() {
        // openraft times a call out by dropping it. The late answer to the
        // first request must not be taken as the second's: that one would
        // acknowledge entries the follower never matched.
        let follower = FakeFollower::new(true, Duration::from_millis(500));
        let mut client = serve(follower.clone()).await;
        let abandoned = tokio::time::timeout(
            Duration::from_millis(100),
            client.append_entries(append_after(1), RPCOption::new(GENEROUS)),
        )
        .await;
        assert!(abandoned.is_err(), "the first answer is held back");
        let response = client
            .append_entries(append_after(2), RPCOption::new(GENEROUS))
            .await
            .unwrap();
        assert_eq!(answered_up_to(response), 2);
        assert_eq!(follower.streams_opened.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_call_timed_out_by_its_ttl_is_an_error_and_the_next_one_works() {
        let follower = FakeFollower::new(true, Duration::from_millis(500));
        let mut client = serve(follower.clone()).await;
        let err = client
            .append_entries(append_after(1), RPCOption::new(Duration::from_millis(100)))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RPCError::Network(_)),
            "a timeout is a network error: {err:?}"
        );
        let response = client
            .append_entries(append_after(2), RPCOption::new(GENEROUS))
            .await
            .unwrap();
        assert_eq!(answered_up_to(response), 2);
    }

    #[tokio::test]
    async fn a_replica_without_the_stream_gets_unary_appends() {
        let follower = FakeFollower::new(false, Duration::ZERO);
        let mut client = serve(follower.clone()).await;
        for index in 1..=3 {
            let response = client
                .append_entries(append_after(index), RPCOption::new(GENEROUS))
                .await
                .unwrap();
            assert_eq!(answered_up_to(response), index);
        }
        assert_eq!(follower.unary_calls.load(Ordering::SeqCst), 3);
        assert_eq!(client.metrics.raft_appends(2, RaftAppend::Unary), 3);
        assert_eq!(client.metrics.raft_appends(2, RaftAppend::StreamOpened), 0);
        // Refused once, then not asked again for a while.
        assert_eq!(
            follower.callers.lock().unwrap().len(),
            4,
            "one stream asked for"
        );
    }

    #[tokio::test]
    async fn every_client_of_a_network_remembers_a_refused_stream() {
        // openraft makes fresh clients for each read round's heartbeats;
        // during a rolling upgrade each would ask an older replica for the
        // stream again, a wasted round trip per read.
        let follower = FakeFollower::new(false, Duration::ZERO);
        let addr = serve_at(follower.clone()).await;
        appends_from_fresh_clients(&addr, 3).await;
        assert_eq!(follower.unary_calls.load(Ordering::SeqCst), 3);
        assert_eq!(
            follower.callers.lock().unwrap().len(),
            4,
            "the stream asked for by the first client only"
        );
    }

    #[tokio::test]
    async fn connections_to_departed_addresses_are_forgotten() {
        let mut network = network_dialing(PeerDial::from([(3, "127.0.0.1:9003".to_string())]));
        let members = BTreeMap::from([
            (2, BasicNode::new("127.0.0.1:8002")),
            (3, BasicNode::new("unreachable-name:8003")),
            (4, BasicNode::new("127.0.0.1:8004")),
        ]);
        for (id, node) in &members {
            network.new_client(*id, node).await;
        }
        network.stream_refusals.refused("127.0.0.1:8004");
        let cached = |network: &Network| -> Vec<String> { network.dialer.dialed_addresses() };
        assert_eq!(
            cached(&network),
            ["127.0.0.1:8002", "127.0.0.1:8004", "127.0.0.1:9003"]
        );
        // Replica 4 leaves; replica 2 moves to another port.
        let members = BTreeMap::from([
            (2, BasicNode::new("127.0.0.1:8102")),
            (3, BasicNode::new("unreachable-name:8003")),
        ]);
        network.forget_departed(&members);
        assert_eq!(cached(&network), ["127.0.0.1:9003"], "dialed, not listed");
        assert!(network.stream_refusals.may_stream("127.0.0.1:8004"));
    }

    #[test]
    fn a_refused_stream_is_asked_for_again_later_or_once_accepted() {
        let refusals = StreamRefusals::default();
        assert!(refusals.may_stream("a:1"));
        refusals.refused("a:1");
        assert!(!refusals.may_stream("a:1"));
        assert!(refusals.may_stream("b:1"), "per address");
        // Refused long ago: asked again (the replica may have been upgraded).
        let long_ago = Instant::now().checked_sub(STREAM_RETRY_AFTER);
        if let Some(long_ago) = long_ago {
            refusals
                .refused_at
                .lock()
                .unwrap()
                .insert("a:1".to_string(), long_ago);
            assert!(refusals.may_stream("a:1"));
        }
        refusals.refused("a:1");
        refusals.accepted("a:1");
        assert!(refusals.may_stream("a:1"));
    }

    #[tokio::test]
    async fn clients_to_one_address_share_its_connection() {
        // openraft asks for a new client per linearizable read and voter.
        let follower = FakeFollower::new(true, Duration::ZERO);
        let addr = serve_at(follower.clone()).await;
        appends_from_fresh_clients(&addr, 3).await;
        let callers = follower.callers.lock().unwrap().clone();
        assert_eq!(callers.len(), 3, "one stream per client");
        assert!(
            callers.iter().all(|addr| *addr == callers[0]),
            "one connection: {callers:?}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_replica_is_reported_as_unreachable() {
        // A port nothing listens on: port 1, which no test binds (a port
        // picked free and let go can be taken by another test meanwhile).
        let mut client = client_to("127.0.0.1:1").await;
        let err = client
            .append_entries(append_after(1), RPCOption::new(GENEROUS))
            .await
            .unwrap_err();
        assert!(matches!(err, RPCError::Unreachable(_)), "{err:?}");
    }

    #[tokio::test]
    async fn appends_on_a_stream_do_not_wait_for_the_previous_answer() {
        // The follower answers only once three requests are in: sent one
        // at a time, the first would never be answered.
        let follower = Arc::new(FakeFollower {
            answer_in_groups_of: 3,
            ..Arc::into_inner(FakeFollower::new(true, Duration::ZERO)).unwrap()
        });
        let mut client = serve(follower.clone()).await;
        let requests = futures::stream::iter((1..=6).map(append_after));
        let results: Vec<_> = client
            .stream_append(requests, RPCOption::new(GENEROUS))
            .await
            .unwrap()
            .collect()
            .await;
        let covered: Vec<Option<u64>> = results
            .into_iter()
            .map(|r| r.unwrap().unwrap().map(|l| l.index))
            .collect();
        assert_eq!(covered, (1..=6).map(Some).collect::<Vec<_>>());
        assert_eq!(follower.streams_opened.load(Ordering::SeqCst), 1);
        assert_eq!(follower.unary_calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_pipelined_answer_not_back_within_the_ttl_ends_the_session() {
        let follower = FakeFollower::new(true, Duration::from_millis(500));
        let mut client = serve(follower).await;
        let requests = futures::stream::iter((1..=3).map(append_after));
        let results: Vec<_> = client
            .stream_append(requests, RPCOption::new(Duration::from_millis(100)))
            .await
            .unwrap()
            .collect()
            .await;
        assert_eq!(results.len(), 1, "{results:?}");
        assert!(
            matches!(results[0], Err(RPCError::Network(_))),
            "{results:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_that_stalls_keeps_the_connection_its_appends_share() {
        // The issue-61 failure: heartbeats given up after openraft's 100 ms
        // while the follower read nothing were reset before it had accepted
        // them; past 20 it sent GOAWAY ENHANCE_YOUR_CALM ("too_many_resets")
        // and the replication stream on that connection died with it.
        let stall = Duration::from_secs(3);
        let follower = Arc::new(FakeFollower {
            stall: Some((100, stall)),
            ..Arc::into_inner(FakeFollower::new(true, Duration::ZERO)).unwrap()
        });
        let addr = serve_on_one_thread(follower.clone());
        let network = network();
        // A replication session, open across the stall.
        let mut session_client = network.client(2, &BasicNode::new(&addr));
        let (feed, input) = mpsc::channel(4);
        let mut session = session_client
            .stream_append(ReceiverStream::new(input), RPCOption::new(GENEROUS))
            .await
            .unwrap();
        feed.send(append_after(1)).await.unwrap();
        let first = session.next().await.unwrap().unwrap().unwrap();
        assert_eq!(first.map(|l| l.index), Some(1));

        // The follower stops (an append over a connection of its own
        // blocks its only thread) ...
        let stalling = tokio::spawn({
            let addr = addr.clone();
            async move {
                let mut other =
                    network_dialing(PeerDial::default()).client(2, &BasicNode::new(&addr));
                other
                    .append_entries(append_after(100), RPCOption::new(GENEROUS))
                    .await
            }
        });
        let deadline = tokio::time::Instant::now() + GENEROUS;
        while !follower.stalled.load(Ordering::SeqCst) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the stall never began"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // ... while the leader sends heartbeats on the session's connection
        // and gives each up after 100 ms, as openraft does.
        let mut heartbeats = network.client(2, &BasicNode::new(&addr));
        let began = tokio::time::Instant::now();
        let mut given_up = 0;
        while began.elapsed() < stall - Duration::from_millis(500) {
            let ttl = Duration::from_millis(100);
            let heartbeat = futures::stream::iter([append_after(50)]);
            let answered = tokio::time::timeout(ttl, async {
                let mut answers = heartbeats
                    .stream_append(heartbeat, RPCOption::new(ttl))
                    .await?;
                answers.next().await.transpose()
            })
            .await;
            if answered.is_err() {
                given_up += 1;
            }
        }
        assert!(
            given_up > 20,
            "only {given_up} heartbeats given up during the stall"
        );
        stalling.await.unwrap().unwrap();

        // The session goes on, on the same connection.
        feed.send(append_after(2)).await.unwrap();
        let next = tokio::time::timeout(GENEROUS, session.next())
            .await
            .expect("the session answers after the stall")
            .expect("the session was not ended");
        assert_eq!(
            next.expect("the session's connection survived the stall")
                .unwrap()
                .map(|l| l.index),
            Some(2)
        );
    }

    #[test]
    fn a_request_split_to_fit_covers_the_same_entries_in_order() {
        let entry = |index| crate::raft::Entry {
            log_id: crate::raft::log_id(2, 1, index),
            payload: openraft::EntryPayload::Blank,
        };
        let rpc = AppendEntriesRequest {
            vote: Vote::new_committed(2, 1),
            prev_log_id: Some(crate::raft::log_id(1, 1, 10)),
            leader_commit: Some(crate::raft::log_id(2, 1, 15)),
            entries: (11..=17).map(entry).collect(),
        };
        let parts = split_request(rpc, 3);
        let shape: Vec<(u64, Vec<u64>, u64)> = parts
            .iter()
            .map(|p| {
                (
                    p.prev_log_id.unwrap().index,
                    p.entries.iter().map(|e| e.log_id.index).collect(),
                    p.leader_commit.unwrap().index,
                )
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                (10, vec![11, 12, 13], 13),
                (13, vec![14, 15, 16], 15),
                (16, vec![17], 15),
            ],
            "each part follows the previous; none commits past its own entries or the leader's commit"
        );
    }

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
        // The newest format all of them read: the oldest answer, 0 for a
        // peer that has not answered, none without peers.
        formats.record(2, 4);
        assert_eq!(formats.newest_all_read([2, 3]), Some(3));
        assert_eq!(formats.newest_all_read([2, 3, 4]), Some(0));
        assert_eq!(formats.newest_all_read([]), None);
    }
}

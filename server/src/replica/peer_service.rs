//! The internal `RaftService` the other replicas call: hands their Raft
//! messages to openraft, starts an election when a leader transfer asks,
//! and applies a follower's `EndWait` on the leader.

use crate::auth::Action;
use crate::cluster_id::AdoptError;
use std::sync::Arc;
use std::time::Duration;

use std::pin::Pin;

use futures::Stream;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tether_proto::raft_service_server::RaftService;
use tether_proto::{RaftReply, RaftRequest};
use tonic::{Request, Response, Status, Streaming};

use super::Replica;
use crate::auth::Auth;
use crate::raft::dial::{FORMAT_METADATA, TARGET_METADATA};
use crate::sm::{Command, FORMAT_VERSION};
use crate::store::{decode, encode};

/// The `RaftService` implementation.
pub struct RaftApi {
    core: Arc<Replica>,
    /// Checks that a caller is a replica.
    auth: Arc<Auth>,
    /// When a message of another cluster was last logged.
    last_other_cluster_warning: std::sync::Mutex<Option<std::time::Instant>>,
}

impl RaftApi {
    /// The service of replica `core`, whose callers `auth` identifies.
    pub fn new(core: Arc<Replica>, auth: Arc<Auth>) -> Self {
        Self {
            core,
            auth,
            last_other_cluster_warning: Default::default(),
        }
    }
}

impl RaftApi {
    /// Refuses a message meant for another node id. Raft messages do not
    /// name their target, so a replica that took over an address (a pod
    /// back with an empty volume and a new id) would otherwise answer for
    /// the member that used to live there, and the leader would see that
    /// member's log go backwards.
    fn check_target<T>(&self, request: &Request<T>) -> Result<(), Status> {
        self.auth
            .check(request, Action::Raft)
            .map_err(Status::from)?;
        let Some(target) = request.metadata().get(TARGET_METADATA) else {
            return Ok(());
        };
        match target.to_str().ok().and_then(|t| t.parse::<u64>().ok()) {
            Some(id) if id == self.core.id => Ok(()),
            _ => Err(Status::unavailable(format!(
                "this address now serves node {}, not node {target:?}",
                self.core.id
            ))),
        }
    }

    /// Refuses a message from a replica of another cluster (its metadata
    /// names another cluster id than this replica's), so that two clusters
    /// never mix their logs. A replica that knows no id yet takes the one
    /// of a leader that replicates to it (`from_leader`: AppendEntries, a
    /// snapshot), which is how members sent a snapshot past the entry that
    /// recorded the id learn it. Messages of older builds name no cluster
    /// and are not checked.
    fn check_cluster<T>(&self, request: &Request<T>, from_leader: bool) -> Result<(), Status> {
        let Some(theirs) = request
            .metadata()
            .get(crate::cluster_id::METADATA)
            .and_then(|v| v.to_str().ok())
        else {
            return Ok(());
        };
        let result = if from_leader {
            let db = self.core.db().map_err(Status::from)?;
            self.core.cluster_id.adopt(theirs, |id| {
                crate::store::write_cluster_id(&db, id)?;
                tracing::info!(
                    cluster_id = id,
                    "this replica's cluster id, from its leader"
                );
                Ok(())
            })
        } else {
            match self.core.cluster_id.get() {
                Some(ours) if ours != theirs => Err(AdoptError::Other(ours)),
                _ => Ok(()),
            }
        };
        match result {
            Ok(()) => Ok(()),
            Err(AdoptError::Storage(err)) => Err(Status::unavailable(format!(
                "cannot store the cluster id: {err}"
            ))),
            Err(AdoptError::Other(ours)) => {
                self.warn_other_cluster(&ours, theirs);
                Err(Status::failed_precondition(format!(
                    "this replica (node {}) belongs to cluster {ours}, the sender to cluster \
                     {theirs}: clusters never mix their logs",
                    self.core.id
                )))
            }
        }
    }

    /// Logs a refused message of another cluster, at most every 10 s.
    fn warn_other_cluster(&self, ours: &str, theirs: &str) {
        let mut last = self
            .last_other_cluster_warning
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at: std::time::Instant| at.elapsed() < Duration::from_secs(10)) {
            return;
        }
        *last = Some(std::time::Instant::now());
        tracing::warn!(
            cluster_id = ours,
            sender_cluster_id = theirs,
            "refusing Raft messages of another cluster: this replica's data belongs to \
             cluster {ours}. If it should be a member of cluster {theirs} (e.g. after a \
             restore from a backup), delete its data directory and start it again"
        );
    }
}

fn decode_request<T: DeserializeOwned>(request: Request<RaftRequest>) -> Result<T, Status> {
    decode_message(&request.into_inner())
}

fn decode_message<T: DeserializeOwned>(message: &RaftRequest) -> Result<T, Status> {
    decode(&message.data)
        .map_err(|e| Status::invalid_argument(format!("undecodable Raft message: {e}")))
}

/// A receiver's answer to one message: its encoded value or error.
fn reply_message<T: Serialize, E: Serialize>(result: Result<T, E>) -> RaftReply {
    match result {
        Ok(value) => RaftReply {
            data: encode(&value),
            error: Vec::new(),
        },
        Err(err) => RaftReply {
            data: Vec::new(),
            error: encode(&err),
        },
    }
}

/// `response` with this replica's log format in its metadata.
fn with_format<T>(body: T) -> Response<T> {
    let mut response = Response::new(body);
    response
        .metadata_mut()
        .insert(FORMAT_METADATA, FORMAT_VERSION.into());
    response
}

fn reply<T: Serialize, E: Serialize>(result: Result<T, E>) -> Result<Response<RaftReply>, Status> {
    Ok(with_format(reply_message(result)))
}

/// The answers on an `AppendEntriesStream`. Requests are decoded as they
/// arrive and handed to openraft's pipelined `stream_append`, which
/// appends the next while the previous ones are being synced; answers come
/// back in request order, in the shape a leader of either build reads (a
/// 0.9 leader sends one request at a time and waits; that works the same).
/// Ends when the leader closes its side or breaks the stream; after an
/// undecodable message with `INVALID_ARGUMENT`, or with `UNAVAILABLE` when
/// this replica shuts down (a stream is never "finished" on its own, and
/// the gRPC server's graceful shutdown waits for every open one).
fn append_replies(
    requests: Streaming<RaftRequest>,
    core: Arc<Replica>,
) -> impl Stream<Item = Result<RaftReply, Status>> + Send + 'static {
    use futures::StreamExt;
    use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, StreamAppendError};

    use crate::raft::{LogId, TypeConfig};

    // What each request covers, in order, for telling a full success from
    // a partial one; and why the input ended, if not with the leader.
    let covered: Arc<std::sync::Mutex<std::collections::VecDeque<Option<LogId>>>> = Arc::default();
    let ended_with: Arc<std::sync::Mutex<Option<Status>>> = Arc::default();
    let input = {
        let (covered, ended_with, core) = (covered.clone(), ended_with.clone(), core.clone());
        futures::stream::unfold(Some(requests), move |state| {
            let (covered, ended_with, core) = (covered.clone(), ended_with.clone(), core.clone());
            async move {
                let mut requests = state?;
                let next = tokio::select! {
                    next = requests.message() => next,
                    () = core.shutting_down() => {
                        *ended_with.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(Status::unavailable("this replica is shutting down"));
                        return None;
                    }
                };
                // An error reading the leader's side means it went away;
                // there is no one left to answer.
                let message = match next {
                    Ok(message) => message?,
                    Err(status) => {
                        // Usually the leader went away and no one is left
                        // to answer; but a message over the limit ends up
                        // here too, and the leader must hear why.
                        tracing::debug!(%status, "the leader's AppendEntries stream broke");
                        *ended_with.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
                        return None;
                    }
                };
                match decode_message::<AppendEntriesRequest<TypeConfig>>(&message) {
                    Ok(rpc) => {
                        let last = rpc.entries.last().map(|e| e.log_id).or(rpc.prev_log_id);
                        covered
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push_back(last);
                        Some((rpc, Some(requests)))
                    }
                    Err(status) => {
                        *ended_with.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
                        None
                    }
                }
            }
        })
    };
    // openraft's stream is `'static` but borrows the handle by its
    // signature's lifetimes; boxed as `dyn` it stands on its own.
    let answers: std::pin::Pin<Box<dyn Stream<Item = _> + Send + 'static>> =
        Box::pin(core.raft.stream_append(input));
    let answers = answers.map(move |result| {
        let last = covered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
            .flatten();
        match result {
            Ok(Ok(matching)) if matching == last => Ok(reply_message(Ok::<_, ()>(
                AppendEntriesResponse::<TypeConfig>::Success,
            ))),
            Ok(Ok(matching)) => Ok(reply_message(Ok::<_, ()>(AppendEntriesResponse::<
                TypeConfig,
            >::PartialSuccess(
                matching
            )))),
            Ok(Err(StreamAppendError::Conflict(_))) => Ok(reply_message(Ok::<_, ()>(
                AppendEntriesResponse::<TypeConfig>::Conflict,
            ))),
            Ok(Err(StreamAppendError::HigherVote(vote))) => {
                Ok(reply_message(Ok::<_, ()>(AppendEntriesResponse::<
                    TypeConfig,
                >::HigherVote(
                    vote
                ))))
            }
            Err(fatal) => Ok(reply_message(Err::<AppendEntriesResponse<TypeConfig>, _>(
                openraft::error::RaftError::<TypeConfig>::Fatal(fatal),
            ))),
        }
    });
    answers.chain(futures::stream::iter(std::iter::from_fn(move || {
        ended_with
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(Err)
    })))
}

#[tonic::async_trait]
impl RaftService for RaftApi {
    type AppendEntriesStreamStream =
        Pin<Box<dyn Stream<Item = Result<RaftReply, Status>> + Send + 'static>>;

    async fn append_entries_stream(
        &self,
        request: Request<Streaming<RaftRequest>>,
    ) -> Result<Response<Self::AppendEntriesStreamStream>, Status> {
        self.check_target(&request)?;
        self.check_cluster(&request, true)?;
        let replies = append_replies(request.into_inner(), self.core.clone());
        Ok(with_format(Box::pin(replies)))
    }

    async fn append_entries(
        &self,
        request: Request<RaftRequest>,
    ) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        self.check_cluster(&request, true)?;
        let rpc = decode_request(request)?;
        reply(self.core.raft.append_entries(rpc).await)
    }

    async fn vote(&self, request: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        self.check_cluster(&request, false)?;
        let rpc = crate::raft::network::decode_vote_request(&request.into_inner().data)
            .map_err(|e| Status::invalid_argument(format!("undecodable Raft message: {e}")))?;
        reply(self.core.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftRequest>,
    ) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        self.check_cluster(&request, true)?;
        // The 0.9 chunked transfer, which every build still sends.
        let rpc: openraft_legacy::network_v1::InstallSnapshotRequest<crate::raft::TypeConfig> =
            decode_request(request)?;
        reply(
            openraft_legacy::network_v1::ChunkedSnapshotReceiver::install_snapshot(
                &self.core.raft,
                rpc,
            )
            .await,
        )
    }

    async fn timeout_now(
        &self,
        request: Request<RaftRequest>,
    ) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        self.check_cluster(&request, false)?;
        tracing::info!("leader transfer: starting an election at the leader's request");
        let result = self
            .core
            .raft
            .trigger()
            .elect(false)
            .await
            .map_err(|e| e.to_string());
        reply(result)
    }

    async fn end_wait(&self, request: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        self.check_cluster(&request, false)?;
        let command: Command = decode_request(request)?;
        if !matches!(command, Command::CancelWait(_) | Command::AbandonWait(_)) {
            return Err(Status::invalid_argument(
                "EndWait carries only CancelWait or AbandonWait",
            ));
        }
        let reply = self.core.write(None, command).await.map_err(Status::from)?;
        Ok(Response::new(RaftReply {
            data: encode(&reply),
            error: Vec::new(),
        }))
    }
}

//! The Tether client: endpoint list, leader following with backoff, request
//! ids for exactly-once retries, deadlines on every call.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_proto as pb;
use tether_proto::cluster_service_client::ClusterServiceClient;
use tether_proto::lease_service_client::LeaseServiceClient;
use tether_proto::lock_service_client::LockServiceClient;
use tether_proto::node_service_client::NodeServiceClient;
use tether_proto::pin_service_client::PinServiceClient;
use tether_proto::watch_service_client::WatchServiceClient;
use tether_proto::{LEADER_ADDR_METADATA, LockKey, Pod};
use tokio::time::Instant;
use tonic::Status;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::cluster::{ClusterGuard, SeenCluster};
use crate::error::{Error, Result};
use crate::hold::Held;
use crate::watch::Watcher;

/// Client settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// Deadline of one attempt of a call (a queued acquire adds its wait).
    pub call_timeout: Duration,
    /// How long a call keeps retrying on other replicas / the new leader
    /// before giving up with [`Error::Unavailable`].
    pub retry_timeout: Duration,
    /// Names this client's exactly-once session (default `client`). Each
    /// [`Client`] adds a random incarnation to it (`{client_id}.{16 hex}`,
    /// [`Client::client_id`]), so a restarted process, or a second client
    /// with the same name, never meets an earlier one's kept answers: its
    /// sequences start at 1 in a session of its own. At most
    /// [`MAX_CLIENT_ID_PREFIX_LEN`] printable ASCII characters.
    pub client_id: Option<String>,
    /// Mutual TLS: this client's certificate (its role) and the CA the
    /// replicas' certificates must chain to. Needed when the replicas run
    /// with `--tls-dir`.
    pub tls: Option<Arc<tether_tls::TlsMaterial>>,
    /// A bearer token, for replicas run with `--auth-tokens` (development).
    pub bearer_token: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            call_timeout: Duration::from_secs(5),
            retry_timeout: Duration::from_secs(15),
            client_id: None,
            tls: None,
            bearer_token: None,
        }
    }
}

/// A connection to one replica, with this client's credentials attached
/// to every call, kept to the client's cluster ([`ClusterGuard`]).
pub type Conn = InterceptedService<ClusterGuard<Channel>, Credentials>;

/// Adds the bearer token (if any) to each request.
#[derive(Clone)]
pub struct Credentials {
    authorization: Option<MetadataValue<Ascii>>,
}

impl Interceptor for Credentials {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, Status> {
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// A connection to a Tether cluster. Clones share connections and the
/// request-id sequence; safe to use from many tasks at once.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

/// What clones of one [`Client`] share.
struct Shared {
    endpoints: Vec<String>,
    options: Options,
    client_id: String,
    sequence: AtomicU64,
    /// The replica to try first (the believed leader).
    preferred: Mutex<String>,
    channels: Mutex<HashMap<String, Conn>>,
    /// Attached to every call.
    credentials: Credentials,
    /// The cluster this client uses, once an answer named it.
    cluster: SeenCluster,
    /// Sequences of requests not yet answered.
    in_flight: Mutex<BTreeSet<u64>>,
    /// Signalled when a request completes (see `begin_request`).
    freed: tokio::sync::Notify,
}

/// Most sequences one client spans between its oldest unanswered request and
/// its newest: half the server's per-client bound on kept answers (4,096).
pub const MAX_OUTSTANDING: u64 = 2048;

/// Marks a request complete (answered, or given up on) when dropped.
pub struct InFlight<'a> {
    client: &'a Client,
    sequence: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.client
            .shared
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.sequence);
        self.client.shared.freed.notify_waiters();
    }
}

/// Longest [`Options::client_id`]: the server's limit on client ids (128)
/// less the incarnation this client adds.
pub const MAX_CLIENT_ID_PREFIX_LEN: usize = 128 - 17;

/// `prefix` with a random-enough incarnation, without a randomness
/// dependency: std's random hasher keys (fresh per process, and different
/// for every `RandomState` made in it), the process id and the time.
fn session_client_id(prefix: &str) -> String {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!("{prefix}.{:016x}", hasher.finish())
}

/// Whether a status means "this replica cannot serve the call now" (not the
/// leader, down, connection reset) rather than an answer about the request.
pub(crate) fn replica_unusable(status: &Status) -> bool {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled => true,
        tonic::Code::Unknown => {
            let message = status.message();
            ["transport", "connection", "h2 protocol", "broken pipe"]
                .iter()
                .any(|m| message.contains(m))
        }
        _ => false,
    }
}

/// Reads a server stream whose last message has arrived to its end, in the
/// background (the server closes an acquire stream right after the grant,
/// and the caller need not wait for that). Dropping it unread resets the
/// stream while its end is still in flight; with 256 acquires at once on
/// one connection the bench then saw about 200 calls at a time fail with
/// ENHANCE_YOUR_CALM ("resource exhausted: h2 protocol error"), the code
/// HTTP/2 closes a connection with after too many stream resets. Reading
/// the streams to their end, those failures stopped (six runs, none).
fn drain_finished_stream<T: Send + 'static>(mut stream: tonic::Streaming<T>) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.message()).await;
    });
}

/// Parses `scope/name`.
pub fn parse_lock_key(text: &str) -> Result<LockKey> {
    match text.split_once('/') {
        Some((scope, name)) if !scope.is_empty() && !name.is_empty() => Ok(LockKey {
            scope: scope.to_string(),
            name: name.to_string(),
        }),
        _ => Err(Error::InvalidArgument(format!(
            "lock {text:?} must be written SCOPE/NAME, e.g. gpu-bind/node-1"
        ))),
    }
}

/// How a queued acquire progresses.
#[derive(Debug, Clone)]
pub enum AcquireProgress {
    /// Queued at this position (more messages follow).
    Queued(u32),
    /// Granted.
    Granted(pb::Hold),
}

impl Client {
    /// A client for these endpoints (`host:port`, any replica). Connections are
    /// made lazily, so this does not fail when replicas are down.
    pub fn new(
        endpoints: impl IntoIterator<Item = impl Into<String>>,
        options: Options,
    ) -> Result<Self> {
        let endpoints: Vec<String> = endpoints
            .into_iter()
            .map(Into::into)
            .filter(|e: &String| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Err(Error::InvalidArgument("no endpoints given".into()));
        }
        let prefix = options.client_id.as_deref().unwrap_or("client");
        if prefix.is_empty()
            || prefix.len() > MAX_CLIENT_ID_PREFIX_LEN
            || !prefix.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(Error::InvalidArgument(format!(
                "client id {prefix:?} is not valid: use 1-{MAX_CLIENT_ID_PREFIX_LEN} printable \
                 ASCII characters without spaces"
            )));
        }
        let client_id = session_client_id(prefix);
        let authorization = match &options.bearer_token {
            Some(token) => Some(format!("Bearer {}", token.trim()).parse().map_err(|_| {
                Error::InvalidArgument(
                    "the bearer token holds characters a header cannot carry".into(),
                )
            })?),
            None => None,
        };
        let shared = Shared {
            preferred: Mutex::new(endpoints[0].clone()),
            endpoints,
            options,
            client_id,
            sequence: AtomicU64::new(0),
            channels: Mutex::new(HashMap::new()),
            credentials: Credentials { authorization },
            cluster: SeenCluster::default(),
            in_flight: Mutex::new(BTreeSet::new()),
            freed: tokio::sync::Notify::new(),
        };
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// This client's id in request ids: [`Options::client_id`] and this
    /// client's incarnation. (With authentication on, the server binds it to
    /// the caller's identity too: holds show `{identity}/{this id}`.)
    pub fn client_id(&self) -> &str {
        &self.shared.client_id
    }

    /// A fresh request id for one logical request (its retries reuse it),
    /// and a guard that marks the request complete when dropped. The id
    /// carries the lowest sequence still in flight, so the server forgets the
    /// answers this client has already seen.
    ///
    /// Waits while the span from the oldest unanswered sequence to the next
    /// one would reach [`MAX_OUTSTANDING`]: the server keeps a bounded number
    /// of answers per client, and a request older than that window would be
    /// refused instead of applied.
    pub async fn begin_request(&self) -> (pb::RequestId, InFlight<'_>) {
        loop {
            let freed = self.shared.freed.notified();
            tokio::pin!(freed);
            // Registered before the check, so a release in between wakes us.
            freed.as_mut().enable();
            {
                let mut in_flight = self
                    .shared
                    .in_flight
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                let next = self.shared.sequence.load(Ordering::Relaxed) + 1;
                let oldest = in_flight.first().copied().unwrap_or(next);
                if next - oldest < MAX_OUTSTANDING {
                    let sequence = self.shared.sequence.fetch_add(1, Ordering::Relaxed) + 1;
                    in_flight.insert(sequence);
                    let first_incomplete = in_flight.first().copied().unwrap_or(sequence);
                    let id = pb::RequestId {
                        client_id: self.shared.client_id.clone(),
                        sequence,
                        first_incomplete,
                    };
                    return (
                        id,
                        InFlight {
                            client: self,
                            sequence,
                        },
                    );
                }
            }
            freed.await;
        }
    }

    fn channel(&self, addr: &str) -> Result<Conn> {
        let mut channels = self
            .shared
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(channel) = channels.get(addr) {
            return Ok(channel.clone());
        }
        let url = if addr.starts_with("http://") || addr.starts_with("https://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let endpoint = Endpoint::from_shared(url)
            .map_err(|e| Error::InvalidArgument(format!("bad endpoint {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        let channel = match &self.shared.options.tls {
            Some(tls) => tether_tls::lazy_channel(endpoint, tls.clone(), Duration::from_secs(2)),
            None => endpoint.connect_lazy(),
        };
        let channel = InterceptedService::new(
            ClusterGuard::new(channel, addr, self.shared.cluster.clone()),
            self.shared.credentials.clone(),
        );
        channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }

    fn preferred(&self) -> String {
        self.shared
            .preferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn prefer(&self, addr: String) {
        *self
            .shared
            .preferred
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = addr;
    }

    /// Moves to the next endpoint after `failed`.
    fn rotate(&self, failed: &str) {
        let next = match self.shared.endpoints.iter().position(|e| e == failed) {
            Some(i) => self.shared.endpoints[(i + 1) % self.shared.endpoints.len()].clone(),
            None => self.shared.endpoints[0].clone(),
        };
        self.prefer(next);
    }

    /// Runs `call` against the believed leader, following `UNAVAILABLE` +
    /// leader-address answers and rotating through endpoints with backoff
    /// until it succeeds, fails for a reason retrying cannot fix, or the
    /// retry budget runs out. `call` must reuse one request id throughout.
    pub async fn with_leader<T, F, Fut>(&self, extra_timeout: Duration, call: F) -> Result<T>
    where
        F: Fn(Conn) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        let budget = Instant::now() + self.shared.options.retry_timeout + extra_timeout;
        // The caller's deadline for its whole operation, if it set one
        // (`deadline::within`), cuts the budget and every attempt.
        let caller_deadline = crate::deadline::current().map(Instant::from_std);
        let give_up = caller_deadline.map_or(budget, |d| d.min(budget));
        let mut backoff = Duration::from_millis(20);
        let mut last_error;
        loop {
            let addr = self.preferred();
            let channel = self.channel(&addr)?;
            let attempt = self.shared.options.call_timeout + extra_timeout;
            let attempt = match caller_deadline {
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::DeadlineExceeded(
                            "the caller's deadline for this operation passed before the call \
                             could be made"
                                .into(),
                        ));
                    }
                    attempt.min(left)
                }
                None => attempt,
            };
            match tokio::time::timeout(attempt, call(channel)).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(status)) if replica_unusable(&status) => {
                    let leader = status
                        .metadata()
                        .get(LEADER_ADDR_METADATA)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    match leader {
                        Some(leader) if leader != addr => {
                            self.prefer(leader);
                            last_error = format!("{addr} is not the leader");
                            // Go straight to the leader: no backoff.
                            if Instant::now() < give_up {
                                continue;
                            }
                        }
                        _ => {
                            last_error = format!("{addr}: {}", status.message());
                            self.rotate(&addr);
                        }
                    }
                }
                Ok(Err(status)) => return Err(status.into()),
                Err(_) => {
                    last_error = format!("{addr} did not answer within {attempt:?}");
                    self.rotate(&addr);
                }
            }
            if let Some(deadline) = caller_deadline
                && deadline < budget
                && Instant::now() + backoff >= deadline
            {
                return Err(Error::DeadlineExceeded(format!(
                    "the caller's deadline for this operation passed while the call was retried; \
                     last error: {last_error}"
                )));
            }
            if Instant::now() + backoff >= give_up {
                return Err(Error::Unavailable(format!(
                    "no replica could serve the call within {:?} (tried {}); last error: {last_error}",
                    self.shared.options.retry_timeout + extra_timeout,
                    self.shared.endpoints.join(",")
                )));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// One unary call through [`Client::with_leader`]: `call` sends
    /// `request` on a channel to the believed leader, as often as the retry
    /// rules say; the answer's message is returned. The same request (and
    /// so the same request id) goes on every attempt.
    pub async fn unary<Req, Resp, F, Fut>(&self, request: Req, call: F) -> Result<Resp>
    where
        Req: Clone,
        F: Fn(Conn, Req) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<Resp>, Status>>,
    {
        self.unary_within(Duration::ZERO, request, call).await
    }

    /// [`Client::unary`] for a call the server may take `extra` to answer
    /// (a membership change, a snapshot): each attempt and the retry budget
    /// get that much longer.
    pub async fn unary_within<Req, Resp, F, Fut>(
        &self,
        extra: Duration,
        request: Req,
        call: F,
    ) -> Result<Resp>
    where
        Req: Clone,
        F: Fn(Conn, Req) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<Resp>, Status>>,
    {
        self.with_leader(extra, |channel| {
            let answer = call(channel, request.clone());
            async move { Ok(answer.await?.into_inner()) }
        })
        .await
    }

    /// Acquires `key` for `pod`, waiting up to `wait` in the FIFO queue
    /// (zero = fail at once if held). Returns the hold with its fencing token
    /// and payload. Re-acquiring for the same pod UID through this client
    /// returns the same hold; through another client (another process) it
    /// takes the hold over with a new token, and this client's goes stale
    /// (format 9).
    pub async fn acquire(
        &self,
        key: &LockKey,
        pod: &Pod,
        payload: Vec<u8>,
        wait: Duration,
        lease_id: u64,
    ) -> Result<Held> {
        self.acquire_with_progress(key, pod, payload, wait, lease_id, |_| {})
            .await
    }

    /// [`Client::acquire`], reporting the queue position as it is learned.
    pub async fn acquire_with_progress(
        &self,
        key: &LockKey,
        pod: &Pod,
        payload: Vec<u8>,
        wait: Duration,
        lease_id: u64,
        on_progress: impl Fn(AcquireProgress),
    ) -> Result<Held> {
        self.acquire_for_node_object(key, "", pod, payload, wait, lease_id, on_progress)
            .await
    }

    /// [`Client::acquire_with_progress`] of a lock named after a node, for
    /// the node object with UID `node_uid` as the caller saw it: refused
    /// with [`Error::FailedPrecondition`], taking nothing, when Tether has
    /// another object registered under the name (the node deleted and
    /// re-created, and the bridge has not reported it yet) or has this one
    /// reported deleted. So a report that the old object is gone never ends
    /// what was taken for the new one. An empty `node_uid` is not checked;
    /// nor is any while a replica is known to read only log formats older
    /// than 10 (an upgrade from an older build).
    #[allow(clippy::too_many_arguments)]
    pub async fn acquire_for_node_object(
        &self,
        key: &LockKey,
        node_uid: &str,
        pod: &Pod,
        payload: Vec<u8>,
        wait: Duration,
        lease_id: u64,
        on_progress: impl Fn(AcquireProgress),
    ) -> Result<Held> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::AcquireRequest {
            request_id: Some(request_id),
            key: Some(key.clone()),
            pod: Some(pod.clone()),
            payload,
            wait_timeout_ms: wait.as_millis() as u64,
            lease_id,
            node_uid: node_uid.to_string(),
        };
        let on_progress = &on_progress;
        self.with_leader(wait, |channel| {
            let request = request.clone();
            async move {
                let mut stream = LockServiceClient::new(channel)
                    .acquire(request)
                    .await?
                    .into_inner();
                loop {
                    let Some(message) = stream.message().await? else {
                        return Err(Status::unavailable(
                            "the acquire stream ended without a grant",
                        ));
                    };
                    if let Some(hold) = message
                        .hold
                        .filter(|_| message.state == pb::acquire_response::State::Granted as i32)
                    {
                        on_progress(AcquireProgress::Granted(hold.clone()));
                        drain_finished_stream(stream);
                        return Ok(hold);
                    }
                    on_progress(AcquireProgress::Queued(message.queue_position));
                }
            }
        })
        .await
        .map(|hold| Held::new(self.clone(), key.clone(), hold))
    }

    /// Releases a hold with its token and outcome. Returns the next holder
    /// granted in the same entry, if any.
    pub async fn release(
        &self,
        key: &LockKey,
        pod_uid: &str,
        token: u64,
        outcome: pb::Outcome,
    ) -> Result<Option<pb::Hold>> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::ReleaseRequest {
            request_id: Some(request_id),
            key: Some(key.clone()),
            pod_uid: pod_uid.to_string(),
            token,
            outcome: outcome as i32,
        };
        self.unary(request, |channel, request| async move {
            LockServiceClient::new(channel).release(request).await
        })
        .await
        .map(|reply| reply.next_holder)
    }

    /// Withdraws `pod_uid`'s acquire of `key` after its caller gave up on
    /// it (a dropped [`Client::acquire`] does not): its wait ends, or the
    /// hold it was granted meanwhile is given back and the next waiter
    /// granted, in one entry. Idempotent, and retried as any write is.
    /// Once every member reads format 9 it ends only what this client
    /// queued or was granted: a wait or hold another client's acquire of
    /// the pod took over (or another client queued) is kept, answered
    /// `TAKEN_OVER`.
    pub async fn withdraw(&self, key: &LockKey, pod_uid: &str) -> Result<pb::WithdrawResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::WithdrawRequest {
            request_id: Some(request_id),
            key: Some(key.clone()),
            pod_uid: pod_uid.to_string(),
        };
        self.unary(request, |channel, request| async move {
            LockServiceClient::new(channel).withdraw(request).await
        })
        .await
    }

    /// Linearizable read of the current holder and the holder's pin in
    /// `claim_set` (keyed by its pod UID, as device claims are), both from
    /// one state: what a device plugin needs to learn which pod it serves
    /// and with which devices, in one read. From a replica older than this
    /// read (a rolling upgrade) the pin comes from a second read.
    pub async fn holder_and_claim(
        &self,
        key: &LockKey,
        claim_set: &str,
    ) -> Result<(Option<pb::Hold>, Option<pb::Pin>)> {
        self.read_holder_and_claim(key, claim_set, false).await
    }

    /// [`Client::holder_and_claim`] from the leader's applied state without
    /// a ReadIndex round (`HolderRequest.unconfirmed`): cheaper, and behind
    /// the newest writes only just after an election. For steering, never
    /// for deciding: the device plugin's `GetPreferredAllocation`.
    pub async fn holder_and_claim_unconfirmed(
        &self,
        key: &LockKey,
        claim_set: &str,
    ) -> Result<(Option<pb::Hold>, Option<pb::Pin>)> {
        self.read_holder_and_claim(key, claim_set, true).await
    }

    async fn read_holder_and_claim(
        &self,
        key: &LockKey,
        claim_set: &str,
        unconfirmed: bool,
    ) -> Result<(Option<pb::Hold>, Option<pb::Pin>)> {
        let request = pb::HolderRequest {
            key: Some(key.clone()),
            claim_set: claim_set.to_string(),
            unconfirmed,
        };
        let reply = self
            .unary(request, |channel, request| async move {
                LockServiceClient::new(channel).holder(request).await
            })
            .await?;
        let Some(hold) = reply.hold else {
            return Ok((None, None));
        };
        if reply.claim_read {
            return Ok((Some(hold), reply.claim));
        }
        let member = hold.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default();
        let claim = self
            .get_pin(&pb::PinKey {
                set: claim_set.to_string(),
                member,
            })
            .await?;
        Ok((Some(hold), claim))
    }

    /// Linearizable read of the current holder (None = free).
    pub async fn holder(&self, key: &LockKey) -> Result<Option<pb::Hold>> {
        let request = pb::HolderRequest {
            key: Some(key.clone()),
            claim_set: String::new(),
            unconfirmed: false,
        };
        self.unary(request, |channel, request| async move {
            LockServiceClient::new(channel).holder(request).await
        })
        .await
        .map(|reply| reply.hold)
    }

    /// Linearizable read of a lock's holder and queue.
    pub async fn get(&self, key: &LockKey) -> Result<pb::LockState> {
        let request = pb::GetLockRequest {
            key: Some(key.clone()),
        };
        self.unary(request, |channel, request| async move {
            LockServiceClient::new(channel).get(request).await
        })
        .await
        .map(|reply| reply.lock.unwrap_or_default())
    }

    /// Locks with a holder or waiters (empty scope = all), as the answering
    /// replica has applied them.
    pub async fn list(&self, scope: &str) -> Result<Vec<pb::LockState>> {
        let request = pb::ListLocksRequest {
            scope: scope.to_string(),
        };
        self.unary(request, |channel, request| async move {
            LockServiceClient::new(channel).list(request).await
        })
        .await
        .map(|reply| reply.locks)
    }

    /// Admin: releases whatever holds `key`, audited.
    pub async fn force_release(
        &self,
        key: &LockKey,
        operator: &str,
        reason: &str,
    ) -> Result<pb::ForceReleaseResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::ForceReleaseRequest {
            request_id: Some(request_id),
            key: Some(key.clone()),
            operator: operator.to_string(),
            reason: reason.to_string(),
        };
        self.unary(request, |channel, request| async move {
            LockServiceClient::new(channel).force_release(request).await
        })
        .await
    }

    /// Releases every hold and queued wait of a pod UID in one entry.
    pub async fn revoke_pod(&self, pod_uid: &str, reason: &str) -> Result<pb::RevokePodResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::RevokePodRequest {
            request_id: Some(request_id),
            pod_uid: pod_uid.to_string(),
            reason: reason.to_string(),
        };
        self.unary(request, |channel, request| async move {
            LeaseServiceClient::new(channel).revoke_pod(request).await
        })
        .await
    }

    /// Grants a TTL lease; returns its id.
    pub async fn grant_lease(&self, ttl: Duration) -> Result<u64> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::LeaseGrantRequest {
            request_id: Some(request_id),
            ttl_ms: ttl.as_millis() as u64,
        };
        self.unary(request, |channel, request| async move {
            LeaseServiceClient::new(channel).grant(request).await
        })
        .await
        .map(|reply| reply.lease_id)
    }

    /// Refreshes a TTL lease once; returns the TTL restarted (0 = gone).
    pub async fn keep_alive_once(&self, lease_id: u64) -> Result<u64> {
        self.with_leader(Duration::ZERO, |channel| async move {
            let request = tokio_stream::iter([pb::LeaseKeepAliveRequest { lease_id }]);
            let mut replies = LeaseServiceClient::new(channel)
                .keep_alive(request)
                .await?
                .into_inner();
            match replies.message().await? {
                Some(reply) => Ok(reply.ttl_ms),
                None => Err(Status::unavailable(
                    "keepalive stream closed without a reply",
                )),
            }
        })
        .await
    }

    /// Revokes a TTL lease and what is attached to it.
    pub async fn revoke_lease(&self, lease_id: u64) -> Result<pb::LeaseRevokeResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::LeaseRevokeRequest {
            request_id: Some(request_id),
            lease_id,
        };
        self.unary(request, |channel, request| async move {
            LeaseServiceClient::new(channel).revoke(request).await
        })
        .await
    }

    /// Status of one replica (`addr`), without leader following.
    pub async fn status_of(&self, addr: &str) -> Result<pb::StatusResponse> {
        let channel = self.channel(addr)?;
        let mut client = ClusterServiceClient::new(channel);
        let call = client.status(pb::StatusRequest {});
        match tokio::time::timeout(self.shared.options.call_timeout, call).await {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            Ok(Err(status)) => Err(status.into()),
            Err(_) => Err(Error::Unavailable(format!(
                "{addr} did not answer within {:?}",
                self.shared.options.call_timeout
            ))),
        }
    }

    /// Builds a snapshot on the leader and downloads it (a backup for
    /// `tetherd --restore-from`): the log index it covers and its bytes.
    pub async fn export_snapshot(&self) -> Result<(u64, Vec<u8>)> {
        self.with_leader(Duration::from_secs(60), |channel| async move {
            let mut stream = ClusterServiceClient::new(channel)
                .export_snapshot(pb::ExportSnapshotRequest {})
                .await?
                .into_inner();
            let (mut index, mut data, mut total) = (0, Vec::new(), 0);
            while let Some(chunk) = stream.message().await? {
                index = chunk.snapshot_index;
                total = chunk.total_bytes;
                data.extend_from_slice(&chunk.data);
            }
            if data.len() as u64 != total || data.is_empty() {
                return Err(Status::unavailable(format!(
                    "the snapshot stream ended after {} of {total} bytes",
                    data.len()
                )));
            }
            Ok((index, data))
        })
        .await
    }

    /// [`Client::history_query`] answered by one replica (`addr`), from its
    /// own event store, without leader following. A replica that joined by
    /// snapshot only has the events after it: see `oldest_retained`.
    pub async fn history_at(
        &self,
        addr: &str,
        request: pb::HistoryRequest,
    ) -> Result<pb::HistoryResponse> {
        let channel = self.channel(addr)?;
        let mut client = WatchServiceClient::new(channel);
        match tokio::time::timeout(self.shared.options.call_timeout, client.history(request)).await
        {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            Ok(Err(status)) => Err(status.into()),
            Err(_) => Err(Error::Unavailable(format!(
                "{addr} did not answer within {:?}",
                self.shared.options.call_timeout
            ))),
        }
    }

    /// The configured endpoints.
    pub fn endpoints(&self) -> &[String] {
        &self.shared.endpoints
    }

    /// The options it was made with (for another client of the same
    /// cluster and credentials).
    pub fn options(&self) -> &Options {
        &self.shared.options
    }

    /// Adds a learner (leader only; followed automatically).
    pub async fn add_learner(&self, node_id: u64, addr: &str, blocking: bool) -> Result<u64> {
        let request = pb::AddLearnerRequest {
            node_id,
            addr: addr.to_string(),
            blocking,
        };
        self.unary_within(
            Duration::from_secs(60),
            request,
            |channel, request| async move {
                ClusterServiceClient::new(channel)
                    .add_learner(request)
                    .await
            },
        )
        .await
        .map(|reply| reply.log_index)
    }

    /// Sets the voters.
    pub async fn change_membership(
        &self,
        voters: Vec<u64>,
        retain_as_learners: bool,
    ) -> Result<u64> {
        let request = pb::ChangeMembershipRequest {
            voters,
            retain_as_learners,
            remove_learners: vec![],
        };
        self.unary_within(
            Duration::from_secs(30),
            request,
            |channel, request| async move {
                ClusterServiceClient::new(channel)
                    .change_membership(request)
                    .await
            },
        )
        .await
        .map(|reply| reply.log_index)
    }

    /// Removes learners (non-voting members).
    pub async fn remove_learners(&self, node_ids: Vec<u64>) -> Result<u64> {
        let request = pb::ChangeMembershipRequest {
            voters: vec![],
            retain_as_learners: false,
            remove_learners: node_ids,
        };
        self.unary_within(
            Duration::from_secs(30),
            request,
            |channel, request| async move {
                ClusterServiceClient::new(channel)
                    .change_membership(request)
                    .await
            },
        )
        .await
        .map(|reply| reply.log_index)
    }

    /// The leader's status (its view of members and replication).
    pub async fn leader_status(&self) -> Result<pb::StatusResponse> {
        let any = self
            .with_leader(Duration::ZERO, |channel| async move {
                Ok(ClusterServiceClient::new(channel)
                    .status(pb::StatusRequest {})
                    .await?
                    .into_inner())
            })
            .await?;
        if any.role == "leader" || any.leader_addr.is_empty() {
            return Ok(any);
        }
        self.status_of(&any.leader_addr).await
    }

    /// Hands leadership to `target`; returns the new leader id.
    pub async fn transfer_leader(&self, target: u64) -> Result<u64> {
        let request = pb::TransferLeaderRequest {
            target_node_id: target,
        };
        self.unary_within(
            Duration::from_secs(30),
            request,
            |channel, request| async move {
                ClusterServiceClient::new(channel)
                    .transfer_leader(request)
                    .await
            },
        )
        .await
        .map(|reply| reply.leader_id)
    }

    /// Builds a snapshot on the leader now.
    pub async fn snapshot(&self) -> Result<u64> {
        self.unary_within(
            Duration::from_secs(60),
            pb::SnapshotRequest {},
            |channel, request| async move { ClusterServiceClient::new(channel).snapshot(request).await },
        )
        .await
        .map(|reply| reply.snapshot_index)
    }
}

impl Client {
    /// Pins `key` to one of `candidates` (or returns its existing pin).
    pub async fn assign(
        &self,
        key: &pb::PinKey,
        candidates: Vec<String>,
        pod_uid: &str,
        lifetime: Duration,
        labels: HashMap<String, String>,
        affinity: pb::Affinity,
    ) -> Result<pb::AssignResponse> {
        let uids = HashMap::new();
        self.assign_for_node_objects(key, candidates, uids, pod_uid, lifetime, labels, affinity)
            .await
    }

    /// [`Client::assign`] for the candidate node objects the caller saw
    /// (`candidate_uids`: node name to UID), checked as
    /// [`Client::acquire_for_node_object`] checks its one.
    #[allow(clippy::too_many_arguments)]
    pub async fn assign_for_node_objects(
        &self,
        key: &pb::PinKey,
        candidates: Vec<String>,
        candidate_uids: HashMap<String, String>,
        pod_uid: &str,
        lifetime: Duration,
        labels: HashMap<String, String>,
        affinity: pb::Affinity,
    ) -> Result<pb::AssignResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::AssignRequest {
            request_id: Some(request_id),
            key: Some(key.clone()),
            candidates,
            pod_uid: pod_uid.to_string(),
            lifetime_ms: lifetime.as_millis() as u64,
            labels,
            affinity: Some(affinity),
            candidate_uids,
        };
        self.unary(request, |channel, request| async move {
            PinServiceClient::new(channel).assign(request).await
        })
        .await
    }

    /// Makes pin `key` carry exactly `labels` on `node` (created if absent),
    /// taking each of them that starts with `exclusive_prefix` out of every
    /// other pin of its set on the node, in one entry (a pin left with none
    /// is released). No schedulability rule applies. Format 7.
    pub async fn reclaim(
        &self,
        key: &pb::PinKey,
        node: &str,
        pod_uid: &str,
        lifetime: Duration,
        labels: HashMap<String, String>,
        exclusive_prefix: &str,
    ) -> Result<pb::ReclaimResponse> {
        self.reclaim_for_node_object(key, node, "", pod_uid, lifetime, labels, exclusive_prefix)
            .await
    }

    /// [`Client::reclaim`] for the node object with UID `node_uid` as the
    /// caller saw it, checked as [`Client::acquire_for_node_object`] checks.
    #[allow(clippy::too_many_arguments)]
    pub async fn reclaim_for_node_object(
        &self,
        key: &pb::PinKey,
        node: &str,
        node_uid: &str,
        pod_uid: &str,
        lifetime: Duration,
        labels: HashMap<String, String>,
        exclusive_prefix: &str,
    ) -> Result<pb::ReclaimResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::ReclaimRequest {
            request_id: Some(request_id),
            key: Some(key.clone()),
            node: node.to_string(),
            pod_uid: pod_uid.to_string(),
            lifetime_ms: lifetime.as_millis() as u64,
            labels,
            exclusive_prefix: exclusive_prefix.to_string(),
            node_uid: node_uid.to_string(),
        };
        self.unary(request, |channel, request| async move {
            PinServiceClient::new(channel).reclaim(request).await
        })
        .await
    }

    /// Releases a pin; returns it (None if there was none).
    pub async fn release_pin(&self, key: &pb::PinKey, reason: &str) -> Result<Option<pb::Pin>> {
        self.release_pin_if(key, reason, HashMap::new()).await
    }

    /// Releases a pin only while it carries every one of `labels` (name
    /// and value): a pin made again since without them is kept, and the
    /// call fails with [`Error::FailedPrecondition`] naming its labels. No
    /// pin answers `None`. Needs every member at format 9; with no labels
    /// it is [`Client::release_pin`].
    pub async fn release_pin_if(
        &self,
        key: &pb::PinKey,
        reason: &str,
        labels: HashMap<String, String>,
    ) -> Result<Option<pb::Pin>> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::ReleasePinRequest {
            request_id: Some(request_id),
            key: Some(key.clone()),
            reason: reason.to_string(),
            if_labels: labels,
        };
        self.unary(request, |channel, request| async move {
            PinServiceClient::new(channel).release(request).await
        })
        .await
        .map(|reply| reply.released)
    }

    /// Linearizable read of one pin.
    pub async fn get_pin(&self, key: &pb::PinKey) -> Result<Option<pb::Pin>> {
        let request = pb::GetPinRequest {
            key: Some(key.clone()),
        };
        self.unary(request, |channel, request| async move {
            PinServiceClient::new(channel).get(request).await
        })
        .await
        .map(|reply| reply.pin)
    }

    /// Pins of a set and/or on a node (empty = any).
    pub async fn list_pins(&self, set: &str, node: &str) -> Result<Vec<pb::Pin>> {
        let request = pb::ListPinsRequest {
            set: set.to_string(),
            node: node.to_string(),
        };
        self.unary(request, |channel, request| async move {
            PinServiceClient::new(channel).list(request).await
        })
        .await
        .map(|reply| reply.pins)
    }

    /// Reports a node (what the bridge sends).
    pub async fn report_node(
        &self,
        mut request: pb::ReportNodeRequest,
    ) -> Result<pb::ReportNodeResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        request.request_id = Some(request_id);
        self.unary(request, |channel, request| async move {
            NodeServiceClient::new(channel).report(request).await
        })
        .await
    }

    /// The node registry.
    pub async fn list_nodes(&self, include_gone: bool) -> Result<Vec<pb::Node>> {
        let request = pb::ListNodesRequest { include_gone };
        self.unary(request, |channel, request| async move {
            NodeServiceClient::new(channel).list(request).await
        })
        .await
        .map(|reply| reply.nodes)
    }

    /// Reports a pod's phase (what the bridge sends).
    pub async fn report_pod(
        &self,
        pod_uid: &str,
        phase: pb::PodPhase,
    ) -> Result<pb::ReportPodResponse> {
        let (request_id, _in_flight) = self.begin_request().await;
        let request = pb::ReportPodRequest {
            request_id: Some(request_id),
            pod_uid: pod_uid.to_string(),
            phase: phase as i32,
        };
        self.unary(request, |channel, request| async move {
            LeaseServiceClient::new(channel).report_pod(request).await
        })
        .await
    }

    /// Watches events from `start` (None = from now on), filtered by kinds
    /// (empty = all) and key prefix; resumes across disconnects.
    pub async fn watch(
        &self,
        start: Option<pb::Revision>,
        kinds: Vec<String>,
        prefix: &str,
    ) -> Result<Watcher> {
        let start = match start {
            Some(start) if start.index > 0 => start,
            _ => {
                let status = self
                    .with_leader(Duration::ZERO, |channel| async move {
                        Ok(ClusterServiceClient::new(channel)
                            .status(pb::StatusRequest {})
                            .await?
                            .into_inner())
                    })
                    .await?;
                pb::Revision {
                    index: status.applied_index + 1,
                    sub: 0,
                }
            }
        };
        Ok(Watcher::new(self.clone(), start, kinds, prefix.to_string()))
    }

    /// Retained events of one key (`lock/<scope>/<name>`, `pin/<set>/<member>`,
    /// `node/<name>`), oldest first, since `since_ms` (0 = all retained).
    pub async fn history(
        &self,
        key: &str,
        since_ms: u64,
        limit: u32,
    ) -> Result<pb::HistoryResponse> {
        self.history_query(pb::HistoryRequest {
            key: key.to_string(),
            since_ms,
            limit,
            ..Default::default()
        })
        .await
    }
}

impl Client {
    /// Retained events of one key in a revision range, oldest first; the full
    /// [`pb::HistoryRequest`] (the server answers at most 1,000 per call:
    /// page by asking again from the last revision + 1).
    pub async fn history_query(&self, request: pb::HistoryRequest) -> Result<pb::HistoryResponse> {
        self.unary(request, |channel, request| async move {
            WatchServiceClient::new(channel).history(request).await
        })
        .await
    }

    /// [`Client::list`] with the answering replica's applied index: the
    /// state is as of that index (for list-then-watch without gaps).
    pub async fn list_with_index(&self, scope: &str) -> Result<(Vec<pb::LockState>, u64)> {
        let request = pb::ListLocksRequest {
            scope: scope.to_string(),
        };
        self.with_leader(Duration::ZERO, |channel| {
            let request = request.clone();
            async move {
                let reply = LockServiceClient::new(channel)
                    .list(request)
                    .await?
                    .into_inner();
                Ok((reply.locks, reply.header.map_or(0, |h| h.applied_index)))
            }
        })
        .await
    }

    /// [`Client::list_pins`] with the answering replica's applied index.
    pub async fn list_pins_with_index(&self, set: &str, node: &str) -> Result<(Vec<pb::Pin>, u64)> {
        let request = pb::ListPinsRequest {
            set: set.to_string(),
            node: node.to_string(),
        };
        self.with_leader(Duration::ZERO, |channel| {
            let request = request.clone();
            async move {
                let reply = PinServiceClient::new(channel)
                    .list(request)
                    .await?
                    .into_inner();
                Ok((reply.pins, reply.header.map_or(0, |h| h.applied_index)))
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn requests_wait_while_the_outstanding_window_is_full() {
        let client = Client::new(["127.0.0.1:1"], Options::default()).unwrap();
        let mut guards = Vec::new();
        for _ in 0..MAX_OUTSTANDING {
            guards.push(client.begin_request().await);
        }
        let blocked =
            tokio::time::timeout(Duration::from_millis(100), client.begin_request()).await;
        assert!(blocked.is_err(), "a request beyond the window must wait");
        // The oldest completes: room again.
        guards.remove(0);
        let (id, _guard) = tokio::time::timeout(Duration::from_secs(5), client.begin_request())
            .await
            .expect("admitted");
        assert_eq!(id.sequence, MAX_OUTSTANDING + 1);
        assert_eq!(id.first_incomplete, 2);
    }
}

//! One running replica: opens the store, starts openraft, serves gRPC and
//! HTTP, bootstraps the cluster when asked to, and runs the leader's sweeper.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use openraft::{BasicNode, ServerState, SnapshotPolicy};
use tether_proto::cluster_service_server::ClusterServiceServer;
use tether_proto::lease_service_server::LeaseServiceServer;
use tether_proto::lock_service_server::LockServiceServer;
use tether_proto::node_service_server::NodeServiceServer;
use tether_proto::pin_service_server::PinServiceServer;
use tether_proto::raft_service_server::RaftServiceServer;
use tether_proto::watch_service_server::WatchServiceServer;
use tether_tls::{TlsFiles, TlsMaterial};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::Ctx;
use crate::api::cluster::{ClusterApi, transfer_leader};
use crate::api::lease::LeaseApi;
use crate::api::lock::LockApi;
use crate::api::node::NodeApi;
use crate::api::pin::PinApi;
use crate::api::raft::RaftApi;
use crate::api::watch::WatchApi;
use crate::auth::Auth;
use crate::config::{Config, parse_members};
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::raft::network::Network;
use crate::sm::command::{Sweep, sweep_due};
use crate::sm::{Command, Reply};
use crate::statefulset;
use crate::store;

/// Room a request needs beside its payload (key, pod, ids, framing).
const REQUEST_OVERHEAD: usize = 16 * 1024;

/// A running replica.
pub struct Node {
    ctx: Arc<Ctx>,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    shutdown: Arc<watch::Sender<bool>>,
    /// Set to why Raft's core stopped, if it stops on its own.
    core: watch::Receiver<Option<String>>,
    tasks: Vec<JoinHandle<()>>,
    /// The replica's database, held to know when Raft's tasks have let go.
    db: Arc<rocksdb::DB>,
}

impl Node {
    /// Binds the configured addresses and starts the replica.
    pub async fn start(config: Config) -> anyhow::Result<Node> {
        let grpc = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen for gRPC on {}", config.listen))?;
        let http = TcpListener::bind(config.http_listen)
            .await
            .with_context(|| format!("cannot listen for HTTP on {}", config.http_listen))?;
        Self::start_with(config, grpc, http).await
    }

    /// Starts the replica on already-bound listeners (tests bind port 0 and
    /// learn the addresses before building the member list).
    pub async fn start_with(
        config: Config,
        grpc: TcpListener,
        http: TcpListener,
    ) -> anyhow::Result<Node> {
        let grpc_addr = grpc.local_addr()?;
        let http_addr = http.local_addr()?;
        let set = if config.statefulset {
            Some(statefulset_membership(&config, grpc_addr.port())?)
        } else {
            None
        };
        let advertise = config.advertise.clone().unwrap_or_else(|| match &set {
            Some(set) => statefulset::peer_address(&set.template, set.ordinal),
            None => grpc_addr.to_string(),
        });
        let id = match set {
            Some(_) => statefulset::node_id(&config.data_dir)?,
            None => config.node_id,
        };
        anyhow::ensure!(id > 0, "node id must be at least 1");
        anyhow::ensure!(
            config.max_request_bytes >= config.max_payload_bytes + REQUEST_OVERHEAD,
            "--max-request-bytes {} leaves no room for a payload of --max-payload-bytes {} \
             (it must be at least {} more)",
            config.max_request_bytes,
            config.max_payload_bytes,
            REQUEST_OVERHEAD
        );
        anyhow::ensure!(
            config.max_request_bytes <= config.raft_message_limit / 4,
            "--max-request-bytes {} is too large: at most {} (a quarter of the {} byte Raft \
             message limit, so that any one log entry fits a message to the other replicas)",
            config.max_request_bytes,
            config.raft_message_limit / 4,
            config.raft_message_limit
        );

        std::fs::create_dir_all(&config.data_dir).with_context(|| {
            format!("cannot create data directory {}", config.data_dir.display())
        })?;
        let (db, log_store, mut sm_store) = store::open(&config.data_dir)
            .await
            .with_context(|| format!("cannot open the store in {}", config.data_dir.display()))?;
        let metrics = Arc::new(Metrics::default());
        sm_store.set_metrics(metrics.clone());
        let log_store = log_store.with_metrics(metrics.clone());
        sm_store.set_event_retention(store::EventRetention {
            entries: config.event_retention_entries,
            age_ms: config.event_retention_age.as_millis() as u64,
        });
        if let Some(path) = &config.restore_from {
            let data = std::fs::read(path)
                .with_context(|| format!("cannot read the backup {}", path.display()))?;
            let empty = store::state_machine::stored_snapshot(&db)?.is_none()
                && sm_store.handle().read().last_applied.is_none();
            anyhow::ensure!(
                empty,
                "--restore-from needs an empty data directory; {} already holds a replica",
                config.data_dir.display()
            );
            let last = sm_store
                .restore_backup(&data, id, &advertise)
                .with_context(|| format!("cannot restore {}", path.display()))?;
            log_store.start_after(last, id)?;
            tracing::info!(backup = %path.display(), index = last.index, "restored a backup as a one-member cluster");
        }
        let state = sm_store.handle();
        let cluster_id = state.cluster_id();

        let election_ms = config.election_timeout.as_millis() as u64;
        let raft_config = openraft::Config {
            cluster_name: "tether".to_string(),
            heartbeat_interval: config.heartbeat_interval.as_millis() as u64,
            election_timeout_min: election_ms,
            election_timeout_max: election_ms * 2,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(config.snapshot_every),
            max_in_snapshot_log_to_keep: config.keep_logs_after_snapshot,
            // openraft's 3 MiB chunks, or half the Raft message limit when
            // that is lower, so a chunk and its metadata fit one message.
            snapshot_max_chunk_size: (config.raft_message_limit as u64 / 2).min(3 * 1024 * 1024),
            ..Default::default()
        }
        .validate()
        .context("invalid Raft timing (the heartbeat must be shorter than the election timeout)")?;
        let tls = load_tls(&config)?;
        let auth = match (&tls, &config.auth_tokens) {
            (Some(_), _) => Auth::Certificates,
            (None, Some(path)) => Auth::from_token_file(path)?,
            (None, None) => Auth::Open,
        };
        if let Auth::Tokens(_) = &auth {
            check_token_cluster(&config, auth.peer_authorization().is_some())?;
        }
        let peer_formats = Arc::new(crate::raft::network::PeerFormats::default());
        let dialer = Arc::new(crate::raft::dial::PeerDialer::new(
            config.peer_dial.clone(),
            tls.clone(),
            auth.peer_authorization(),
            cluster_id.clone(),
        ));
        let network = Network::new(
            dialer.clone(),
            peer_formats.clone(),
            config.raft_message_limit,
            metrics.clone(),
        );
        let raft = Raft::new(
            id,
            Arc::new(raft_config),
            network.clone(),
            log_store,
            sm_store,
        )
        .await
        .context("cannot start Raft")?;

        let config = Arc::new(config);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let shutdown = Arc::new(shutdown);
        let clock = Arc::new(crate::api::clock::CommitClock::new(state.clone()));
        let proposer = (config.batch_max_commands > 1).then(|| {
            let limits = crate::api::batching::BatchLimits {
                max_commands: config.batch_max_commands as usize,
                // Keeps a batch entry well inside one Raft message.
                max_payload_bytes: config.max_request_bytes,
                in_flight: config.batch_in_flight as usize,
                hold_queued: config.batch_hold_queued,
            };
            crate::api::batching::Proposer::start(
                raft.clone(),
                id,
                peer_formats.clone(),
                state.clone(),
                limits,
                metrics.clone(),
                clock.clone(),
            )
        });
        let reads = crate::api::reads::ReadBarrier::new(raft.clone(), metrics.clone());
        let ctx = Arc::new(Ctx {
            id,
            addr: advertise.clone(),
            raft: raft.clone(),
            state,
            db: Arc::downgrade(&db),
            config: config.clone(),
            metrics,
            shutdown: shutdown_rx.clone(),
            core_stopped: Default::default(),
            transferring: Default::default(),
            auth,
            dialer,
            watchers: Default::default(),
            proposer,
            reads,
            peer_formats,
            cluster_id,
            clock,
        });

        if set.is_none() {
            bootstrap(&ctx, &advertise).await?;
        }

        let mut tasks = Vec::new();
        if let Some(tls) = &tls {
            tasks.push(tls.watch(config.tls_reload_interval));
        }
        let request_limit = config.max_request_bytes;
        // Every response names the cluster (`cluster_id`): clients refuse a
        // replica of another cluster than the one they have been using.
        let cluster_id = ctx.cluster_id.clone();
        let name_cluster = tower::util::MapResponseLayer::new(
            move |mut response: tonic::codegen::http::Response<tonic::body::Body>| {
                if let Some(value) = cluster_id.get().and_then(|id| id.parse().ok()) {
                    response
                        .headers_mut()
                        .insert(crate::cluster_id::METADATA, value);
                }
                response
            },
        );
        let expected = ctx.cluster_id.clone();
        let check_cluster =
            tonic::service::InterceptorLayer::new(move |request: tonic::Request<()>| {
                crate::cluster_id::check_expected(&expected, request.metadata())?;
                Ok(request)
            });
        let grpc_server = tonic::transport::Server::builder()
            // Outermost: every call is timed, refused ones too.
            .layer(crate::metrics::GrpcTimingLayer(ctx.metrics.clone()))
            // Then: a refused request reaches no handler (its refusal
            // names this replica's cluster in its own metadata).
            .layer(check_cluster)
            .layer(name_cluster)
            .add_service(
                LockServiceServer::new(LockApi::new(ctx.clone()))
                    .max_decoding_message_size(request_limit),
            )
            .add_service(
                LeaseServiceServer::new(LeaseApi::new(ctx.clone()))
                    .max_decoding_message_size(request_limit),
            )
            .add_service(
                PinServiceServer::new(PinApi::new(ctx.clone()))
                    .max_decoding_message_size(request_limit),
            )
            .add_service(
                NodeServiceServer::new(NodeApi::new(ctx.clone()))
                    .max_decoding_message_size(request_limit),
            )
            .add_service(
                WatchServiceServer::new(WatchApi::new(ctx.clone()))
                    .max_decoding_message_size(request_limit),
            )
            .add_service(
                ClusterServiceServer::new(ClusterApi::new(ctx.clone()))
                    .max_decoding_message_size(request_limit),
            )
            .add_service(
                RaftServiceServer::new(RaftApi::new(ctx.clone()))
                    .max_decoding_message_size(config.raft_message_limit)
                    .max_encoding_message_size(config.raft_message_limit),
            );
        let stop = wait_for(shutdown_rx.clone());
        let incoming = tether_tls::incoming(grpc, tls.clone());
        tasks.push(tokio::spawn(async move {
            if let Err(err) = grpc_server
                .serve_with_incoming_shutdown(incoming, stop)
                .await
            {
                tracing::error!(%err, "gRPC server failed");
            }
        }));
        tasks.push(tokio::spawn(crate::http::serve(
            http,
            ctx.clone(),
            wait_for(shutdown_rx.clone()),
        )));
        tasks.push(tokio::spawn(forget_departed_peers(
            ctx.raft.clone(),
            network,
            shutdown_rx.clone(),
        )));
        tasks.push(tokio::spawn(claim_cluster_id(
            ctx.clone(),
            shutdown_rx.clone(),
        )));
        tasks.push(tokio::spawn(sweeper(ctx.clone(), shutdown_rx)));
        let (core_tx, core) = watch::channel(None);
        tasks.push(tokio::spawn(watch_core(
            ctx.clone(),
            shutdown.clone(),
            core_tx,
        )));
        if let Some(set) = set {
            let ctx = ctx.clone();
            tasks.push(tokio::spawn(async move {
                if let Err(err) = statefulset::join_or_bootstrap(&ctx, &set).await {
                    tracing::error!(%err, "cannot join the StatefulSet's cluster");
                }
                statefulset::keep_membership(&ctx, &set, ctx.config.scale_in_after).await;
            }));
        }

        tracing::info!(node_id = id, grpc = %grpc_addr, advertise, http = %http_addr, data_dir = %config.data_dir.display(), "tetherd replica started");
        Ok(Node {
            ctx,
            grpc_addr,
            http_addr,
            shutdown,
            core,
            tasks,
            db,
        })
    }

    /// Resolves, with the reason, if Raft's core stops without being asked
    /// to (a fatal storage error, a panic in openraft). The replica can then
    /// serve nothing: `tetherd` exits non-zero, so that Kubernetes restarts
    /// it and it recovers from its data directory.
    pub async fn core_stopped(&self) -> String {
        let mut core = self.core.clone();
        loop {
            if let Some(reason) = core.borrow_and_update().clone() {
                return reason;
            }
            if core.changed().await.is_err() {
                // The watching task is gone (the replica is stopping).
                std::future::pending::<()>().await;
            }
        }
    }

    /// The gRPC address this replica listens on.
    pub fn addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The HTTP (`/health`, `/metrics`) address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The node id.
    pub fn id(&self) -> u64 {
        self.ctx.id
    }

    /// The Raft handle (tests wait on its metrics).
    pub fn raft(&self) -> &Raft {
        &self.ctx.raft
    }

    /// The replica's context (state handle, config).
    pub fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// Clean shutdown: a leader first hands leadership to the most caught-up
    /// other voter (so clients see no election timeout), then the servers and
    /// Raft stop.
    pub async fn shutdown(self) {
        let leading = self.ctx.raft.metrics().borrow().state == ServerState::Leader;
        if leading && let Some(target) = best_successor(&self.ctx) {
            {
                match transfer_leader(&self.ctx, target).await {
                    Ok(leader) => tracing::info!(
                        new_leader = leader,
                        "leadership handed over before shutdown"
                    ),
                    Err(err) => {
                        tracing::warn!(%err, "leadership hand-over failed; the others will elect")
                    }
                }
            }
        }
        self.stop().await;
    }

    /// Stops at once without handing over leadership (what a crash looks like
    /// to the other replicas, minus the lost unsynced writes).
    pub async fn stop(self) {
        let Node {
            ctx,
            shutdown,
            tasks,
            db,
            ..
        } = self;
        let id = ctx.id;
        let _ = shutdown.send(true);
        if let Err(err) = ctx.raft.shutdown().await {
            tracing::warn!(%err, "Raft shutdown failed");
        }
        for task in tasks {
            task.abort();
            let _ = task.await;
        }
        // Raft's storage tasks let go of the database shortly after shutdown;
        // wait for that so the directory can be opened again at once (RocksDB
        // takes a lock file per directory).
        drop(ctx);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&db) > 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if Arc::strong_count(&db) > 1 {
            tracing::warn!("storage still in use 10 s after shutdown");
        }
        tracing::info!(node_id = id, "replica stopped");
    }
}

/// Watches Raft's core. When it stops on its own, this replica can neither
/// replicate nor apply, yet its gRPC and HTTP servers would keep answering
/// (and its watches would wait forever for events that never come). So:
/// record why (for `/live`), end every watch and queued acquire with
/// `UNAVAILABLE` (the shutdown signal), and report it to the caller
/// ([`Node::core_stopped`]). An asked-for shutdown is not a stop.
async fn watch_core(
    ctx: Arc<Ctx>,
    shutdown: Arc<watch::Sender<bool>>,
    stopped: watch::Sender<Option<String>>,
) {
    let mut metrics = ctx.raft.metrics();
    let reason = loop {
        if let Err(fatal) = &metrics.borrow_and_update().running_state {
            break fatal.to_string();
        }
        if metrics.changed().await.is_err() {
            // The core task is gone without a last report: it panicked.
            break "the Raft core task ended without a report (panicked)".to_string();
        }
    };
    if *ctx.shutdown.borrow() {
        return;
    }
    tracing::error!(
        node_id = ctx.id,
        reason,
        "the Raft core stopped: this replica cannot serve; ending its watches and exiting so that \
         it is restarted and recovers from its data directory"
    );
    let _ = ctx.core_stopped.set(reason.clone());
    let _ = shutdown.send(true);
    let _ = stopped.send(Some(reason));
}

async fn wait_for(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// The replica's TLS material when `--tls-dir` is set. Its certificate
/// must name the `replica` role: the other replicas accept Raft traffic
/// only from that role.
fn load_tls(config: &Config) -> anyhow::Result<Option<Arc<TlsMaterial>>> {
    let Some(dir) = &config.tls_dir else {
        return Ok(None);
    };
    let tls = TlsMaterial::load(TlsFiles::in_dir(dir))
        .with_context(|| format!("cannot use the TLS files in {}", dir.display()))?;
    let identity = tls.identity();
    anyhow::ensure!(
        identity.name == "replica",
        "the replica's certificate ({}) must name the role `replica` (common name or a \
         `tether:replica` URI SAN); it names {:?}",
        identity.subject,
        identity.name
    );
    Ok(Some(tls))
}

/// What development tokens (`--auth-tokens`) can carry: replicas send each
/// other the token file's `replica` token, so a cluster of several needs
/// one; the StatefulSet bootstrap's probes send none, so it needs TLS.
fn check_token_cluster(config: &Config, has_replica_token: bool) -> anyhow::Result<()> {
    anyhow::ensure!(
        !config.statefulset,
        "--statefulset does not work with --auth-tokens (its bootstrap probes carry no token); \
         use --tls-dir"
    );
    let members = config
        .initial_members
        .as_deref()
        .map_or(1, |m| m.split(',').filter(|s| !s.trim().is_empty()).count());
    if !has_replica_token {
        anyhow::ensure!(
            members <= 1,
            "--auth-tokens: a cluster of {members} replicas needs a `TOKEN replica` line in the \
             token file: the replicas send it to each other"
        );
        tracing::warn!(
            "the --auth-tokens file has no `replica` token: members added later cannot reach \
             this replica"
        );
    }
    Ok(())
}

/// The StatefulSet identity of this pod, from its hostname.
fn statefulset_membership(config: &Config, port: u16) -> anyhow::Result<statefulset::Membership> {
    let hostname = match &config.hostname {
        Some(name) => name.clone(),
        None => std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
            })
            .context("--statefulset needs the pod's hostname (--hostname or $HOSTNAME)")?,
    };
    let ordinal = statefulset::ordinal_from_hostname(&hostname)
        .with_context(|| format!("--statefulset: hostname {hostname:?} is not <set>-<ordinal>"))?;
    let template = match &config.peer_template {
        Some(template) => template.clone(),
        None => statefulset::default_template(&hostname, port)
            .context("--statefulset: cannot derive the peer template from the hostname")?,
    };
    anyhow::ensure!(
        template.contains("{ordinal}"),
        "--peer-template {template:?} has no {{ordinal}} placeholder"
    );
    tracing::info!(
        hostname,
        ordinal,
        template,
        "running as a StatefulSet member"
    );
    let expect = config.bootstrap_expect.context(
        "--statefulset needs --bootstrap-expect (TETHER_BOOTSTRAP_EXPECT): the StatefulSet's \
         replicas, so that a new cluster starts only once all of them answer",
    )?;
    anyhow::ensure!(expect >= 1, "--bootstrap-expect must be at least 1");
    Ok(statefulset::Membership {
        ordinal,
        template,
        expect,
        probe: config.probe_ordinals.max(ordinal + 1).max(expect),
    })
}

/// Initializes a new cluster if this replica has no Raft state yet and has
/// the lowest id among the initial members; otherwise it waits to be
/// contacted (by the bootstrapping replica, or by AddLearner).
async fn bootstrap(ctx: &Ctx, advertise: &str) -> anyhow::Result<()> {
    let members: BTreeMap<u64, String> = match &ctx.config.initial_members {
        Some(text) => parse_members(text).map_err(|e| anyhow::anyhow!("--initial-members: {e}"))?,
        None => BTreeMap::from([(ctx.id, advertise.to_string())]),
    };
    if ctx.raft.is_initialized().await? {
        tracing::info!("existing Raft state found; --initial-members is ignored");
        return Ok(());
    }
    let lowest = *members
        .keys()
        .next()
        .expect("parse_members refuses an empty list");
    if lowest != ctx.id {
        tracing::info!(
            bootstrapper = lowest,
            "waiting to be contacted by the cluster"
        );
        return Ok(());
    }
    let nodes: BTreeMap<u64, BasicNode> = members
        .into_iter()
        .map(|(id, addr)| (id, BasicNode { addr }))
        .collect();
    tracing::info!(members = ?nodes.keys().collect::<Vec<_>>(), "initializing a new cluster");
    ctx.raft
        .initialize(nodes)
        .await
        .context("cannot initialize the cluster")?;
    Ok(())
}

/// The voter other than this one with the highest replicated index.
fn best_successor(ctx: &Ctx) -> Option<u64> {
    let m = ctx.raft.metrics().borrow().clone();
    let replication = m.replication.clone().unwrap_or_default();
    m.membership_config
        .membership()
        .voter_ids()
        .filter(|id| *id != ctx.id)
        .max_by_key(|id| {
            replication
                .get(id)
                .copied()
                .flatten()
                .map_or(0, |l| l.index)
        })
}

/// How often the cached peer connections are checked against the
/// membership.
const FORGET_DEPARTED_EVERY: Duration = Duration::from_secs(30);

/// Keeps the Raft network's cached connections to the membership's
/// addresses: after a membership change, the connections to replicas that
/// left (or moved) are dropped at the next check.
async fn forget_departed_peers(raft: Raft, network: Network, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(FORGET_DEPARTED_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checked = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let membership = raft.metrics().borrow().membership_config.clone();
        if checked.as_ref() == Some(membership.log_id()) {
            continue;
        }
        network.forget_departed(membership.membership().nodes());
        checked = Some(*membership.log_id());
    }
}

/// While this replica leads, proposes a [`Sweep`] whenever its applied state
/// shows a wait, lease, hold or session due on the leader's clock.
/// As leader, gives the cluster its id when none is applied yet: right
/// after the cluster was initialized, or once on a cluster an older build
/// started. The id goes through the log ([`crate::cluster_id`]), so all
/// members take the same one even if two leaders in a row each propose
/// one.
async fn claim_cluster_id(ctx: Arc<Ctx>, mut shutdown: watch::Receiver<bool>) {
    let mut metrics = ctx.raft.metrics();
    loop {
        let leading = metrics.borrow_and_update().state == ServerState::Leader;
        if leading && ctx.cluster_id.get().is_none() {
            let id = crate::cluster_id::draw();
            let command = Command::Audit(crate::sm::command::Audit {
                identity: "tetherd".into(),
                action: crate::cluster_id::AUDIT_ACTION.into(),
                detail: id.clone(),
            });
            match ctx.write(None, command).await {
                Ok(_) => tracing::info!(
                    proposed = id,
                    cluster_id = ctx.cluster_id.get(),
                    "gave the cluster its id"
                ),
                Err(err) => tracing::debug!(%err, "could not record a cluster id yet"),
            }
            // A failed proposal (leadership lost) is retried after a pause.
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = shutdown.changed() => return,
            }
            continue;
        }
        tokio::select! {
            changed = metrics.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

async fn sweeper(ctx: Arc<Ctx>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(ctx.config.sweep_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leading_since: Option<(u64, Instant)> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let (state, term) = {
            let m = ctx.raft.metrics();
            let m = m.borrow();
            (m.state, m.current_term)
        };
        if state != ServerState::Leader {
            leading_since = None;
            continue;
        }
        let since = match leading_since {
            Some((t, since)) if t == term => since,
            _ => leading_since.insert((term, Instant::now())).1,
        };
        let sweep = Sweep {
            leader_tenure_ms: since.elapsed().as_millis() as u64,
            hold_timeout_ms: ctx.config.hold_timeout.as_millis() as u64,
            scope_hold_timeout_ms: ctx
                .config
                .scope_hold_timeouts
                .iter()
                .map(|(scope, d)| (scope.clone(), d.as_millis() as u64))
                .collect(),
            session_idle_ms: ctx.config.session_idle.as_millis() as u64,
            node_tombstone_ms: ctx.config.node_tombstone.as_millis() as u64,
        };
        let now = ctx.clock.stamp(term);
        // Format 6 (grants after all ends, forgets unreferenced pods), or
        // an older one during a rolling upgrade: see `Ctx::request`.
        let request = ctx.request(None, now, Command::Sweep(sweep));
        let Command::Sweep(sweep) = &request.command else {
            unreachable!("a sweep was built")
        };
        // Due on committed time, as apply will judge it: the entry applies
        // at the later of this leader's clock and the committed time (which
        // stays ahead while an earlier leader's clock ran ahead of this one).
        let due = {
            let applied = ctx.state.read();
            let at = now.max(applied.state.now_ms);
            sweep_due(&applied.state, at, sweep, request.format_version)
        };
        if !due {
            continue;
        }
        match ctx
            .metrics
            .time_commit(ctx.raft.client_write(request))
            .await
        {
            Ok(response) => {
                if let Ok(Reply::Swept {
                    waits,
                    leases,
                    holds,
                    sessions,
                    pins,
                    stuck,
                }) = response.data.result
                {
                    ctx.metrics.swept("wait", waits.into());
                    ctx.metrics.swept("lease", leases.into());
                    ctx.metrics.swept("hold", holds.into());
                    ctx.metrics.swept("session", sessions.into());
                    ctx.metrics.swept("pin", pins.into());
                    ctx.metrics.swept("stuck_hold", stuck.into());
                    if holds > 0 || leases > 0 || pins > 0 || stuck > 0 {
                        tracing::info!(
                            waits,
                            leases,
                            holds,
                            sessions,
                            pins,
                            stuck,
                            "sweep expired or reported"
                        );
                    }
                }
            }
            Err(err) => {
                tracing::debug!(%err, "sweep not committed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

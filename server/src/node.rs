//! One running replica, wired: opens the store, starts openraft, builds the
//! replica core ([`crate::replica`]) and the handlers over it, serves gRPC
//! and HTTP, and starts the core's tasks (bootstrap, sweeper, ...).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
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
use crate::api::cluster::ClusterApi;
use crate::api::lease::LeaseApi;
use crate::api::lock::LockApi;
use crate::api::node::NodeApi;
use crate::api::pin::PinApi;
use crate::api::watch::WatchApi;
use crate::auth::Auth;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::raft::network::Network;
use crate::replica::peer_service::RaftApi;
use crate::replica::{Parts, Replica, Role, tasks};
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
        check_limits(&config, id)?;
        let (db, log_store, sm_store, metrics) = open_store(&config, id, &advertise).await?;
        let state = sm_store.handle();
        let cluster_id = state.cluster_id();
        let tls = load_tls(&config)?;
        let auth = Arc::new(match (&tls, &config.auth_tokens) {
            (Some(_), _) => Auth::Certificates,
            (None, Some(path)) => Auth::from_token_file(path)?,
            (None, None) => Auth::Open,
        });
        if let Auth::Tokens(_) = auth.as_ref() {
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
            id,
            dialer.clone(),
            peer_formats.clone(),
            config.raft_message_limit,
            metrics.clone(),
        );
        let raft = crate::raft::start(id, &config, network.clone(), log_store, sm_store).await?;

        let config = Arc::new(config);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let shutdown = Arc::new(shutdown);
        let core = Arc::new(Replica::new(Parts {
            id,
            addr: advertise.clone(),
            raft,
            state,
            db: Arc::downgrade(&db),
            config: config.clone(),
            metrics,
            shutdown: shutdown_rx.clone(),
            dialer,
            peer_formats,
            cluster_id,
        }));
        let ctx = Arc::new(Ctx::new(core.clone(), auth.clone()));
        if set.is_none() {
            tasks::bootstrap(&core, &advertise).await?;
        }

        let mut tasks = Vec::new();
        if let Some(tls) = &tls {
            tasks.push(tls.watch(config.tls_reload_interval));
        }
        tasks.push(serve_grpc(
            &ctx,
            RaftApi::new(core.clone(), auth),
            grpc,
            tls.clone(),
            wait_for(shutdown_rx.clone()),
        ));
        tasks.push(tokio::spawn(crate::http::serve(
            http,
            tls.clone(),
            ctx.clone(),
            wait_for(shutdown_rx.clone()),
        )));
        tasks.push(tokio::spawn(tasks::forget_departed_peers(
            core.clone(),
            network,
            shutdown_rx.clone(),
        )));
        tasks.push(tokio::spawn(tasks::claim_cluster_id(
            core.clone(),
            shutdown_rx.clone(),
        )));
        tasks.push(tokio::spawn(tasks::sweeper(core.clone(), shutdown_rx)));
        let (core_tx, core_stopped) = watch::channel(None);
        tasks.push(tokio::spawn(tasks::watch_core(
            core.clone(),
            shutdown.clone(),
            core_tx,
        )));
        if let Some(set) = set {
            let core = core.clone();
            tasks.push(tokio::spawn(async move {
                if let Err(err) = statefulset::join_or_bootstrap(&core, &set).await {
                    tracing::error!(%err, "cannot join the StatefulSet's cluster");
                }
                statefulset::keep_membership(&core, &set, core.config.scale_in_after).await;
            }));
        }

        tracing::info!(node_id = id, grpc = %grpc_addr, advertise, http = %http_addr, data_dir = %config.data_dir.display(), "tetherd replica started");
        Ok(Node {
            ctx,
            grpc_addr,
            http_addr,
            shutdown,
            core: core_stopped,
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
        self.ctx.core.id
    }

    /// The Raft handle (tests wait on its metrics).
    pub fn raft(&self) -> &Raft {
        self.ctx.core.raft_handle()
    }

    /// The replica core (state handle, config, metrics).
    pub fn core(&self) -> &Arc<Replica> {
        &self.ctx.core
    }

    /// The handlers' context (the core, authentication, open watches).
    pub fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// Clean shutdown: a leader first hands leadership to the most caught-up
    /// other voter (so clients see no election timeout), then the servers and
    /// Raft stop.
    pub async fn shutdown(self) {
        let core = &self.ctx.core;
        let leading = core.view().role == Role::Leader;
        if leading && let Some(target) = tasks::best_successor(core) {
            {
                match core.transfer_leader(target).await {
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
        let id = ctx.core.id;
        let _ = shutdown.send(true);
        ctx.core.stop_raft().await;
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

async fn wait_for(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Refuses limits that cannot work together.
fn check_limits(config: &Config, id: u64) -> anyhow::Result<()> {
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
    Ok(())
}

/// Opens (creating it if needed) the data directory's store, restoring
/// `--restore-from` into it when asked; the replica's counters record its
/// work.
async fn open_store(
    config: &Config,
    id: u64,
    advertise: &str,
) -> anyhow::Result<(
    Arc<rocksdb::DB>,
    store::LogStore,
    store::StateMachineStore,
    Arc<Metrics>,
)> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create data directory {}", config.data_dir.display()))?;
    let (db, log_store, mut sm_store) = store::open(&config.data_dir)
        .await
        .with_context(|| format!("cannot open the store in {}", config.data_dir.display()))?;
    let metrics = Arc::new(Metrics::default());
    sm_store.set_metrics(metrics.clone());
    let log_store = log_store.with_metrics(metrics.clone()).with_own_id(id);
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
            .restore_backup(&data, id, advertise)
            .with_context(|| format!("cannot restore {}", path.display()))?;
        log_store.start_after(last, id)?;
        tracing::info!(backup = %path.display(), index = last.index, "restored a backup as a one-member cluster");
    }
    Ok((db, log_store, sm_store, metrics))
}

/// The most metadata (HTTP/2 headers, decoded) one gRPC request may carry:
/// hyper's own default, named so that the docs and tests can say it. A
/// request a little over it is answered HTTP `431` on its own stream (gRPC
/// clients report "mapped from HTTP status code 431"); one over four times
/// it (h2's abuse limit) closes the connection with HTTP/2's
/// `ENHANCE_YOUR_CALM` and the debug data `header_list_way_too_large`.
pub const MAX_METADATA_BYTES: u32 = 16 * 1024;

/// Serves gRPC on `listener` until `stop`: every API the handlers serve
/// and the Raft service the other replicas call, behind the timing layer
/// and the cluster-id checks.
fn serve_grpc(
    ctx: &Arc<Ctx>,
    raft_api: RaftApi,
    listener: TcpListener,
    tls: Option<Arc<TlsMaterial>>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> JoinHandle<()> {
    let config = &ctx.core.config;
    let request_limit = config.max_request_bytes;
    // Every response names the cluster (`cluster_id`): clients refuse a
    // replica of another cluster than the one they have been using.
    let cluster_id = ctx.core.cluster_id.clone();
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
    let expected = ctx.core.cluster_id.clone();
    let check_cluster = tonic::service::InterceptorLayer::new(move |request: tonic::Request<()>| {
        crate::cluster_id::check_expected(&expected, request.metadata())?;
        Ok(request)
    });
    let server = tonic::transport::Server::builder()
        .http2_max_header_list_size(MAX_METADATA_BYTES)
        // Outermost: every call is timed, refused ones too.
        .layer(crate::metrics::GrpcTimingLayer(ctx.core.metrics.clone()))
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
            RaftServiceServer::new(raft_api)
                .max_decoding_message_size(config.raft_message_limit)
                .max_encoding_message_size(config.raft_message_limit),
        );
    let incoming = tether_tls::incoming(listener, tls);
    tokio::spawn(async move {
        if let Err(err) = server.serve_with_incoming_shutdown(incoming, stop).await {
            tracing::error!(%err, "gRPC server failed");
        }
    })
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

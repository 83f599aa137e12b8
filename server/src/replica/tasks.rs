//! What runs beside the handlers for as long as a replica does: the
//! leader's sweeper (wait deadlines, TTL leases, hold timeouts, sessions),
//! the cluster id's claim, the watch on Raft's core, the pruning of
//! departed peers' connections; and the bootstrap of a new cluster.

use openraft::async_runtime::WatchReceiver as _;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use openraft::{BasicNode, ServerState};
use tokio::sync::{broadcast, watch};

use super::Replica;
use crate::config::parse_members;
use crate::raft::network::Network;
use crate::sm::command::{Sweep, sweep_due};
use crate::sm::{Command, Event, EventKind, PodPhase, Reply};

/// Watches Raft's core. When it stops on its own, this replica can neither
/// replicate nor apply, yet its gRPC and HTTP servers would keep answering
/// (and its watches would wait forever for events that never come). So:
/// record why (for `/live`), end every watch and queued acquire with
/// `UNAVAILABLE` (the shutdown signal), and report it to the caller
/// ([`Node::core_stopped`]). An asked-for shutdown is not a stop.
pub async fn watch_core(
    core: Arc<Replica>,
    shutdown: Arc<watch::Sender<bool>>,
    stopped: watch::Sender<Option<String>>,
) {
    let mut metrics = core.raft.metrics();
    let reason = loop {
        if let Err(fatal) = &metrics.borrow_and_update().running_state {
            break fatal.to_string();
        }
        if metrics.changed().await.is_err() {
            // The core task is gone without a last report: it panicked.
            break "the Raft core task ended without a report (panicked)".to_string();
        }
    };
    if *core.shutdown.borrow() {
        return;
    }
    tracing::error!(
        node_id = core.id,
        reason,
        "the Raft core stopped: this replica cannot serve; ending its watches and exiting so that \
         it is restarted and recovers from its data directory"
    );
    let _ = core.core_stopped.set(reason.clone());
    let _ = shutdown.send(true);
    let _ = stopped.send(Some(reason));
}

/// Initializes a new cluster if this replica has no Raft state yet and has
/// the lowest id among the initial members; otherwise it waits to be
/// contacted (by the bootstrapping replica, or by AddLearner).
pub async fn bootstrap(core: &Replica, advertise: &str) -> anyhow::Result<()> {
    let members: BTreeMap<u64, String> = match &core.config.initial_members {
        Some(text) => parse_members(text).map_err(|e| anyhow::anyhow!("--initial-members: {e}"))?,
        None => BTreeMap::from([(core.id, advertise.to_string())]),
    };
    if core.raft.is_initialized().await? {
        tracing::info!("existing Raft state found; --initial-members is ignored");
        return Ok(());
    }
    let lowest = *members
        .keys()
        .next()
        .expect("parse_members refuses an empty list");
    if lowest != core.id {
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
    core.raft
        .initialize(nodes)
        .await
        .context("cannot initialize the cluster")?;
    Ok(())
}

/// The voter other than this one with the highest replicated index.
pub fn best_successor(core: &Replica) -> Option<u64> {
    let m = core.raft.metrics().borrow_watched().clone();
    let replication = m.replication.clone().unwrap_or_default();
    m.membership_config
        .membership()
        .voter_ids()
        .filter(|id| *id != core.id)
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
pub async fn forget_departed_peers(
    core: Arc<Replica>,
    network: Network,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(FORGET_DEPARTED_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checked = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let membership = core
            .raft
            .metrics()
            .borrow_watched()
            .membership_config
            .clone();
        if checked.as_ref() == Some(membership.log_id()) {
            continue;
        }
        network.forget_departed(membership.membership().nodes());
        checked = Some(*membership.log_id());
    }
}

/// As leader, gives the cluster its id when none is applied yet: right
/// after the cluster was initialized, or once on a cluster an older build
/// started. The id goes through the log ([`crate::cluster_id`]), so all
/// members take the same one even if two leaders in a row each propose
/// one.
pub async fn claim_cluster_id(core: Arc<Replica>, mut shutdown: watch::Receiver<bool>) {
    let mut metrics = core.raft.metrics();
    loop {
        let leading = metrics.borrow_and_update().state == ServerState::Leader;
        if leading && core.cluster_id.get().is_none() {
            let id = crate::cluster_id::draw();
            let command = Command::Audit(crate::sm::command::Audit {
                identity: "tetherd".into(),
                action: crate::cluster_id::AUDIT_ACTION.into(),
                detail: id.clone(),
            });
            match core.write(None, command).await {
                Ok(_) => tracing::info!(
                    proposed = id,
                    cluster_id = core.cluster_id.get(),
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

/// How long after a stop with nothing due yet the sweeper looks once more.
const STOP_RECHECK: Duration = Duration::from_millis(2);

/// Whether `kind` stops a pod: the pins it owns may then be due at once
/// (a device claim outlives its pod by 1 ms, `tether_embed`'s
/// `DEFAULT_LIFETIME`).
fn stops_a_pod(kind: &EventKind) -> bool {
    matches!(
        kind,
        EventKind::PodRevoked { .. }
            | EventKind::PodReported {
                phase: PodPhase::Terminal | PodPhase::Gone,
                ..
            }
    )
}

/// Waits for the next applied event that stops a pod, then takes every
/// event already queued behind it (so a burst of stops is one look, and at
/// most one sweep). A lagged receiver counts as a stop; a closed one never
/// wakes.
async fn next_stop(events: &mut broadcast::Receiver<Event>) {
    loop {
        match events.recv().await {
            Ok(event) if stops_a_pod(&event.kind) => break,
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(_)) => break,
            Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
        }
    }
    while let Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) = events.try_recv() {}
}

/// While this replica leads, proposes a [`Sweep`] whenever its applied state
/// shows a wait, lease, hold or session due on the leader's clock: looked
/// for every `sweep_interval`, and at once when a pod stops, so that the
/// pins of a deleted pod (a GPU's claim) end within a commit of the
/// bridge's report instead of up to an interval later (issue 52's churn:
/// the next pod waited 78 ms at the median for a freed GPU, most of it
/// this interval).
pub async fn sweeper(core: Arc<Replica>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(core.config.sweep_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leading_since: Option<(u64, Instant)> = None;
    let mut events = core.state.subscribe();
    // A look due soon after a stop that found nothing due yet: the stopped
    // pod's 1 ms lifetime runs from the report's committed time, which may
    // be less than 1 ms before the look.
    let mut recheck: Option<tokio::time::Instant> = None;
    loop {
        let after_stop = tokio::select! {
            _ = tick.tick() => false,
            () = next_stop(&mut events) => true,
            () = async {
                match recheck {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => false,
            _ = shutdown.changed() => return,
        };
        recheck = None;
        let (state, term) = {
            let m = core.raft.metrics();
            let m = m.borrow_watched();
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
            hold_timeout_ms: core.config.hold_timeout.as_millis() as u64,
            scope_hold_timeout_ms: core
                .config
                .scope_hold_timeouts
                .iter()
                .map(|(scope, d)| (scope.clone(), d.as_millis() as u64))
                .collect(),
            session_idle_ms: core.config.session_idle.as_millis() as u64,
            node_tombstone_ms: core.config.node_tombstone.as_millis() as u64,
        };
        let now = core.clock.stamp(term);
        // Format 6 (grants after all ends, forgets unreferenced pods), or
        // an older one during a rolling upgrade: see `Replica::request`.
        let request = core.request(None, now, Command::Sweep(sweep));
        let Command::Sweep(sweep) = &request.command else {
            unreachable!("a sweep was built")
        };
        // Due on committed time, as apply will judge it: the entry applies
        // at the later of this leader's clock and the committed time (which
        // stays ahead while an earlier leader's clock ran ahead of this one).
        let due = {
            let applied = core.state.read();
            let at = now.max(applied.state.now_ms);
            sweep_due(&applied.state, at, sweep, request.format_version)
        };
        if !due {
            if after_stop {
                recheck = Some(tokio::time::Instant::now() + STOP_RECHECK);
            }
            continue;
        }
        match core
            .metrics
            .time_commit(super::commit::commit(&core.raft, request))
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
                    core.metrics.swept("wait", waits.into());
                    core.metrics.swept("lease", leases.into());
                    core.metrics.swept("hold", holds.into());
                    core.metrics.swept("session", sessions.into());
                    core.metrics.swept("pin", pins.into());
                    core.metrics.swept("stuck_hold", stuck.into());
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

//! Running as a member of a Kubernetes StatefulSet (`--statefulset`): no
//! hand-made member list, the pod's ordinal decides.
//!
//! - **Identity.** The pod's hostname is `<set>-<ordinal>`. Its Raft node id
//!   is drawn at random the first time it starts with an empty data
//!   directory and kept there (`node-id`), so a pod restarted with its
//!   volume rejoins as itself, and a pod whose volume was lost comes back
//!   as a new member: ids are never reused.
//! - **Addresses.** Peers are reached at `--peer-template` with `{ordinal}`
//!   replaced (default `<set>-{ordinal}.<set>-peers:<port>`, the headless
//!   service's per-pod names); this replica advertises its own.
//! - **Bootstrap.** An empty replica asks ordinals 0..`--probe-ordinals` for
//!   a leader. Found: it joins — added as a learner (the call returns once
//!   it has caught up), then promoted to voter in the same membership change
//!   that removes any older member with its address (its former self, whose
//!   volume was lost). Not found: a new cluster starts only when ordinal 0
//!   sees every ordinal of the set's expected size (`--bootstrap-expect`,
//!   Consul's rule) answer with no Raft state at all; it then initializes
//!   the cluster with all of them as voters. Any peer with data means a
//!   cluster exists whose leader is not elected yet (a whole-set restart,
//!   peers still attaching their volumes): nobody initializes, the empty
//!   replicas wait to be added. So a lost volume, however slow its peers
//!   are to come back, never starts a second cluster beside the first.
//!
//! - **Scale in.** The leader removes voters unreachable for
//!   `--scale-in-after` that hold the highest ordinals (a StatefulSet scales
//!   in from the top); a removed replica that comes back (scaled out again
//!   with its old volume, or only cut off) notices and joins again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use crate::raft::dial::PeerDialer;
use anyhow::Context;
use tether_proto as pb;
use tether_proto::cluster_service_client::ClusterServiceClient;

use crate::replica::Replica;

/// File in the data directory holding this replica's node id.
const NODE_ID_FILE: &str = "node-id";

/// `tether-3` -> 3.
pub fn ordinal_from_hostname(hostname: &str) -> Option<u32> {
    let (_, ordinal) = hostname.rsplit_once('-')?;
    ordinal.parse().ok()
}

/// `tether-3` -> `tether`.
pub fn set_name(hostname: &str) -> Option<&str> {
    hostname.rsplit_once('-').map(|(set, _)| set)
}

/// The default template: the headless service `<set>-peers` in the same
/// namespace, at this replica's gRPC port.
pub fn default_template(hostname: &str, port: u16) -> Option<String> {
    Some(format!(
        "{}-{{ordinal}}.{}-peers:{port}",
        set_name(hostname)?,
        set_name(hostname)?
    ))
}

/// A peer's address from the template.
pub fn peer_address(template: &str, ordinal: u32) -> String {
    template.replace("{ordinal}", &ordinal.to_string())
}

/// The node id kept in `data_dir`, drawn and stored on first use. Ids are
/// random below 2^53 (JSON-safe), never 0.
pub fn node_id(data_dir: &Path) -> anyhow::Result<u64> {
    let path = data_dir.join(NODE_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => text
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|id| *id > 0)
            .with_context(|| format!("{} does not hold a node id: {text:?}", path.display())),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(data_dir)?;
            let id = (crate::cluster_id::random_u64() & ((1 << 53) - 1)).max(1);
            // Synced before the rename and the directory after it: the
            // replica may join the cluster under this id at once, and a
            // power cut must not leave the file empty or gone (LazyFS
            // found it empty: the rename kept, the unsynced data lost).
            let tmp = path.with_extension("tmp");
            let mut file = std::fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut file, format!("{id}\n").as_bytes())?;
            file.sync_all()?;
            drop(file);
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(data_dir)?.sync_all()?;
            Ok(id)
        }
        Err(err) => Err(err).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// How this replica finds the others.
#[derive(Debug, Clone)]
pub struct Membership {
    /// This pod's ordinal.
    pub ordinal: u32,
    /// Peer address template (`{ordinal}`).
    pub template: String,
    /// The set's size: ordinals 0..expect must all answer, empty, before
    /// a new cluster starts.
    pub expect: u32,
    /// Ordinals asked for a leader (at least `expect`).
    pub probe: u32,
}

/// How long a status probe of another replica may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long each call of a join may take (adding a learner returns once it
/// has caught up).
const JOIN_CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// A cluster-service client of `addr`, on the channel the replica's
/// [`PeerDialer`] keeps for it; each call is bounded by its caller.
fn cluster_client(
    dialer: &PeerDialer,
    addr: &str,
) -> anyhow::Result<ClusterServiceClient<tonic::transport::Channel>> {
    let channel = dialer
        .channel(addr)
        .with_context(|| format!("{addr:?} is not an address that can be dialed"))?;
    Ok(ClusterServiceClient::new(channel))
}

/// `call`'s answer, or an error naming `what` if it fails or takes longer
/// than `timeout`.
async fn bounded<T>(
    what: &str,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(anyhow::anyhow!("{what}: {status}")),
        Err(_) => Err(anyhow::anyhow!("{what}: no answer within {timeout:?}")),
    }
}

/// `addr`'s status.
async fn status_of(addr: &str, dialer: &PeerDialer) -> Option<pb::StatusResponse> {
    let mut client = cluster_client(dialer, addr).ok()?;
    bounded("Status", PROBE_TIMEOUT, client.status(pb::StatusRequest {}))
        .await
        .ok()
}

/// Asks `addr` for its status; the leader's address when it knows one.
async fn leader_of(addr: &str, dialer: &PeerDialer) -> Option<(String, pb::StatusResponse)> {
    let status = status_of(addr, dialer).await?;
    if status.role == "leader" {
        return Some((addr.to_string(), status));
    }
    if status.leader_addr.is_empty() {
        return None;
    }
    let leader = status.leader_addr.clone();
    let status = status_of(&leader, dialer).await?;
    (status.role == "leader").then_some((leader, status))
}

/// Joins through the leader at `leader`: learner first (returns once caught
/// up), then voter, replacing any older member at this address.
async fn join(core: &Replica, leader: &str, status: &pb::StatusResponse) -> anyhow::Result<()> {
    let mut client = cluster_client(&core.dialer, leader)?;
    if !status.members.iter().any(|m| m.node_id == core.id) {
        tracing::info!(leader, "joining as a learner");
        let learner = pb::AddLearnerRequest {
            node_id: core.id,
            addr: core.addr.clone(),
            blocking: true,
        };
        bounded("AddLearner", JOIN_CALL_TIMEOUT, client.add_learner(learner)).await?;
    }
    let status = bounded(
        "Status",
        JOIN_CALL_TIMEOUT,
        client.status(pb::StatusRequest {}),
    )
    .await?;
    let stale: BTreeSet<u64> = status
        .members
        .iter()
        .filter(|m| m.addr == core.addr && m.node_id != core.id)
        .map(|m| m.node_id)
        .collect();
    // Made a voter by the cluster's initialization (or an earlier join that
    // only lost its answer), with no former self to remove: done.
    if stale.is_empty()
        && status
            .members
            .iter()
            .any(|m| m.node_id == core.id && m.voter)
    {
        return Ok(());
    }
    let mut voters: BTreeSet<u64> = status
        .members
        .iter()
        .filter(|m| m.voter && !stale.contains(&m.node_id))
        .map(|m| m.node_id)
        .collect();
    voters.insert(core.id);
    tracing::info!(?voters, replaced = ?stale, "promoting to voter");
    // Stale voters leave with this change (they are not kept as learners).
    let promote = pb::ChangeMembershipRequest {
        voters: voters.into_iter().collect(),
        retain_as_learners: false,
        remove_learners: vec![],
    };
    bounded(
        "promoting to voter",
        JOIN_CALL_TIMEOUT,
        client.change_membership(promote),
    )
    .await?;
    // A stale learner (its volume lost before it was promoted) is removed
    // on its own.
    let stale_learners: Vec<u64> = status
        .members
        .iter()
        .filter(|m| !m.voter && stale.contains(&m.node_id))
        .map(|m| m.node_id)
        .collect();
    if !stale_learners.is_empty() {
        let remove = pb::ChangeMembershipRequest {
            voters: vec![],
            retain_as_learners: false,
            remove_learners: stale_learners,
        };
        bounded(
            "removing a stale learner",
            JOIN_CALL_TIMEOUT,
            client.change_membership(remove),
        )
        .await?;
    }
    Ok(())
}

/// Brings an empty replica into the set's cluster, or starts the cluster
/// ([`bootstrap_step`]). Returns once this replica is a voter or the
/// cluster was initialized; retries until then. A replica with Raft state
/// returns at once ([`keep_membership`] takes it from there).
pub async fn join_or_bootstrap(core: &Replica, set: &Membership) -> anyhow::Result<()> {
    if core.is_initialized().await? {
        tracing::info!("existing Raft state: rejoining as node {}", core.id);
        return Ok(());
    }
    let mut last_wait = String::new();
    loop {
        if *core.shutdown.borrow() {
            return Ok(());
        }
        // Initialized by ordinal 0 (with this replica among the voters),
        // or added by a leader while this loop slept.
        if core.is_initialized().await? && is_voter(core) {
            return Ok(());
        }
        let answers = survey(set, &core.dialer).await;
        let leader = match answers.values().find_map(leader_hint) {
            Some(addr) => leader_of(&addr, &core.dialer).await,
            None => None,
        };
        if let Some((leader, status)) = leader {
            match join(core, &leader, &status).await {
                Ok(()) => return Ok(()),
                Err(err) => {
                    tracing::warn!(err = format!("{err:#}"), leader, "joining failed; retrying")
                }
            }
        } else {
            let me = PeerView {
                node_id: core.id,
                addr: core.addr.clone(),
                has_raft_state: core.is_initialized().await?,
            };
            let views: BTreeMap<u32, PeerView> = answers
                .iter()
                .map(|(ordinal, status)| (*ordinal, PeerView::from(status)))
                .collect();
            match bootstrap_step(set, &me, &views) {
                Step::Initialize(members) => {
                    tracing::info!(
                        voters = ?members.keys().collect::<Vec<_>>(),
                        "all {} expected replicas answer and none has data: ordinal 0 \
                         initializes a new cluster with all of them as voters",
                        set.expect
                    );
                    // Not initialized: Raft state appeared since the survey
                    // (a peer's vote request), someone else started it.
                    if core.initialize(members).await? {
                        return Ok(());
                    }
                }
                Step::Wait(why) => {
                    // Said once per change, not every second.
                    if why != last_wait {
                        tracing::info!("{why}");
                        last_wait = why;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The statuses of the other ordinals that answer (0..`probe`).
async fn survey(set: &Membership, dialer: &PeerDialer) -> BTreeMap<u32, pb::StatusResponse> {
    let mut answers = BTreeMap::new();
    for ordinal in (0..set.probe).filter(|o| *o != set.ordinal) {
        if let Some(status) = status_of(&peer_address(&set.template, ordinal), dialer).await {
            answers.insert(ordinal, status);
        }
    }
    answers
}

/// The leader, asked through the other ordinals.
async fn find_leader(
    set: &Membership,
    dialer: &PeerDialer,
) -> Option<(String, pb::StatusResponse)> {
    for ordinal in (0..set.probe).filter(|o| *o != set.ordinal) {
        if let Some(leader) = leader_of(&peer_address(&set.template, ordinal), dialer).await {
            return Some(leader);
        }
    }
    None
}

/// Where `status` says the leader is: itself, or the leader it names.
fn leader_hint(status: &pb::StatusResponse) -> Option<String> {
    if status.role == "leader" {
        Some(status.addr.clone())
    } else {
        (!status.leader_addr.is_empty()).then(|| status.leader_addr.clone())
    }
}

/// What bootstrap needs of a replica's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerView {
    /// Its Raft node id.
    pub node_id: u64,
    /// The address it advertises.
    pub addr: String,
    /// Whether it has a log, a snapshot or a vote.
    pub has_raft_state: bool,
}

impl From<&pb::StatusResponse> for PeerView {
    fn from(status: &pb::StatusResponse) -> Self {
        Self {
            node_id: status.node_id,
            addr: status.addr.clone(),
            has_raft_state: status.has_raft_state,
        }
    }
}

/// What an empty replica that found no leader does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Initialize a new cluster with these voters.
    Initialize(BTreeMap<u64, String>),
    /// Keep asking; the reason, for the log.
    Wait(String),
}

/// The bootstrap rule for `me`, an empty replica that found no leader,
/// given the peers that answered (ordinal -> status): only ordinal 0 ever
/// initializes, only when every ordinal in 0..`expect` answered and none
/// has Raft state, and then with all of them as voters. A peer with Raft
/// state means a cluster exists (its leader not elected yet): wait to be
/// added, whatever else is seen.
pub fn bootstrap_step(set: &Membership, me: &PeerView, answers: &BTreeMap<u32, PeerView>) -> Step {
    if let Some((ordinal, _)) = answers.iter().find(|(_, peer)| peer.has_raft_state) {
        return Step::Wait(format!(
            "ordinal {ordinal} has data of an existing cluster: waiting for that cluster's \
             leader to add this replica (a new cluster never starts beside it)"
        ));
    }
    if me.has_raft_state {
        return Step::Wait("this replica has Raft state: waiting for a leader".into());
    }
    if set.ordinal != 0 {
        return Step::Wait(
            "no leader yet: waiting for ordinal 0 to start the cluster, or for a leader to \
             add this replica"
                .into(),
        );
    }
    let missing: Vec<u32> = (1..set.expect)
        .filter(|ordinal| !answers.contains_key(ordinal))
        .collect();
    if !missing.is_empty() {
        return Step::Wait(format!(
            "no leader, and ordinals {missing:?} do not answer: a new cluster starts only \
             when all {} expected replicas (--bootstrap-expect) answer and none has data",
            set.expect
        ));
    }
    let mut members = BTreeMap::new();
    members.insert(me.node_id, me.addr.clone());
    for (_, peer) in answers.range(1..set.expect) {
        members.insert(peer.node_id, peer.addr.clone());
    }
    Step::Initialize(members)
}

/// How often membership is looked after.
const KEEP_INTERVAL: Duration = Duration::from_secs(2);

/// Runs for the replica's life after [`join_or_bootstrap`]:
/// - a replica asks the leader (found through the others when it knows
///   none) whether it is a voter; if not (it was removed while down, e.g.
///   scaled in and now scaled out again with its old volume, or its
///   promotion was cut short), it joins again;
/// - the leader removes voters that have been unreachable for
///   `scale_in_after` (zero: never) when they hold the highest ordinals of
///   the set — a StatefulSet scales in from the top, so that is a scale-in.
///   Removing a member that is down never costs availability; one that was
///   only cut off rejoins by the first rule when it is back.
pub async fn keep_membership(core: &Replica, set: &Membership, scale_in_after: Duration) {
    let mut leaderless_since: Option<tokio::time::Instant> = None;
    let mut down_since: std::collections::BTreeMap<u64, tokio::time::Instant> = Default::default();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(KEEP_INTERVAL) => {}
            _ = wait_shutdown(core) => return,
        }
        let (leader_addr, is_leader) = {
            let view = core.view();
            (view.leader_addr, view.leader_id == Some(core.id))
        };
        if is_leader {
            leaderless_since = None;
            if !scale_in_after.is_zero() {
                scale_in(core, set, scale_in_after, &mut down_since).await;
            }
            continue;
        }
        down_since.clear();
        // What this replica believes (a leader, itself a member) can be
        // stale: one removed while it was down restarts with the old
        // configuration and the old leader's vote. Ask the leader.
        let asked = match &leader_addr {
            Some(addr) => leader_of(addr, &core.dialer).await,
            None => None,
        };
        let asked = match asked {
            Some(found) => {
                leaderless_since = None;
                Some(found)
            }
            None => {
                let since = *leaderless_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() < KEEP_INTERVAL * 3 {
                    continue;
                }
                find_leader(set, &core.dialer).await
            }
        };
        // Not a voter: removed while away, or added as a learner whose
        // promotion was cut short (e.g. by a leader change) — join() adds
        // it if needed and promotes it.
        if let Some((addr, status)) = asked
            && !status
                .members
                .iter()
                .any(|m| m.node_id == core.id && m.voter)
        {
            tracing::info!(leader = addr, "not a voter: joining again");
            if let Err(err) = join(core, &addr, &status).await {
                tracing::warn!(err = format!("{err:#}"), "joining again failed; retrying");
            }
        }
    }
}

async fn wait_shutdown(core: &Replica) {
    let mut rx = core.shutdown.clone();
    while !*rx.borrow() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Whether `addr` answers as node `id`.
async fn answers_as(addr: &str, id: u64, dialer: &PeerDialer) -> bool {
    status_of(addr, dialer)
        .await
        .is_some_and(|s| s.node_id == id)
}

/// The leader's half of [`keep_membership`].
async fn scale_in(
    core: &Replica,
    set: &Membership,
    after: Duration,
    down_since: &mut std::collections::BTreeMap<u64, tokio::time::Instant>,
) {
    let voters: Vec<(u64, String)> = {
        let view = core.view();
        view.members
            .into_iter()
            .filter(|m| m.voter)
            .map(|m| (m.id, m.addr))
            .collect()
    };
    let ordinal_of = |addr: &str| (0..set.probe).find(|o| peer_address(&set.template, *o) == addr);
    let mut highest_up = set.ordinal;
    for (id, addr) in &voters {
        if *id == core.id {
            continue;
        }
        if answers_as(addr, *id, &core.dialer).await {
            down_since.remove(id);
            if let Some(ordinal) = ordinal_of(addr) {
                highest_up = highest_up.max(ordinal);
            }
        } else {
            down_since
                .entry(*id)
                .or_insert_with(tokio::time::Instant::now);
        }
    }
    down_since.retain(|id, _| voters.iter().any(|(v, _)| v == id));
    let leaving: BTreeSet<u64> = voters
        .iter()
        .filter(|(id, addr)| {
            down_since.get(id).is_some_and(|t| t.elapsed() >= after)
                && ordinal_of(addr).is_some_and(|o| o > highest_up)
        })
        .map(|(id, _)| *id)
        .collect();
    if leaving.is_empty() {
        return;
    }
    let remaining: BTreeSet<u64> = voters
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| !leaving.contains(id))
        .collect();
    tracing::info!(
        ?leaving,
        ?remaining,
        "scale-in: removing the highest ordinals, down for {after:?}"
    );
    match core.change_voters(&remaining, false).await {
        Ok(_) => {
            for id in &leaving {
                down_since.remove(id);
            }
        }
        Err(err) => tracing::warn!(%err, "scale-in membership change failed; retrying"),
    }
}

fn is_voter(core: &Replica) -> bool {
    core.view().is_voter(core.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_templates_and_ids() {
        assert_eq!(ordinal_from_hostname("tether-12"), Some(12));
        assert_eq!(ordinal_from_hostname("my-tether-0"), Some(0));
        assert_eq!(ordinal_from_hostname("tether"), None);
        assert_eq!(ordinal_from_hostname("tether-x"), None);
        assert_eq!(
            default_template("tether-2", 7420).as_deref(),
            Some("tether-{ordinal}.tether-peers:7420")
        );
        assert_eq!(peer_address("tether-{ordinal}.p:1", 4), "tether-4.p:1");
        let dir = tempfile::tempdir().unwrap();
        let id = node_id(dir.path()).unwrap();
        assert!(id > 0 && id < (1 << 53));
        assert_eq!(node_id(dir.path()).unwrap(), id, "kept across restarts");
        std::fs::write(dir.path().join(NODE_ID_FILE), "zero\n").unwrap();
        assert!(node_id(dir.path()).is_err());
    }

    fn set(ordinal: u32, expect: u32) -> Membership {
        Membership {
            ordinal,
            template: "tether-{ordinal}:7420".into(),
            expect,
            probe: 16,
        }
    }

    fn view(id: u64, has_raft_state: bool) -> PeerView {
        PeerView {
            node_id: id,
            addr: format!("tether-{}:7420", id - 100),
            has_raft_state,
        }
    }

    fn answers(peers: &[(u32, bool)]) -> BTreeMap<u32, PeerView> {
        peers
            .iter()
            .map(|(ordinal, data)| (*ordinal, view(100 + u64::from(*ordinal), *data)))
            .collect()
    }

    #[test]
    fn ordinal_0_initializes_only_when_every_expected_replica_answers_empty() {
        let me = view(100, false);
        // All three answer, none has data: one cluster of all three.
        let Step::Initialize(members) =
            bootstrap_step(&set(0, 3), &me, &answers(&[(1, false), (2, false)]))
        else {
            panic!("all expected replicas answered empty");
        };
        let voters: Vec<(u64, String)> = members
            .iter()
            .map(|(id, addr)| (*id, addr.clone()))
            .collect();
        assert_eq!(
            voters,
            [
                (100, "tether-0:7420".to_string()),
                (101, "tether-1:7420".to_string()),
                (102, "tether-2:7420".to_string())
            ]
        );
        // One of them silent: wait, however long it takes (a whole-set
        // restart whose peers attach their volumes slowly).
        let Step::Wait(why) = bootstrap_step(&set(0, 3), &me, &answers(&[(1, false)])) else {
            panic!("ordinal 2 did not answer");
        };
        assert!(why.contains("[2]"), "{why}");
        // Nobody answers: wait (the old rule started a cluster here).
        assert!(matches!(
            bootstrap_step(&set(0, 3), &me, &BTreeMap::new()),
            Step::Wait(_)
        ));
        // A peer with data: a cluster exists, never start another, even
        // when everyone answers (two volumes lost, one kept).
        for peers in [
            &[(1, true), (2, false)][..],
            &[(1, false), (2, true)],
            &[(1, false), (2, false), (5, true)],
        ] {
            let Step::Wait(why) = bootstrap_step(&set(0, 3), &me, &answers(peers)) else {
                panic!("{peers:?}: a peer has data");
            };
            assert!(why.contains("has data"), "{why}");
        }
        // Only ordinal 0 initializes.
        assert!(matches!(
            bootstrap_step(
                &set(1, 3),
                &view(101, false),
                &answers(&[(0, false), (2, false)])
            ),
            Step::Wait(_)
        ));
        // A set of one starts alone; extra answering ordinals (scaled out
        // since) are not made voters of the new cluster.
        let Step::Initialize(alone) = bootstrap_step(&set(0, 1), &me, &answers(&[(3, false)]))
        else {
            panic!("a set of one starts at once");
        };
        assert_eq!(alone.keys().collect::<Vec<_>>(), [&100]);
    }
}

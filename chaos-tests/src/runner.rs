//! Runs one fault schedule against a cluster: starts the workload, drives the
//! faults, heals everything, waits for the replicas to converge, collects
//! the event log of every key the run touched, and runs the checkers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tether_client::{Client, proto as pb};

use crate::checkers::{self, Evidence};
use crate::cluster::ProcessCluster;
use crate::history::{History, Outcome};
use crate::proxy::LinkMode;
use crate::rng::Rng;
use crate::schedule::{Fault, Schedule, Target};
use crate::workers::{self, Shadow, Shared};

/// Workload shape of a run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Locks driven by try-acquire (checked for linearizability).
    pub try_locks: usize,
    /// Workers on them.
    pub try_workers: usize,
    /// Workers queueing on one lock.
    pub queue_workers: usize,
    /// Lease workers (three pods each), each on a lease lock of its own.
    pub lease_workers: usize,
    /// Enders (two pods each): holds ended by node-gone, force release and
    /// hold timeout.
    pub enders: usize,
    /// Retry storms (a stormer and a forger each), each on a lock of its
    /// own.
    pub storms: usize,
    /// Abandoners (three pods each): queued callers that go away, and come
    /// back.
    pub abandoners: usize,
    /// Lease keepers (two pods each): holds on leases kept alive.
    pub keepers: usize,
    /// Claimers (three pods a round): device claims corrected by `Reclaim`.
    pub claimers: usize,
    /// Retriers (three pods a round): a pod's second attempt through
    /// another client takes its hold over; the first leaves.
    pub retriers: usize,
    /// The session flooder (clusters with tokens only).
    pub session_flood: bool,
    /// TTL of the lease workers' leases: the replicas' shortest.
    pub lease_ttl: Duration,
    /// Pins placed with one-per-node anti-affinity.
    pub pins: usize,
    /// Rounds of the pin lifetime worker (assign, stop the owner, expire).
    pub pin_lifetime_rounds: usize,
    /// Time budget of each linearizability search.
    pub search_budget: Duration,
    /// How long faults may take to heal and the cluster to converge.
    pub converge_within: Duration,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            try_locks: 2,
            try_workers: 3,
            queue_workers: 3,
            lease_workers: 2,
            enders: 1,
            storms: 1,
            abandoners: 1,
            keepers: 1,
            claimers: 1,
            retriers: 1,
            session_flood: true,
            // 3 x the chaos clusters' election timeout upper bound (2 x
            // 300 ms), the shortest TTL a replica grants.
            lease_ttl: Duration::from_millis(1800),
            pins: 6,
            pin_lifetime_rounds: 3,
            search_budget: Duration::from_secs(10),
            converge_within: Duration::from_secs(60),
        }
    }
}

/// What one schedule did and found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The schedule, printed.
    pub schedule: String,
    /// Operations recorded.
    pub ops: usize,
    /// Of which unknown (timeouts, lost answers).
    pub unknown: usize,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Failpoint crashes that fired.
    pub crashes_fired: u64,
    /// Replicas restarted after their Raft core stopped (they exit then).
    pub core_restarts: u64,
    /// Violations by checker.
    pub violations: BTreeMap<&'static str, Vec<String>>,
    /// Locks whose linearizability search ran out of budget.
    pub undecided: Vec<String>,
    /// Watch re-lists (compaction) seen.
    pub relists: u64,
    /// Operations by call and outcome, e.g. "acquire ok-granted".
    pub outcomes: BTreeMap<String, u64>,
    /// Whether some replica had the run's whole event log (one that
    /// caught up by snapshot lacks the events before it); when none did,
    /// the checkers that read the log were skipped.
    pub events_complete: bool,
    /// Raft terms that passed during the run (elections).
    pub elections: u64,
    /// Where the time went: (phase, duration).
    pub phases: Vec<(&'static str, Duration)>,
    /// The worker whose stop ended the wind-down, and when it stopped
    /// (workers finish their round before they stop).
    pub slowest_to_stop: (&'static str, Duration),
    /// Times for a lock due to move on to reach its next waiter
    /// (`progress`), faults or not.
    pub recoveries: Vec<Duration>,
    /// Recoveries the `progress` bound was judged on.
    pub recoveries_judged: u64,
    /// Those that came: due (or the nearby fault's heal) to grant
    /// (`progress::judged_times`).
    pub judged_times: Vec<Duration>,
    /// When something was found: the run's evidence, printed in full, for
    /// the driver to keep beside the replicas' logs.
    pub evidence_dump: Option<String>,
    /// When the progress checker found something: the operations and
    /// events of each lock it names, short enough to print (a CI log is
    /// all that is left of a CI run).
    pub progress_digest: Option<String>,
}

impl Report {
    /// Total violations.
    pub fn violation_count(&self) -> usize {
        self.violations.values().map(Vec::len).sum()
    }
}

/// Faults in force, to heal.
#[derive(Default)]
struct Damage {
    stopped: BTreeSet<u64>,
    armed: BTreeSet<u64>,
    /// Replicas whose clock was stepped while they ran (`ClockStep`).
    clock_stepped: BTreeSet<u64>,
    /// Failpoint crashes seen outside `heal`.
    fired: u64,
    /// Replicas that exited because their Raft core stopped, restarted as
    /// Kubernetes would restart them.
    core_restarts: u64,
}

fn leader_or_any(leader: Option<u64>, live: &[u64]) -> Option<u64> {
    leader.or_else(|| live.first().copied())
}

fn pick_target(target: Target, leader: Option<u64>, live: &[u64]) -> Option<u64> {
    match target {
        Target::Leader => leader_or_any(leader, live),
        Target::Follower(n) => {
            let followers: Vec<u64> = live
                .iter()
                .copied()
                .filter(|id| Some(*id) != leader)
                .collect();
            (!followers.is_empty()).then(|| followers[(n as usize) % followers.len()])
        }
    }
}

/// A random minority of `ids` (at least one) and the rest, by `pick`.
fn split_minority(ids: &[u64], pick: u64) -> (Vec<u64>, Vec<u64>) {
    let mut rng = Rng::new(pick);
    let mut ids = ids.to_vec();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let minority = rng.between(1, ((ids.len() as u64).saturating_sub(1) / 2).max(1));
    let rest = ids.split_off(minority as usize);
    (ids, rest)
}

/// Starts one fault; returns whether it was injected.
async fn inject(
    cluster: &mut ProcessCluster,
    control: &Client,
    fault: &Fault,
    lasts: Duration,
    damage: &mut Damage,
) -> anyhow::Result<bool> {
    let leader = cluster.leader(control).await.map(|s| s.node_id);
    let live = cluster.live();
    let voters: Vec<u64> = {
        let v = cluster.voters(control).await;
        if v.is_empty() { live.clone() } else { v }
    };
    match fault {
        Fault::Partition { pick } => {
            let (a, b) = split_minority(&voters, *pick);
            cluster.partition(&a, &b);
        }
        Fault::PowerLoss { pick } => {
            let (cut, _) = split_minority(&voters, *pick);
            for id in cut {
                cluster.power_cut(id)?;
                damage.stopped.insert(id);
            }
        }
        Fault::PowerLossAll => {
            // Every replica that runs, voters or not, at once.
            for id in cluster.running() {
                cluster.power_cut(id)?;
                damage.stopped.insert(id);
            }
        }
        Fault::IsolateLeader => {
            let Some(leader) = leader else {
                return Ok(false);
            };
            let rest: Vec<u64> = cluster
                .running()
                .into_iter()
                .filter(|id| *id != leader)
                .collect();
            cluster.partition(&[leader], &rest);
        }
        Fault::OneWay { pick } => {
            let mut rng = Rng::new(*pick);
            let from = *rng.pick(&voters);
            for to in cluster.running() {
                if to != from {
                    cluster.set_link(from, to, LinkMode::Blackhole);
                }
            }
        }
        Fault::Delay { target, millis } => {
            let Some(id) = pick_target(*target, leader, &live) else {
                return Ok(false);
            };
            let mode = LinkMode::Delay(Duration::from_millis(*millis));
            for other in cluster.running() {
                cluster.set_link(id, other, mode);
                cluster.set_link(other, id, mode);
            }
        }
        Fault::Flaky { per_mille } => {
            let ids = cluster.running();
            for &a in &ids {
                for &b in &ids {
                    cluster.set_link(a, b, LinkMode::Flaky(*per_mille));
                }
            }
        }
        Fault::Kill(target) => {
            let Some(id) = pick_target(*target, leader, &live) else {
                return Ok(false);
            };
            cluster.kill(id);
            damage.stopped.insert(id);
        }
        Fault::Pause(target) => {
            let Some(id) = pick_target(*target, leader, &live) else {
                return Ok(false);
            };
            cluster.pause(id).await;
        }
        Fault::TransferLeader => {
            let Some(to) = pick_target(Target::Follower(lasts.as_millis() as u64), leader, &voters)
            else {
                return Ok(false);
            };
            // Refused transfers (target behind, leader changing) are normal.
            let _ = control.transfer_leader(to).await;
        }
        Fault::Replace => {
            let Some(old) =
                pick_target(Target::Follower(lasts.as_millis() as u64), leader, &voters)
            else {
                return Ok(false);
            };
            return Ok(cluster
                .replace(old)
                .await
                .context("replacing a member")?
                .is_some());
        }
        Fault::Crash { point, lag_first } => {
            let Some(id) = pick_target(Target::Follower(lasts.as_millis() as u64), leader, &voters)
            else {
                return Ok(false);
            };
            if *lag_first {
                // Fall behind the leader's log compaction, so the way back
                // is a snapshot install, then crash there.
                cluster.kill(id);
                tokio::time::sleep(lasts / 2).await;
                // A fresh snapshot purges the log past the stopped replica
                // (it only keeps the last 50 entries).
                let _ = control.snapshot().await;
                cluster.restart(id, Some(&format!("{point}=panic")))?;
            } else if *point == crate::schedule::CORE_STOP_POINT {
                // Its fourth log write and every one after fail: the core
                // stops and the process must exit by itself.
                cluster.restart(id, Some(&format!("{point}=3*off->return")))?;
            } else {
                cluster.restart(id, Some(&format!("{point}=3*off->panic")))?;
            }
            damage.armed.insert(id);
        }
        Fault::ClockSkew { offset_ms } => {
            let Some(id) = pick_target(Target::Follower(lasts.as_millis() as u64), leader, &voters)
            else {
                return Ok(false);
            };
            cluster.restart(id, Some(&format!("{CLOCK_OFFSET}=return({offset_ms})")))?;
            // Restarted with a true clock when the fault ends, like an armed
            // replica (it does not crash, so nothing counts as fired).
            damage.armed.insert(id);
            // Lead it once it has caught up, so its clock stamps entries:
            // committed time jumps 10 s ahead, or stands still while it
            // leads 10 s behind. Refused transfers are normal.
            if cluster
                .wait_caught_up(id, Duration::from_secs(30))
                .await
                .is_ok()
            {
                let _ = control.transfer_leader(id).await;
            }
        }
        Fault::ClockStep { offset_ms } => {
            let Some(id) = leader else {
                return Ok(false);
            };
            cluster.set_failpoint(id, CLOCK_OFFSET, Some(&format!("return({offset_ms})")))?;
            damage.clock_stepped.insert(id);
        }
        Fault::CrashInMembershipChange => {
            let followers: Vec<u64> = voters
                .iter()
                .copied()
                .filter(|id| Some(*id) != leader)
                .collect();
            let (Some(&armed), Some(&old)) = (followers.first(), followers.get(1)) else {
                return Ok(false);
            };
            if cluster.spare_slot().is_none() {
                return Ok(false);
            }
            cluster.restart(armed, Some("sm-apply-membership-before-write=panic"))?;
            cluster
                .wait_caught_up(armed, Duration::from_secs(60))
                .await
                .context("the armed replica did not catch up")?;
            let remaining: Vec<u64> = voters.iter().copied().filter(|v| *v != old).collect();
            let client = cluster.client_with(Duration::from_secs(60));
            let removal = {
                let remaining = remaining.clone();
                tokio::spawn(async move { client.change_membership(remaining, false).await })
            };
            // The removal cannot finish without the armed replica once it
            // has crashed: bring it back (disarmed) as soon as it is down.
            // It may also apply (and crash) just after the removal commits.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let mut finished_at = None;
            while tokio::time::Instant::now() < deadline {
                if cluster.reap_exited().contains(&armed) {
                    damage.fired += 1;
                    break;
                }
                if removal.is_finished() {
                    let at = *finished_at.get_or_insert_with(tokio::time::Instant::now);
                    if at.elapsed() > Duration::from_secs(2) {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            cluster.restart(armed, None)?;
            removal
                .await
                .context("the membership change task")?
                .context("removing a member while another crashed")?;
            cluster.wipe(old);
            cluster
                .add_member(remaining)
                .await
                .context("adding a member after the crash")?;
        }
    }
    Ok(true)
}

/// Ends every fault: links pass, paused replicas continue, stopped and
/// armed replicas start again (disarmed). Returns how many armed replicas
/// had crashed at their failpoint.
/// What `tetherd` logs when its Raft core stopped on its own, just before it
/// exits (`server/src/node.rs`, `watch_core`).
const CORE_STOPPED_LINE: &str = "the Raft core stopped";

/// The failpoint that moves a replica's wall clock (`replica::wall_clock_ms`).
const CLOCK_OFFSET: &str = "clock-offset-ms";

fn heal(
    cluster: &mut ProcessCluster,
    damage: &mut Damage,
    unexpected: &mut Vec<String>,
) -> anyhow::Result<u64> {
    cluster.heal_network();
    let mut fired = std::mem::take(&mut damage.fired);
    for id in cluster.reap_exited() {
        if cluster.log_tail(id, 50).contains(CORE_STOPPED_LINE) {
            // It did what a replica with a dead core must do (exit, to be
            // restarted): restart it, as Kubernetes would, and count it
            // (armed to stop its core, or stopped on its own).
            damage.core_restarts += 1;
        } else if damage.armed.contains(&id) {
            fired += 1;
        } else {
            unexpected.push(format!("replica {id} exited without being killed"));
        }
        damage.stopped.insert(id);
    }
    for id in std::mem::take(&mut damage.armed) {
        damage.stopped.insert(id);
    }
    // Step a stepped clock back; a replica that cannot be told is restarted,
    // which clears it too.
    for id in std::mem::take(&mut damage.clock_stepped) {
        if !damage.stopped.contains(&id) && cluster.set_failpoint(id, CLOCK_OFFSET, None).is_err() {
            damage.stopped.insert(id);
        }
    }
    for id in std::mem::take(&mut damage.stopped) {
        cluster.restart(id, None)?;
    }
    Ok(fired)
}

/// The operations, recoveries and events of each lock a progress violation
/// names, one line each, with the fault windows: what a CI log needs to
/// tell a stalled cluster from a lost grant.
fn progress_digest(found: &[String], evidence: &Evidence) -> String {
    use std::fmt::Write as _;
    let ms = |us: u64| us as f64 / 1000.0;
    let mut out = String::new();
    let windows: Vec<String> = evidence
        .fault_windows
        .iter()
        .map(|(began, healed)| match healed {
            Some(h) => format!("{:.0}-{:.0}", ms(*began), ms(*h)),
            None => format!("{:.0}-", ms(*began)),
        })
        .collect();
    let _ = writeln!(out, "    faults (ms): {}", windows.join(" "));
    // Definite answers per 500 ms of the run: a stalled cluster (or test
    // process) shows as a run of zeros.
    let mut answered = Vec::new();
    for op in evidence.ops.iter().filter(|o| o.is_ok()) {
        if let Some(at) = op.complete_us {
            let slot = (at / 500_000) as usize;
            if answered.len() <= slot {
                answered.resize(slot + 1, 0u32);
            }
            answered[slot] += 1;
        }
    }
    let answered: Vec<String> = answered.iter().map(u32::to_string).collect();
    let _ = writeln!(out, "    answers per 500 ms: {}", answered.join(" "));
    let keys: std::collections::BTreeSet<&str> = found
        .iter()
        .filter_map(|v| v.split(' ').next())
        .filter(|k| k.starts_with("lock/"))
        .collect();
    for key in keys {
        let _ = writeln!(out, "    {key}:");
        for r in evidence.recoveries.iter().filter(|r| r.key == key) {
            let _ = writeln!(
                out,
                "      recovery ({}): due {:.0} ms, granted {:?}, answered {:.0} ms",
                r.cause,
                ms(r.due_us),
                r.granted_us.map(|g| ms(g).round()),
                ms(r.answered_us)
            );
        }
        for op in evidence.ops.iter().filter(|o| o.key == key) {
            let _ = writeln!(
                out,
                "      op p{} {:?} at {:.0} ms -> {:?} at {:?} ms",
                op.process,
                op.call,
                ms(op.invoke_us),
                op.outcome,
                op.complete_us.map(|c| ms(c).round())
            );
        }
        for event in evidence.events.get(key).into_iter().flatten() {
            let _ = writeln!(
                out,
                "      event {} {} {}",
                crate::checkers::rev(event),
                event.kind,
                event.reason
            );
        }
    }
    out
}

/// Every event of `key` from `from` on, paging; from replica `addr`, or
/// the leader when `None`. `None` when that replica's events do not reach
/// back to `from` (it joined or caught up by snapshot since).
pub async fn events_of(
    client: &Client,
    addr: Option<&str>,
    key: &str,
    from: pb::Revision,
) -> anyhow::Result<Option<Vec<pb::Event>>> {
    const PAGE: u32 = 1000;
    let mut out: Vec<pb::Event> = Vec::new();
    let mut cursor = from;
    loop {
        let request = pb::HistoryRequest {
            key: key.to_string(),
            from: Some(cursor),
            limit: PAGE,
            ..Default::default()
        };
        let page = match addr {
            Some(addr) => client.history_at(addr, request).await,
            None => client.history_query(request).await,
        }
        .with_context(|| format!("history of {key}"))?;
        if page.oldest_retained.is_some_and(|o| o.index > from.index) {
            return Ok(None);
        }
        let Some(last) = page.events.last().and_then(|e| e.revision) else {
            return Ok(Some(out));
        };
        cursor = pb::Revision {
            index: last.index,
            sub: last.sub + 1,
        };
        let full = page.events.len() == PAGE as usize;
        out.extend(page.events);
        if !full {
            return Ok(Some(out));
        }
    }
}

/// The events of `keys` from a replica whose event store covers the whole
/// run (all replicas have applied the same entries once converged, so any
/// such replica has the same events); None when no replica does.
async fn run_events(
    cluster: &ProcessCluster,
    client: &Client,
    keys: &[String],
    from: pb::Revision,
) -> anyhow::Result<Option<BTreeMap<String, Vec<pb::Event>>>> {
    'replicas: for id in cluster.live() {
        let addr = cluster.addr(id);
        let mut events = BTreeMap::new();
        for key in keys {
            match events_of(client, Some(&addr), key, from).await? {
                Some(list) => {
                    events.insert(key.clone(), list);
                }
                None => continue 'replicas,
            }
        }
        return Ok(Some(events));
    }
    Ok(None)
}

/// The locks a run's workers share, named under the run's prefix.
struct RunLocks {
    /// Taken with try-acquires.
    try_locks: Vec<pb::LockKey>,
    /// Queued for by the queue workers.
    queue_lock: pb::LockKey,
    /// One per lease worker: each worker's round is a scenario of its own.
    lease_locks: Vec<pb::LockKey>,
    /// One per retry storm.
    storm_locks: Vec<pb::LockKey>,
    /// The revoker's: acquires raced by their pod's revoke.
    race_lock: pb::LockKey,
}

impl RunLocks {
    fn new(shared: &Shared, config: &RunConfig) -> Self {
        Self {
            try_locks: (0..config.try_locks)
                .map(|n| shared.lock(&format!("t{n}")))
                .collect(),
            queue_lock: shared.lock("q"),
            lease_locks: (0..config.lease_workers)
                .map(|n| shared.lock(&format!("l{n}")))
                .collect(),
            storm_locks: (0..config.storms)
                .map(|n| shared.lock(&format!("rs{n}")))
                .collect(),
            race_lock: shared.lock("rv"),
        }
    }

    /// The event-log key of every lock, pin set and node the run touched.
    fn event_keys(&self, shared: &Shared, prefix: &str, config: &RunConfig) -> Vec<String> {
        let mut keys: Vec<String> = self.try_locks.iter().map(workers::lock_event_key).collect();
        keys.push(workers::lock_event_key(&self.queue_lock));
        keys.extend(self.lease_locks.iter().map(workers::lock_event_key));
        keys.extend(self.storm_locks.iter().map(workers::lock_event_key));
        keys.push(workers::lock_event_key(&self.race_lock));
        keys.extend(
            shared
                .extra_locks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(workers::lock_event_key),
        );
        keys.extend(
            shared
                .extra_nodes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|name| format!("node/{name}")),
        );
        for member in 0..config.pins {
            keys.push(format!("pin/{prefix}/{member}"));
        }
        if config.pin_lifetime_rounds > 0 {
            keys.push(workers::pin_lifetime_event_key(prefix));
        }
        keys
    }
}

/// Starts every worker of the workload; each has its own process numbers
/// (the history's) and its own fork of `rng`.
fn spawn_workers(
    cluster: &ProcessCluster,
    shared: &Arc<Shared>,
    locks: &RunLocks,
    config: &RunConfig,
    rng: &mut Rng,
) -> Vec<(&'static str, tokio::task::JoinHandle<()>)> {
    let mut tasks = Vec::new();
    let mut process = 0;
    for _ in 0..config.try_workers {
        process += 1;
        tasks.push((
            "try_lock_worker",
            tokio::spawn(workers::try_lock_worker(
                shared.clone(),
                process,
                locks.try_locks.clone(),
                rng.fork(process),
            )),
        ));
    }
    for _ in 0..config.queue_workers {
        process += 1;
        tasks.push((
            "queue_worker",
            tokio::spawn(workers::queue_worker(
                shared.clone(),
                process,
                locks.queue_lock.clone(),
                rng.fork(process),
            )),
        ));
    }
    for (n, lease_lock) in locks.lease_locks.iter().enumerate() {
        process += 1;
        tasks.push((
            "lease_worker",
            tokio::spawn(workers::lease_worker(
                shared.clone(),
                process,
                lease_lock.clone(),
                config.lease_ttl,
                n as u64 % 2 + 1,
                rng.fork(process),
            )),
        ));
        // Its three pods are processes `process` to `process + 2`.
        process += 2;
    }
    for _ in 0..config.enders {
        process += 1;
        tasks.push((
            "ender",
            tokio::spawn(workers::ender(shared.clone(), process, rng.fork(process))),
        ));
        // Its two pods are processes `process` and `process + 1`.
        process += 1;
    }
    for storm_lock in &locks.storm_locks {
        process += 1;
        tasks.push((
            "retry_storm",
            tokio::spawn(crate::storm::retry_storm(
                shared.clone(),
                process,
                storm_lock.clone(),
                rng.fork(process),
            )),
        ));
        // Its forger is process `process + 1`.
        process += 1;
    }
    for _ in 0..config.abandoners {
        process += 1;
        tasks.push((
            "abandoner",
            tokio::spawn(crate::abandon::abandoner(
                shared.clone(),
                process,
                rng.fork(process),
            )),
        ));
        // Its three pods are processes `process` to `process + 2`.
        process += 2;
    }
    for _ in 0..config.keepers {
        process += 1;
        tasks.push((
            "keeper",
            tokio::spawn(crate::keeper::keeper(
                shared.clone(),
                process,
                config.lease_ttl,
                rng.fork(process),
            )),
        ));
        // Its waiter is process `process + 1`.
        process += 1;
    }
    // The flooder needs roles: only on clusters with tokens.
    if config.session_flood && cluster.has_tokens() {
        tasks.push((
            "flooder",
            tokio::spawn(crate::sessions::flooder(
                shared.clone(),
                cluster.bridge_client(),
            )),
        ));
    }
    for _ in 0..config.claimers {
        process += 1;
        tasks.push((
            "claimer",
            tokio::spawn(crate::claims::claimer(shared.clone(), rng.fork(process))),
        ));
    }
    process += 1;
    tasks.push((
        "revoker",
        tokio::spawn(workers::revoker(
            shared.clone(),
            process,
            locks.race_lock.clone(),
            rng.fork(process),
        )),
    ));
    // Its racing revokes are process `process + 1`.
    process += 1;
    process += 1;
    tasks.push((
        "pin_assigner",
        tokio::spawn(workers::pin_assigner(
            shared.clone(),
            process,
            config.pins,
            rng.fork(process),
        )),
    ));
    process += 1;
    tasks.push((
        "pin_lifetimes",
        tokio::spawn(workers::pin_lifetimes(
            shared.clone(),
            process,
            config.pin_lifetime_rounds,
            rng.fork(process),
        )),
    ));
    // Last, so that the workers before keep their processes and draws.
    for _ in 0..config.retriers {
        process += 1;
        tasks.push((
            "retrier",
            tokio::spawn(crate::retry::retrier(
                shared.clone(),
                process,
                rng.fork(process),
            )),
        ));
        // Its two attempts and its waiter are `process` to `process + 2`.
        process += 2;
    }

    tasks
}

/// Injects the schedule's faults in order on the workload's clock, which
/// starts now, healing each after it lasted; counts them in the report.
/// Returns when the clock started.
async fn drive_faults(
    cluster: &mut ProcessCluster,
    control: &Client,
    schedule: &Schedule,
    shared: &Shared,
    report: &mut Report,
    damage: &mut Damage,
    unexpected: &mut Vec<String>,
) -> anyhow::Result<tokio::time::Instant> {
    let began = tokio::time::Instant::now();
    for step in &schedule.steps {
        tokio::time::sleep_until(began + step.at).await;
        shared.history.fault_began();
        if inject(cluster, control, &step.fault, step.lasts, damage).await? {
            *report.faults.entry(step.fault.kind()).or_default() += 1;
        }
        tokio::time::sleep(step.lasts).await;
        report.crashes_fired += heal(cluster, damage, unexpected)?;
        // The replicas heal from here; the progress bound is judged after.
        shared.history.faults_healed();
    }
    Ok(began)
}

/// Counts each kind of call by outcome, and how the run's holds and waits
/// ended in the log: shows that the workload drove each path that ends one
/// (printed with -v).
fn tally_outcomes(
    report: &mut Report,
    ops: &[crate::history::Op],
    events: &BTreeMap<String, Vec<pb::Event>>,
) {
    for op in ops {
        let call = match op.call {
            crate::history::Call::Acquire { wait_ms: 0, .. } => "try-acquire",
            crate::history::Call::Acquire { .. } => "acquire",
            crate::history::Call::Release { .. } => "release",
            crate::history::Call::RevokePod { .. } => "revoke",
            crate::history::Call::Assign { .. } => "assign",
            crate::history::Call::Withdraw { .. } => "withdraw",
        };
        let outcome = match &op.outcome {
            Outcome::Ok(value) => format!("{value:?}")
                .split(['(', ' '])
                .next()
                .unwrap_or("")
                .to_string(),
            Outcome::Fail(why) => format!("fail({})", why.chars().take(40).collect::<String>()),
            Outcome::Unknown(_) | Outcome::Pending => "unknown".to_string(),
        };
        *report
            .outcomes
            .entry(format!("{call} {outcome}"))
            .or_default() += 1;
    }
    for event in events.values().flatten() {
        if event.kind == "WaitEnded" {
            // `WaitEndReason`'s debug form: its variant name first.
            let how: String = event
                .reason
                .chars()
                .take_while(|c| c.is_alphanumeric())
                .collect();
            *report
                .outcomes
                .entry(format!("wait ended by {how}"))
                .or_default() += 1;
            continue;
        }
        if event.kind != "LockReleased" {
            continue;
        }
        let how = [
            ("released", "released"),
            ("force-released", "force release"),
            ("pod revoked", "pod revoke"),
            ("lease", "lease end"),
            ("hold timeout", "hold timeout"),
            ("node gone", "node gone"),
            ("granted to a wait whose caller", "give-back (caller gone)"),
            ("withdrawn", "give-back (withdrawn)"),
        ]
        .iter()
        .find(|(prefix, _)| event.reason.starts_with(prefix))
        .map_or("other", |(_, how)| how);
        *report
            .outcomes
            .entry(format!("hold ended by {how}"))
            .or_default() += 1;
    }
}

/// The cluster's id as its leader reports it, once it has one (the first
/// leader draws it as soon as it leads): `None` when none came within 10 s.
async fn leader_cluster_id(cluster: &ProcessCluster) -> Option<String> {
    let client = cluster.client_with(Duration::from_secs(1));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let id = cluster
            .leader(&client)
            .await
            .map(|leader| leader.cluster_id)
            .filter(|id| !id.is_empty());
        if id.is_some() || tokio::time::Instant::now() > deadline {
            return id;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the healed cluster answers under another id than `before`, the
/// id it had when the run began: after a power cut that means every
/// replica's log lost the entry that recorded the id (committed when the
/// cluster started, so synced by a majority before anyone was told of any
/// later entry), and the leader that came back found none applied and drew
/// a new one (`tetherd`'s `claim_cluster_id`). A build that syncs its log
/// cannot get there; one that acknowledges appends it has not synced can
/// (`log-append-without-sync` under `power-loss-all`).
async fn identity_lost(cluster: &ProcessCluster, before: Option<&str>) -> Option<String> {
    let before = before?;
    let now = leader_cluster_id(cluster).await?;
    (now != before).then(|| {
        format!(
            "the cluster came back as cluster {now}, not {before}: every replica's log lost \
             the entry that named it (and with it what clients were told was committed), and \
             its clients are refused"
        )
    })
}

/// Runs `schedule` on `cluster`; keys and pods are prefixed with `prefix`
/// (unique per run on one cluster).
pub async fn run(
    cluster: &mut ProcessCluster,
    schedule: &Schedule,
    prefix: &str,
    config: &RunConfig,
) -> anyhow::Result<Report> {
    let control = cluster.client_with(Duration::from_secs(10));
    let leader = cluster
        .wait_converged(config.converge_within)
        .await
        .context("cluster not converged before the run")?;
    let start = pb::Revision {
        index: leader.applied_index + 1,
        sub: 0,
    };
    let cluster_id = match leader.cluster_id.as_str() {
        "" => leader_cluster_id(cluster).await,
        id => Some(id.to_string()),
    };
    let shared = Arc::new(Shared {
        // A short retry budget: calls that cannot finish during a fault end
        // as unknown, which the checkers must handle.
        client: cluster.client_with(Duration::from_millis(800)),
        // Another extender replica's client, for a pod's second attempt.
        second_client: cluster.client_with(Duration::from_millis(800)),
        history: History::new(),
        shadow: Shadow::default(),
        holding: Mutex::new(Vec::new()),
        stop: AtomicBool::new(false),
        workload_ends: tokio::time::Instant::now() + schedule.workload,
        prefix: prefix.to_string(),
        extra_locks: Mutex::new(Vec::new()),
        extra_nodes: Mutex::new(Vec::new()),
        remade_claims: Mutex::new(Vec::new()),
        taken_for_objects: Mutex::new(Vec::new()),
    });
    let mut rng = Rng::new(schedule.seed ^ 0x5EED);
    let locks = RunLocks::new(&shared, config);

    let watch_stop = Arc::new(AtomicBool::new(false));
    let watch_until = Arc::new(Mutex::new(None));
    let watch_prefix = format!("lock/{}/{prefix}-", workers::SCOPE);
    let watch_task = tokio::spawn(workers::watcher(
        cluster.client(),
        start,
        watch_prefix.clone(),
        watch_stop.clone(),
        watch_until.clone(),
    ));
    let tasks = spawn_workers(cluster, &shared, &locks, config, &mut rng);

    // Faults, in order, on the workload's clock.
    let mut report = Report {
        schedule: schedule.to_string(),
        ..Report::default()
    };
    let mut damage = Damage::default();
    let mut unexpected = Vec::new();
    let began = drive_faults(
        cluster,
        &control,
        schedule,
        &shared,
        &mut report,
        &mut damage,
        &mut unexpected,
    )
    .await?;
    tokio::time::sleep_until(began + schedule.workload).await;
    report.phases.push(("workload", began.elapsed()));
    let mut phase = tokio::time::Instant::now();
    shared.stop.store(true, Ordering::SeqCst);
    // Joined in order, so a worker that stopped early is joined late: the
    // last join that had to wait (more than a few ms) is the slowest.
    for (name, task) in tasks {
        task.await.context("a worker panicked")?;
        let stopped = phase.elapsed();
        if stopped > report.slowest_to_stop.1 + Duration::from_millis(5) {
            report.slowest_to_stop = (name, stopped);
        }
    }
    report.phases.push(("wind-down", phase.elapsed()));
    phase = tokio::time::Instant::now();
    report.crashes_fired += heal(cluster, &mut damage, &mut unexpected)?;
    report.core_restarts = damage.core_restarts;
    let converged = cluster.wait_converged(config.converge_within).await;
    if let Err(err) = &converged {
        unexpected.push(format!("after healing: {err:#}"));
    }
    let converged = converged?;
    report.elections = converged.term.saturating_sub(leader.term);
    report.phases.push(("heal+converge", phase.elapsed()));
    if let Some(lost) = identity_lost(cluster, cluster_id.as_deref()).await {
        // Nothing of the run can be read back (its clients know the old
        // id and every replica refuses them), and nothing needs to be: the
        // log lost what it had committed first.
        report.violations.insert("durability", vec![lost]);
        report.violations.insert("process", unexpected);
        report.evidence_dump = Some(format!("{report:#?}"));
        return Ok(report);
    }
    phase = tokio::time::Instant::now();

    // The log of every key the run touched.
    let keys = locks.event_keys(&shared, prefix, config);
    let events = run_events(cluster, &control, &keys, start).await?;
    let events_complete = events.is_some();
    report.events_complete = events_complete;
    // The log is judged as of convergence: what applies later (a wait's
    // deadline or a lease's TTL running out after the workers stopped) may
    // be in the log of keys read late and not of keys read early, and may
    // reach the watcher in one batch with the last event it waits for.
    let cutoff = converged.applied_index;
    let mut events = events.unwrap_or_default();
    for list in events.values_mut() {
        list.retain(|e| e.revision.is_none_or(|r| r.index <= cutoff));
    }
    let last_lock_event = events
        .iter()
        // Only what the watcher follows (the hold-timeout scope is outside
        // its prefix).
        .filter(|(k, _)| k.starts_with(watch_prefix.as_str()))
        .flat_map(|(_, e)| e.iter().filter_map(|e| e.revision))
        .map(|r| (r.index, r.sub))
        .max();
    report.phases.push(("read log", phase.elapsed()));
    phase = tokio::time::Instant::now();
    *watch_until.lock().unwrap_or_else(|p| p.into_inner()) = last_lock_event;
    let watch_deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !watch_task.is_finished() && tokio::time::Instant::now() < watch_deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    watch_stop.store(true, Ordering::SeqCst);
    let (watched, relists) = watch_task.await.context("the watcher panicked")?;
    let watched = workers::watched_as_of(watched, cutoff);
    report.phases.push(("watch catch-up", phase.elapsed()));
    report.relists = relists;
    if let Some(target) = last_lock_event {
        let reached = workers::watcher_passed(&watched, target);
        if !reached {
            unexpected.push(format!(
                "the watcher did not reach revision {}.{} within 30 s of convergence",
                target.0, target.1
            ));
        }
    }
    let pins = control
        .list_pins(prefix, "")
        .await
        .context("listing the run's pins")?;
    let claims = control
        .list_pins(&crate::claims::claims_set(prefix), "")
        .await
        .context("listing the run's device claims")?;

    let ops = shared.history.ops();
    report.ops = ops.len();
    tally_outcomes(&mut report, &ops, &events);
    report.unknown = ops
        .iter()
        .filter(|op| matches!(op.outcome, Outcome::Unknown(_) | Outcome::Pending))
        .count();
    let recoveries = shared.history.recoveries();
    let fault_windows = shared.history.fault_windows();
    report.recoveries = checkers::progress::recovery_times(&recoveries);
    report.recoveries_judged = checkers::progress::judged(&recoveries, &fault_windows) as u64;
    report.judged_times = checkers::progress::judged_times(&recoveries, &fault_windows);
    let evidence = Evidence {
        ops,
        events,
        shadow: shared.shadow.writes(),
        watches: vec![(watch_prefix, watched)],
        try_locks: locks
            .try_locks
            .iter()
            .map(workers::lock_event_key)
            .collect(),
        pins,
        claims,
        remade_claims: shared
            .remade_claims
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
        taken_for_objects: shared
            .taken_for_objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
        events_complete,
        recoveries,
        fault_windows,
        kept_leases: shared.history.kept_leases(),
        session_floods: shared.history.session_floods(),
    };
    (report.violations, report.undecided) = checkers::check_all(&evidence, config.search_budget);
    report.violations.insert("process", unexpected);
    if report.violation_count() > 0 {
        report.evidence_dump = Some(format!("{report:#?}\n{evidence:#?}"));
    }
    if let Some(found) = report.violations.get("progress").filter(|v| !v.is_empty()) {
        report.progress_digest = Some(progress_digest(found, &evidence));
    }
    Ok(report)
}

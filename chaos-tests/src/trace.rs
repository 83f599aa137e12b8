//! Pod-lifecycle trace replay (after SimKube's trace replay): a seeded trace
//! of nodes and pods — create, bind, delete mid-bind, go Failed, run and be
//! deleted, node removed, a worker set scaled in with gaps — is played
//! against a Tether cluster through the bridge's own logic (`mapping` for
//! every pod and node change, `orphans` + `Interest` for the final resync,
//! `send_report` for the commands), with schedulers binding through the
//! per-node `gpu-bind` lock and device plugins releasing it, as HAMi does.
//!
//! Some of the bridge's reports are lost (`LoseNextReport`: the send failed,
//! as it does while Tether has no quorum); only the bridge's reconciliation
//! (`reconcile::pod_corrections`, in the final resync) brings them.
//!
//! Checked:
//! - a bind that lands after its pod's deletion (the scheduler lost the
//!   race) is released as soon as the bridge learns of it (its tombstones);
//! - right after the bridge's report of a deleted (or terminal) pod is
//!   acknowledged, the pod neither holds nor waits for its node's lock;
//! - once the bridge has synced (trace done, resync sent), no lock is held or
//!   waited for by a pod that is gone, no lock of a removed node is held,
//!   and no pin sits on a removed node;
//! - once synced, every pin's owner state in Tether is what the pod object
//!   shows (running, starting, stopped once terminal or gone), lost reports
//!   included;
//! - a bound pod that is being deleted (an init container runs, or its image
//!   is still pulling) is not gone: right after its deletion is reported, its
//!   pin's owner is not stopped;
//! - the node locks' event logs pass the mutual exclusion, token and FIFO
//!   checkers.
//!
//! What it is not: the Kubernetes API server. Events are applied in trace
//! order by one driver (a real bridge sees them through watches, possibly
//! late); the bridge's watch plumbing is covered by k8s-bridge's own tests.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_client::{Client, proto as pb};
use tether_k8s_bridge::bridge::send_report;
use tether_k8s_bridge::interest::Interest;
use tether_k8s_bridge::mapping::{node_change, pod_change};
use tether_k8s_bridge::model::{Command, NodeView, Phase, PodReport, PodView};
use tether_k8s_bridge::orphans::{
    LiveView, Lookup, TetherView, confirm_node, confirm_pod, missing_joins, node_candidates,
    pod_candidates,
};
use tether_k8s_bridge::reconcile::pod_corrections;
use tether_k8s_bridge::tombstones::{Tombstones, late_interest};

use crate::checkers::{self, Evidence};
use crate::rng::Rng;

/// The lock scope schedulers bind through, one lock per node.
pub const BIND_SCOPE: &str = "gpu-bind";

/// One step of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A node appears, Ready.
    AddNode(String),
    /// A node is deleted (its pods are deleted right after, as the
    /// Kubernetes garbage collector does).
    RemoveNode(String),
    /// A pod is created, scheduled to `node`; its scheduler binds it
    /// (acquire the node's lock, the device plugin releases it ~20 ms
    /// later) and, for workers, pins it.
    CreatePod {
        /// Pod index in the trace.
        pod: usize,
        /// The node it is scheduled to.
        node: String,
        /// A worker of the pinned set.
        worker: bool,
    },
    /// The scheduler's bind set the pod's nodeName; no container has
    /// started yet (an image pull, an init container).
    Bound(usize),
    /// Containers started.
    Start(usize),
    /// Phase Failed.
    Fail(usize),
    /// Deletion requested (graceful); `Remove` follows for started pods.
    Delete(usize),
    /// The object is gone.
    Remove(usize),
    /// The scheduler's bind of a pod already removed lands now (it raced
    /// the deletion and lost).
    LateBind(usize),
    /// The bridge's next report of this pod is lost: its send failed (as
    /// while Tether has no quorum) and nothing but reconciliation sends it
    /// again.
    LoseNextReport(usize),
    /// Pause before the next step.
    Wait(u64),
}

/// A generated trace.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Its seed.
    pub seed: u64,
    /// Names of pods and nodes start with this.
    pub prefix: String,
    /// The steps, in order.
    pub steps: Vec<Step>,
}

impl Trace {
    /// The trace of `seed`: `nodes` nodes, `pods` pods.
    pub fn generate(seed: u64, nodes: usize, pods: usize) -> Trace {
        let mut rng = Rng::new(seed);
        let prefix = format!("tr{seed}");
        let node_names: Vec<String> = (0..nodes).map(|n| format!("{prefix}-n{n}")).collect();
        let mut steps: Vec<Step> = node_names.iter().cloned().map(Step::AddNode).collect();
        let removed_after = rng.between(pods as u64 / 3, pods as u64 * 2 / 3) as usize;
        let doomed = rng.pick(&node_names).clone();
        let mut live_nodes = node_names.clone();
        let mut on_node: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let mut gone: BTreeSet<usize> = BTreeSet::new();
        let mut workers = Vec::new();
        // Pods arrive in bursts, several scheduled to one node at once
        // (HAMi's contended case); each burst's fates follow its creations.
        let mut pod = 0;
        while pod < pods {
            if pod >= removed_after && live_nodes.len() == node_names.len() {
                steps.push(Step::RemoveNode(doomed.clone()));
                live_nodes.retain(|n| *n != doomed);
                for &p in on_node.get(&doomed).into_iter().flatten() {
                    if gone.insert(p) {
                        steps.push(Step::Remove(p));
                    }
                }
            }
            let burst: Vec<usize> = (pod..(pod + rng.between(1, 5) as usize).min(pods)).collect();
            pod += burst.len();
            let node = rng.pick(&live_nodes).clone();
            for &p in &burst {
                let worker = rng.percent(30);
                on_node.entry(node.clone()).or_default().push(p);
                if worker {
                    workers.push(p);
                }
                steps.push(Step::CreatePod {
                    pod: p,
                    node: node.clone(),
                    worker,
                });
            }
            for &p in &burst {
                steps.push(Step::Wait(rng.between(0, 15)));
                // A pod's next report is lost about one time in three.
                let maybe_lose = |steps: &mut Vec<Step>, rng: &mut Rng| {
                    if rng.percent(35) {
                        steps.push(Step::LoseNextReport(p));
                    }
                };
                match rng.below(12) {
                    // Deleted mid-bind (perhaps while queued): HAMi #1271.
                    0 | 1 => {
                        steps.push(Step::Delete(p));
                        steps.push(Step::Remove(p));
                        gone.insert(p);
                        if rng.percent(50) {
                            steps.push(Step::LateBind(p));
                        }
                    }
                    2 => {
                        steps.push(Step::Wait(rng.between(10, 30)));
                        maybe_lose(&mut steps, &mut rng);
                        steps.push(Step::Fail(p));
                    }
                    // Bound, then deleted before its containers start: it
                    // keeps what it has until the object is gone.
                    3 | 4 => {
                        steps.push(Step::Wait(rng.between(10, 30)));
                        maybe_lose(&mut steps, &mut rng);
                        steps.push(Step::Bound(p));
                        steps.push(Step::Wait(rng.between(0, 10)));
                        steps.push(Step::Delete(p));
                        steps.push(Step::Wait(rng.between(5, 20)));
                        steps.push(Step::Remove(p));
                        gone.insert(p);
                    }
                    _ => {
                        steps.push(Step::Wait(rng.between(10, 30)));
                        maybe_lose(&mut steps, &mut rng);
                        steps.push(Step::Start(p));
                        let worker = workers.contains(&p);
                        if rng.percent(25) && !worker {
                            steps.push(Step::Delete(p));
                            steps.push(Step::Wait(rng.between(0, 10)));
                            steps.push(Step::Remove(p));
                            gone.insert(p);
                        }
                    }
                }
            }
        }
        // Scale the worker set in, leaving gaps.
        for &pod in &workers {
            if rng.percent(50) && gone.insert(pod) {
                steps.push(Step::Delete(pod));
                steps.push(Step::Remove(pod));
            }
        }
        Trace {
            seed,
            prefix,
            steps,
        }
    }
}

/// What a replay found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Commands the bridge logic sent.
    pub commands: u64,
    /// Binds that were granted.
    pub binds: u64,
    /// Binds that ended without a grant (the pod was deleted while queued,
    /// or its node went).
    pub binds_abandoned: u64,
    /// Pod reports lost (`LoseNextReport`) and left to reconciliation.
    pub lost_reports: u64,
    /// Reports the final resync's reconciliation sent.
    pub corrections: u64,
    /// Problems found.
    pub violations: Vec<String>,
}

/// The simulated API server's objects.
#[derive(Default)]
struct Objects {
    pods: BTreeMap<usize, (PodView, String)>,
    nodes: BTreeMap<String, NodeView>,
    /// Nodes of removed pods, for late binds.
    removed: BTreeMap<usize, (PodView, String)>,
}

impl Objects {
    /// What the bridge's GET of a node would answer.
    fn node_lookup(&self, name: &str) -> Lookup<NodeView> {
        self.nodes
            .get(name)
            .cloned()
            .map_or(Lookup::NotFound, Lookup::Found)
    }

    /// What the bridge's GET of a pod (namespace/name) would answer.
    fn pod_lookup(&self, namespace: &str, name: &str) -> Lookup<PodView> {
        self.pods
            .values()
            .map(|(view, _)| view)
            .find(|v| v.namespace == namespace && v.name == name)
            .cloned()
            .map_or(Lookup::NotFound, Lookup::Found)
    }
}

fn pod_view(trace: &Trace, pod: usize) -> PodView {
    PodView {
        uid: format!("{}-uid{pod}", trace.prefix),
        namespace: "trace".into(),
        name: format!("{}-p{pod}", trace.prefix),
        phase: Phase::Pending,
        deleting: false,
        started: false,
        // The trace does not model the bind's nodeName update: its pods
        // are reported when they start (and are bound from then on). A pod
        // deleted before that is deleted unbound: gone at once.
        bound: false,
    }
}

fn bind_key(node: &str) -> pb::LockKey {
    pb::LockKey {
        scope: BIND_SCOPE.into(),
        name: node.to_string(),
    }
}

/// Sends the bridge's commands; a node delete is confirmed against the
/// simulated objects, as the bridge confirms it with a GET.
async fn send_all(
    client: &Client,
    commands: Vec<Command>,
    objects: &Objects,
    outcome: &mut Outcome,
    acked: &mut HashMap<String, PodReport>,
) -> Result<(), tether_client::Error> {
    for command in commands {
        let command = match command {
            Command::ConfirmNodeGone { name, uid } => {
                match confirm_node(&name, &uid, objects.node_lookup(&name)) {
                    Some(gone) => gone,
                    None => continue,
                }
            }
            other => other,
        };
        send_report(client, &command).await?;
        outcome.commands += 1;
        // What the bridge remembers as acknowledged (`reconcile.rs`).
        if let Command::Pod { uid, report } = &command {
            acked.insert(uid.clone(), *report);
        }
    }
    Ok(())
}

/// Scheduler + device plugin of one pod: take the node's bind lock (FIFO),
/// hold it for 40 ms (Allocate), release it. Revocation (the pod deleted
/// mid-bind) makes the release or the wait fail, which is expected.
async fn bind(
    client: Client,
    key: pb::LockKey,
    pod: pb::Pod,
    binds: Arc<Mutex<(u64, u64)>>,
    applied: tokio::sync::oneshot::Sender<()>,
) {
    // Told once the acquire is in Tether's log (queued or granted), or has
    // failed; dropped unsent on failure, which tells the same.
    let applied = Mutex::new(Some(applied));
    let tell = || {
        if let Some(tx) = applied.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(());
        }
    };
    let acquired = client
        .acquire_with_progress(
            &key,
            &pod,
            Vec::new(),
            Duration::from_secs(10),
            0,
            |progress| {
                if matches!(progress, tether_client::AcquireProgress::Queued(_)) {
                    tell();
                }
            },
        )
        .await;
    tell();
    let held = match acquired {
        Ok(held) => held,
        Err(_) => {
            // Revoked while queued (deleted mid-bind) or the node went.
            binds.lock().unwrap_or_else(|p| p.into_inner()).1 += 1;
            return;
        }
    };
    binds.lock().unwrap_or_else(|p| p.into_inner()).0 += 1;
    // Allocate on a busy node: long enough that pods queue behind it.
    tokio::time::sleep(Duration::from_millis(40)).await;
    let _ = held.release(pb::Outcome::Allocated).await;
}

/// Whether `uid` holds or waits for `key` (a linearizable read).
async fn involved(
    client: &Client,
    key: &pb::LockKey,
    uid: &str,
) -> Result<bool, tether_client::Error> {
    let state = client.get(key).await?;
    let holds = state
        .holder
        .as_ref()
        .and_then(|h| h.pod.as_ref())
        .is_some_and(|p| p.uid == uid);
    let waits = state
        .waiters
        .iter()
        .any(|w| w.pod.as_ref().is_some_and(|p| p.uid == uid));
    Ok(holds || waits)
}

/// Plays `trace` against the cluster `client` talks to: every step, then
/// the bridge's resync, then the checks of the synced state and of the node
/// locks' logs.
pub async fn replay(client: &Client, trace: &Trace) -> Result<Outcome, tether_client::Error> {
    let mut replay = Replay::new(client, trace);
    for step in &trace.steps {
        replay.step(step).await?;
    }
    for task in std::mem::take(&mut replay.tasks) {
        let _ = task.await;
    }
    let binds = *replay.binds.lock().unwrap_or_else(|p| p.into_inner());
    (replay.outcome.binds, replay.outcome.binds_abandoned) = binds;
    replay.resync().await?;
    replay.check_synced().await?;
    replay.check_node_logs().await?;
    Ok(replay.outcome)
}

/// A replay in progress: the simulated objects, what the bridge has sent
/// and had acknowledged, and the binds running.
struct Replay<'a> {
    client: &'a Client,
    trace: &'a Trace,
    outcome: Outcome,
    objects: Objects,
    /// Binds that took their lock, and that gave up.
    binds: Arc<Mutex<(u64, u64)>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The pin set of the trace's workers.
    workers_set: String,
    removed_nodes: BTreeSet<String>,
    tombstones: Tombstones,
    /// The last report Tether acknowledged for each pod.
    acked: HashMap<String, PodReport>,
    /// Pods whose next report is lost.
    lose_next: BTreeSet<usize>,
    /// The pods that are workers (pinned to their node).
    workers: BTreeSet<usize>,
}

impl<'a> Replay<'a> {
    fn new(client: &'a Client, trace: &'a Trace) -> Self {
        Self {
            client,
            trace,
            outcome: Outcome::default(),
            objects: Objects::default(),
            binds: Arc::new(Mutex::new((0, 0))),
            tasks: Vec::new(),
            workers_set: format!("{}-workers", trace.prefix),
            removed_nodes: BTreeSet::new(),
            tombstones: Tombstones::new(10_000),
            acked: HashMap::new(),
            lose_next: BTreeSet::new(),
            workers: BTreeSet::new(),
        }
    }

    /// Sends `commands` as the bridge does, recording what was acknowledged.
    async fn send(&mut self, commands: Vec<Command>) -> Result<(), tether_client::Error> {
        send_all(
            self.client,
            commands,
            &self.objects,
            &mut self.outcome,
            &mut self.acked,
        )
        .await
    }

    /// The pin key of worker `pod`.
    fn worker_pin(&self, pod: usize) -> pb::PinKey {
        pb::PinKey {
            set: self.workers_set.clone(),
            member: pod.to_string(),
        }
    }

    /// Starts a bind of `pod` through `key` (the node's lock); `applied`
    /// fires once Tether has its acquire.
    fn start_bind(
        &mut self,
        key: pb::LockKey,
        pod: &PodView,
        applied: tokio::sync::oneshot::Sender<()>,
    ) {
        let pb_pod = pb::Pod {
            uid: pod.uid.clone(),
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
        };
        self.tasks.push(tokio::spawn(bind(
            self.client.clone(),
            key,
            pb_pod,
            self.binds.clone(),
            applied,
        )));
    }

    async fn step(&mut self, step: &Step) -> Result<(), tether_client::Error> {
        match step {
            Step::Wait(ms) => tokio::time::sleep(Duration::from_millis(*ms)).await,
            Step::LoseNextReport(pod) => {
                self.lose_next.insert(*pod);
            }
            Step::AddNode(name) => {
                let view = NodeView {
                    name: name.clone(),
                    uid: format!("{name}-uid"),
                    labels: BTreeMap::from([("kubernetes.io/hostname".into(), name.clone())]),
                    ready: true,
                    unschedulable: false,
                };
                self.objects.nodes.insert(name.clone(), view.clone());
                self.send(node_change(None, Some(&view))).await?;
            }
            Step::RemoveNode(name) => {
                let old = self.objects.nodes.remove(name);
                self.removed_nodes.insert(name.clone());
                self.send(node_change(old.as_ref(), None)).await?;
            }
            Step::CreatePod { pod, node, worker } => self.create_pod(*pod, node, *worker).await?,
            Step::Bound(pod) | Step::Start(pod) | Step::Fail(pod) | Step::Delete(pod) => {
                self.pod_changes(step, *pod).await?
            }
            Step::LateBind(pod) => self.late_bind(*pod).await?,
            Step::Remove(pod) => self.remove_pod(*pod).await?,
        }
        Ok(())
    }

    async fn create_pod(
        &mut self,
        pod: usize,
        node: &str,
        worker: bool,
    ) -> Result<(), tether_client::Error> {
        let view = pod_view(self.trace, pod);
        self.objects
            .pods
            .insert(pod, (view.clone(), node.to_string()));
        if worker {
            self.workers.insert(pod);
            // Slinky-style: the worker is pinned to its node.
            self.client
                .assign(
                    &self.worker_pin(pod),
                    vec![node.to_string()],
                    &view.uid,
                    Duration::from_secs(60),
                    HashMap::new(),
                    pb::Affinity::default(),
                )
                .await?;
        }
        // The scheduler's bind takes the node's lock; the pod's next event
        // comes after it (the bind sets nodeName once it holds the lock). A
        // bind that lands after the pod's deletion is a step of its own
        // (`LateBind`).
        let (applied, in_log) = tokio::sync::oneshot::channel();
        self.start_bind(bind_key(node), &view, applied);
        let _ = tokio::time::timeout(Duration::from_secs(30), in_log).await;
        self.send(pod_change(None, Some(&view), true)).await
    }

    /// A bound, started, failed or deleted pod: the bridge's report (unless
    /// lost), and what must hold right after it.
    async fn pod_changes(&mut self, step: &Step, pod: usize) -> Result<(), tether_client::Error> {
        let change: &dyn Fn(&mut PodView) = match step {
            Step::Bound(_) => &|v| v.bound = true,
            // Containers run only on the node it was bound to.
            Step::Start(_) => &|v| {
                v.started = true;
                v.bound = true;
                v.phase = Phase::Running;
            },
            Step::Fail(_) => &|v| v.phase = Phase::Failed,
            _ => &|v| v.deleting = true,
        };
        // The pod's view before and after this step.
        let Some((old, node)) = self.objects.pods.get(&pod).cloned() else {
            return Ok(());
        };
        let mut new = old.clone();
        change(&mut new);
        self.objects.pods.insert(pod, (new.clone(), node.clone()));
        let mut commands = pod_change(Some(&old), Some(&new), true);
        if self.lose_next.remove(&pod) {
            let before = commands.len();
            commands.retain(|c| !matches!(c, Command::Pod { .. }));
            self.outcome.lost_reports += (before - commands.len()) as u64;
        }
        let ends = commands.iter().any(|c| {
            matches!(
                c,
                Command::Pod {
                    report: PodReport::Gone | PodReport::Terminal,
                    ..
                }
            )
        });
        self.send(commands).await?;
        if ends && involved(self.client, &bind_key(&node), &new.uid).await? {
            self.outcome.violations.push(format!(
                "{}: still holds or waits for {node}'s bind lock after its end was reported",
                new.uid
            ));
        }
        // A bound pod being deleted still exists: the kubelet runs or tears
        // down its containers and counts its devices.
        let terminating_bound = matches!(step, Step::Delete(_)) && new.bound;
        if terminating_bound && !new.phase.is_terminal() && self.workers.contains(&pod) {
            let stopped = self
                .client
                .get_pin(&self.worker_pin(pod))
                .await?
                .is_none_or(|pin| pin.owner() == pb::OwnerState::OwnerStopped);
            if stopped {
                self.outcome.violations.push(format!(
                    "{}: bound and being deleted (its object still exists), yet Tether \
                     already counts its pin's owner stopped",
                    new.uid
                ));
            }
        }
        Ok(())
    }

    /// A bind that lands after its pod was deleted: the bridge's tombstones
    /// must end it as soon as it learns of it.
    async fn late_bind(&mut self, pod: usize) -> Result<(), tether_client::Error> {
        let Some((old, node)) = self.objects.removed.get(&pod).cloned() else {
            return Ok(());
        };
        let key = bind_key(&node);
        // Waited for below, through Tether's state.
        let (applied, _) = tokio::sync::oneshot::channel();
        self.start_bind(key.clone(), &old, applied);
        // The bridge learns of the grant or the wait from Tether's events;
        // here: once Tether shows it.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !involved(self.client, &key, &old.uid).await?
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let late = late_interest(&old.uid, None, &self.tombstones);
        self.send(late.into_iter().collect()).await?;
        if involved(self.client, &key, &old.uid).await? {
            self.outcome.violations.push(format!(
                "{}: a bind that landed after the pod's deletion still holds or waits for {node}'s lock",
                old.uid
            ));
        }
        Ok(())
    }

    /// The pod object is gone: the bridge reports it (and keeps a
    /// tombstone); right after, it neither holds nor waits for its lock.
    async fn remove_pod(&mut self, pod: usize) -> Result<(), tether_client::Error> {
        let Some((old, node)) = self.objects.pods.remove(&pod) else {
            return Ok(());
        };
        self.lose_next.remove(&pod);
        self.tombstones.record(&old.uid);
        self.objects
            .removed
            .insert(pod, (old.clone(), node.clone()));
        self.send(pod_change(Some(&old), None, true)).await?;
        if involved(self.client, &bind_key(&node), &old.uid).await? {
            self.outcome.violations.push(format!(
                "{}: still holds or waits for {node}'s bind lock after its deletion was reported",
                old.uid
            ));
        }
        Ok(())
    }

    /// The bridge's resync: what Tether refers to against what exists.
    async fn resync(&mut self) -> Result<(), tether_client::Error> {
        let client = self.client;
        let prefix = &self.trace.prefix;
        let locks: Vec<pb::LockState> = client
            .list(BIND_SCOPE)
            .await?
            .into_iter()
            .filter(|l| l.key.as_ref().is_some_and(|k| k.name.starts_with(prefix)))
            .collect();
        let pins = client.list_pins(&self.workers_set, "").await?;
        let interest = Interest::from_state(&locks, &pins);
        let live = LiveView {
            pod_uids: self
                .objects
                .pods
                .values()
                .map(|(v, _)| v.uid.clone())
                .collect(),
            nodes: self.objects.nodes.clone(),
        };
        let registry: BTreeMap<String, String> = client
            .list_nodes(false)
            .await?
            .into_iter()
            .filter(|n| n.name.starts_with(prefix))
            .map(|n| (n.name, n.uid))
            .collect();
        let tether = TetherView {
            pod_uids: interest.uids().clone(),
            nodes: registry,
        };
        // Reports Tether has not acknowledged for pods it cares about (the
        // lost ones among them), then the orphans: candidates confirmed as
        // the bridge confirms them, seen deleted or by a GET of the name
        // (here: the simulated objects).
        let cache: HashMap<String, PodView> = self
            .objects
            .pods
            .values()
            .map(|(view, _)| (view.uid.clone(), view.clone()))
            .collect();
        let mut commands = pod_corrections(interest.uids(), &cache, &self.acked);
        self.outcome.corrections = commands.len() as u64;
        commands.extend(missing_joins(&tether, &live));
        for uid in pod_candidates(&tether, &live) {
            if self.tombstones.contains(&uid) {
                commands.push(Command::Pod {
                    uid,
                    report: PodReport::Gone,
                });
            } else if let Some((namespace, name)) = interest.name_of(&uid) {
                commands.extend(confirm_pod(&uid, self.objects.pod_lookup(namespace, name)));
            }
        }
        for (name, uid) in node_candidates(&tether, &live) {
            commands.extend(confirm_node(&name, &uid, self.objects.node_lookup(&name)));
        }
        self.send(commands).await
    }

    /// Synced: nothing refers to what is gone or terminal, and every pin's
    /// owner state is what the API server shows.
    async fn check_synced(&mut self) -> Result<(), tether_client::Error> {
        let client = self.client;
        let violations = &mut self.outcome.violations;
        let live_uids: BTreeSet<String> = self
            .objects
            .pods
            .values()
            .filter(|(v, _)| !v.phase.is_terminal())
            .map(|(v, _)| v.uid.clone())
            .collect();
        for lock in client.list(BIND_SCOPE).await? {
            let Some(key) = lock
                .key
                .as_ref()
                .filter(|k| k.name.starts_with(&self.trace.prefix))
            else {
                continue;
            };
            let holder = lock.holder.as_ref().and_then(|h| h.pod.as_ref());
            if let Some(pod) = holder {
                if !live_uids.contains(&pod.uid) {
                    violations.push(format!("{}: held by {}, which is gone", key.name, pod.uid));
                }
                if self.removed_nodes.contains(&key.name) {
                    violations.push(format!(
                        "{}: the node is gone but {} holds its lock",
                        key.name, pod.uid
                    ));
                }
            }
            for waiter in lock.waiters.iter().filter_map(|w| w.pod.as_ref()) {
                if !live_uids.contains(&waiter.uid) {
                    violations.push(format!(
                        "{}: {} waits for it but is gone",
                        key.name, waiter.uid
                    ));
                }
            }
        }
        for pin in client.list_pins(&self.workers_set, "").await? {
            if self.removed_nodes.contains(&pin.node) {
                violations.push(format!(
                    "pin {:?} is on {}, which is gone",
                    pin.key.as_ref().map(|k| &k.member),
                    pin.node
                ));
            }
            // What the API server shows of the owner, as Tether's owner state.
            let shown = match self
                .objects
                .pods
                .values()
                .find(|(v, _)| v.uid == pin.pod_uid)
            {
                None => Some(pb::OwnerState::OwnerStopped),
                Some((view, _)) => view.state().report().map(|report| match report {
                    PodReport::Starting => pb::OwnerState::OwnerStarting,
                    PodReport::Running => pb::OwnerState::OwnerRunning,
                    PodReport::Terminal | PodReport::Gone => pb::OwnerState::OwnerStopped,
                }),
            };
            if let Some(shown) = shown.filter(|shown| *shown != pin.owner()) {
                violations.push(format!(
                    "pin {:?}: Tether says its owner {} is {:?}, the API server shows {:?}",
                    pin.key.as_ref().map(|k| &k.member),
                    pin.pod_uid,
                    pin.owner(),
                    shown
                ));
            }
        }
        Ok(())
    }

    /// The node locks' logs, through the history checkers.
    async fn check_node_logs(&mut self) -> Result<(), tether_client::Error> {
        let mut events = BTreeMap::new();
        for node in self.objects.nodes.keys().chain(self.removed_nodes.iter()) {
            let key = format!("lock/{BIND_SCOPE}/{node}");
            let from = pb::Revision { index: 0, sub: 0 };
            let list = crate::runner::events_of(self.client, None, &key, from)
                .await
                .map_err(|e| tether_client::Error::Other(format!("{e:#}")))?
                .ok_or_else(|| {
                    tether_client::Error::Other(format!(
                        "the event log of {key} no longer reaches back to the trace's start"
                    ))
                })?;
            events.insert(key, list);
        }
        let evidence = Evidence {
            events,
            events_complete: true,
            ..Evidence::default()
        };
        for (name, found) in [
            (
                "mutual_exclusion",
                checkers::mutual_exclusion::check(&evidence),
            ),
            ("tokens", checkers::tokens::check(&evidence)),
            ("fifo", checkers::fifo::check(&evidence)),
        ] {
            self.outcome
                .violations
                .extend(found.into_iter().map(|v| format!("{name}: {v}")));
        }
        Ok(())
    }
}

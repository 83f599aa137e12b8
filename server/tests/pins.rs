//! Pins, the node registry, pod reports, watch and history on a 3-replica
//! in-process cluster.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use common::{Cluster, DEADLINE, lock, pod};
use tether_client::proto::watch_service_client::WatchServiceClient;
use tether_client::proto::{self as pb, Outcome, PodPhase};
use tether_client::{Client, Error, WatchUpdate};

fn pin_key(member: &str) -> pb::PinKey {
    pb::PinKey {
        set: "slurm/nodeset-a".into(),
        member: member.into(),
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

async fn report_node(client: &Client, name: &str, zone: Option<&str>, state: pb::NodeState) {
    let labels: HashMap<String, String> = zone
        .map(|z| ("zone".to_string(), z.to_string()))
        .into_iter()
        .collect();
    let request = pb::ReportNodeRequest {
        name: name.into(),
        uid: format!("uid-{name}"),
        state: state as i32,
        set_labels: true,
        labels,
        ..Default::default()
    };
    client.report_node(request).await.unwrap();
}

async fn assign(
    client: &Client,
    member: &str,
    pod_uid: &str,
    candidates: &[&str],
    lifetime: Duration,
) -> Result<pb::AssignResponse, Error> {
    let candidates = candidates.iter().map(|c| c.to_string()).collect();
    client
        .assign(
            &pin_key(member),
            candidates,
            pod_uid,
            lifetime,
            HashMap::new(),
            pb::Affinity::default(),
        )
        .await
}

/// Polls `check` until it holds or the deadline passes.
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn assign_is_idempotent_and_pins_survive_pod_restarts() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let first = assign(&client, "0", "pod-a", &["node-1", "node-2"], Duration::ZERO)
        .await
        .unwrap();
    assert!(first.created);
    let again = assign(&client, "0", "pod-a", &["node-2"], Duration::ZERO)
        .await
        .unwrap();
    assert!(!again.created);
    assert_eq!(again.pin.as_ref().unwrap().node, "node-1");
    // The pod is deleted and recreated: a permanent pin stays.
    client.report_pod("pod-a", PodPhase::PodGone).await.unwrap();
    let recreated = assign(&client, "0", "pod-b", &["node-2"], Duration::ZERO)
        .await
        .unwrap();
    assert!(!recreated.created);
    let pin = recreated.pin.unwrap();
    assert_eq!(pin.node, "node-1");
    assert_eq!(pin.pod_uid, "pod-b");
    assert_eq!(
        client
            .get_pin(&pin_key("0"))
            .await
            .unwrap()
            .unwrap()
            .pod_uid,
        "pod-b"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_pods_short_lived_pin_ends_without_waiting_for_the_sweep_interval() {
    // The leader looks for what is due every hour here: only a look made
    // when the pod stops can end its pin within the test's deadline.
    let cluster = Cluster::start_with(3, |config| {
        config.sweep_interval = Duration::from_secs(3600);
    })
    .await;
    let client = common::client(&cluster);
    // A GPU claim's lifetime: it ends as soon as its pod has stopped.
    let lifetime = Duration::from_millis(1);
    for (member, pod) in [
        ("0", "pod-gone"),
        ("1", "pod-terminal"),
        ("2", "pod-running"),
    ] {
        assign(&client, member, pod, &["node-1"], lifetime)
            .await
            .unwrap();
        client.report_pod(pod, PodPhase::PodRunning).await.unwrap();
    }
    // Deleted, then ended: each stop ends the pod's pin.
    for (member, pod, phase) in [
        ("0", "pod-gone", PodPhase::PodGone),
        ("1", "pod-terminal", PodPhase::PodTerminal),
    ] {
        client.report_pod(pod, phase).await.unwrap();
        eventually(&format!("{pod}'s pin ends"), async || {
            client.get_pin(&pin_key(member)).await.unwrap().is_none()
        })
        .await;
    }
    // A running pod's pin stays.
    assert!(client.get_pin(&pin_key("2")).await.unwrap().is_some());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pin_lifetime_runs_only_after_the_pod_stops_and_silence_never_unpins() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let lifetime = Duration::from_millis(1500);
    assign(&client, "0", "pod-a", &["node-1"], lifetime)
        .await
        .unwrap();
    assign(&client, "1", "pod-silent", &["node-1"], lifetime)
        .await
        .unwrap();
    client
        .report_pod("pod-a", PodPhase::PodRunning)
        .await
        .unwrap();
    // Well past the lifetime: a running pod, and a pod nobody reports on
    // (bridge unreachable), both keep their pins.
    tokio::time::sleep(lifetime * 3).await;
    assert!(
        client.get_pin(&pin_key("0")).await.unwrap().is_some(),
        "running pod lost its pin"
    );
    assert!(
        client.get_pin(&pin_key("1")).await.unwrap().is_some(),
        "silence unpinned"
    );
    // The countdown starts at the report's committed (leader-stamped) time,
    // which is after this instant and before the call returns.
    let stopped_at = tokio::time::Instant::now();
    client
        .report_pod("pod-a", PodPhase::PodTerminal)
        .await
        .unwrap();
    eventually("the pin expires after its lifetime", async || {
        client.get_pin(&pin_key("0")).await.unwrap().is_none()
    })
    .await;
    assert!(
        stopped_at.elapsed() >= lifetime,
        "expired before its lifetime"
    );
    assert!(client.get_pin(&pin_key("1")).await.unwrap().is_some());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_gone_releases_pins_and_the_next_assign_picks_a_live_candidate() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    report_node(&client, "node-1", None, pb::NodeState::NodeReady).await;
    report_node(&client, "node-2", None, pb::NodeState::NodeReady).await;
    let pin = assign(&client, "3", "pod-a", &["node-1", "node-2"], Duration::ZERO)
        .await
        .unwrap()
        .pin
        .unwrap();
    assert_eq!(pin.node, "node-1");
    let hold = client
        .acquire(&lock("node-1"), &pod("binding"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(hold.token > 0);

    let request = pb::ReportNodeRequest {
        name: "node-1".into(),
        state: pb::NodeState::NodeGone as i32,
        ..Default::default()
    };
    let reply = client.report_node(request.clone()).await.unwrap();
    assert_eq!((reply.pins_released, reply.locks_released), (1, 1));
    assert!(client.get_pin(&pin_key("3")).await.unwrap().is_none());
    assert!(client.holder(&lock("node-1")).await.unwrap().is_none());
    // Idempotent.
    assert!(!client.report_node(request).await.unwrap().changed);
    let repinned = assign(&client, "3", "pod-a", &["node-1", "node-2"], Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(repinned.pin.unwrap().node, "node-2");
    let nodes: Vec<String> = client
        .list_nodes(false)
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.name)
        .collect();
    assert_eq!(nodes, ["node-2"]);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_in_with_gaps_then_out_again_reuses_the_old_pins() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let nodes = names("node-", 4);
    let mut placed = BTreeMap::new();
    for member in 0..4 {
        // Each member prefers a different node first.
        let mut candidates: Vec<&str> = nodes.iter().map(String::as_str).collect();
        candidates.rotate_left(member);
        let pin = assign(
            &client,
            &member.to_string(),
            &format!("pod-{member}"),
            &candidates,
            Duration::ZERO,
        )
        .await
        .unwrap()
        .pin
        .unwrap();
        placed.insert(member, pin.node);
    }
    // Scale 4 -> 2 removing members 1 and 3 (not highest-first: gaps).
    for member in [1, 3] {
        client
            .report_pod(&format!("pod-{member}"), PodPhase::PodGone)
            .await
            .unwrap();
    }
    let pins = client.list_pins("slurm/nodeset-a", "").await.unwrap();
    assert_eq!(pins.len(), 4, "permanent pins outlive their pods");
    // Scale back to 4: new pods, same nodes.
    for member in [1, 3] {
        let pin = assign(
            &client,
            &member.to_string(),
            &format!("pod-{member}-new"),
            &["node-0"],
            Duration::ZERO,
        )
        .await
        .unwrap()
        .pin
        .unwrap();
        assert_eq!(pin.node, placed[&member], "member {member} moved");
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_assigners_never_break_required_anti_affinity_by_zone() {
    let cluster = Cluster::start(3).await;
    let client = Arc::new(common::client(&cluster));
    const ZONES: usize = 200;
    let nodes = names("node-", ZONES + 10);
    for (i, node) in nodes.iter().enumerate() {
        report_node(
            &client,
            node,
            Some(&format!("zone-{}", i % ZONES)),
            pb::NodeState::NodeReady,
        )
        .await;
    }
    let term = pb::AffinityTerm {
        label_selector: Some(pb::LabelSelector {
            match_labels: HashMap::from([("app".into(), "slurmd".into())]),
            ..Default::default()
        }),
        topology_key: "zone".into(),
    };
    let affinity = pb::Affinity {
        required_anti: vec![term],
        ..Default::default()
    };
    let mut tasks = Vec::new();
    for assigner in 0..2usize {
        let (client, nodes, affinity) = (client.clone(), nodes.clone(), affinity.clone());
        tasks.push(tokio::spawn(async move {
            for member in (assigner..ZONES).step_by(2) {
                // Both assigners favour the same few nodes first, so they
                // race for the same zones.
                let mut candidates = nodes.clone();
                candidates.rotate_left(member % 7);
                let labels = HashMap::from([("app".to_string(), "slurmd".to_string())]);
                client
                    .assign(
                        &pin_key(&member.to_string()),
                        candidates,
                        "",
                        Duration::ZERO,
                        labels,
                        affinity.clone(),
                    )
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let pins = client.list_pins("slurm/nodeset-a", "").await.unwrap();
    assert_eq!(pins.len(), ZONES);
    let node_zone: HashMap<&String, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n, i % ZONES))
        .collect();
    let zones: BTreeSet<usize> = pins.iter().map(|p| node_zone[&p.node]).collect();
    assert_eq!(zones.len(), ZONES, "two pins share a zone");
    // Zones have run out: the error says so for each candidate.
    let labels = HashMap::from([("app".to_string(), "slurmd".to_string())]);
    let err = client
        .assign(
            &pin_key("extra"),
            nodes[..3].to_vec(),
            "",
            Duration::ZERO,
            labels,
            affinity,
        )
        .await
        .unwrap_err();
    let Error::ResourceExhausted(message) = &err else {
        panic!("{err}")
    };
    assert!(
        message.contains("no candidate node fits pin slurm/nodeset-a/extra"),
        "{message}"
    );
    assert!(
        message.contains("node-0: pin slurm/nodeset-a/"),
        "{message}"
    );
    assert!(message.contains("zone=zone-0"), "{message}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watch_resumes_without_gaps_across_a_leader_change() {
    let mut cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    // The watcher talks to the leader first, so stopping the leader breaks
    // its stream and it must resume elsewhere.
    let leader = cluster.wait_leader().await;
    let mut endpoints = vec![cluster.addrs[&leader].to_string()];
    endpoints.extend(
        cluster
            .addrs
            .iter()
            .filter(|(id, _)| **id != leader)
            .map(|(_, a)| a.to_string()),
    );
    let watch_client = Client::new(
        endpoints,
        tether_client::Options {
            retry_timeout: DEADLINE,
            ..Default::default()
        },
    )
    .unwrap();
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    // The start revision is fixed here, before the first acquire: a watch
    // opened inside the task could start after the first grant and miss it.
    let mut watch = watch_client.watch(None, vec![], "lock/").await.unwrap();
    let watcher = tokio::spawn(async move {
        loop {
            match watch.next().await {
                Ok(WatchUpdate::Events(batch)) => {
                    for event in batch {
                        if seen_tx.send(event).is_err() {
                            return;
                        }
                    }
                }
                Ok(WatchUpdate::Relist { .. }) => panic!("the watch reported a gap"),
                Err(err) => panic!("watch failed: {err}"),
            }
        }
    });
    let key = lock("node-w");
    let mut tokens = Vec::new();
    let mut seen: Vec<pb::Event> = Vec::new();
    for round in 0..10 {
        if round == 5 {
            // Make sure the watcher is streaming from the leader, then stop it.
            while seen.is_empty() {
                seen.push(
                    tokio::time::timeout(DEADLINE, seen_rx.recv())
                        .await
                        .expect("watch stalled")
                        .unwrap(),
                );
            }
            cluster.stop(leader).await;
            cluster.wait_leader().await;
        }
        let hold = client
            .acquire(&key, &pod(&format!("p{round}")), vec![], Duration::ZERO, 0)
            .await
            .unwrap();
        client
            .release(&key, &format!("p{round}"), hold.token, Outcome::Allocated)
            .await
            .unwrap();
        tokens.push(hold.token);
    }
    while seen.iter().filter(|e| e.kind == "LockReleased").count() < 10 {
        seen.push(
            tokio::time::timeout(DEADLINE, seen_rx.recv())
                .await
                .expect("watch stalled")
                .unwrap(),
        );
    }
    watcher.abort();
    let revisions: Vec<(u64, u32)> = seen
        .iter()
        .map(|e| {
            let r = e.revision.unwrap();
            (r.index, r.sub)
        })
        .collect();
    assert!(
        revisions.windows(2).all(|w| w[0] < w[1]),
        "out of order or repeated: {revisions:?}"
    );
    let granted: Vec<u64> = seen
        .iter()
        .filter(|e| e.kind == "LockGranted")
        .map(|e| e.token)
        .collect();
    assert_eq!(granted, tokens, "every grant seen once, in order");
    // Compare with what a surviving replica stored: nothing missing.
    let leader = cluster.wait_leader().await;
    let stored = tether_server::store::read_events(
        &cluster.node(leader).core().db().unwrap(),
        tether_server::sm::Revision { index: 0, sub: 0 },
        10_000,
    )
    .unwrap();
    let stored_lock: Vec<(u64, u32)> = stored
        .iter()
        .map(tether_server::api::convert::event_to)
        .filter(|e| e.key.starts_with("lock/"))
        .map(|e| (e.revision.unwrap().index, e.revision.unwrap().sub))
        .collect();
    assert_eq!(
        revisions, stored_lock,
        "the watch skipped or invented events"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watch_from_a_compacted_revision_gets_the_compaction_error() {
    let cluster = Cluster::start_with(3, |c| c.event_retention_entries = 5).await;
    let client = common::client(&cluster);
    for i in 0..20 {
        client
            .acquire(
                &lock(&format!("n{i}")),
                &pod("u"),
                vec![],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
    }
    client.snapshot().await.unwrap();
    // On the wire: OUT_OF_RANGE carrying the compact revision.
    let leader = cluster.wait_leader().await;
    let mut raw = WatchServiceClient::connect(format!("http://{}", cluster.addrs[&leader]))
        .await
        .unwrap();
    let request = pb::WatchRequest {
        start: Some(pb::Revision { index: 1, sub: 0 }),
        ..Default::default()
    };
    let status = raw.watch(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange);
    let compact: u64 = status
        .metadata()
        .get(pb::COMPACT_REVISION_METADATA)
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(compact > 1, "{compact}");
    assert!(status.message().contains("re-list"), "{}", status.message());

    // The client's watcher asks for a re-list, then carries on from now.
    let mut watch = client
        .watch(Some(pb::Revision { index: 1, sub: 0 }), vec![], "")
        .await
        .unwrap();
    let WatchUpdate::Relist {
        oldest_retained,
        resume_at,
    } = watch.next().await.unwrap()
    else {
        panic!("expected a re-list request")
    };
    assert_eq!(oldest_retained, compact);
    client
        .acquire(&lock("after"), &pod("u"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let WatchUpdate::Events(events) = watch.next().await.unwrap() else {
        panic!("expected events")
    };
    assert!(events[0].revision.unwrap().index >= resume_at.index);
    assert_eq!(events[0].key, "lock/gpu-bind/after");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn history_answers_who_held_a_lock_across_snapshot_and_restart() {
    let mut cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let key = lock("node-7");
    let a = client
        .acquire(&key, &pod("alice"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    client
        .release(&key, "alice", a.token, Outcome::Allocated)
        .await
        .unwrap();
    client
        .acquire(&key, &pod("bob"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    client
        .force_release(&key, "ops", "stuck after reboot")
        .await
        .unwrap();
    client
        .acquire(&key, &pod("carol"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    client.revoke_pod("carol", "pod deleted").await.unwrap();
    client.snapshot().await.unwrap();
    for id in [1, 2, 3] {
        cluster.stop(id).await;
    }
    for id in [1, 2, 3] {
        cluster.restart(id).await;
    }
    cluster.wait_leader().await;
    let client = common::client(&cluster);
    let history = client.history("lock/gpu-bind/node-7", 0, 0).await.unwrap();
    let story: Vec<(String, String, String)> = history
        .events
        .iter()
        .map(|e| {
            (
                e.kind.clone(),
                e.pod.clone().unwrap_or_default().uid,
                e.reason.clone(),
            )
        })
        .collect();
    let expected = [
        ("LockGranted", "alice", ""),
        ("LockReleased", "alice", "released (Allocated)"),
        ("LockGranted", "bob", ""),
        (
            "LockReleased",
            "bob",
            "force-released by ops: stuck after reboot",
        ),
        ("LockGranted", "carol", ""),
        ("LockReleased", "carol", "pod revoked: pod deleted"),
    ];
    let expected: Vec<(String, String, String)> = expected
        .iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect();
    assert_eq!(story, expected);
    cluster.shutdown().await;
}

/// The device plugin's claim correction on a cordoned node: the kubelet
/// admitted pod A with the device pod B's stale claim names. Made in steps
/// (release A's claim, assign it again), the second step is refused on a
/// cordoned node and A is left without a claim; `Reclaim` does it in one
/// entry, whatever the node's schedulability: A's claim names what it got
/// and B's stale claim loses that device (released, as it names no other).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_correction_on_a_cordoned_node_is_one_step_that_cannot_be_refused_halfway() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    report_node(&client, "gpu-1", None, pb::NodeState::NodeJoined).await;
    report_node(&client, "gpu-1", None, pb::NodeState::NodeReady).await;
    let claim_key = |uid: &str| pb::PinKey {
        set: "gpu-devices".into(),
        member: uid.into(),
    };
    let device_labels = |devices: &[&str]| -> HashMap<String, String> {
        devices
            .iter()
            .map(|d| (format!("devices.tether.io/{d}"), "held".to_string()))
            .collect()
    };
    for (uid, device) in [("pod-a", "gpu0"), ("pod-b", "gpu1")] {
        client
            .assign(
                &claim_key(uid),
                vec!["gpu-1".into()],
                uid,
                Duration::from_secs(1),
                device_labels(&[device]),
                pb::Affinity::default(),
            )
            .await
            .unwrap();
    }
    // Cordoned (the bridge reports spec.unschedulable).
    client
        .report_node(pb::ReportNodeRequest {
            name: "gpu-1".into(),
            uid: "uid-gpu-1".into(),
            state: pb::NodeState::NodeJoined as i32,
            unschedulable: Some(true),
            ..Default::default()
        })
        .await
        .unwrap();
    // In steps, the claim made again is refused on the cordoned node.
    let refused = client
        .assign(
            &claim_key("pod-c"),
            vec!["gpu-1".into()],
            "pod-c",
            Duration::from_secs(1),
            device_labels(&["gpu2"]),
            pb::Affinity::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(refused, Error::ResourceExhausted(_)), "{refused}");
    // In one step: the kubelet gave pod A gpu1.
    let done = client
        .reclaim(
            &claim_key("pod-a"),
            "gpu-1",
            "pod-a",
            Duration::from_secs(1),
            device_labels(&["gpu1"]),
            "devices.tether.io/",
        )
        .await
        .unwrap();
    let pin = done.pin.unwrap();
    assert_eq!(
        pin.labels.keys().collect::<Vec<_>>(),
        ["devices.tether.io/gpu1"]
    );
    assert_eq!(
        done.previous.unwrap().labels.keys().collect::<Vec<_>>(),
        ["devices.tether.io/gpu0"]
    );
    assert_eq!(done.taken.len(), 1);
    assert_eq!(done.taken[0].key.as_ref().unwrap().member, "pod-b");
    let claims = client.list_pins("gpu-devices", "gpu-1").await.unwrap();
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!(claims[0].pod_uid, "pod-a");
    // Again: nothing more to do.
    let again = client
        .reclaim(
            &claim_key("pod-a"),
            "gpu-1",
            "pod-a",
            Duration::from_secs(1),
            device_labels(&["gpu1"]),
            "devices.tether.io/",
        )
        .await
        .unwrap();
    assert!(again.taken.is_empty());
    assert_eq!(again.pin, again.previous);
    cluster.shutdown().await;
}

/// Pod "claimer" with a pin on node-1 in slurm/nodeset-a, holding
/// node-1's lock: the pin and the hold.
async fn claimer_holding_node_1(client: &Client) -> (pb::Pin, tether_client::Held) {
    report_node(client, "node-1", None, pb::NodeState::NodeReady).await;
    let pin = assign(client, "claimer", "claimer", &["node-1"], Duration::ZERO)
        .await
        .unwrap()
        .pin
        .unwrap();
    let held = client
        .acquire(&lock("node-1"), &pod("claimer"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    (pin, held)
}

/// The device plugin's steering read (`HolderRequest.unconfirmed`): the
/// leader answers the hold and claim a linearizable read gives, from its
/// applied state, without a ReadIndex round (its round counter does not
/// move); a follower sends the caller to the leader, as for a
/// linearizable read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unconfirmed_holder_read_is_the_leaders_without_a_read_round() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let (pin, held) = claimer_holding_node_1(&client).await;
    let linearizable = client
        .holder_and_claim(&lock("node-1"), "slurm/nodeset-a")
        .await
        .unwrap();

    let leader = cluster.wait_leader().await;
    let rounds = || {
        let text = cluster.node(leader).core().metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix("tether_read_index_rounds_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let before = rounds();
    assert!(
        before > 0.0,
        "the linearizable read ran no round on the leader"
    );
    let unconfirmed = client
        .holder_and_claim_unconfirmed(&lock("node-1"), "slurm/nodeset-a")
        .await
        .unwrap();
    assert_eq!(unconfirmed, linearizable);
    let (hold, claim) = unconfirmed;
    assert_eq!(hold.map(|h| h.token), Some(held.token));
    assert_eq!(claim, Some(pin));
    assert_eq!(
        rounds(),
        before,
        "the unconfirmed read ran a ReadIndex round"
    );
    // The answer says it is not linearizable.
    let mut raw = tether_client::proto::lock_service_client::LockServiceClient::connect(format!(
        "http://{}",
        cluster.addrs[&leader]
    ))
    .await
    .unwrap();
    let request = pb::HolderRequest {
        key: Some(lock("node-1")),
        claim_set: "slurm/nodeset-a".into(),
        unconfirmed: true,
    };
    let answer = raw.holder(request.clone()).await.unwrap().into_inner();
    assert!(!answer.header.unwrap().linearizable);

    let follower = *cluster
        .addrs
        .keys()
        .find(|id| **id != leader)
        .expect("a follower");
    let mut raw = tether_client::proto::lock_service_client::LockServiceClient::connect(format!(
        "http://{}",
        cluster.addrs[&follower]
    ))
    .await
    .unwrap();
    let refused = raw.holder(request).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    cluster.shutdown().await;
}

/// The device plugin's one read: a lock's holder and the holder's pin in a
/// claims set, from one state. A holder without a pin there, a free lock
/// and a set name that is not valid are answered as such; the bad set
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_holder_and_its_claim_are_read_together() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let (pin, held) = claimer_holding_node_1(&client).await;

    let (hold, claim) = client
        .holder_and_claim(&lock("node-1"), "slurm/nodeset-a")
        .await
        .unwrap();
    let hold = hold.expect("the lock is held");
    assert_eq!(hold.pod.unwrap().uid, "claimer");
    assert_eq!(hold.token, held.token);
    assert_eq!(claim, Some(pin));

    // The answer says the pin was looked for, so the client needs no
    // second read.
    let mut raw = tether_client::proto::lock_service_client::LockServiceClient::connect(format!(
        "http://{}",
        cluster.addrs[&cluster.wait_leader().await]
    ))
    .await
    .unwrap();
    let answer = raw
        .holder(pb::HolderRequest {
            key: Some(lock("node-1")),
            claim_set: "slurm/other-set".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.claim_read && answer.claim.is_none() && answer.hold.is_some());
    let plain = raw
        .holder(pb::HolderRequest {
            key: Some(lock("node-1")),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!plain.claim_read && plain.claim.is_none() && plain.hold.is_some());

    let free = client
        .holder_and_claim(&lock("node-2"), "slurm/nodeset-a")
        .await
        .unwrap();
    assert_eq!(free, (None, None));

    let refused = client
        .holder_and_claim(&lock("node-1"), "Not A Set")
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::InvalidArgument(m) if m.contains("pin set")),
        "{refused:?}"
    );
    assert_eq!(
        client.holder(&lock("node-1")).await.unwrap().unwrap().token,
        held.token
    );
    cluster.shutdown().await;
}

//! The bridge against a protocol-faithful fake Kubernetes API (real
//! `kube::Client` over HTTP) and a 3-replica Tether.

mod fake_apiserver;

use std::sync::Arc;
use std::time::Duration;

use fake_apiserver::{FakeApi, node, pod};
use tether_client::proto::{self as pb, LockKey, Pod};
use tether_client::{Client, Options, WatchUpdate};
use tether_k8s_bridge::bridge::Bridge;
use tether_server::testing::{Cluster, DEADLINE};
use tokio::task::JoinHandle;

struct Rig {
    cluster: Cluster,
    client: Client,
    api: Arc<FakeApi>,
    bridge: Option<(Arc<Bridge>, JoinHandle<()>)>,
}

fn key(node: &str) -> LockKey {
    LockKey {
        scope: "gpu-bind".into(),
        name: node.into(),
    }
}

fn tether_pod(name: &str) -> Pod {
    Pod {
        uid: format!("uid-{name}"),
        namespace: "ml".into(),
        name: name.into(),
    }
}

async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Rig {
    async fn start() -> Rig {
        let cluster = Cluster::start(3).await;
        let client = Client::new(
            cluster.endpoints(),
            Options {
                retry_timeout: DEADLINE,
                ..Options::default()
            },
        )
        .unwrap();
        let api = FakeApi::start().await;
        let mut rig = Rig {
            cluster,
            client,
            api,
            bridge: None,
        };
        rig.start_bridge();
        rig
    }

    /// A new bridge between the fake API and the cluster, running.
    fn spawn_bridge(&self) -> (Arc<Bridge>, JoinHandle<()>) {
        let options = Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        };
        let tether = Client::new(self.cluster.endpoints(), options).unwrap();
        let bridge = Bridge::new(tether, self.api.client());
        let task = tokio::spawn(
            bridge
                .clone()
                .run(Duration::from_secs(3600), std::future::pending()),
        );
        (bridge, task)
    }

    fn start_bridge(&mut self) {
        self.bridge = Some(self.spawn_bridge());
    }

    fn stop_bridge(&mut self) {
        if let Some((_, task)) = self.bridge.take() {
            task.abort();
        }
    }

    fn bridge(&self) -> &Bridge {
        &self.bridge.as_ref().expect("bridge running").0
    }

    /// Waits until the bridge knows Tether cares about `uid`.
    async fn until_interesting(&self, uid: &str) {
        eventually("the bridge to learn the pod", async || {
            self.bridge().is_interesting(uid)
        })
        .await;
    }

    async fn holder(&self, node: &str) -> Option<String> {
        self.client
            .holder(&key(node))
            .await
            .unwrap()
            .map(|h| h.pod.unwrap().name)
    }

    async fn shutdown(mut self) {
        self.stop_bridge();
        self.cluster.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owner_deleted_right_after_acquire_hands_the_lock_to_the_next_waiter() {
    let rig = Rig::start().await;
    rig.api.put_pod(pod("owner", "uid-owner", "Pending", false));
    rig.api.put_pod(pod("next", "uid-next", "Pending", false));
    rig.client
        .acquire(&key("n1"), &tether_pod("owner"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let client = rig.client.clone();
    let next = tokio::spawn(async move {
        client
            .acquire(&key("n1"), &tether_pod("next"), vec![], DEADLINE, 0)
            .await
    });
    rig.until_interesting("uid-owner").await;
    let deleted_at = std::time::Instant::now();
    rig.api.delete_pod("ml", "owner");
    let held = next.await.unwrap().expect("the next waiter is granted");
    println!(
        "pod delete event -> next waiter granted in {:?}",
        deleted_at.elapsed()
    );
    assert_eq!(held.pod_uid(), "uid-next");
    // The bridge counts the revoke once Tether's answer reaches it, which
    // can be just after the waiter saw its grant.
    eventually("the revoke to be counted", async || {
        !rig.bridge()
            .render_metrics()
            .contains("tether_bridge_commands_total 0\n")
    })
    .await;
    assert!(
        rig.bridge()
            .render_metrics()
            .contains("tether_bridge_lag_seconds_count")
    );
    eventually("both lists done", async || rig.bridge().healthy()).await;
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_that_lands_after_its_pods_deletion_is_released_at_once() {
    let rig = Rig::start().await;
    eventually("both lists done", async || rig.bridge().healthy()).await;
    rig.api.put_pod(pod("late", "uid-late", "Pending", false));
    rig.api.delete_pod("ml", "late");
    eventually("the bridge to see the deletion", async || {
        rig.bridge().knows_deleted("uid-late")
    })
    .await;
    // The scheduler lost the race: its bind arrives after the deletion,
    // when no pod event will ever mention the pod again.
    let granted_at = std::time::Instant::now();
    rig.client
        .acquire(&key("n1"), &tether_pod("late"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    eventually("the late hold to be released", async || {
        rig.holder("n1").await.is_none()
    })
    .await;
    // Well before the resync (an hour in this rig) would have found it.
    println!(
        "late bind granted -> released in {:?}",
        granted_at.elapsed()
    );
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_pod_releases_its_hold() {
    let rig = Rig::start().await;
    rig.api.put_pod(pod("job", "uid-job", "Running", true));
    rig.client
        .acquire(&key("n1"), &tether_pod("job"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    rig.until_interesting("uid-job").await;
    rig.api.put_pod(pod("job", "uid-job", "Failed", false));
    eventually("the failed pod's hold to go", async || {
        rig.holder("n1").await.is_none()
    })
    .await;
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_deleted_while_the_bridge_was_down_is_released_when_it_is_back() {
    let mut rig = Rig::start().await;
    rig.api.put_pod(pod("ghost", "uid-ghost", "Pending", false));
    rig.api.put_pod(pod("alive", "uid-alive", "Pending", false));
    rig.client
        .acquire(&key("n1"), &tether_pod("ghost"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    rig.client
        .acquire(&key("n2"), &tether_pod("alive"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    rig.stop_bridge();
    rig.api.delete_pod("ml", "ghost");
    rig.start_bridge();
    eventually("the orphaned hold to be released", async || {
        rig.holder("n1").await.is_none()
    })
    .await;
    assert_eq!(
        rig.holder("n2").await.as_deref(),
        Some("alive"),
        "a live pod keeps its hold"
    );
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_410_relist_misses_nothing_and_releases_nothing_twice() {
    let rig = Rig::start().await;
    rig.api.put_pod(pod("lost", "uid-lost", "Pending", false));
    rig.api.put_pod(pod("kept", "uid-kept", "Pending", false));
    let lost = rig
        .client
        .acquire(&key("n1"), &tether_pod("lost"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    rig.client
        .acquire(&key("n2"), &tether_pod("kept"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    rig.until_interesting("uid-lost").await;
    // The delete happens while the watch is broken and its history is
    // compacted: the re-watch gets 410 Gone, the bridge re-lists.
    rig.api.delete_pod_silently("ml", "lost");
    eventually("the relist to release the lost pod", async || {
        rig.holder("n1").await.is_none()
    })
    .await;
    assert_eq!(rig.holder("n2").await.as_deref(), Some("kept"));
    // Another relist finds nothing more to do.
    rig.api.compact();
    rig.api.break_watches();
    rig.api
        .put_pod(pod("marker", "uid-marker", "Pending", false));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let history = rig.client.history("lock/gpu-bind/n1", 0, 0).await.unwrap();
    let releases = history
        .events
        .iter()
        .filter(|e| e.kind == "LockReleased" && e.token == lost.token())
        .count();
    assert_eq!(releases, 1, "released exactly once");
    assert_eq!(rig.holder("n2").await.as_deref(), Some("kept"));
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_node_loses_its_pins_and_the_next_assign_picks_a_live_node() {
    let rig = Rig::start().await;
    rig.api.put_node(node("n1", true, "a"));
    rig.api.put_node(node("n2", true, "b"));
    eventually("both nodes in the registry", async || {
        rig.client.list_nodes(false).await.unwrap().len() == 2
    })
    .await;
    let pin_key = pb::PinKey {
        set: "slurm/set-a".into(),
        member: "0".into(),
    };
    let candidates = vec!["n1".to_string(), "n2".to_string()];
    let pin = rig
        .client
        .assign(
            &pin_key,
            candidates.clone(),
            "",
            Duration::ZERO,
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(pin.pin.unwrap().node, "n1");
    rig.api.delete_node("n1");
    eventually("the pin to be released", async || {
        rig.client.get_pin(&pin_key).await.unwrap().is_none()
    })
    .await;
    let pin = rig
        .client
        .assign(
            &pin_key,
            candidates,
            "",
            Duration::ZERO,
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(pin.pin.unwrap().node, "n2");
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_joining_and_becoming_ready_is_seen_on_tethers_watch() {
    let rig = Rig::start().await;
    let mut watch = rig
        .client
        .watch(None, vec!["NodeJoined".into(), "NodeReady".into()], "node/")
        .await
        .unwrap();
    rig.api.put_node(node("n3", false, "c"));
    rig.api.put_node(node("n3", true, "c"));
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match tokio::time::timeout(DEADLINE, watch.next())
            .await
            .expect("watch stalled")
            .unwrap()
        {
            WatchUpdate::Events(events) => {
                seen.extend(events.into_iter().map(|e| (e.kind, e.node)))
            }
            WatchUpdate::Relist { .. } => panic!("unexpected gap"),
        }
    }
    assert_eq!(
        seen,
        [
            ("NodeJoined".to_string(), "n3".to_string()),
            ("NodeReady".to_string(), "n3".to_string())
        ]
    );
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_bridges_at_once_release_a_deleted_owner_exactly_once() {
    let mut rig = Rig::start().await;
    // A second, independent bridge on the same cluster (active-active).
    let (second, second_task) = rig.spawn_bridge();
    rig.api.put_pod(pod("owner", "uid-owner", "Pending", false));
    rig.api.put_pod(pod("next", "uid-next", "Pending", false));
    let first = rig
        .client
        .acquire(&key("n1"), &tether_pod("owner"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let client = rig.client.clone();
    let next = tokio::spawn(async move {
        client
            .acquire(&key("n1"), &tether_pod("next"), vec![], DEADLINE, 0)
            .await
    });
    rig.until_interesting("uid-owner").await;
    eventually("the second bridge to learn the pod", async || {
        second.is_interesting("uid-owner")
    })
    .await;
    rig.api.delete_pod("ml", "owner");
    let held = next.await.unwrap().expect("the next waiter is granted");
    assert_eq!(held.pod_uid(), "uid-next");
    // Both bridges act on the same events (each sends its reports); the
    // lock still changes hands once.
    eventually("both bridges to have sent commands", async || {
        let sent = |b: &Bridge| {
            b.metrics
                .commands_sent
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        sent(rig.bridge()) > 0 && sent(&second) > 0
    })
    .await;
    let history = rig.client.history("lock/gpu-bind/n1", 0, 0).await.unwrap();
    let releases: Vec<u64> = history
        .events
        .iter()
        .filter(|e| e.kind == "LockReleased")
        .map(|e| e.token)
        .collect();
    assert_eq!(releases, [first.token()], "released exactly once");
    assert_eq!(rig.holder("n1").await.as_deref(), Some("next"));
    second_task.abort();
    rig.stop_bridge();
    rig.shutdown().await;
}

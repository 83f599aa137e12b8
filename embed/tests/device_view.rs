//! The extender's watched copy of the claims and inventories
//! (`tether_embed::device_view`) against a real 3-replica cluster: after
//! every kind of change to those pins — a claim made, a claim's pod
//! reported running then stopped, a claim ended, a claim corrected to
//! other devices, an inventory published, published again by a new plugin
//! pod (its pin taken over) — the copy comes to answer what Tether answers
//! when read directly, within [`FOLLOWS_WITHIN`], well before the copy's
//! own resync could hide a missed event; and once its follower stops, the
//! copy is no longer read.
//!
//! The planted bugs `device-view-ignores-pod-reports` (the copy skips pod
//! reports, so a stopped pod's claims stay taken) and
//! `device-view-assignments-lose-labels` (the copy applies a claim made
//! from its event without the labels that name its devices) must be caught
//! by the same check.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_client::proto as pb;
use tether_client::{Client, Options};
use tether_embed::accounting::{ClaimOwner, DeviceLedger};
use tether_embed::device_view::{DeviceView, Pins, RESYNC};
use tether_embed::inventory::{
    DeviceSource, INVENTORY_SET, Inventory, publish, published_inventories,
};
use tether_server::testing::Cluster;

/// How soon the copy must follow a change: far below [`RESYNC`].
const FOLLOWS_WITHIN: Duration = Duration::from_secs(4);

/// One test at a time: a planted bug is on for the whole process.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Rig {
    cluster: Cluster,
    client: Client,
    ledger: DeviceLedger,
    view: Arc<DeviceView>,
    follower: tokio::task::JoinHandle<()>,
}

impl Rig {
    /// A cluster with claims on two nodes already made, and a copy that
    /// starts following after them (its first list has them).
    async fn start() -> Rig {
        let cluster = Cluster::start(3).await;
        cluster.wait_leader().await;
        let client = Client::new(cluster.endpoints(), Options::default()).expect("a client");
        let ledger = DeviceLedger::new(client.clone(), Duration::from_secs(600));
        claim(&ledger, "n1", "a", &["gpu0", "gpu1"]).await;
        claim(&ledger, "n2", "b", &["gpu0"]).await;
        let view = Arc::new(DeviceView::new(client.clone()));
        let follower = tokio::spawn(view.clone().follow());
        Rig {
            cluster,
            client,
            ledger,
            view,
            follower,
        }
    }

    async fn claim(&self, node: &str, uid: &str, devices: &[&str]) {
        claim(&self.ledger, node, uid, devices).await;
    }

    async fn report(&self, uid: &str, phase: pb::PodPhase) {
        self.client.report_pod(uid, phase).await.expect("a report");
    }

    async fn publish(&self, node: &str, plugin_pod: &str, devices: &[&str]) {
        let source = DeviceSource::Fake(devices.iter().map(|d| d.to_string()).collect());
        let inventory = Inventory::read(&source).expect("fake devices");
        publish(&self.client, INVENTORY_SET, node, plugin_pod, &inventory)
            .await
            .expect("published");
    }

    /// Where the copy and a direct read differ now (None: they agree).
    async fn difference(&self) -> Option<String> {
        let Some(copy_claims) = self.view.read(Pins::live_claims_by_node) else {
            return Some("the copy has not listed yet".into());
        };
        let claims = self.ledger.live_claims_by_node().await.expect("claims");
        if copy_claims != claims {
            return Some(format!(
                "claims: the copy has {copy_claims:?}, Tether {claims:?}"
            ));
        }
        let published = published_inventories(&self.client, INVENTORY_SET)
            .await
            .expect("inventories");
        for (node, devices) in &published {
            let copy = self.view.read(|pins| pins.published(node)).flatten();
            if copy.as_ref() != Some(devices) {
                return Some(format!(
                    "node {node}'s inventory: the copy has {copy:?}, Tether {devices:?}"
                ));
            }
        }
        None
    }

    /// Waits up to `within` for the copy to agree with Tether; the last
    /// difference if it never did.
    async fn follows(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let Some(difference) = self.difference().await else {
                return Ok(());
            };
            if Instant::now() > deadline {
                return Err(difference);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn must_follow(&self, after: &str) {
        if let Err(difference) = self.follows(FOLLOWS_WITHIN).await {
            panic!(
                "after {after}, the copy did not follow within {FOLLOWS_WITHIN:?}: {difference}"
            );
        }
    }

    async fn shutdown(self) {
        self.follower.abort();
        self.cluster.shutdown().await;
    }
}

async fn claim(ledger: &DeviceLedger, node: &str, uid: &str, devices: &[&str]) {
    let devices: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
    ledger
        .claim(node, owner(uid), &devices)
        .await
        .expect("a claim");
}

fn owner(uid: &str) -> ClaimOwner<'_> {
    ClaimOwner {
        uid,
        namespace: "ml",
        name: uid,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_copy_follows_every_change_to_claims_and_inventories() {
    // Each change must be followed by its event, not by the resync.
    assert!(FOLLOWS_WITHIN * 2 < RESYNC);
    let _turn = TURN.lock().await;
    let rig = Rig::start().await;
    rig.must_follow("the first list").await;

    rig.claim("n1", "c", &["gpu2"]).await;
    rig.must_follow("a claim made").await;

    rig.report("a", pb::PodPhase::PodRunning).await;
    rig.must_follow("a claim's pod reported running").await;
    rig.report("a", pb::PodPhase::PodTerminal).await;
    rig.must_follow("a claim's pod reported stopped").await;
    let n1 = rig
        .view
        .read(|pins| pins.live_claims("n1"))
        .expect("listed");
    assert!(
        !n1.values().any(|uid| uid == "a"),
        "a stopped pod's devices count free: {n1:?}"
    );

    // Reported running again (a report after a revoke the bridge took
    // back): its claims count again.
    rig.report("a", pb::PodPhase::PodRunning).await;
    rig.must_follow("a stopped claim's pod reported running again")
        .await;
    rig.report("a", pb::PodPhase::PodGone).await;
    rig.must_follow("a claim's pod reported gone").await;

    rig.ledger.release("b", "test").await.expect("released");
    rig.must_follow("a claim ended").await;

    let corrected = rig
        .ledger
        .correct("n1", owner("c"), &["gpu3".to_string()])
        .await
        .expect("corrected");
    println!("correction: {corrected:?}");
    rig.must_follow("a claim corrected to other devices").await;
    assert_eq!(
        rig.view
            .read(|pins| pins.live_claims("n1"))
            .expect("listed"),
        BTreeMap::from([("gpu3".to_string(), "c".to_string())])
    );

    rig.publish("n1", "plugin-1", &["gpu0", "gpu1", "gpu2", "gpu3"])
        .await;
    rig.must_follow("an inventory published").await;
    rig.publish("n1", "plugin-2", &["gpu0", "gpu1"]).await;
    rig.must_follow("an inventory published again by a new plugin pod")
        .await;
    let published = rig.view.read(|pins| pins.published("n1")).expect("listed");
    assert_eq!(
        published
            .unwrap_or_default()
            .iter()
            .map(|d| d.id.as_str())
            .collect::<Vec<_>>(),
        ["gpu0", "gpu1"]
    );

    // A copy nobody follows any more (its extender stopped while a
    // connection of the scheduler still reaches it) is not read: it would
    // go stale.
    rig.follower.abort();
    let deadline = Instant::now() + FOLLOWS_WITHIN;
    while rig.view.read(|_| ()).is_some() {
        assert!(
            Instant::now() < deadline,
            "the unfollowed copy still reads as whole"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn planted_a_copy_that_ignores_pod_reports_is_caught() {
    struct Planted;
    impl Drop for Planted {
        fn drop(&mut self) {
            fail::remove("device-view-ignores-pod-reports");
        }
    }
    let _turn = TURN.lock().await;
    fail::cfg("device-view-ignores-pod-reports", "return").expect("a failpoint action");
    let _planted = Planted;
    let rig = Rig::start().await;
    rig.must_follow("the first list").await;
    rig.report("a", pb::PodPhase::PodTerminal).await;
    // Below the resync, which would hide the bug.
    let caught = rig.follows(FOLLOWS_WITHIN).await;
    println!("with device-view-ignores-pod-reports: {caught:?}");
    assert!(
        caught.is_err_and(|difference| difference.starts_with("claims:")),
        "the planted bug went unnoticed"
    );
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn planted_a_copy_that_applies_assignments_without_their_labels_is_caught() {
    struct Planted;
    impl Drop for Planted {
        fn drop(&mut self) {
            fail::remove("device-view-assignments-lose-labels");
        }
    }
    let _turn = TURN.lock().await;
    fail::cfg("device-view-assignments-lose-labels", "return").expect("a failpoint action");
    let _planted = Planted;
    let rig = Rig::start().await;
    rig.must_follow("the first list").await;
    rig.claim("n1", "c", &["gpu2"]).await;
    // Below the resync, which would hide the bug.
    let caught = rig.follows(FOLLOWS_WITHIN).await;
    println!("with device-view-assignments-lose-labels: {caught:?}");
    assert!(
        caught.is_err_and(|difference| difference.starts_with("claims:")),
        "the planted bug went unnoticed"
    );
    rig.shutdown().await;
}

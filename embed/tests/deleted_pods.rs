//! The extender's copy of the claims (`tether_embed::device_view`) counts
//! a pod's claims free as soon as the extender's own pod watch
//! (`KubeBinder::follow_deletions`, on the real API server) sees the pod's
//! object deleted, before Tether hears of it: kube-scheduler frees the
//! pod's devices from that same event and asks the filter about a waiting
//! pod at once. No bridge runs here, so Tether never hears: the claim stays
//! live in Tether while the copy counts it free, and the copy forgets the
//! pod once its claim ends. A deleted pod that had no claim is not
//! remembered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use tether_client::{Client, Options};
use tether_embed::accounting::{ClaimOwner, DeviceLedger};
use tether_embed::device_view::{DeviceView, Pins};
use tether_embed::extender::{Binder, KubeBinder};
use tether_kube_testenv::ControlPlane;
use tether_server::testing::Cluster;

/// Generous on a loaded 2-core machine: a watch event and a re-summary.
const WITHIN: Duration = Duration::from_secs(20);

async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WITHIN;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn create_pod(pods: &Api<Pod>, name: &str) -> String {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "none"}]},
    }))
    .expect("a pod");
    let created = pods
        .create(&PostParams::default(), &pod)
        .await
        .expect("the pod created");
    created.metadata.uid.expect("a uid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pods_claim_counts_free_in_the_copy_before_tether_hears() {
    let Some(plane) = ControlPlane::shared_or_skip(
        "a_deleted_pods_claim_counts_free_in_the_copy_before_tether_hears",
    ) else {
        return;
    };
    let namespace = plane.namespace("deleted").await;
    let kube = plane.client().await;
    let pods: Api<Pod> = Api::namespaced(kube.clone(), &namespace);
    let cluster = Cluster::start(3).await;
    cluster.wait_leader().await;
    let client = Client::new(cluster.endpoints(), Options::default()).expect("a client");
    let ledger = DeviceLedger::new(client.clone(), Duration::from_secs(600));

    let claimed = create_pod(&pods, "claimed").await;
    let unclaimed = create_pod(&pods, "unclaimed").await;
    let owner = ClaimOwner {
        uid: &claimed,
        namespace: &namespace,
        name: "claimed",
    };
    ledger
        .claim("n1", owner, &["gpu0".to_string()])
        .await
        .expect("a claim");

    let view = Arc::new(DeviceView::new(client.clone()));
    let follower = tokio::spawn(view.clone().follow());
    let live = |view: &DeviceView| {
        view.read(|pins: &Pins| pins.live_claims("n1"))
            .unwrap_or_default()
    };
    until("the copy lists the claim", || {
        live(&view).get("gpu0") == Some(&claimed)
    })
    .await;

    let binder = KubeBinder::new(kube.clone());
    let marked = view.clone();
    let watch = tokio::spawn(async move {
        binder
            .follow_deletions(Arc::new(move |uid: &str| marked.pod_deleted(uid)))
            .await
    });
    let now_free = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    // A deletion before the watch has listed is seen by nobody: probe
    // with claimed pods on another node until one's deletion is seen.
    let mut probe = 0;
    loop {
        probe += 1;
        assert!(probe <= 10, "the pod watch saw none of 10 probes deleted");
        let name = format!("probe-{probe}");
        let uid = create_pod(&pods, &name).await;
        let owner = ClaimOwner {
            uid: &uid,
            namespace: &namespace,
            name: &name,
        };
        ledger
            .claim("n2", owner, &[format!("gpu{probe}")])
            .await
            .expect("a probe's claim");
        until("the copy lists the probe's claim", || {
            view.read(|pins: &Pins| pins.live_claims("n2"))
                .unwrap_or_default()
                .values()
                .any(|by| *by == uid)
        })
        .await;
        pods.delete(&name, &now_free).await.expect("deleted");
        let seen_by = Instant::now() + Duration::from_secs(3);
        while !view.is_deleted(&uid) && Instant::now() < seen_by {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if view.is_deleted(&uid) {
            break;
        }
    }
    pods.delete("unclaimed", &now_free).await.expect("deleted");
    pods.delete("claimed", &now_free).await.expect("deleted");
    until("the copy counts the deleted pod's device free", || {
        live(&view).is_empty()
    })
    .await;
    assert!(view.is_deleted(&claimed));
    assert!(
        !view.is_deleted(&unclaimed),
        "a pod with no claim is not remembered"
    );
    // Tether has not heard (no bridge): the claim is live there.
    let in_tether = ledger.claims_on("n1").await.expect("a read");
    let by = in_tether.get("gpu0").expect("the claim is still in Tether");
    assert_eq!(by.pod_uid, claimed);
    assert!(!by.owner_stopped, "no report reached Tether: {by:?}");

    // The claim ends: nothing is left to count stopped.
    ledger.release(&claimed, "test").await.expect("released");
    until("the copy forgets the deleted pod", || {
        !view.is_deleted(&claimed)
    })
    .await;

    watch.abort();
    follower.abort();
    let _ = watch.await;
    let _ = follower.await;
    // Stopped before the runtime ends, as the other tests on a `Cluster`
    // do: replicas dropped with the process (RocksDB's threads still
    // running) crashed it at exit once in CI, after the test had passed.
    cluster.shutdown().await;
}

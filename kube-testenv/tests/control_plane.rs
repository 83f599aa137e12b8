//! The harness itself against the real binaries: a plane starts and serves,
//! service accounts get exactly the RBAC granted to them, the API server
//! comes back after a stop, a compaction makes old resourceVersions 410 Gone,
//! and no process outlives a test process that dies without cleaning up.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use tether_kube_testenv::{ControlPlane, watch_error_code};

/// Set in the child run of `the_watchdog_helper_aborts_holding_a_plane`.
const HELPER_VAR: &str = "TETHER_TESTENV_WATCHDOG_HELPER";

fn config_map(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}})).unwrap()
}

#[tokio::test]
async fn a_shared_plane_serves_namespaces_and_service_accounts_get_only_their_rbac() {
    let Some(plane) = ControlPlane::shared_or_skip(
        "a_shared_plane_serves_namespaces_and_service_accounts_get_only_their_rbac",
    ) else {
        return;
    };
    println!("shared control plane ready in {:?}", plane.started_in);
    let namespace = plane.namespace("harness").await;
    let admin = plane.client().await;
    let maps: Api<ConfigMap> = Api::namespaced(admin.clone(), &namespace);
    maps.create(&PostParams::default(), &config_map("one"))
        .await
        .unwrap();
    assert_eq!(
        maps.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );

    // A service account with no RBAC is refused, as on a real cluster.
    let account = plane.client_as_service_account(&namespace, "nobody").await;
    let pods: Api<Pod> = Api::namespaced(account, &namespace);
    match pods.list(&ListParams::default()).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{e:?}"),
        other => panic!("a service account without RBAC listed pods: {other:?}"),
    }
}

#[tokio::test]
async fn the_api_server_comes_back_after_a_stop_and_compaction_expires_old_versions() {
    let Some(plane) = ControlPlane::start_or_skip(
        "the_api_server_comes_back_after_a_stop_and_compaction_expires_old_versions",
    )
    .await
    else {
        return;
    };
    let namespace = plane.namespace("outage").await;
    let maps: Api<ConfigMap> = Api::namespaced(plane.client().await, &namespace);
    let first = maps
        .create(&PostParams::default(), &config_map("before"))
        .await
        .unwrap();
    plane.stop_apiserver();
    assert!(
        maps.get("before").await.is_err(),
        "the API server answered while stopped"
    );
    plane.start_apiserver().await.unwrap();
    let maps: Api<ConfigMap> = Api::namespaced(plane.client().await, &namespace);
    assert_eq!(
        maps.get("before").await.unwrap().metadata.uid,
        first.metadata.uid
    );
    maps.create(&PostParams::default(), &config_map("after"))
        .await
        .unwrap();
    let revision = plane.compact_etcd().await.unwrap();
    assert!(revision > 0);
    // A restarted API server's watch cache starts at etcd's current
    // revision, and etcd no longer has the history before it: a watch from
    // the old resourceVersion answers 410 Gone.
    plane.stop_apiserver();
    plane.start_apiserver().await.unwrap();
    let maps: Api<ConfigMap> = Api::namespaced(plane.client().await, &namespace);
    let old = first.metadata.resource_version.unwrap();
    assert_eq!(watch_error_code(&maps, &old).await, Some(410));
}

/// Runs the helper below in a child test process that aborts (no unwinding,
/// no destructor) while it holds a control plane, and checks that etcd and
/// the API server are gone soon after.
#[tokio::test]
async fn a_test_process_that_dies_leaves_no_control_plane_behind() {
    if std::env::var_os(HELPER_VAR).is_some() {
        return;
    }
    if tether_kube_testenv::assets_or_skip(
        "a_test_process_that_dies_leaves_no_control_plane_behind",
    )
    .is_none()
    {
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "the_watchdog_helper_aborts_holding_a_plane",
            "--nocapture",
            "--include-ignored",
        ])
        .env(HELPER_VAR, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "the helper was meant to abort");
    let pids: Vec<u32> = stdout
        .lines()
        .find_map(|line| line.strip_prefix("plane pids: "))
        .unwrap_or_else(|| {
            panic!(
                "the helper printed no pids:\n{stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            )
        })
        .split(',')
        .map(|pid| pid.parse().unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while pids
        .iter()
        .any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
    {
        assert!(
            Instant::now() < deadline,
            "processes {pids:?} outlived their test process"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Only does something in the child run of the test above.
#[tokio::test]
#[ignore = "run by a_test_process_that_dies_leaves_no_control_plane_behind"]
async fn the_watchdog_helper_aborts_holding_a_plane() {
    if std::env::var_os(HELPER_VAR).is_none() {
        return;
    }
    let plane = ControlPlane::start().await.unwrap();
    println!(
        "plane pids: {},{}",
        plane.etcd().id(),
        plane.apiserver_id().unwrap()
    );
    std::process::abort();
}

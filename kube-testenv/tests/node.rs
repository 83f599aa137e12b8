//! A real node (kubelet + containerd) beside a real control plane: it
//! registers Ready, runs a pod from the local images whose output is read
//! from the kubelet's log files, and leaves no process, cgroup or mount
//! behind when dropped.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use tether_kube_testenv::node::BUSYBOX_IMAGE;
use tether_kube_testenv::{ControlPlane, NodeOptions, RealNode, node_assets_or_skip};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_node_runs_a_pod_and_leaves_nothing_behind() {
    let test = "a_real_node_runs_a_pod_and_leaves_nothing_behind";
    let (Some(_), Some(plane)) = (
        node_assets_or_skip(test),
        ControlPlane::shared_or_skip(test),
    ) else {
        return;
    };
    let namespace = plane.namespace("real-node").await;
    let options = NodeOptions {
        device_nodes: vec![("tether-test0".into(), 1, 3)],
    };
    let node = RealNode::start(plane, "real-node-1", options)
        .await
        .expect("the node starts");
    println!("node Ready {:?} after start", node.started_in);
    assert!(
        node.namespace_path("/dev/tether-test0").exists(),
        "the device node exists in the node's namespace"
    );
    assert!(
        !std::path::Path::new("/dev/tether-test0").exists(),
        "and only there"
    );
    let pods: Api<Pod> = Api::namespaced(plane.client().await, &namespace);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "hello"},
        "spec": {
            "nodeName": node.name(),
            "hostNetwork": true,
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", "echo hello from a real node"],
            }],
        },
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let phase = pods
            .get("hello")
            .await
            .unwrap()
            .status
            .and_then(|s| s.phase)
            .unwrap_or_default();
        if phase == "Succeeded" {
            break;
        }
        assert_ne!(phase, "Failed", "{}", node.log_tails(30));
        assert!(
            Instant::now() < deadline,
            "the pod did not succeed (phase {phase:?}):\n{}",
            node.log_tails(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        node.container_log(&namespace, "hello", "main"),
        "hello from a real node\n"
    );
    let cgroup = format!("/sys/fs/cgroup/pids/{}", node.cgroup());
    let plugin_dir = node.device_plugin_dir();
    assert!(plugin_dir.exists(), "the kubelet made its plugin directory");
    drop(node);
    assert!(
        !std::path::Path::new(&cgroup).exists(),
        "the node's cgroup tree is removed"
    );
    assert!(!plugin_dir.exists(), "the node's namespace is gone");
}

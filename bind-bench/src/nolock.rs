//! The floor: the extender's path with no lock and no device planning.
//! Its filter passes the scheduler's candidates through (kube-scheduler has
//! already kept the nodes whose allocatable GPUs fit), its bind is the
//! `pods/binding` call alone, and each node's plugin answers `Allocate`
//! with the devices the kubelet picked. What is left is what the scheduler,
//! the API server and the kubelet cost: the floor no lock can go below.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use serde_json::json;
use tether_embed::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
};

/// The extender of the floor.
pub struct NoLockExtender {
    client: kube::Client,
}

impl NoLockExtender {
    /// Binding through `client` (no client-side rate limit).
    pub fn new(client: kube::Client) -> Arc<NoLockExtender> {
        Arc::new(NoLockExtender { client })
    }

    async fn bind(&self, args: ExtenderBindingArgs) -> ExtenderBindingResult {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &args.pod_namespace);
        let binding = json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        });
        match pods
            .create_subresource::<_, serde_json::Value>(
                "binding",
                &args.pod_name,
                &Default::default(),
                &binding,
            )
            .await
        {
            Ok(_) => ExtenderBindingResult {
                error: String::new(),
            },
            Err(e) => ExtenderBindingResult {
                error: format!("binding the pod: {e}"),
            },
        }
    }
}

impl crate::verbs::Verbs for NoLockExtender {
    /// The scheduler's candidates, as they came.
    async fn filter(&self, args: ExtenderArgs) -> ExtenderFilterResult {
        ExtenderFilterResult {
            node_names: args.node_names,
            nodes: args.nodes,
            ..Default::default()
        }
    }

    async fn bind(&self, args: ExtenderBindingArgs) -> ExtenderBindingResult {
        NoLockExtender::bind(self, args).await
    }
}

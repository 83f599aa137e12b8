//! The scheduler-extender `bind` verb on Tether.
//!
//! kube-scheduler POSTs `ExtenderBindingArgs` to the extender's bind URL. The
//! extender takes `gpu-bind/<node>` for the pod's UID with the device plan as
//! payload — waiting its turn in Tether's FIFO queue, pushed the grant, rather
//! than failing and letting the scheduler retry — then binds the pod through
//! the Kubernetes API. The lock is kept on success: the device plugin's
//! `Allocate` reads it to learn the pod and releases it. On any failure the
//! extender releases with outcome `failed` (the Unreserve path) and returns
//! the error, so kube-scheduler backs off and retries.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tether_client::proto::{LockKey, Outcome, Pod};
use tether_client::{Client, Error};
use tokio::net::TcpListener;

use crate::plan::Planner;
use tether_client::http::{HttpRequest, HttpResponse, serve};

/// What kube-scheduler sends to the bind verb.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingArgs {
    /// Pod name.
    #[serde(rename = "PodName")]
    pub pod_name: String,
    /// Pod namespace.
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node chosen.
    #[serde(rename = "Node")]
    pub node: String,
}

/// What the bind verb answers; an empty error means bound.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    /// Why binding failed ("" on success).
    #[serde(rename = "Error")]
    pub error: String,
}

/// Binds a pod to a node (the `pods/binding` subresource).
pub trait Binder: Send + Sync + 'static {
    /// Binds; an error is returned to the scheduler as text.
    fn bind(&self, args: &ExtenderBindingArgs) -> impl Future<Output = Result<(), String>> + Send;
}

/// Binds through the Kubernetes API with kube-rs.
pub struct KubeBinder {
    client: kube::Client,
}

impl KubeBinder {
    /// A binder over a kube client (in-cluster config or a kubeconfig).
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl Binder for KubeBinder {
    async fn bind(&self, args: &ExtenderBindingArgs) -> Result<(), String> {
        use k8s_openapi::api::core::v1::Pod as KubePod;
        let pods: kube::Api<KubePod> =
            kube::Api::namespaced(self.client.clone(), &args.pod_namespace);
        let binding = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        });
        pods.create_subresource::<_, serde_json::Value>(
            "binding",
            &args.pod_name,
            &Default::default(),
            &binding,
        )
        .await
        .map(|_| ())
        .map_err(|e| {
            format!(
                "binding {}/{} to {} failed: {e}",
                args.pod_namespace, args.pod_name, args.node
            )
        })
    }
}

/// Extender settings.
#[derive(Debug, Clone)]
pub struct ExtenderConfig {
    /// Lock scope, e.g. `gpu-bind`.
    pub scope: String,
    /// How long a bind waits in the queue for the node's lock.
    pub wait: Duration,
    /// How device plans are chosen.
    pub planner: Planner,
}

/// The bind verb.
pub struct Extender<B> {
    client: Client,
    binder: B,
    config: ExtenderConfig,
}

impl<B: Binder> Extender<B> {
    /// An extender over a Tether client and a binder.
    pub fn new(client: Client, binder: B, config: ExtenderConfig) -> Self {
        Self {
            client,
            binder,
            config,
        }
    }

    /// Handles one bind: acquire (FIFO), bind, release on failure.
    pub async fn bind(&self, args: &ExtenderBindingArgs) -> ExtenderBindingResult {
        let started = Instant::now();
        let key = LockKey {
            scope: self.config.scope.clone(),
            name: args.node.clone(),
        };
        let pod = Pod {
            uid: args.pod_uid.clone(),
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
        };
        let plan = self
            .config
            .planner
            .plan(&args.pod_uid, &args.pod_namespace, &args.pod_name);
        let held = match self
            .client
            .acquire(&key, &pod, plan.to_payload(), self.config.wait, 0)
            .await
        {
            Ok(held) => held,
            Err(err) => {
                let error = match err {
                    Error::DeadlineExceeded(_) => format!(
                        "node {} is busy: {}/{} did not get {}/{} within {:?}; retry",
                        args.node,
                        args.pod_namespace,
                        args.pod_name,
                        key.scope,
                        key.name,
                        self.config.wait
                    ),
                    other => format!(
                        "cannot take {}/{} for {}/{}: {other}",
                        key.scope, key.name, args.pod_namespace, args.pod_name
                    ),
                };
                tracing::warn!(
                    pod_uid = args.pod_uid,
                    node = args.node,
                    error,
                    "bind refused"
                );
                return ExtenderBindingResult { error };
            }
        };
        let token = held.token();
        if let Err(error) = self.binder.bind(args).await {
            // Unreserve: give the node to the next waiter at once.
            if let Err(err) = held.release(Outcome::Failed).await {
                tracing::error!(pod_uid = args.pod_uid, node = args.node, token, %err, "release after a failed bind failed; the hold timeout or a pod revoke will free it");
            }
            tracing::warn!(
                pod_uid = args.pod_uid,
                node = args.node,
                token,
                error,
                "bind failed; lock released"
            );
            return ExtenderBindingResult { error };
        }
        tracing::info!(pod_uid = args.pod_uid, node = args.node, token, devices = ?plan.devices, elapsed_ms = started.elapsed().as_millis() as u64, "bound; lock kept for the device plugin");
        ExtenderBindingResult {
            error: String::new(),
        }
    }

    /// Handles one HTTP request: `POST .../bind` with `ExtenderBindingArgs`,
    /// `GET /health`.
    pub async fn handle(&self, request: HttpRequest) -> HttpResponse {
        match (request.method.as_str(), request.path.trim_end_matches('/')) {
            ("POST", path) if path.ends_with("/bind") => {
                let result = match serde_json::from_slice::<ExtenderBindingArgs>(&request.body) {
                    Ok(args) if args.pod_uid.is_empty() || args.node.is_empty() => {
                        ExtenderBindingResult {
                            error: "bind request without PodUID or Node".into(),
                        }
                    }
                    Ok(args) => self.bind(&args).await,
                    Err(err) => ExtenderBindingResult {
                        error: format!("malformed ExtenderBindingArgs: {err}"),
                    },
                };
                let body = serde_json::to_vec(&result).expect("a result always serializes");
                HttpResponse {
                    status: "200 OK",
                    content_type: "application/json",
                    body,
                }
            }
            ("GET", "/health") => HttpResponse {
                status: "200 OK",
                content_type: "text/plain",
                body: b"ok\n".to_vec(),
            },
            _ => HttpResponse {
                status: "404 Not Found",
                content_type: "text/plain",
                body: b"the extender serves POST /bind and GET /health\n".to_vec(),
            },
        }
    }
}

/// Serves the extender on `listener` until `shutdown` resolves.
pub async fn serve_extender<B: Binder>(
    listener: TcpListener,
    extender: Arc<Extender<B>>,
    shutdown: impl Future<Output = ()>,
) {
    let handler = Arc::new(move |request: HttpRequest| {
        let extender = extender.clone();
        async move { extender.handle(request).await }
    });
    serve(listener, handler, shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binding_args_use_the_schedulers_field_names() {
        let json = r#"{"PodName":"p","PodNamespace":"ns","PodUID":"u-1","Node":"n1"}"#;
        let args: ExtenderBindingArgs = serde_json::from_str(json).unwrap();
        assert_eq!(args.pod_uid, "u-1");
        assert_eq!(
            serde_json::to_string(&ExtenderBindingResult {
                error: String::new()
            })
            .unwrap(),
            r#"{"Error":""}"#
        );
    }
}

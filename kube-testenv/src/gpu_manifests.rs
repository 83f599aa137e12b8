//! The manifests of this checkout's `deploy/optional/gpu` (and the bridge's
//! RBAC in `deploy/base`) read as deployed, for the GPU suites on a real
//! kube-scheduler and the bind benchmark: the service accounts and RBAC of
//! the extender, the bridge and the scheduler, and the scheduler's
//! KubeSchedulerConfiguration pointed at a test's extender.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::{Value, json};

use crate::{ControlPlane, yaml_documents};

/// `deploy/<dir>/<file>` in this checkout.
fn deploy_file(dir: &str, file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(dir)
        .join(file)
}

/// `deploy/optional/gpu/<file>` in this checkout.
pub fn gpu_manifest(file: &str) -> PathBuf {
    deploy_file("optional/gpu", file)
}

/// The objects of `kinds` in `deploy/optional/gpu/<file>`.
pub fn objects_of(file: &str, kinds: &[&str]) -> anyhow::Result<Vec<Value>> {
    Ok(yaml_documents(&gpu_manifest(file))?
        .into_iter()
        .filter(|o| kinds.contains(&o["kind"].as_str().unwrap_or_default()))
        .collect())
}

/// The manifest's KubeSchedulerConfiguration with its one extender at
/// `extender` (the manifest's path kept) and the API server reached through
/// `kubeconfig`.
pub fn scheduler_config(extender: SocketAddr, kubeconfig: &Path) -> anyhow::Result<Value> {
    let config_map = objects_of("scheduler.yaml", &["ConfigMap"])?
        .into_iter()
        .next()
        .context("scheduler.yaml has no ConfigMap")?;
    let text = config_map["data"]["config.yaml"]
        .as_str()
        .context("the scheduler's ConfigMap has no config.yaml")?;
    let mut config: Value = serde_saphyr::from_str(text)?;
    let extenders = config["extenders"]
        .as_array_mut()
        .context("the scheduler's configuration has no extenders")?;
    anyhow::ensure!(
        extenders.len() == 1,
        "the scheduler's configuration has {} extenders, one expected",
        extenders.len()
    );
    let url = extenders[0]["urlPrefix"].as_str().unwrap_or_default();
    let path = url
        .splitn(4, '/')
        .nth(3)
        .context("the extender's urlPrefix has no path")?;
    extenders[0]["urlPrefix"] = json!(format!("http://{extender}/{path}"));
    config["clientConnection"] = json!({"kubeconfig": kubeconfig.display().to_string()});
    Ok(config)
}

/// Applies the service accounts and RBAC of the extender, the bridge and
/// the scheduler from the manifests, the accounts in `namespace` (where the
/// manifests' bindings name them: `tether-system`).
pub async fn apply_gpu_rbac(plane: &ControlPlane, namespace: &str) -> anyhow::Result<()> {
    let kinds = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"];
    let mut rbac = objects_of("extender.yaml", &kinds)?;
    rbac.extend(yaml_documents(&deploy_file("base", "bridge-rbac.yaml"))?);
    rbac.extend(objects_of("scheduler.yaml", &kinds)?);
    plane.apply(&rbac, namespace).await
}

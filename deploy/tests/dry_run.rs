//! The manifests against a real kube-apiserver v1.36 (`tether-kube-testenv`):
//! every object of every overlay and of `optional/*` passes a server-side
//! dry run (server-side apply with strict field validation, as `kubectl
//! apply --dry-run=server` validates), the TLS patch applies to the prod
//! overlay, and the real PodSecurity admission admits every pod template
//! under the `restricted` profile but the device plugin's, which its
//! manifest says needs `privileged`.
//!
//! Objects of custom resources (Prometheus Operator's, cert-manager's) are
//! set aside: their CRDs are not ours to install. The test names the exact
//! kinds it sets aside, so an object of a mistyped group is not skipped in
//! silence.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::Discovery;
use serde_json::{Value, json};
use tether_deploy::{kind, name, read_documents, render};
use tether_kube_testenv::ControlPlane;
use tether_kube_testenv::apply::{Mode, api_for, apply, gvk_of};

/// The namespace every overlay deploys to.
const NAMESPACE: &str = "tether-system";

/// API groups of custom resources whose CRDs come from their operators.
const CRD_GROUPS: &[&str] = &["monitoring.coreos.com", "cert-manager.io"];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// Creates `name` (with `labels`) for real, or leaves the one there.
async fn ensure_namespace(client: &kube::Client, name: &str, labels: Value) {
    let namespace: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("namespace {name}: {e}"),
    }
}

/// Every object of the manifests, by where it comes from.
fn all_manifests() -> Vec<(String, Vec<Value>)> {
    let mut sets = Vec::new();
    for overlay in [
        "overlays/dev",
        "overlays/prod",
        "overlays/prod-5",
        "optional/gpu",
    ] {
        let objects =
            render(&deploy_dir().join(overlay)).unwrap_or_else(|e| panic!("{overlay}: {e:#}"));
        sets.push((overlay.to_string(), objects));
    }
    for file in [
        "optional/monitoring/servicemonitor.yaml",
        "optional/monitoring/alerts.yaml",
        "optional/tls/certificates.yaml",
    ] {
        let objects = read_documents(&deploy_dir().join(file)).unwrap();
        sets.push((file.to_string(), objects));
    }
    sets
}

#[tokio::test]
async fn every_overlay_and_optional_part_passes_a_server_side_dry_run() {
    let Some(plane) = ControlPlane::shared_or_skip(
        "every_overlay_and_optional_part_passes_a_server_side_dry_run",
    ) else {
        return;
    };
    let client = plane.client().await;
    ensure_namespace(&client, NAMESPACE, json!({})).await;
    let discovery = Discovery::new(client.clone()).run().await.unwrap();
    let mut set_aside = BTreeSet::new();
    let mut checked = 0;
    let mut failures = Vec::new();
    for (source, objects) in all_manifests() {
        assert!(!objects.is_empty(), "{source}: no objects");
        for object in &objects {
            let gvk = gvk_of(object);
            if CRD_GROUPS.contains(&gvk.group.as_str()) {
                set_aside.insert(format!("{}/{}", gvk.group, gvk.kind));
                continue;
            }
            match apply(&client, &discovery, object, NAMESPACE, Mode::DryRun).await {
                Ok(_) => checked += 1,
                Err(e) => failures.push(format!("{source}: {e:#}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "refused by the API server:\n{}",
        failures.join("\n")
    );
    println!("{checked} objects passed a server-side dry run; set aside: {set_aside:?}");
    assert!(checked >= 30, "only {checked} objects checked");
    let expected: BTreeSet<String> = [
        "cert-manager.io/Certificate",
        "cert-manager.io/Issuer",
        "monitoring.coreos.com/PodMonitor",
        "monitoring.coreos.com/PrometheusRule",
        "monitoring.coreos.com/ServiceMonitor",
    ]
    .map(String::from)
    .into();
    assert_eq!(set_aside, expected);
}

/// `optional/tls/tls-patch.yaml` is a strategic-merge patch for an
/// overlay's `patches:`: applied (dry run) to the prod overlay's objects on
/// the API server, it mounts the Secret and sets `TETHER_TLS_DIR`.
#[tokio::test]
async fn the_tls_patch_applies_to_the_prod_overlay() {
    let Some(plane) = ControlPlane::shared_or_skip("the_tls_patch_applies_to_the_prod_overlay")
    else {
        return;
    };
    let client = plane.client().await;
    // A namespace of its own: the prod overlay is created for real here.
    let namespace = plane.namespace("tls-patch").await;
    let discovery = Discovery::new(client.clone()).run().await.unwrap();
    for mut object in render(&deploy_dir().join("overlays/prod")).unwrap() {
        if object["metadata"].get("namespace").is_some() {
            object["metadata"]["namespace"] = json!(namespace);
        }
        apply(&client, &discovery, &object, &namespace, Mode::ForReal)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
    let patches = read_documents(&deploy_dir().join("optional/tls/tls-patch.yaml")).unwrap();
    assert!(!patches.is_empty());
    for patch in &patches {
        let mut target = patch.clone();
        target["metadata"]["namespace"] = json!(namespace);
        let patched = api_for(&client, &discovery, &target, &namespace)
            .unwrap()
            .patch(
                name(patch),
                &PatchParams::default().dry_run().validation_strict(),
                &Patch::Strategic(patch),
            )
            .await
            .unwrap_or_else(|e| panic!("{} {}: {e}", kind(patch), name(patch)));
        let text = serde_json::to_string(&patched.data).unwrap();
        assert!(
            text.contains("TETHER_TLS_DIR"),
            "{} {}: the patch did not land: {text}",
            kind(patch),
            name(patch)
        );
        if kind(patch) == "StatefulSet" {
            // The probes follow the HTTP port to HTTPS, path and port kept.
            let container = &patched.data["spec"]["template"]["spec"]["containers"][0];
            for probe in ["readinessProbe", "livenessProbe"] {
                let get = &container[probe]["httpGet"];
                assert_eq!(get["scheme"], "HTTPS", "{probe}: {get}");
                assert_eq!(get["port"], "http", "{probe}: {get}");
            }
        }
    }
}

/// Every workload's pod template, created (dry run) as a Pod in a namespace
/// that enforces PodSecurity `restricted`: the API server's own PodSecurity
/// admission admits each, and refuses the device plugins' (host paths, and
/// root for the kubelet's socket directory), as their manifests say.
#[tokio::test]
async fn pod_security_restricted_admits_every_pod_but_the_device_plugins() {
    let Some(plane) = ControlPlane::shared_or_skip(
        "pod_security_restricted_admits_every_pod_but_the_device_plugins",
    ) else {
        return;
    };
    let client = plane.client().await;
    let restricted = "tether-restricted";
    ensure_namespace(
        &client,
        restricted,
        json!({"pod-security.kubernetes.io/enforce": "restricted",
               "pod-security.kubernetes.io/enforce-version": "latest"}),
    )
    .await;
    let pods: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        restricted,
        &kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&()),
    );
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    let mut objects = render(&deploy_dir().join("overlays/prod")).unwrap();
    objects.extend(render(&deploy_dir().join("optional/gpu")).unwrap());
    for object in &objects {
        if !["StatefulSet", "Deployment", "DaemonSet"].contains(&kind(object)) {
            continue;
        }
        let template = &object["spec"]["template"];
        let mut spec = template["spec"].clone();
        // The StatefulSet controller adds a volume per claim template,
        // naming the claim `<template>-<set>-<ordinal>`.
        for claim in object["spec"]["volumeClaimTemplates"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let claim_name = claim["metadata"]["name"].as_str().unwrap();
            let volume = json!({"name": claim_name, "persistentVolumeClaim": {
                "claimName": format!("{claim_name}-{}-0", name(object))}});
            match spec["volumes"].as_array_mut() {
                Some(volumes) => volumes.push(volume),
                None => spec["volumes"] = json!([volume]),
            }
        }
        let pod: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name(object), "labels": template["metadata"]["labels"]},
            "spec": spec,
        }))
        .unwrap();
        match pods
            .create(
                &PostParams {
                    dry_run: true,
                    ..PostParams::default()
                },
                &pod,
            )
            .await
        {
            Ok(_) => admitted.push(name(object).to_string()),
            Err(kube::Error::Api(e)) if e.code == 403 && e.message.contains("PodSecurity") => {
                refused.push(name(object).to_string())
            }
            Err(e) => panic!("{}: {e}", name(object)),
        }
    }
    println!("restricted admits {admitted:?}, refuses {refused:?}");
    assert_eq!(
        refused,
        ["tether-device-plugin", "tether-device-plugin-nvidia"]
    );
    for expected in [
        "tether",
        "tether-bridge",
        "tether-extender",
        "tether-scheduler",
    ] {
        assert!(
            admitted.iter().any(|a| a == expected),
            "{expected}: {admitted:?}"
        );
    }
}

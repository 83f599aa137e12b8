//! The deployment manifests, proven without a cluster: every overlay renders
//! (and matches `kubectl kustomize` when kubectl is installed), every object
//! decodes into its `k8s-openapi` type with nothing left over (an unknown or
//! misspelt field fails), names, labels, selectors and ports agree across
//! objects, and every setting given to `tetherd` or `tether-bridge` is a
//! flag they accept, with a value they accept.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tether_deploy::{kind, name, read_documents, render};

const NAMESPACE: &str = "tether-system";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// Decodes `object` as `T` and insists that encoding it again gives the same
/// JSON: a field the type does not have (unknown, misspelt, misplaced) would
/// be dropped on the way and show up as a difference.
fn strict<T: DeserializeOwned + Serialize>(object: &Value) -> T {
    let typed: T = serde_json::from_value(object.clone())
        .unwrap_or_else(|e| panic!("{} {}: does not decode: {e}", kind(object), name(object)));
    let again = serde_json::to_value(&typed).unwrap();
    if let Some(path) = first_difference(object, &again, String::new()) {
        panic!(
            "{} {}: {path} is not a field of the type (or has the wrong shape)",
            kind(object),
            name(object)
        );
    }
    typed
}

fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (key, value) in x {
                let here = format!("{at}.{key}");
                match y.get(key) {
                    Some(other) => {
                        if let Some(path) = first_difference(value, other, here) {
                            return Some(path);
                        }
                    }
                    None => return Some(here),
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(n, (p, q))| first_difference(p, q, format!("{at}[{n}]"))),
        _ if a == b => None,
        _ => Some(at),
    }
}

/// A tetherd-style binary's flags: env variable -> (long flag name, whether
/// it is a switch that takes no value).
fn flags(command: clap::Command) -> BTreeMap<String, (String, bool)> {
    command
        .get_arguments()
        .filter_map(|arg| {
            let env = arg.get_env()?.to_str()?.to_string();
            let switch = matches!(arg.get_action(), clap::ArgAction::SetTrue);
            Some((env, (arg.get_long()?.to_string(), switch)))
        })
        .collect()
}

/// Checks that every `env` entry is a flag of the binary and that the
/// binary accepts the values (by parsing them as the flags they stand for).
fn check_env<P: clap::Parser>(what: &str, env: &[(String, String)]) {
    let known = flags(P::command());
    let mut args = vec![what.to_string()];
    for (key, value) in env {
        if key == "RUST_LOG" {
            continue; // tracing's filter, not a flag
        }
        let (long, switch) = known
            .get(key)
            .unwrap_or_else(|| panic!("{what}: {key} is not a setting it reads"));
        match (switch, value.as_str()) {
            // clap reads a switch's variable as true unless it is falsy.
            (true, "false" | "0" | "no" | "off" | "") => {}
            (true, "true" | "1" | "yes" | "on") => args.push(format!("--{long}")),
            (true, other) => panic!("{what}: {key}={other:?} is not a boolean"),
            (false, _) => args.push(format!("--{long}={value}")),
        }
    }
    if let Err(e) = P::try_parse_from(args.clone()) {
        panic!("{what} refuses {args:?}: {e}");
    }
}

fn env_of(container: &Container) -> Vec<(String, String)> {
    container
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

fn labels_match(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn by_kind<'a>(objects: &'a [Value], wanted: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| kind(o) == wanted).collect()
}

fn one<T: DeserializeOwned + Serialize>(objects: &[Value], wanted: &str) -> T {
    let found = by_kind(objects, wanted);
    assert_eq!(found.len(), 1, "exactly one {wanted}");
    strict(found[0])
}

/// `kubectl kustomize DIR` as objects, when kubectl is installed.
fn kubectl_render(dir: &Path) -> Option<Vec<Value>> {
    let output = std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .ok()?;
    assert!(
        output.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let file = std::env::temp_dir().join(format!("tether-kustomize-{}.yaml", std::process::id()));
    std::fs::write(&file, &output.stdout).unwrap();
    let objects = read_documents(&file).unwrap();
    let _ = std::fs::remove_file(file);
    Some(objects)
}

fn keyed(objects: &[Value]) -> BTreeMap<(String, String), Value> {
    objects
        .iter()
        .map(|o| ((kind(o).to_string(), name(o).to_string()), o.clone()))
        .collect()
}

#[test]
fn every_overlay_renders_to_valid_consistent_objects() {
    for (overlay, replicas) in [("dev", 1), ("prod", 3), ("prod-5", 5)] {
        let dir = deploy_dir().join("overlays").join(overlay);
        let objects = render(&dir).unwrap_or_else(|e| panic!("{overlay}: {e:#}"));
        match kubectl_render(&dir) {
            Some(theirs) => {
                assert_eq!(
                    keyed(&objects),
                    keyed(&theirs),
                    "{overlay}: differs from kubectl kustomize"
                );
                println!(
                    "{overlay}: {} objects, same as kubectl kustomize",
                    objects.len()
                );
            }
            None => println!(
                "{overlay}: {} objects (kubectl not installed: not cross-checked)",
                objects.len()
            ),
        }

        // Every object decodes strictly; every namespaced one is in ours.
        for object in &objects {
            match kind(object) {
                "ConfigMap" => drop(strict::<ConfigMap>(object)),
                "Service" => drop(strict::<Service>(object)),
                "StatefulSet" => drop(strict::<StatefulSet>(object)),
                "Deployment" => drop(strict::<Deployment>(object)),
                "PodDisruptionBudget" => drop(strict::<PodDisruptionBudget>(object)),
                "NetworkPolicy" => drop(strict::<NetworkPolicy>(object)),
                "ServiceAccount" => drop(strict::<ServiceAccount>(object)),
                "ClusterRole" => drop(strict::<ClusterRole>(object)),
                "ClusterRoleBinding" => drop(strict::<ClusterRoleBinding>(object)),
                other => panic!("{overlay}: unexpected kind {other}"),
            }
            if !["ClusterRole", "ClusterRoleBinding"].contains(&kind(object)) {
                assert_eq!(
                    object["metadata"]["namespace"],
                    NAMESPACE,
                    "{} {}",
                    kind(object),
                    name(object)
                );
            }
        }

        let sts: StatefulSet = one(&objects, "StatefulSet");
        let spec = sts.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(replicas), "{overlay}: replicas");
        assert_eq!(spec.pod_management_policy.as_deref(), Some("Parallel"));
        let pod_labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .clone()
            .unwrap();
        assert!(labels_match(
            spec.selector.match_labels.as_ref().unwrap(),
            &pod_labels
        ));
        let pod = spec.template.spec.as_ref().unwrap();
        let container = &pod.containers[0];
        let ports: BTreeMap<String, i32> = container
            .ports
            .iter()
            .flatten()
            .map(|p| (p.name.clone().unwrap(), p.container_port))
            .collect();

        // Services: the headless one is the StatefulSet's, both select the
        // pods, target ports exist on the container.
        let services: Vec<Service> = by_kind(&objects, "Service")
            .into_iter()
            .map(strict)
            .collect();
        let headless = services
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(spec.service_name.as_deref().unwrap()))
            .expect("the StatefulSet's serviceName is a Service");
        assert_eq!(
            headless.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("None")
        );
        for service in &services {
            let s = service.spec.as_ref().unwrap();
            assert!(
                labels_match(s.selector.as_ref().unwrap(), &pod_labels),
                "{:?} selects the pods",
                service.metadata.name
            );
            for port in s.ports.iter().flatten() {
                let target = match port.target_port.as_ref().unwrap() {
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(n) => {
                        ports[n]
                    }
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => *n,
                };
                assert!(
                    ports.values().any(|p| *p == target),
                    "{:?} port {target}",
                    service.metadata.name
                );
            }
        }

        // Probes hit named ports and paths tetherd serves.
        for probe in [&container.readiness_probe, &container.liveness_probe] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            assert!(["/ready", "/live", "/health"].contains(&get.path.as_deref().unwrap()));
            let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(port) = &get.port
            else {
                panic!("probes use named ports");
            };
            assert!(ports.contains_key(port));
        }

        // The peer template names the headless service and the gRPC port.
        let env = env_of(container);
        let template = &env
            .iter()
            .find(|(k, _)| k == "TETHER_PEER_TEMPLATE")
            .unwrap()
            .1;
        assert_eq!(
            *template,
            format!(
                "{}-{{ordinal}}.{}:{}",
                sts.metadata.name.as_deref().unwrap(),
                spec.service_name.as_deref().unwrap(),
                ports["grpc"]
            )
        );
        let listen = &env.iter().find(|(k, _)| k == "TETHER_LISTEN").unwrap().1;
        assert!(listen.ends_with(&format!(":{}", ports["grpc"])));
        let volume = &spec.volume_claim_templates.as_ref().unwrap()[0];
        let data_dir = &env.iter().find(|(k, _)| k == "TETHER_DATA_DIR").unwrap().1;
        assert!(
            container
                .volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == volume.metadata.name.clone().unwrap()
                    && m.mount_path == *data_dir)
        );

        // tetherd accepts every setting: the container's and those of the
        // ConfigMaps it reads (the shared one and the overlay's bootstrap).
        let config_maps: BTreeMap<String, ConfigMap> = by_kind(&objects, "ConfigMap")
            .into_iter()
            .map(|object| (name(object).to_string(), strict::<ConfigMap>(object)))
            .collect();
        let mut all = env.clone();
        for from in container.env_from.iter().flatten() {
            let wanted = &from.config_map_ref.as_ref().unwrap().name;
            let config = config_maps
                .get(wanted)
                .unwrap_or_else(|| panic!("{overlay}: no ConfigMap {wanted}"));
            all.extend(config.data.clone().unwrap_or_default());
        }
        check_env::<tether_server::Config>("tetherd", &all);
        // A new cluster starts only once the whole set answers: the set's
        // size for bootstrap is the StatefulSet's replicas.
        let expect = &all
            .iter()
            .find(|(k, _)| k == "TETHER_BOOTSTRAP_EXPECT")
            .unwrap_or_else(|| panic!("{overlay}: TETHER_BOOTSTRAP_EXPECT is not set"))
            .1;
        assert_eq!(
            *expect,
            replicas.to_string(),
            "{overlay}: TETHER_BOOTSTRAP_EXPECT is the StatefulSet's replicas"
        );

        // PDB and NetworkPolicy select the pods; the policy admits the
        // replicas, labelled clients, and nothing on ports tetherd lacks.
        let pdb: PodDisruptionBudget = one(&objects, "PodDisruptionBudget");
        let pdb_spec = pdb.spec.unwrap();
        assert!(labels_match(
            pdb_spec.selector.unwrap().match_labels.as_ref().unwrap(),
            &pod_labels
        ));
        assert_eq!(
            pdb_spec.max_unavailable,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
        );
        let policy: NetworkPolicy = one(&objects, "NetworkPolicy");
        let policy_spec = policy.spec.unwrap();
        assert!(labels_match(
            policy_spec
                .pod_selector
                .unwrap()
                .match_labels
                .as_ref()
                .unwrap(),
            &pod_labels
        ));
        for rule in policy_spec.ingress.unwrap() {
            for port in rule.ports.unwrap() {
                let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) =
                    port.port.unwrap()
                else {
                    panic!("numeric policy ports");
                };
                assert!(ports.values().any(|p| *p == n), "policy port {n}");
            }
        }

        // The bridge: its account is bound to its role in our namespace, it
        // reaches Tether through the client Service, its pods are admitted
        // as clients, and tether-bridge accepts its settings.
        let bridge: Deployment = one(&objects, "Deployment");
        let bridge_pod = bridge.spec.as_ref().unwrap().template.clone();
        let bridge_labels = bridge_pod.metadata.unwrap().labels.unwrap();
        assert_eq!(
            bridge_labels.get("tether.io/client").map(String::as_str),
            Some("true")
        );
        let bridge_spec = bridge_pod.spec.unwrap();
        let account: ServiceAccount = one(&objects, "ServiceAccount");
        assert_eq!(bridge_spec.service_account_name, account.metadata.name);
        let binding: ClusterRoleBinding = one(&objects, "ClusterRoleBinding");
        let role: ClusterRole = one(&objects, "ClusterRole");
        assert_eq!(Some(binding.role_ref.name.clone()), role.metadata.name);
        let subject = &binding.subjects.unwrap()[0];
        assert_eq!(
            (subject.name.as_str(), subject.namespace.as_deref()),
            (account.metadata.name.as_deref().unwrap(), Some(NAMESPACE))
        );
        let verbs: BTreeSet<String> = role
            .rules
            .unwrap()
            .into_iter()
            .flat_map(|r| r.verbs)
            .collect();
        assert_eq!(
            verbs,
            ["get", "list", "watch"]
                .map(String::from)
                .into_iter()
                .collect()
        );
        let bridge_env = env_of(&bridge_spec.containers[0]);
        let endpoints = &bridge_env
            .iter()
            .find(|(k, _)| k == "TETHER_ENDPOINTS")
            .unwrap()
            .1;
        let client_service = services
            .iter()
            .find(|s| s.spec.as_ref().unwrap().cluster_ip.as_deref() != Some("None"))
            .unwrap();
        assert_eq!(
            *endpoints,
            format!(
                "{}:{}",
                client_service.metadata.name.as_deref().unwrap(),
                ports["grpc"]
            )
        );
        check_env::<tether_k8s_bridge::config::BridgeConfig>("tether-bridge", &bridge_env);
    }
}

#[test]
fn the_optional_service_monitor_scrapes_the_client_service() {
    let monitors = read_documents(&deploy_dir().join("optional/servicemonitor.yaml")).unwrap();
    let prod = render(&deploy_dir().join("overlays/prod")).unwrap();
    let service = prod
        .iter()
        .find(|o| kind(o) == "Service" && o["spec"]["clusterIP"] != "None")
        .unwrap();
    for monitor in monitors {
        assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
        for (key, value) in monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .unwrap()
        {
            assert_eq!(&service["metadata"]["labels"][key], value);
        }
        let port = monitor["spec"]["endpoints"][0]["port"].as_str().unwrap();
        assert!(
            service["spec"]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == port)
        );
    }
}

#[test]
fn the_image_holds_the_binaries_the_manifests_run_as_the_user_they_expect() {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile")).unwrap();
    let prod = render(&deploy_dir().join("overlays/prod")).unwrap();
    let mut commands = BTreeSet::new();
    for object in &prod {
        for container in object["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            commands.insert(container["command"][0].as_str().unwrap().to_string());
        }
    }
    for binary in commands.iter().map(String::as_str).chain(["lockctl"]) {
        assert!(
            dockerfile.contains(&format!("/usr/local/bin/{binary}")),
            "the image installs {binary}"
        );
    }
    let sts = prod.iter().find(|o| kind(o) == "StatefulSet").unwrap();
    let user = sts["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
        .as_u64()
        .unwrap();
    assert!(
        dockerfile.contains(&format!("USER {user}")),
        "the image runs as {user}"
    );
}

/// Whether DNS `name` is covered by certificate name `pattern` (a leading
/// `*.` matches one label).
fn covers(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(rest) => name
            .split_once('.')
            .is_some_and(|(first, tail)| !first.is_empty() && tail == rest),
        None => pattern == name,
    }
}

#[test]
fn the_optional_tls_certificates_and_patch_fit_the_manifests() {
    let tls = deploy_dir().join("optional/tls");
    let documents = read_documents(&tls.join("certificates.yaml")).unwrap();
    let certificates: Vec<&Value> = documents
        .iter()
        .filter(|d| kind(d) == "Certificate")
        .collect();
    let by_role = |role: &str| -> &Value {
        certificates
            .iter()
            .find(|c| c["spec"]["commonName"] == role)
            .unwrap_or_else(|| panic!("no certificate for role {role}"))
    };
    // Every leaf is signed by the CA issuer, and names a role tetherd knows.
    for certificate in &certificates {
        assert_eq!(certificate["apiVersion"], "cert-manager.io/v1");
        let name = certificate["spec"]["commonName"].as_str().unwrap();
        if certificate["spec"]["isCA"] == true {
            continue;
        }
        assert_eq!(
            certificate["spec"]["issuerRef"]["name"], "tether-ca",
            "{name}"
        );
        name.parse::<tether_server::auth::Role>()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for uri in certificate["spec"]["uris"].as_array().into_iter().flatten() {
            let uri = uri.as_str().unwrap();
            assert_eq!(uri.strip_prefix("tether:"), Some(name), "{uri}");
        }
    }
    // The replicas' certificate covers what peers and clients dial.
    let prod = render(&deploy_dir().join("overlays/prod")).unwrap();
    let set: StatefulSet = one(&prod, "StatefulSet");
    let tetherd_env = env_of(
        &set.spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0],
    );
    let template = tetherd_env
        .iter()
        .find(|(k, _)| k == "TETHER_PEER_TEMPLATE")
        .map(|(_, v)| v.clone())
        .unwrap();
    let peer_host = template.replace("{ordinal}", "0");
    let peer_host = peer_host.rsplit_once(':').unwrap().0;
    let bridge: Deployment = one(&prod, "Deployment");
    let bridge_container = &bridge
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    let endpoint = env_of(bridge_container)
        .into_iter()
        .find(|(k, _)| k == "TETHER_ENDPOINTS")
        .map(|(_, v)| v)
        .unwrap();
    let client_host = endpoint.rsplit_once(':').unwrap().0.to_string();
    let replica = by_role("replica");
    let names: Vec<&str> = replica["spec"]["dnsNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    for host in [
        peer_host.to_string(),
        format!("{peer_host}.{NAMESPACE}.svc"),
        client_host.clone(),
        format!("{client_host}.{NAMESPACE}.svc"),
    ] {
        assert!(
            names.iter().any(|p| covers(p, &host)),
            "{host} not in {names:?}"
        );
    }
    let usages = replica["spec"]["usages"].as_array().unwrap();
    assert!(
        usages.contains(&Value::from("server auth"))
            && usages.contains(&Value::from("client auth"))
    );
    by_role("bridge");

    // The patch: containers that exist, Secrets the certificates write,
    // and settings the binaries accept.
    let secrets: BTreeMap<&str, &str> = certificates
        .iter()
        .map(|c| {
            (
                c["spec"]["commonName"].as_str().unwrap(),
                c["spec"]["secretName"].as_str().unwrap(),
            )
        })
        .collect();
    let patches = read_documents(&tls.join("tls-patch.yaml")).unwrap();
    for patch in &patches {
        let (target, role) = match kind(patch) {
            "StatefulSet" => (&set.spec.as_ref().unwrap().template, "replica"),
            "Deployment" => (&bridge.spec.as_ref().unwrap().template, "bridge"),
            other => panic!("unexpected kind {other} in the patch"),
        };
        assert_eq!(
            name(patch),
            if role == "replica" {
                "tether"
            } else {
                "tether-bridge"
            }
        );
        let pod = &patch["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let existing: Vec<&str> = target
            .spec
            .as_ref()
            .unwrap()
            .containers
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert!(existing.contains(&container["name"].as_str().unwrap()));
        assert_eq!(pod["volumes"][0]["secret"]["secretName"], secrets[role]);
        assert_eq!(
            container["volumeMounts"][0]["mountPath"],
            container["env"][0]["value"]
        );
        let env = vec![(
            container["env"][0]["name"].as_str().unwrap().to_string(),
            container["env"][0]["value"].as_str().unwrap().to_string(),
        )];
        if role == "replica" {
            check_env::<tether_server::Config>("tetherd", &env);
        } else {
            check_env::<tether_k8s_bridge::config::BridgeConfig>("tether-bridge", &env);
        }
    }
}

//! The deployment manifests, proven without a cluster: every overlay renders
//! (and matches `kubectl kustomize` when kubectl is installed), every object
//! decodes into its `k8s-openapi` type with nothing left over (an unknown or
//! misspelt field fails), names, labels, selectors and ports agree across
//! objects, and every setting given to `tetherd` or `tether-bridge` is a
//! flag they accept, with a value they accept.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tether_deploy::{documents_of, kind, name, read_documents, render};

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

/// The kinds the overlays render to.
const OVERLAY_KINDS: &[&str] = &[
    "ConfigMap",
    "Service",
    "StatefulSet",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
];

/// The kinds `optional/gpu` renders to.
const GPU_KINDS: &[&str] = &[
    "ConfigMap",
    "Service",
    "Deployment",
    "DaemonSet",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
];

/// Decodes `object` strictly as its kind's type; a kind outside `allowed`
/// fails.
fn decode_strictly(what: &str, object: &Value, allowed: &[&str]) {
    let kind = kind(object);
    assert!(allowed.contains(&kind), "{what}: unexpected kind {kind}");
    match kind {
        "ConfigMap" => drop(strict::<ConfigMap>(object)),
        "Service" => drop(strict::<Service>(object)),
        "StatefulSet" => drop(strict::<StatefulSet>(object)),
        "Deployment" => drop(strict::<Deployment>(object)),
        "DaemonSet" => drop(strict::<DaemonSet>(object)),
        "PodDisruptionBudget" => drop(strict::<PodDisruptionBudget>(object)),
        "NetworkPolicy" => drop(strict::<NetworkPolicy>(object)),
        "ServiceAccount" => drop(strict::<ServiceAccount>(object)),
        "ClusterRole" => drop(strict::<ClusterRole>(object)),
        "ClusterRoleBinding" => drop(strict::<ClusterRoleBinding>(object)),
        other => panic!("{what}: no decoder for kind {other}"),
    }
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
    // Parsed from the output itself: the tests run in parallel in one
    // process, and a temporary file named after the process was shared
    // (one test removed it while another read it).
    let text = String::from_utf8(output.stdout).expect("kubectl writes UTF-8");
    Some(documents_of(&text).unwrap())
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
            decode_strictly(overlay, object, OVERLAY_KINDS);
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
fn the_optional_monitors_scrape_the_client_service_and_the_pods_of_the_bridge_and_gpu_binaries() {
    let monitors =
        read_documents(&deploy_dir().join("optional/monitoring/servicemonitor.yaml")).unwrap();
    let prod = render(&deploy_dir().join("overlays/prod")).unwrap();
    let service = prod
        .iter()
        .find(|o| kind(o) == "Service" && o["spec"]["clusterIP"] != "None")
        .unwrap();
    let gpu = render(&deploy_dir().join("optional/gpu")).unwrap();
    let workloads: Vec<&Value> = prod
        .iter()
        .chain(&gpu)
        .filter(|o| matches!(kind(o), "Deployment" | "DaemonSet"))
        .collect();
    let mut kinds = BTreeSet::new();
    let mut scraped = BTreeSet::new();
    for monitor in &monitors {
        assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
        kinds.insert(kind(monitor).to_string());
        let selector = monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .unwrap();
        match kind(monitor) {
            "ServiceMonitor" => {
                for (key, value) in selector {
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
            "PodMonitor" => {
                let workload = workloads
                    .iter()
                    .find(|w| {
                        selector
                            .iter()
                            .all(|(k, v)| &w["spec"]["template"]["metadata"]["labels"][k] == v)
                    })
                    .unwrap_or_else(|| panic!("no workload's pods match {selector:?}"));
                scraped.insert(name(workload).to_string());
                let template = &workload["spec"]["template"];
                let port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
                    .as_str()
                    .unwrap();
                let container_ports = template["spec"]["containers"][0]["ports"]
                    .as_array()
                    .unwrap();
                assert!(container_ports.iter().any(|p| p["name"] == port));
            }
            other => panic!("unexpected {other} in servicemonitor.yaml"),
        }
    }
    assert_eq!(
        kinds,
        BTreeSet::from(["PodMonitor".to_string(), "ServiceMonitor".to_string()])
    );
    assert_eq!(
        scraped,
        BTreeSet::from(
            [
                "tether-bridge",
                "tether-device-plugin",
                "tether-device-plugin-nvidia",
                "tether-extender"
            ]
            .map(String::from)
        )
    );
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

/// `deploy/image.sh` (the registry-free build `./dev image` runs, and the
/// real-node test imports) builds the image `deploy/Dockerfile` describes:
/// the same binaries in `/usr/local/bin`, the same user, working directory,
/// volume, ports and command, the CA certificates, and the tether user's
/// data directory. (Its shared libraries are whatever the binaries link;
/// `embed/tests/real_node.rs` runs the device plugin from it.)
#[test]
fn the_registry_free_image_build_matches_the_dockerfile() {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile")).unwrap();
    let script = std::fs::read_to_string(deploy_dir().join("image.sh")).unwrap();
    let copied: Vec<String> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY --from=build /src/target/release/"))
        .map(|rest| rest.split_whitespace().next().unwrap().to_string())
        .collect();
    let listed: Vec<String> = script
        .lines()
        .find_map(|l| l.strip_prefix("BINARIES=("))
        .expect("image.sh lists its binaries")
        .trim_end_matches(')')
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(listed, copied, "the same binaries, in the same order");
    // The image is the last stage's.
    let last_stage = dockerfile.rsplit("\nFROM ").next().unwrap();
    let line = |prefix: &str| -> String {
        last_stage
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("the Dockerfile has {prefix}"))
            .trim()
            .to_string()
    };
    let user = line("USER ");
    assert_eq!(line("WORKDIR "), "/var/lib/tether");
    assert_eq!(line("VOLUME "), "/var/lib/tether");
    let ports: Vec<String> = line("EXPOSE ")
        .split_whitespace()
        .map(|p| format!("\"{p}/tcp\":{{}}"))
        .collect();
    let cmd = line("CMD ");
    for expected in [
        format!("\"User\":\"{user}\""),
        "\"WorkingDir\":\"/var/lib/tether\"".to_string(),
        "\"Volumes\":{\"/var/lib/tether\":{}}".to_string(),
        format!("\"ExposedPorts\":{{{}}}", ports.join(",")),
        format!("\"Cmd\":{}", cmd.replace(' ', "")),
    ] {
        assert!(
            script.contains(&expected),
            "image.sh's config has {expected}"
        );
    }
    assert!(dockerfile.contains("ca-certificates"));
    assert!(script.contains("/etc/ssl/certs/ca-certificates.crt"));
    assert!(
        dockerfile.contains("--uid 10001") && dockerfile.contains("--home-dir /var/lib/tether")
    );
    assert!(script.contains("chown 10001:10001 \"$root/var/lib/tether\""));
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

/// The PodSecurity "restricted" rules a pod spec can be checked for here:
/// non-root, the default seccomp profile, and per container no privilege
/// escalation and every capability dropped. `as_root_allowed` skips the
/// non-root rule (the device plugin, whose manifest says why).
fn assert_restricted(what: &str, pod: &PodSpec, as_root_allowed: bool) {
    let security = pod.security_context.clone().unwrap_or_default();
    if !as_root_allowed {
        assert_eq!(security.run_as_non_root, Some(true), "{what}: runAsNonRoot");
    }
    assert_eq!(
        security.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
        Some("RuntimeDefault"),
        "{what}: seccompProfile"
    );
    for container in pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
    {
        let c = container.security_context.clone().unwrap_or_default();
        assert_eq!(
            c.allow_privilege_escalation,
            Some(false),
            "{what}/{}: allowPrivilegeEscalation",
            container.name
        );
        let drop = c.capabilities.and_then(|c| c.drop).unwrap_or_default();
        assert_eq!(
            drop,
            ["ALL"],
            "{what}/{}: capabilities.drop",
            container.name
        );
        if c.read_only_root_filesystem == Some(true) {
            // A read-only root still needs somewhere to write, if it
            // mounts /tmp at all it is an emptyDir.
            for mount in container.volume_mounts.iter().flatten() {
                if mount.mount_path == "/tmp" {
                    let volume = pod
                        .volumes
                        .iter()
                        .flatten()
                        .find(|v| v.name == mount.name)
                        .unwrap_or_else(|| panic!("{what}: /tmp's volume"));
                    assert!(volume.empty_dir.is_some(), "{what}: /tmp is an emptyDir");
                }
            }
        }
    }
}

#[test]
fn every_pod_of_the_overlays_passes_the_restricted_profile_and_has_a_writable_tmp_for_backups() {
    let prod = render(&deploy_dir().join("overlays/prod")).unwrap();
    for object in &prod {
        let pod: PodSpec = match kind(object) {
            "StatefulSet" => strict::<StatefulSet>(object)
                .spec
                .unwrap()
                .template
                .spec
                .unwrap(),
            "Deployment" => strict::<Deployment>(object)
                .spec
                .unwrap()
                .template
                .spec
                .unwrap(),
            _ => continue,
        };
        assert_restricted(name(object), &pod, false);
    }
    // The ops guide's backup: `lockctl cluster export-snapshot /tmp/...`
    // inside a tetherd container whose root is read-only.
    let guide = std::fs::read_to_string(deploy_dir().join("README.md")).unwrap();
    assert!(guide.contains("export-snapshot /tmp/tether.snap"));
    let sts: StatefulSet = one(&prod, "StatefulSet");
    let container = &sts.spec.unwrap().template.spec.unwrap().containers[0];
    assert!(
        container
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/tmp" && m.read_only != Some(true)),
        "tetherd has a writable /tmp"
    );
}

/// The part of `kubescheduler.config.k8s.io/v1` KubeSchedulerConfiguration
/// the GPU scheduler uses, field for field (an unknown field fails).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SchedulerConfig {
    api_version: String,
    kind: String,
    leader_election: Option<serde_json::Value>,
    profiles: Vec<SchedulerProfile>,
    extenders: Vec<SchedulerExtender>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SchedulerProfile {
    scheduler_name: String,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SchedulerExtender {
    url_prefix: String,
    filter_verb: String,
    bind_verb: String,
    #[serde(rename = "enableHTTPS")]
    enable_https: bool,
    node_cache_capable: bool,
    http_timeout: String,
    ignorable: bool,
    managed_resources: Vec<ManagedResource>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ManagedResource {
    name: String,
    ignored_by_scheduler: bool,
}

fn pod_of(objects: &[Value], wanted_kind: &str, wanted_name: &str) -> PodSpec {
    let object = objects
        .iter()
        .find(|o| kind(o) == wanted_kind && name(o) == wanted_name)
        .unwrap_or_else(|| panic!("{wanted_kind} {wanted_name}"));
    match wanted_kind {
        "Deployment" => strict::<Deployment>(object)
            .spec
            .unwrap()
            .template
            .spec
            .unwrap(),
        "DaemonSet" => strict::<DaemonSet>(object)
            .spec
            .unwrap()
            .template
            .spec
            .unwrap(),
        other => panic!("{other}"),
    }
}

/// The node label NVIDIA's GPU feature discovery (and the GPU operator)
/// puts on nodes with NVIDIA GPUs.
const NVIDIA_NODE_LABEL: &str = "nvidia.com/gpu.present";

/// Checks a device plugin DaemonSet against the extender's contract (see
/// the caller); returns its pod and its parsed flags.
fn check_device_plugin(
    objects: &[Value],
    daemonset: &str,
    extender_args: &tether_embed::cli::ExtenderArgs,
) -> (PodSpec, tether_embed::cli::DevicePluginArgs) {
    use tether_embed::cli::DevicePluginArgs;
    let plugin = pod_of(objects, "DaemonSet", daemonset);
    assert_restricted(daemonset, &plugin, true);
    let container = &plugin.containers[0];
    // The downward API field a variable is set from.
    let field_of = |variable: &str| {
        container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == variable)
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(field_of("NODE_NAME").as_deref(), Some("spec.nodeName"));
    assert_eq!(
        field_of("POD_UID").as_deref(),
        Some("metadata.uid"),
        "{daemonset}: the owner of the devices it publishes"
    );
    let env: Vec<(String, String)> = env_of(container)
        .into_iter()
        .filter(|(k, _)| k != "NODE_NAME")
        .chain([("NODE_NAME".to_string(), "gpu-node-1".to_string())])
        .collect();
    check_env::<DevicePluginArgs>("tether-device-plugin", &env);
    let mut argv = vec!["tether-device-plugin".to_string()];
    argv.extend(container.args.clone().unwrap_or_default());
    argv.push("--node-name=gpu-node-1".into());
    let plugin_args = <DevicePluginArgs as clap::Parser>::try_parse_from(&argv)
        .unwrap_or_else(|e| panic!("tether-device-plugin refuses {argv:?}: {e}"));
    assert_eq!(plugin_args.resource_name, extender_args.resource);
    assert_eq!(
        plugin_args.device_prefix, extender_args.device_prefix,
        "the extender plans the device ids the plugin advertises"
    );
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == plugin_args.plugin_dir.to_str().unwrap())
        .expect("the plugin directory is mounted");
    assert_eq!(
        host_path_of(&plugin, mount),
        "/var/lib/kubelet/device-plugins"
    );
    (plugin, plugin_args)
}

/// The host directory behind a pod's mount (its volume is a hostPath).
fn host_path_of(pod: &PodSpec, mount: &k8s_openapi::api::core::v1::VolumeMount) -> String {
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("no volume {}", mount.name));
    volume
        .host_path
        .as_ref()
        .expect("a hostPath volume")
        .path
        .clone()
}

/// The NVIDIA variant: real GPUs read under a read-only host root (the
/// driver's GPU list, the device nodes, sysfs for NUMA nodes), on nodes
/// NVIDIA's feature discovery labels.
fn check_nvidia_plugin(plugin: &PodSpec, args: &tether_embed::cli::DevicePluginArgs) {
    assert_eq!(args.devices, "nvidia");
    assert_eq!(
        plugin
            .node_selector
            .as_ref()
            .and_then(|s| s.get(NVIDIA_NODE_LABEL))
            .map(String::as_str),
        Some("true")
    );
    let container = &plugin.containers[0];
    for (host, under_root) in [
        ("/proc/driver/nvidia", "proc/driver/nvidia"),
        ("/dev", "dev"),
        ("/sys", "sys"),
    ] {
        let wanted = args.host_root.join(under_root);
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| std::path::Path::new(&m.mount_path) == wanted)
            .unwrap_or_else(|| panic!("{} is not mounted", wanted.display()));
        assert_eq!(
            mount.read_only,
            Some(true),
            "{} read-only",
            mount.mount_path
        );
        assert_eq!(host_path_of(plugin, mount), host);
    }
}

#[test]
fn the_gpu_manifests_fit_the_extender_the_plugin_and_the_schedulers_contract() {
    use tether_embed::cli::ExtenderArgs;
    let dir = deploy_dir().join("optional/gpu");
    let objects = render(&dir).unwrap_or_else(|e| panic!("optional/gpu: {e:#}"));
    if let Some(theirs) = kubectl_render(&dir) {
        assert_eq!(
            keyed(&objects),
            keyed(&theirs),
            "differs from kubectl kustomize"
        );
    }
    for object in &objects {
        decode_strictly("optional/gpu", object, GPU_KINDS);
    }

    // The extender: its settings are its flags; it may read pods and
    // create bindings, through the account it runs as.
    let extender = pod_of(&objects, "Deployment", "tether-extender");
    assert_restricted("tether-extender", &extender, false);
    let container = &extender.containers[0];
    assert_eq!(container.command.as_ref().unwrap()[0], "tether-extender");
    let env = env_of(container);
    check_env::<ExtenderArgs>("tether-extender", &env);
    let mut argv = vec!["tether-extender".to_string()];
    argv.extend(container.args.clone().unwrap_or_default());
    argv.extend(env.iter().map(|(k, v)| {
        let long = &flags(<ExtenderArgs as clap::CommandFactory>::command())[k].0;
        format!("--{long}={v}")
    }));
    let extender_args = <ExtenderArgs as clap::Parser>::try_parse_from(&argv)
        .unwrap_or_else(|e| panic!("tether-extender refuses {argv:?}: {e}"));
    let role: ClusterRole = strict(
        objects
            .iter()
            .find(|o| kind(o) == "ClusterRole" && name(o) == "tether-extender")
            .unwrap(),
    );
    let allows = |resource: &str, verb: &str| {
        role.rules.iter().flatten().any(|r| {
            r.resources.iter().flatten().any(|x| x == resource) && r.verbs.iter().any(|v| v == verb)
        })
    };
    assert!(allows("pods", "get") && allows("pods/binding", "create"));
    assert!(
        allows("nodes", "get"),
        "the extender reads each node's allocatable devices"
    );
    assert!(
        allows("nodes", "list") && allows("nodes", "watch"),
        "the extender watches the node object under each name"
    );
    let binding: ClusterRoleBinding = strict(
        objects
            .iter()
            .find(|o| kind(o) == "ClusterRoleBinding" && name(o) == "tether-extender")
            .unwrap(),
    );
    let subject = &binding.subjects.as_ref().unwrap()[0];
    assert_eq!(
        Some(subject.name.as_str()),
        extender.service_account_name.as_deref()
    );
    assert_eq!(subject.namespace.as_deref(), Some(NAMESPACE));

    // The scheduler's configuration calls that extender, within timeouts
    // that fit its bind wait, and never binds a GPU pod without it.
    let config_map: ConfigMap = strict(
        objects
            .iter()
            .find(|o| kind(o) == "ConfigMap" && name(o) == "tether-scheduler-config")
            .unwrap(),
    );
    let text = &config_map.data.as_ref().unwrap()["config.yaml"];
    let config: SchedulerConfig =
        serde_saphyr::from_str(text).expect("a KubeSchedulerConfiguration");
    assert_eq!(config.api_version, "kubescheduler.config.k8s.io/v1");
    assert_eq!(config.kind, "KubeSchedulerConfiguration");
    assert!(config.leader_election.is_some());
    assert_eq!(config.profiles.len(), 1);
    assert_eq!(config.profiles[0].scheduler_name, "tether-gpu");
    assert_eq!(config.extenders.len(), 1);
    let ext = &config.extenders[0];
    let service: Service = strict(
        objects
            .iter()
            .find(|o| kind(o) == "Service" && name(o) == "tether-extender")
            .unwrap(),
    );
    let port = service.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port;
    assert_eq!(
        ext.url_prefix,
        format!("http://tether-extender.{NAMESPACE}.svc:{port}/scheduler")
    );
    assert_eq!(
        extender_args.listen.port() as i32,
        port,
        "the Service port is the extender's"
    );
    assert_eq!(
        (ext.filter_verb.as_str(), ext.bind_verb.as_str()),
        ("filter", "bind")
    );
    assert!(!ext.enable_https && ext.node_cache_capable && !ext.ignorable);
    assert!(
        ext.managed_resources
            .iter()
            .any(|r| r.name == extender_args.resource && !r.ignored_by_scheduler),
        "managedResources names the extender's resource"
    );
    let timeout = humantime::parse_duration(&ext.http_timeout).unwrap();
    // A binding call is one API request; give it 2 s beside the wait.
    assert!(
        timeout >= extender_args.bind_wait + std::time::Duration::from_secs(2),
        "httpTimeout {timeout:?} leaves no room after a bind wait of {:?}",
        extender_args.bind_wait
    );
    let scheduler = pod_of(&objects, "Deployment", "tether-scheduler");
    assert_restricted("tether-scheduler", &scheduler, false);
    let command = scheduler.containers[0].command.clone().unwrap();
    assert!(command.contains(&"--config=/etc/tether-scheduler/config.yaml".to_string()));
    let mount = scheduler.containers[0].volume_mounts.as_ref().unwrap()[0].clone();
    assert_eq!(mount.mount_path, "/etc/tether-scheduler");
    let volume = &scheduler.volumes.as_ref().unwrap()[0];
    assert_eq!(volume.name, mount.name);
    assert_eq!(
        volume.config_map.as_ref().unwrap().name,
        "tether-scheduler-config"
    );

    // The device plugins (fake devices; NVIDIA GPUs): the kubelet's
    // directory from the host, their node and pod from the downward API,
    // their settings their flags, the same resource.
    let (_, fake) = check_device_plugin(&objects, "tether-device-plugin", &extender_args);
    assert!(fake.devices.starts_with("fake:"), "{}", fake.devices);
    let (nvidia_pod, nvidia) =
        check_device_plugin(&objects, "tether-device-plugin-nvidia", &extender_args);
    check_nvidia_plugin(&nvidia_pod, &nvidia);
    let fake_pod = pod_of(&objects, "DaemonSet", "tether-device-plugin");
    assert_eq!(
        fake_pod
            .affinity
            .as_ref()
            .map(|a| serde_json::to_value(a).unwrap()),
        Some(
            serde_json::json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": NVIDIA_NODE_LABEL, "operator": "DoesNotExist"}]}]}}})
        ),
        "the fake plugin keeps off NVIDIA nodes, where the NVIDIA one runs"
    );
    for file in ["device-plugin.yaml", "device-plugin-nvidia.yaml"] {
        let manifest = std::fs::read_to_string(dir.join(file)).unwrap();
        assert!(
            manifest.contains("cannot meet\n# PodSecurity \"restricted\""),
            "{file} says why the plugin is not restricted"
        );
    }

    // The image ships both binaries; the overlay-wide image override
    // reaches every tether container.
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile")).unwrap();
    for binary in ["tether-extender", "tether-device-plugin"] {
        assert!(dockerfile.contains(&format!("/usr/local/bin/{binary}")));
    }
    for object in &objects {
        for container in object["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let image = container["image"].as_str().unwrap();
            assert!(
                image == "tether:latest" || image.starts_with("registry.k8s.io/kube-scheduler:"),
                "{image}"
            );
        }
    }
}

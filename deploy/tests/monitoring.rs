//! The monitoring that `deploy/optional/monitoring/` ships is checked
//! against what the binaries serve: every metric the Grafana dashboard and
//! the PrometheusRule alerts name is in `/metrics` of a running `tetherd`
//! (scraped over HTTP after real acquires, a queued wait and releases) or
//! of `tether-bridge`, `tether-extender` or `tether-device-plugin`, every
//! expression parses as PromQL, and the rule file decodes with nothing left
//! over.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tether_client::proto::{LockKey, Outcome, Pod};
use tether_client::{Client, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn monitoring_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("optional/monitoring")
}

/// The PrometheusRule fields the alerts use; anything else fails to decode.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: Value,
    spec: RuleSpec,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    groups: Vec<RuleGroup>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    rules: Vec<Rule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    alert: String,
    expr: String,
    #[serde(rename = "for")]
    pending: Option<String>,
    labels: std::collections::BTreeMap<String, String>,
    annotations: std::collections::BTreeMap<String, String>,
}

/// The `tether_*` names in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(start) = rest.find("tether_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

/// The sample names an OpenMetrics text can carry: each family's name, with
/// `_total` for counters and `_bucket`, `_sum`, `_count` for histograms
/// (read from the `# TYPE` lines, so a family with no sample yet counts).
fn served_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(declared) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = declared.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        for suffix in suffixes {
            names.insert(format!("{name}{suffix}"));
        }
    }
    names
}

fn parses(what: &str, expr: &str) {
    if let Err(err) = promql_parser::parser::parse(expr) {
        panic!("{what}: {expr:?} is not PromQL: {err}");
    }
}

/// `GET path` on `addr`: the status line, the content type and the body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut response = String::new();
    tokio::time::timeout(
        Duration::from_secs(60),
        stream.read_to_string(&mut response),
    )
    .await
    .expect("the replica answers /metrics within 60 s")
    .unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.lines().next().unwrap().to_string();
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    (status, content_type, body.to_string())
}

fn pod(uid: &str) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "ml".into(),
        name: uid.into(),
    }
}

/// What a replica that has granted, queued and released serves, and what a
/// bridge serves.
async fn served() -> BTreeSet<String> {
    let dir = tempfile::tempdir().unwrap();
    let node = tether_server::testing::single_node(dir.path()).await;
    let client = Client::new(
        vec![node.addr().to_string()],
        Options {
            retry_timeout: Duration::from_secs(60),
            ..Options::default()
        },
    )
    .unwrap();
    let key = LockKey {
        scope: "gpu-bind".into(),
        name: "node-a".into(),
    };
    let wait = Duration::from_secs(60);
    let first = client
        .acquire(&key, &pod("uid-1"), vec![], wait, 0)
        .await
        .unwrap();
    let queued = {
        let client = client.clone();
        let key = key.clone();
        tokio::spawn(async move { client.acquire(&key, &pod("uid-2"), vec![], wait, 0).await })
    };
    let deadline = tokio::time::Instant::now() + wait;
    while client.get(&key).await.unwrap().waiters.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "uid-2 never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.release(Outcome::Allocated).await.unwrap();
    let second = queued.await.unwrap().unwrap();
    second.release(Outcome::Allocated).await.unwrap();

    let (status, content_type, text) = http_get(node.http_addr(), "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
    // The histograms the alerts lean on have samples after this traffic.
    for sample in [
        "tether_commit_duration_seconds_count",
        "tether_fsync_duration_seconds_count",
        "tether_apply_duration_seconds_count",
        "tether_lock_wait_duration_seconds_count{outcome=\"granted\"}",
        "tether_grpc_request_duration_seconds_count{method=\"Acquire\",code=\"OK\"}",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(sample) && !l.ends_with(" 0")),
            "no {sample} sample in:\n{text}"
        );
    }
    let mut names = served_names(&text);

    let kube =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let bridge = tether_k8s_bridge::bridge::Bridge::new(client, kube);
    names.extend(served_names(&bridge.render_metrics()));
    names.extend(served_names(
        &tether_embed::metrics::ExtenderMetrics::default().render(),
    ));
    names.extend(served_names(
        &tether_embed::metrics::PluginMetrics::default().render(),
    ));
    node.shutdown().await;
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_alerts_name_only_metrics_the_binaries_serve() {
    let served = served().await;

    let rules_text = std::fs::read_to_string(monitoring_dir().join("alerts.yaml")).unwrap();
    let rules: PrometheusRule = serde_saphyr::from_str(&rules_text).unwrap();
    assert_eq!(rules.api_version, "monitoring.coreos.com/v1");
    assert_eq!(rules.kind, "PrometheusRule");
    assert!(rules.metadata["name"].is_string());
    let mut named = BTreeSet::new();
    let mut alerts = BTreeSet::new();
    for group in &rules.spec.groups {
        assert!(!group.name.is_empty());
        for rule in &group.rules {
            parses(&rule.alert, &rule.expr);
            if let Some(pending) = &rule.pending {
                assert!(
                    humantime::parse_duration(pending).is_ok(),
                    "{}: for {pending:?}",
                    rule.alert
                );
            }
            assert!(rule.labels.contains_key("severity"), "{}", rule.alert);
            assert!(rule.annotations.contains_key("summary"), "{}", rule.alert);
            assert!(alerts.insert(rule.alert.clone()), "{} twice", rule.alert);
            named.extend(metric_names(&rule.expr));
        }
    }
    // The alerts the operators' guide promises.
    for alert in [
        "TetherNoLeader",
        "TetherReplicaBehind",
        "TetherLockStuck",
        "TetherHoldTimeouts",
        "TetherBridgeErrors",
    ] {
        assert!(alerts.contains(alert), "no {alert} in alerts.yaml");
    }

    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(monitoring_dir().join("dashboard.json")).unwrap(),
    )
    .unwrap();
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    for panel in panels {
        let title = panel["title"].as_str().expect("every panel has a title");
        let targets = panel["targets"].as_array().expect("every panel queries");
        assert!(!targets.is_empty(), "{title}");
        for target in targets {
            let expr = target["expr"].as_str().expect("a PromQL target");
            parses(title, expr);
            named.extend(metric_names(expr));
        }
    }

    let missing: Vec<&String> = named.difference(&served).collect();
    assert!(
        missing.is_empty(),
        "named by the dashboard or the alerts but served by no binary: {missing:?}\nserved: {served:?}"
    );
    // The histograms the issue asks for are on the dashboard.
    for histogram in [
        "tether_grpc_request_duration_seconds_bucket",
        "tether_commit_duration_seconds_bucket",
        "tether_fsync_duration_seconds_bucket",
        "tether_apply_duration_seconds_bucket",
        "tether_lock_wait_duration_seconds_bucket",
        "tether_bridge_lag_seconds_bucket",
    ] {
        assert!(
            named.contains(histogram),
            "the dashboard does not show {histogram}"
        );
    }
}

#[test]
fn metric_names_are_read_from_expressions_and_type_lines() {
    assert_eq!(
        metric_names("sum(rate(tether_a_total[5m])) / max(tether_b{x=\"tether_c\"})"),
        BTreeSet::from([
            "tether_a_total".to_string(),
            "tether_b".to_string(),
            "tether_c".to_string()
        ])
    );
    let served = served_names("# TYPE tether_x counter\n# TYPE tether_y histogram\n# EOF\n");
    assert!(served.contains("tether_x_total") && served.contains("tether_y_bucket"));
    assert!(!served.contains("tether_x"));
}

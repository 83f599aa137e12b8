//! The HTTP/JSON API on real replicas: the same calls, errors, roles and
//! leader answers as gRPC, over plain HTTP with bearer tokens and over
//! HTTPS with client certificates; the OpenAPI document against the routes
//! served.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::http::{Answer, Lines, Transport, get, post, send, send_with};
use common::{DEADLINE, client, lock};
use serde_json::{Value, json};
use tether_server::testing::Cluster;
use tether_tls::TlsMaterial;
use tether_tls::testing::TestCa;

fn key(name: &str) -> Value {
    json!({ "scope": "gpu-bind", "name": name })
}

fn json_pod(uid: &str) -> Value {
    json!({ "uid": uid, "namespace": "default", "name": format!("pod-{uid}") })
}

/// `POST` that must reach the server.
async fn call(
    addr: SocketAddr,
    transport: &Transport,
    path: &str,
    token: Option<&str>,
    body: Value,
) -> Answer {
    post(addr, transport, path, token, body)
        .await
        .unwrap_or_else(|err| panic!("POST {path}: {err}"))
}

/// Opens an acquire and reads its first line.
async fn acquire(
    addr: SocketAddr,
    transport: &Transport,
    token: Option<&str>,
    body: Value,
) -> (u16, Lines) {
    let response = send(
        addr,
        transport,
        "POST",
        "/v1/lock/acquire",
        token,
        Some(&body),
    )
    .await
    .unwrap();
    let status = response.status().as_u16();
    (status, Lines::of(response))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn locks_over_json_are_the_grpc_locks() {
    let cluster = Cluster::start(1).await;
    let addr = cluster.node(1).http_addr();
    let plain = &Transport::Plain;

    // Granted at once: the stream's one line, tokens as strings.
    let (status, mut lines) = acquire(
        addr,
        plain,
        None,
        json!({ "key": key("node-a"), "pod": json_pod("p1"), "payload": "Z3B1LTA=" }),
    )
    .await;
    assert_eq!(status, 200);
    let first = lines.next().await.expect("a line");
    let hold = &first["result"]["hold"];
    assert_eq!(first["result"]["state"], "GRANTED", "{first}");
    assert_eq!(hold["pod"]["uid"], "p1");
    assert_eq!(hold["payload"], "Z3B1LTA=");
    let token = hold["token"].as_str().expect("64-bit integers are strings");
    assert!(lines.next().await.is_none(), "a grant ends the stream");

    // The gRPC client sees the same hold.
    let grpc = client(&cluster);
    let seen = grpc.holder(&lock("node-a")).await.unwrap().expect("held");
    assert_eq!(seen.token.to_string(), token);
    assert_eq!(seen.payload, b"gpu-0");

    // A second pod waits: QUEUED, then GRANTED on the same stream when the
    // first releases over JSON.
    let (_, mut waiting) = acquire(
        addr,
        plain,
        None,
        json!({ "key": key("node-a"), "pod": json_pod("p2"), "waitTimeoutMs": "30000" }),
    )
    .await;
    let queued = waiting.next().await.unwrap();
    assert_eq!(queued["result"]["state"], "QUEUED", "{queued}");
    assert_eq!(queued["result"]["queuePosition"], 1);
    let released = call(
        addr,
        plain,
        "/v1/lock/release",
        None,
        json!({ "key": key("node-a"), "podUid": "p1", "token": token, "outcome": "ALLOCATED" }),
    )
    .await;
    assert_eq!(released.status, 200, "{released:?}");
    assert_eq!(released.body["nextHolder"]["pod"]["uid"], "p2");
    assert_eq!(released.header("x-tether-node-id"), "1");
    let granted = tokio::time::timeout(DEADLINE, waiting.next())
        .await
        .expect("the waiter hears of its grant")
        .unwrap();
    assert_eq!(granted["result"]["state"], "GRANTED", "{granted}");
    // Timed per gRPC method and code in /metrics, beside the gRPC calls.
    let metrics = get(addr, plain, "/metrics").await.unwrap();
    let text = metrics.body.as_str().unwrap();
    let release_timed = "tether_http_api_request_duration_seconds_count{method=\"LockService.Release\",code=\"OK\"} 1";
    assert!(text.contains(release_timed), "{text}");
    let holder = call(
        addr,
        plain,
        "/v1/lock/holder",
        None,
        json!({ "key": key("node-a") }),
    )
    .await;
    assert_eq!(holder.body["hold"]["pod"]["uid"], "p2");
    assert_eq!(holder.body["header"]["linearizable"], true);

    // A waiter whose connection closes gives its place up, as a cancelled
    // gRPC acquire does.
    let (_, mut gone) = acquire(
        addr,
        plain,
        None,
        json!({ "key": key("node-a"), "pod": json_pod("p3"), "waitTimeoutMs": "30000" }),
    )
    .await;
    assert_eq!(gone.next().await.unwrap()["result"]["state"], "QUEUED");
    drop(gone);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let state = grpc.get(&lock("node-a")).await.unwrap();
        if state.waiters.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the closed connection's wait stayed queued: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Retries with one request id get the first answer, over JSON too.
    let retried = json!({
        "requestId": { "clientId": "json-client", "sequence": "1" },
        "key": key("node-c"), "pod": json_pod("p4"),
    });
    let (_, mut one) = acquire(addr, plain, None, retried.clone()).await;
    let (_, mut again) = acquire(addr, plain, None, retried).await;
    let (one, again) = (one.next().await.unwrap(), again.next().await.unwrap());
    assert_eq!(one["result"]["hold"], again["result"]["hold"]);

    // Bad input: the gRPC code's HTTP status, its name, what is wrong; and
    // nothing changes.
    let unknown = call(
        addr,
        plain,
        "/v1/lock/release",
        None,
        json!({ "tokn": "1" }),
    )
    .await;
    assert_eq!((unknown.status, unknown.code()), (400, "INVALID_ARGUMENT"));
    assert!(
        unknown.body["message"].as_str().unwrap().contains("tokn"),
        "{unknown:?}"
    );
    let no_key = call(
        addr,
        plain,
        "/v1/lock/release",
        None,
        json!({ "podUid": "p2" }),
    )
    .await;
    assert_eq!(
        (no_key.status, no_key.code()),
        (400, "INVALID_ARGUMENT"),
        "{no_key:?}"
    );
    let taken = call(
        addr,
        plain,
        "/v1/lock/acquire",
        None,
        json!({ "key": key("node-a"), "pod": json_pod("p5") }),
    )
    .await;
    assert_eq!(
        (taken.status, taken.code()),
        (400, "FAILED_PRECONDITION"),
        "{taken:?}"
    );
    assert_eq!(
        grpc.holder(&lock("node-a"))
            .await
            .unwrap()
            .unwrap()
            .pod
            .unwrap()
            .uid,
        "p2"
    );
    let not_json = send(addr, plain, "POST", "/v1/lock/holder", None, None)
        .await
        .unwrap();
    assert_eq!(not_json.status(), 400, "an empty body has no key");
    assert_eq!(
        get(addr, plain, "/v1/lock/nothing").await.unwrap().status,
        404
    );
    assert_eq!(
        get(addr, plain, "/v1/lock/holder").await.unwrap().status,
        405
    );

    // Another cluster's client is refused before anything runs.
    let response = send_with(
        addr,
        plain,
        "POST",
        "/v1/lock/holder",
        &[("x-tether-expect-cluster", "another-cluster")],
        Some(&json!({ "key": key("node-a") })),
    )
    .await
    .unwrap();
    let response = common::http::read(response).await.unwrap();
    assert_eq!(response.status, 400);
    assert_eq!(response.code(), "FAILED_PRECONDITION");
    assert!(
        !response.header("x-tether-wrong-cluster").is_empty(),
        "{response:?}"
    );
    cluster.shutdown().await;
}

/// Every path of `/openapi.json` is served under its method (anything but
/// 404 and 405), and a path the document does not name is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openapi_document_lists_the_routes_served() {
    let cluster = Cluster::start(1).await;
    let addr = cluster.node(1).http_addr();
    let plain = &Transport::Plain;
    let document = get(addr, plain, "/openapi.json").await.unwrap();
    assert_eq!(document.status, 200);
    let paths = document.body["paths"].as_object().expect("paths").clone();
    assert!(paths.len() >= 25, "{} paths", paths.len());
    let mut operations = Vec::new();
    for (path, item) in &paths {
        let operation = &item["post"];
        operations.push(operation["operationId"].as_str().unwrap().to_string());
        // An empty object: refused (400, or 404 for what does not exist)
        // or served (a stream answers 200 and is dropped); either way by
        // the route, whose answers name the replica, not by the 404 of
        // the port's fallback.
        let response = send(addr, plain, "POST", path, None, Some(&json!({})))
            .await
            .unwrap();
        let status = response.status().as_u16();
        assert!(
            response.headers().contains_key("x-tether-node-id") && status != 405,
            "{path}: {status}"
        );
        let asked = send(addr, plain, "GET", path, None, None).await.unwrap();
        assert_eq!(asked.status(), 405, "{path} under GET");
    }
    for id in [
        "LockService.Acquire",
        "LeaseService.KeepAlive",
        "WatchService.Watch",
    ] {
        assert!(operations.iter().any(|o| o == id), "{id} in {operations:?}");
    }
    let unknown = send(
        addr,
        plain,
        "POST",
        "/v1/lock/steal",
        None,
        Some(&json!({})),
    )
    .await
    .unwrap();
    assert_eq!(unknown.status(), 404);
    assert!(!unknown.headers().contains_key("x-tether-node-id"));
    cluster.shutdown().await;
}

/// What the role checks call: one identity's `POST`.
type Caller<'a> = &'a (
        dyn Fn(&'static str, &'static str, Value) -> futures::future::BoxFuture<'static, Answer>
            + Sync
    );

/// The device plugin's confinement and the other roles, as
/// `security.rs` checks them over gRPC: `call(identity, path, body)`.
async fn roles_hold(call: Caller<'_>) {
    let scheduler = "scheduler";
    let plugin = "device-plugin:node-a";
    let reader = "reader";
    let acquire = |name: &str, uid: &str| json!({ "key": key(name), "pod": json_pod(uid), "payload": "Z3B1" });
    // The scheduler binds on both nodes (a one-line stream, read whole).
    let mut tokens = Vec::new();
    for (name, uid) in [("node-a", "pod-a"), ("node-b", "pod-b")] {
        let granted = call(scheduler, "/v1/lock/acquire", acquire(name, uid)).await;
        assert_eq!(granted.status, 200, "{granted:?}");
        let line: Value = match &granted.body {
            Value::String(text) => serde_json::from_str(text.trim()).unwrap(),
            other => other.clone(),
        };
        assert_eq!(line["result"]["state"], "GRANTED", "{line}");
        tokens.push(
            line["result"]["hold"]["token"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    // The plugin reads its own node, nothing else, and says what is needed.
    let own = call(plugin, "/v1/lock/holder", json!({ "key": key("node-a") })).await;
    assert_eq!(own.status, 200, "{own:?}");
    assert_eq!(own.body["hold"]["payload"], "Z3B1");
    let other = call(plugin, "/v1/lock/holder", json!({ "key": key("node-b") })).await;
    assert_eq!(
        (other.status, other.code()),
        (403, "PERMISSION_DENIED"),
        "{other:?}"
    );
    let message = other.body["message"].as_str().unwrap();
    assert!(
        message.contains("read lock gpu-bind/node-b") && message.contains("device-plugin:node-b"),
        "{message}"
    );
    let refused = [
        ("/v1/lock/get", json!({ "key": key("node-b") })),
        (
            "/v1/lock/release",
            json!({ "key": key("node-b"), "podUid": "pod-b", "token": tokens[1] }),
        ),
        (
            "/v1/lock/force-release",
            json!({ "key": key("node-a"), "operator": "mallory", "reason": "testing" }),
        ),
        (
            "/v1/lock/withdraw",
            json!({ "key": key("node-a"), "podUid": "pod-a" }),
        ),
        ("/v1/lock/list", json!({})),
        ("/v1/lock/acquire", acquire("node-b", "pod-x")),
        (
            "/v1/pin/assign",
            json!({ "key": { "set": "gpu-devices", "member": "uid-x" },
                    "candidates": ["node-b"], "podUid": "uid-x" }),
        ),
    ];
    for (path, body) in refused {
        let answer = call(plugin, path, body).await;
        assert_eq!(
            (answer.status, answer.code()),
            (403, "PERMISSION_DENIED"),
            "{path}: {answer:?}"
        );
    }
    let reader_acquire = call(reader, "/v1/lock/acquire", acquire("node-c", "pod-c")).await;
    assert_eq!(reader_acquire.status, 403, "{reader_acquire:?}");
    let reader_reads = call(reader, "/v1/lock/holder", json!({ "key": key("node-b") })).await;
    assert_eq!(reader_reads.status, 200);
    assert_eq!(
        reader_reads.body["hold"]["token"], tokens[1],
        "nothing changed on node-b"
    );
    // Its own node's hold it releases.
    let released = call(
        plugin,
        "/v1/lock/release",
        json!({ "key": key("node-a"), "podUid": "pod-a", "token": tokens[0] }),
    )
    .await;
    assert_eq!(released.status, 200, "{released:?}");
}

const TOKENS: &str = "sched-0123456789abcdef scheduler\n\
    plugin-0123456789abcdef device-plugin:node-a\n\
    reader-0123456789abcdef reader\n";

fn token_of(identity: &str) -> &'static str {
    match identity {
        "scheduler" => "sched-0123456789abcdef",
        "device-plugin:node-a" => "plugin-0123456789abcdef",
        "reader" => "reader-0123456789abcdef",
        other => panic!("no token for {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bearer_tokens_give_the_grpc_roles_over_json() {
    let root = tempfile::tempdir().unwrap();
    let tokens = root.path().join("tokens");
    std::fs::write(&tokens, TOKENS).unwrap();
    let cluster = Cluster::start_with(1, move |config| {
        config.auth_tokens = Some(tokens.clone());
    })
    .await;
    let addr = cluster.node(1).http_addr();
    let caller = move |identity: &'static str, path: &'static str, body: Value| {
        Box::pin(async move {
            call(
                addr,
                &Transport::Plain,
                path,
                Some(token_of(identity)),
                body,
            )
            .await
        }) as futures::future::BoxFuture<'static, Answer>
    };
    roles_hold(&caller).await;
    for (token, expected) in [
        (None, "no bearer token"),
        (Some("guess-0123456789abcdef"), "unknown"),
    ] {
        let answer = call(
            addr,
            &Transport::Plain,
            "/v1/lock/holder",
            token,
            json!({ "key": key("node-b") }),
        )
        .await;
        assert_eq!(
            (answer.status, answer.code()),
            (401, "UNAUTHENTICATED"),
            "{answer:?}"
        );
        assert!(
            answer.body["message"].as_str().unwrap().contains(expected),
            "{answer:?}"
        );
    }
    // Probes and metrics ask nobody.
    assert_eq!(
        get(addr, &Transport::Plain, "/health")
            .await
            .unwrap()
            .status,
        200
    );
    cluster.shutdown().await;
}

fn identity(root: &Path, ca: &TestCa, name: &str) -> std::sync::Arc<TlsMaterial> {
    let dir = root.join(name.replace(':', "-"));
    TlsMaterial::load(ca.write_dir(&dir, name, &["localhost"])).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_certificates_give_the_grpc_roles_over_https() {
    let root = tempfile::tempdir().unwrap();
    let ca = TestCa::new("tether-test-ca");
    let shared = root.path().join("replica");
    ca.write_dir(&shared, "replica", &["127.0.0.1", "localhost"]);
    let cluster = Cluster::start_with(1, move |config| {
        config.tls_dir = Some(shared.clone());
    })
    .await;
    let addr = cluster.node(1).http_addr();
    let identities: std::collections::BTreeMap<&str, Transport> =
        ["scheduler", "device-plugin:node-a", "reader"]
            .into_iter()
            .map(|name| (name, Transport::Tls(identity(root.path(), &ca, name))))
            .collect();
    let identities = std::sync::Arc::new(identities);
    let caller = move |name: &'static str, path: &'static str, body: Value| {
        let identities = identities.clone();
        Box::pin(async move { call(addr, &identities[name], path, None, body).await })
            as futures::future::BoxFuture<'static, Answer>
    };
    roles_hold(&caller).await;

    // Without a certificate: the probes answer, the API refuses.
    let anonymous = Transport::TlsWithoutCertificate(ca.pem().to_string());
    assert_eq!(get(addr, &anonymous, "/health").await.unwrap().status, 200);
    let refused = call(
        addr,
        &anonymous,
        "/v1/lock/holder",
        None,
        json!({ "key": key("node-a") }),
    )
    .await;
    assert_eq!(
        (refused.status, refused.code()),
        (401, "UNAUTHENTICATED"),
        "{refused:?}"
    );
    assert!(
        refused.body["message"]
            .as_str()
            .unwrap()
            .contains("no client certificate")
    );
    // A certificate from another CA does not get through the handshake.
    let stranger = TestCa::new("another-ca");
    let outsider = Transport::Tls(identity(&root.path().join("outsider"), &stranger, "admin"));
    let outcome = post(
        addr,
        &outsider,
        "/v1/lock/holder",
        None,
        json!({ "key": key("node-a") }),
    )
    .await;
    assert!(
        outcome.is_err(),
        "a stranger's certificate was let in: {outcome:?}"
    );
    // Plain HTTP on the HTTPS port gets no answer.
    let plain = post(addr, &Transport::Plain, "/v1/lock/holder", None, json!({})).await;
    assert!(plain.is_err() || plain.unwrap().status != 200);
    cluster.shutdown().await;
}

/// A follower refuses a write with 503 UNAVAILABLE naming the leader, in
/// the header a JSON client follows; the leader takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_names_the_leader() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_leader().await;
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let body = json!({ "key": key("node-a"), "pod": json_pod("p1") });
    // Until the follower has heard from the leader it names nobody.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let refused = loop {
        let refused = call(
            cluster.node(follower).http_addr(),
            &Transport::Plain,
            "/v1/lock/acquire",
            None,
            body.clone(),
        )
        .await;
        assert_eq!(
            (refused.status, refused.code()),
            (503, "UNAVAILABLE"),
            "{refused:?}"
        );
        if !refused.header("x-tether-leader-id").is_empty() {
            break refused;
        }
        assert!(tokio::time::Instant::now() < deadline, "{refused:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused.header("x-tether-leader-id"), leader.to_string());
    assert_eq!(refused.header("x-tether-node-id"), follower.to_string());
    let taken = call(
        cluster.node(leader).http_addr(),
        &Transport::Plain,
        "/v1/lock/acquire",
        None,
        body,
    )
    .await;
    assert_eq!(taken.status, 200, "{taken:?}");
    cluster.shutdown().await;
}

/// A body of `bytes` bytes of JSON: an acquire whose payload fills it.
fn oversized_acquire(bytes: usize) -> String {
    let head = r#"{"key":{"scope":"gpu-bind","name":"node-a"},"pod":{"uid":"p1"},"payload":""#;
    let tail = r#""}"#;
    let mut body = String::with_capacity(bytes);
    body.push_str(head);
    body.push_str(&"A".repeat(bytes - head.len() - tail.len()));
    body.push_str(tail);
    body
}

/// What curl printed: the answer's body, then its status on a line of its
/// own (`-w`), or why curl failed.
fn curl(url: &str, tls: Option<&tether_tls::TlsFiles>, body: &Path, extra: &[&str]) -> String {
    let mut command = std::process::Command::new("curl");
    command
        .args(["--silent", "--show-error", "--max-time", "60", "-X", "POST"])
        .args(["-H", "content-type: application/json"])
        .arg("--data-binary")
        .arg(format!("@{}", body.display()))
        .args(["-w", "\n%{http_code}"])
        .args(extra);
    if let Some(files) = tls {
        command
            .arg("--cacert")
            .arg(&files.ca)
            .arg("--cert")
            .arg(&files.cert)
            .arg("--key")
            .arg(&files.key);
    }
    let output = command
        .arg(url)
        .output()
        .expect("curl runs (./dev installs it)");
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// An 8 MiB body against the 1 MiB `--max-request-bytes` is answered 413
/// with an error naming the limit, and curl reads that answer: over HTTPS
/// with a client certificate and over plain HTTP, with curl's `Expect:
/// 100-continue` (refused before the body is sent), without it (the body
/// arrives while the answer is written) and chunked (no declared length).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_body_is_answered_413_over_https_and_plain_http() {
    let root = tempfile::tempdir().unwrap();
    let body = root.path().join("eight-mebibytes.json");
    std::fs::write(&body, oversized_acquire(8 << 20)).unwrap();
    let ca = TestCa::new("tether-test-ca");
    let shared = root.path().join("replica");
    ca.write_dir(&shared, "replica", &["127.0.0.1", "localhost"]);
    let secure = Cluster::start_with(1, move |config| {
        config.tls_dir = Some(shared.clone());
    })
    .await;
    let admin_files = ca.write_dir(&root.path().join("admin"), "admin", &["localhost"]);
    let plain = Cluster::start(1).await;
    // The default --max-request-bytes.
    let limit = 1024 * 1024;
    let targets = [
        (
            format!("https://127.0.0.1:{}", secure.node(1).http_addr().port()),
            Some(admin_files.clone()),
        ),
        (format!("http://{}", plain.node(1).http_addr()), None),
    ];
    for (base, tls) in targets {
        let url = format!("{base}/v1/lock/acquire");
        for extra in [
            &[][..],
            &["-H", "Expect:"][..],
            &["-H", "Transfer-Encoding: chunked"][..],
        ] {
            // A reset lost the answer in about one run of fifteen over TLS.
            for _ in 0..10 {
                let case = format!("{base} {extra:?}");
                let (url, tls, body, extra) =
                    (url.clone(), tls.clone(), body.clone(), extra.to_vec());
                let printed =
                    tokio::task::spawn_blocking(move || curl(&url, tls.as_ref(), &body, &extra))
                        .await
                        .unwrap();
                let (text, status) = printed.rsplit_once('\n').unwrap_or(("", &printed));
                assert_eq!(status, "413", "{case}: curl printed {printed}");
                let error: Value = serde_json::from_str(text)
                    .unwrap_or_else(|err| panic!("{case}: not JSON ({err}): {text}"));
                assert_eq!(error["code"], "RESOURCE_EXHAUSTED", "{case}: {error}");
                let message = error["message"].as_str().unwrap();
                assert!(
                    message.contains(&limit.to_string()) && message.contains("--max-request-bytes"),
                    "{case}: {message}"
                );
            }
        }
    }
    // Nothing was taken.
    let admin = TlsMaterial::load(admin_files).unwrap();
    let over_tls = tether_client::Client::new(
        secure.endpoints(),
        tether_client::Options {
            retry_timeout: DEADLINE,
            tls: Some(admin),
            ..tether_client::Options::default()
        },
    )
    .unwrap();
    for reader in [over_tls, client(&plain)] {
        assert_eq!(reader.holder(&lock("node-a")).await.unwrap(), None);
    }
    secure.shutdown().await;
    plain.shutdown().await;
}

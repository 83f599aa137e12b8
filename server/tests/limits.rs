//! Every input limit, tested just below, at and just above its bound: below
//! and at are served, above is refused with an error that names the limit,
//! and a refusal changes nothing (the log does not grow).

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{DEADLINE, lock, pod};
use tether_client::proto as pb;
use tether_client::proto::pin_service_client::PinServiceClient;
use tether_client::{Client, Error, Options};
use tether_server::testing::Cluster;

const PAYLOAD: usize = 1024;
const REQUEST: usize = PAYLOAD + 16 * 1024;
const LABELS: usize = 4;
const WATCHERS: usize = 2;
const QUEUE: u32 = 2;

async fn small_limits() -> Cluster {
    Cluster::start_with(1, |config| {
        config.max_payload_bytes = PAYLOAD;
        config.max_request_bytes = REQUEST;
        config.max_labels = LABELS;
        config.max_watchers_per_client = WATCHERS;
        config.max_queue_length = QUEUE;
    })
    .await
}

/// Runs `refused`, expects the error `matches` and the log unchanged.
async fn refused_without_change<T: std::fmt::Debug>(
    cluster: &Cluster,
    what: &str,
    call: impl std::future::Future<Output = Result<T, Error>>,
    expected: impl Fn(&Error) -> bool,
) {
    let before = cluster.applied(1);
    let result = call.await;
    match &result {
        Err(err) if expected(err) => {}
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
    assert_eq!(
        cluster.applied(1),
        before,
        "{what}: a refusal reached the log"
    );
}

fn too_large(needle: &'static str) -> impl Fn(&Error) -> bool {
    move |err| matches!(err, Error::ResourceExhausted(m) if m.contains(needle))
}

fn invalid(needle: &'static str) -> impl Fn(&Error) -> bool {
    move |err| matches!(err, Error::InvalidArgument(m) if m.contains(needle))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payload_bytes_at_below_and_above_the_limit() {
    let cluster = small_limits().await;
    let client = common::client(&cluster);
    for (i, size) in [PAYLOAD - 1, PAYLOAD].into_iter().enumerate() {
        let key = lock(&format!("n{i}"));
        let hold = client
            .acquire(&key, &pod("p"), vec![7; size], Duration::ZERO, 0)
            .await
            .unwrap_or_else(|e| panic!("{size} bytes: {e}"));
        assert_eq!(hold.payload.len(), size);
    }
    refused_without_change(
        &cluster,
        "payload over the limit",
        client.acquire(
            &lock("n9"),
            &pod("p"),
            vec![7; PAYLOAD + 1],
            Duration::ZERO,
            0,
        ),
        too_large("--max-payload-bytes"),
    )
    .await;
    assert!(client.holder(&lock("n9")).await.unwrap().is_none());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_length_at_below_and_above_the_limit() {
    let cluster = small_limits().await;
    let client = common::client(&cluster);
    let key = lock("n1");
    client
        .acquire(&key, &pod("holder"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    // QUEUE - 1 waiters (below), then QUEUE (at): both queue.
    let mut waiters = Vec::new();
    for n in 1..=QUEUE {
        let (waiting, waited) = (client.clone(), key.clone());
        waiters.push(tokio::spawn(async move {
            waiting
                .acquire(
                    &waited,
                    &pod(&format!("w{n}")),
                    vec![],
                    Duration::from_secs(60),
                    0,
                )
                .await
        }));
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while client.get(&key).await.unwrap().waiters.len() < n as usize {
            assert!(
                tokio::time::Instant::now() < deadline,
                "waiter {n} never queued"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The queue length is state, so the state machine refuses (the entry is
    // in the log; the queue is not changed).
    let err = client
        .acquire(&key, &pod("w9"), vec![], Duration::from_secs(60), 0)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::ResourceExhausted(m) if m.contains(&QUEUE.to_string())),
        "{err}"
    );
    assert_eq!(
        client.get(&key).await.unwrap().waiters.len(),
        QUEUE as usize
    );
    for waiter in waiters {
        waiter.abort();
    }
    cluster.shutdown().await;
}

/// A pod known by its UID only.
fn bare_pod(uid: &str) -> pb::Pod {
    pb::Pod {
        uid: uid.to_string(),
        ..Default::default()
    }
}

fn labels(n: usize) -> HashMap<String, String> {
    (0..n).map(|i| (format!("k{i}"), format!("v{i}"))).collect()
}

fn node_report(name: &str, labels: HashMap<String, String>) -> pb::ReportNodeRequest {
    pb::ReportNodeRequest {
        name: name.to_string(),
        uid: format!("uid-{name}"),
        state: pb::NodeState::NodeReady as i32,
        labels,
        set_labels: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn label_count_and_sizes_at_below_and_above_the_limits() {
    let cluster = small_limits().await;
    let client = common::client(&cluster);
    for count in [LABELS - 1, LABELS] {
        client
            .report_node(node_report(&format!("node-{count}"), labels(count)))
            .await
            .unwrap_or_else(|e| panic!("{count} labels: {e}"));
    }
    refused_without_change(
        &cluster,
        "labels over the count",
        client.report_node(node_report("node-x", labels(LABELS + 1))),
        too_large("--max-labels"),
    )
    .await;
    // Sizes follow Kubernetes: keys up to 253 bytes, values up to 63.
    for (key_len, value_len) in [(252, 62), (253, 63)] {
        let one = HashMap::from([("k".repeat(key_len), "v".repeat(value_len))]);
        client
            .report_node(node_report(&format!("node-s{key_len}"), one))
            .await
            .unwrap_or_else(|e| panic!("key {key_len}, value {value_len}: {e}"));
    }
    for (key_len, value_len, what) in [(254, 1, "key"), (1, 64, "value")] {
        let one = HashMap::from([("k".repeat(key_len), "v".repeat(value_len))]);
        refused_without_change(
            &cluster,
            &format!("a label {what} over its size"),
            client.report_node(node_report("node-y", one)),
            invalid("not valid"),
        )
        .await;
    }
    let names: Vec<String> = client
        .list_nodes(true)
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.name)
        .collect();
    assert!(
        !names.iter().any(|n| n == "node-x" || n == "node-y"),
        "{names:?}"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watchers_per_client_at_below_and_above_the_limit() {
    let cluster = small_limits().await;
    let client = common::client(&cluster);
    let open = |cluster: &Cluster| -> usize {
        cluster
            .node(1)
            .ctx()
            .watchers
            .lock()
            .unwrap()
            .values()
            .sum()
    };
    let mut streams = Vec::new();
    for n in 1..=WATCHERS {
        let mut watcher = client.watch(None, vec![], "lock/").await.unwrap();
        streams.push(tokio::spawn(async move { watcher.next().await }));
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while open(&cluster) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "watch {n} never opened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut extra = client.watch(None, vec![], "lock/").await.unwrap();
    let err = tokio::time::timeout(DEADLINE, extra.next())
        .await
        .expect("refused at once")
        .unwrap_err();
    assert!(too_large("--max-watchers-per-client")(&err), "{err}");
    // A closed watch gives its place back.
    streams.pop().unwrap().abort();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while open(&cluster) >= WATCHERS {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the closed watch kept its place"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut again = client.watch(None, vec![], "lock/").await.unwrap();
    client
        .acquire(&lock("n1"), &pod("p"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let update = tokio::time::timeout(DEADLINE, again.next()).await.unwrap();
    assert!(update.is_ok(), "{update:?}");
    cluster.shutdown().await;
}

/// An assign request whose encoding is exactly `size` bytes (candidates
/// of 200-odd characters, the last one trimmed to fit).
fn assign_of_size(size: usize) -> pb::AssignRequest {
    use prost::Message as _;
    let name = |len: usize| "n".repeat(len);
    let mut request = pb::AssignRequest {
        key: Some(pb::PinKey {
            set: "slurm".into(),
            member: "worker-0".into(),
        }),
        pod_uid: "p".into(),
        ..Default::default()
    };
    while request.encoded_len() + 203 + 131 <= size {
        request.candidates.push(name(200));
    }
    // The rest goes into one more candidate of 128-330 characters (its
    // length prefix takes 2 bytes throughout that range).
    let rest = size - request.encoded_len();
    request.candidates.push(name(rest - 3));
    assert_eq!(request.encoded_len(), size);
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn request_bytes_at_below_and_above_the_limit() {
    let cluster = small_limits().await;
    let addr = format!("http://{}", cluster.addrs[&1]);
    let mut raw = PinServiceClient::connect(addr).await.unwrap();
    for size in [REQUEST - 1, REQUEST] {
        // Past the transport: the pin rules judge it (no such nodes).
        let status = raw.assign(assign_of_size(size)).await.unwrap_err();
        assert!(
            !status.message().contains("too large"),
            "{size} bytes: {status:?}"
        );
    }
    let before = cluster.applied(1);
    let status = raw.assign(assign_of_size(REQUEST + 1)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(
        status.message().contains(&REQUEST.to_string()),
        "{status:?}"
    );
    assert_eq!(cluster.applied(1), before);
    // The client library says what to change.
    let err = Error::from(status);
    assert!(invalid("--max-request-bytes")(&err), "{err}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn names_ids_and_text_at_below_and_above_their_bounds() {
    let cluster = small_limits().await;
    let client = common::client(&cluster);
    let key = |scope: usize, name: usize| pb::LockKey {
        scope: "s".repeat(scope),
        name: "n".repeat(name),
    };
    // Lock scope: a DNS-1123 label (63); name: a DNS-1123 subdomain (253,
    // dot-separated labels of up to 63).
    let subdomain = |len: usize| -> String {
        let mut out = String::new();
        while out.len() < len {
            if !out.is_empty() {
                out.push('.');
            }
            let take = (len - out.len()).min(63);
            out.push_str(&"n".repeat(take));
        }
        out
    };
    for (scope, name) in [(62, subdomain(252)), (63, subdomain(253))] {
        let k = pb::LockKey {
            scope: "s".repeat(scope),
            name,
        };
        client
            .acquire(&k, &pod("p"), vec![], Duration::ZERO, 0)
            .await
            .unwrap_or_else(|e| panic!("scope {scope}: {e}"));
    }
    refused_without_change(
        &cluster,
        "a 64-character scope",
        client.acquire(&key(64, 1), &pod("p"), vec![], Duration::ZERO, 0),
        invalid("DNS-1123 label"),
    )
    .await;
    let long_name = pb::LockKey {
        scope: "s".into(),
        name: subdomain(254),
    };
    refused_without_change(
        &cluster,
        "a 254-character name",
        client.acquire(&long_name, &pod("p"), vec![], Duration::ZERO, 0),
        invalid("DNS-1123 subdomain"),
    )
    .await;
    // Pod UIDs: up to 64.
    for len in [63, 64] {
        client
            .acquire(
                &lock(&format!("u{len}")),
                &bare_pod(&"u".repeat(len)),
                vec![],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap_or_else(|e| panic!("uid of {len}: {e}"));
    }
    refused_without_change(
        &cluster,
        "a 65-character pod uid",
        client.acquire(
            &lock("u65"),
            &bare_pod(&"u".repeat(65)),
            vec![],
            Duration::ZERO,
            0,
        ),
        invalid("pod uid"),
    )
    .await;
    // Client ids (request dedupe): the server takes up to 128 characters,
    // sent here as they are; the client library takes a configured id of up
    // to 128 less its incarnation (`.` and 16 hex digits).
    for len in [127, 128, 129] {
        let request = pb::ReleaseRequest {
            request_id: Some(pb::RequestId {
                client_id: "c".repeat(len),
                sequence: 1,
                first_incomplete: 1,
            }),
            key: Some(lock(&format!("c{len}"))),
            pod_uid: "p".into(),
            token: 1,
            outcome: pb::Outcome::Allocated as i32,
        };
        let result = client
            .with_leader(Duration::ZERO, |conn| {
                let request = request.clone();
                async move {
                    pb::lock_service_client::LockServiceClient::new(conn)
                        .release(request)
                        .await
                }
            })
            .await;
        if len <= 128 {
            // Applied, and refused by the state machine: nobody holds it.
            match result {
                Err(Error::FailedPrecondition(m)) if m.contains("does not hold") => {}
                other => panic!("client id of {len}: expected the release to apply, got {other:?}"),
            }
        } else {
            refused_without_change(
                &cluster,
                "a 129-character client id",
                async { result },
                invalid("client id"),
            )
            .await;
        }
    }
    let max = tether_client::MAX_CLIENT_ID_PREFIX_LEN;
    for len in [max - 1, max, max + 1] {
        let made = Client::new(
            cluster.endpoints(),
            Options {
                retry_timeout: DEADLINE,
                client_id: Some("c".repeat(len)),
                ..Options::default()
            },
        );
        if len <= max {
            made.unwrap()
                .acquire(
                    &lock(&format!("k{len}")),
                    &pod("p"),
                    vec![],
                    Duration::ZERO,
                    0,
                )
                .await
                .unwrap_or_else(|e| panic!("configured client id of {len}: {e}"));
        } else {
            assert!(
                matches!(&made, Err(Error::InvalidArgument(m)) if m.contains("client id")),
                "a configured id of {len}: {:?}",
                made.as_ref().err()
            );
        }
    }
    // Free text (force-release reason): up to 1024 bytes.
    for len in [1023, 1024] {
        client
            .force_release(&lock("u63"), "ops", &"r".repeat(len))
            .await
            .unwrap_or_else(|e| panic!("reason of {len}: {e}"));
    }
    refused_without_change(
        &cluster,
        "a 1025-byte reason",
        client.force_release(&lock("u64"), "ops", &"r".repeat(1025)),
        invalid("longer than 1024"),
    )
    .await;
    assert!(client.holder(&lock("u64")).await.unwrap().is_some());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn candidates_at_below_and_above_the_limit() {
    let cluster = small_limits().await;
    let client = common::client(&cluster);
    client
        .report_node(node_report("node-0", HashMap::new()))
        .await
        .unwrap();
    let limit = 1000;
    for (member, count) in [("m-below", limit - 1), ("m-at", limit)] {
        let mut candidates: Vec<String> = (1..count).map(|i| format!("absent-{i}")).collect();
        candidates.push("node-0".into());
        let key = pb::PinKey {
            set: "slurm".into(),
            member: member.into(),
        };
        client
            .assign(
                &key,
                candidates,
                "p",
                Duration::ZERO,
                HashMap::new(),
                pb::Affinity::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("{count} candidates: {e}"));
    }
    let candidates: Vec<String> = (0..=limit).map(|i| format!("absent-{i}")).collect();
    let key = pb::PinKey {
        set: "slurm".into(),
        member: "m-above".into(),
    };
    refused_without_change(
        &cluster,
        "1001 candidates",
        client.assign(
            &key,
            candidates,
            "p",
            Duration::ZERO,
            HashMap::new(),
            pb::Affinity::default(),
        ),
        too_large("over the limit of 1000"),
    )
    .await;
    cluster.shutdown().await;
}

/// Affinity terms bound the work `choose` does inside apply (terms x pins):
/// 32 together at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn affinity_terms_at_below_and_above_the_limit() {
    let cluster = small_limits().await;
    let client = common::client(&cluster);
    client
        .report_node(node_report("node-0", HashMap::new()))
        .await
        .unwrap();
    let affinity = |terms: usize| pb::Affinity {
        required_anti: (0..terms)
            .map(|i| pb::AffinityTerm {
                label_selector: Some(pb::LabelSelector {
                    match_labels: HashMap::from([("app".to_string(), format!("other-{i}"))]),
                    match_expressions: vec![],
                }),
                topology_key: "kubernetes.io/hostname".into(),
            })
            .collect(),
        ..Default::default()
    };
    let key = |member: &str| pb::PinKey {
        set: "slurm".into(),
        member: member.into(),
    };
    for (member, terms) in [("t-below", 31), ("t-at", 32)] {
        client
            .assign(
                &key(member),
                vec!["node-0".into()],
                "p",
                Duration::ZERO,
                HashMap::new(),
                affinity(terms),
            )
            .await
            .unwrap_or_else(|e| panic!("{terms} terms: {e}"));
    }
    refused_without_change(
        &cluster,
        "33 affinity terms",
        client.assign(
            &key("t-above"),
            vec!["node-0".into()],
            "p",
            Duration::ZERO,
            HashMap::new(),
            affinity(33),
        ),
        too_large("33 affinity terms is over the limit of 32"),
    )
    .await;
    cluster.shutdown().await;
}

/// `--max-request-bytes` is checked at start against what it must carry (a
/// payload of `--max-payload-bytes`) and what must carry it (one Raft
/// message holds any one entry): out of bounds, the replica does not start
/// and says which flag to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_refuses_to_start_with_a_request_limit_out_of_bounds() {
    let start = |tweak: fn(&mut tether_server::Config)| async move {
        let dir = tempfile::tempdir().unwrap();
        let mut config = tether_server::testing::test_config(1, dir.path());
        tweak(&mut config);
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        match tether_server::Node::start_with(config, grpc, http).await {
            Ok(node) => {
                node.stop().await;
                panic!("the replica started");
            }
            Err(err) => format!("{err:#}"),
        }
    };
    let err = start(|c| c.max_request_bytes = c.max_payload_bytes).await;
    assert!(
        err.contains("--max-request-bytes") && err.contains("--max-payload-bytes"),
        "{err}"
    );
    let err = start(|c| c.max_request_bytes = c.raft_message_limit / 4 + 1).await;
    assert!(
        err.contains("--max-request-bytes") && err.contains("at most 16777216"),
        "{err}"
    );
}

//! Lock semantics on a 3-replica in-process cluster: real Raft, RocksDB in
//! temp dirs, gRPC on loopback.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Cluster, DEADLINE, lock, pod};
use tether_client::proto::lock_service_client::LockServiceClient;
use tether_client::proto::{self as pb, Outcome};
use tether_client::{AcquireProgress, Error};
use tether_server::metrics::RaftAppend;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acquire_release_round_trip_and_holder_read() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let key = lock("node-1");
    let hold = client
        .acquire(&key, &pod("u1"), b"gpu0,gpu1".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(hold.token > 0);
    let seen = client.holder(&key).await.unwrap().expect("held");
    assert_eq!(seen.token, hold.token);
    assert_eq!(seen.payload, b"gpu0,gpu1");
    assert_eq!(seen.pod.unwrap().uid, "u1");

    let err = client
        .acquire(&key, &pod("u2"), vec![], Duration::ZERO, 0)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::FailedPrecondition(m) if m.contains(&format!("token {}", hold.token))),
        "{err}"
    );
    let err = client
        .release(&key, "u1", hold.token + 100, Outcome::Allocated)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::FailedPrecondition(m) if m.contains(&format!("current token is {}", hold.token))),
        "{err}"
    );
    let err = client
        .release(&key, "u2", hold.token, Outcome::Allocated)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::FailedPrecondition(m) if m.contains("does not hold")),
        "{err}"
    );

    assert_eq!(
        client
            .release(&key, "u1", hold.token, Outcome::Allocated)
            .await
            .unwrap(),
        None
    );
    assert_eq!(client.holder(&key).await.unwrap(), None);
    cluster.shutdown().await;
}

/// The leader's counter `name` from its `/metrics` text.
fn leader_counter(cluster: &Cluster, leader: u64, name: &str) -> u64 {
    let text = cluster.node(leader).core().metrics.render();
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_acquires_and_releases_share_entries_and_tokens_still_rise_per_lock() {
    // One entry in flight at a time, so that commands arriving meanwhile
    // must wait and go out together.
    let cluster = Cluster::start_with(3, |config| config.batch_in_flight = 1).await;
    let leader = cluster.wait_leader().await;
    let client = Arc::new(common::client(&cluster));
    let shared = lock("node-shared");
    // Each task returns its lock's name and the tokens it saw, in order.
    let mut tasks = Vec::new();
    for i in 0..40usize {
        let (client, shared) = (client.clone(), shared.clone());
        tasks.push(tokio::spawn(async move {
            // Most tasks have a lock of their own; every fifth queues on the
            // shared one, so batches meet commands on one lock too.
            let (key, uid) = if i % 5 == 0 {
                (shared, format!("shared-{i}"))
            } else {
                (lock(&format!("node-{i}")), format!("own-{i}"))
            };
            let mut tokens = Vec::new();
            for round in 0..5 {
                let hold = client
                    .acquire(
                        &key,
                        &pod(&uid),
                        format!("{round}").into_bytes(),
                        DEADLINE,
                        0,
                    )
                    .await
                    .unwrap();
                assert_eq!(hold.payload(), format!("{round}").as_bytes());
                tokens.push(hold.token);
                client
                    .release(&key, &uid, hold.token, Outcome::Allocated)
                    .await
                    .unwrap();
            }
            (key.name, tokens)
        }));
    }
    let mut seen = Vec::new();
    for task in tasks {
        seen.push(
            tokio::time::timeout(DEADLINE, task)
                .await
                .expect("task finished")
                .unwrap(),
        );
    }
    let mut shared_tokens = Vec::new();
    for (name, tokens) in &seen {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{name}: tokens {tokens:?} do not rise"
        );
        if name == "node-shared" {
            shared_tokens.extend(tokens.iter().copied());
        }
    }
    // Every grant of the shared lock has a token of its own.
    let grants = shared_tokens.len();
    shared_tokens.sort_unstable();
    shared_tokens.dedup();
    assert_eq!(
        shared_tokens.len(),
        grants,
        "two grants of one lock share a token"
    );

    let entries = leader_counter(&cluster, leader, "tether_write_entries_total");
    let commands = leader_counter(&cluster, leader, "tether_write_commands_total");
    assert_eq!(
        commands,
        40 * 5 * 2,
        "every acquire and release was proposed once"
    );
    assert!(
        entries < commands,
        "{commands} commands went out in {entries} entries: nothing was batched"
    );
    println!("{commands} acquires and releases in {entries} entries");
    // Replication went over AppendEntries streams, not unary calls.
    let metrics = &cluster.node(leader).core().metrics;
    for follower in (1..=3).filter(|id| *id != leader) {
        let opened = metrics.raft_appends(follower, RaftAppend::StreamOpened);
        println!("AppendEntries streams opened to replica {follower}: {opened}");
        assert!(opened >= 1);
        assert_eq!(metrics.raft_appends(follower, RaftAppend::Unary), 0);
    }
    for i in 0..40usize {
        let key = if i % 5 == 0 {
            shared.clone()
        } else {
            lock(&format!("node-{i}"))
        };
        assert_eq!(client.holder(&key).await.unwrap(), None);
    }
    cluster.shutdown().await;
}

/// Once every member reads format 11, claims (assignments) and pod reports
/// and revokes share batch entries with acquires and releases. A pod
/// deleted as it binds (its acquire, claim, report and revoke sent at once)
/// whose revoke lands in the entry that granted its lock is revoked in an
/// entry of its own: its caller never sees the refusal, and the pod holds
/// the lock afterwards only if the revoke came before the acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_and_pod_reports_share_entries_and_a_revoke_racing_its_grant_still_ends_it() {
    let cluster = Cluster::start_with(3, |config| config.batch_in_flight = 1).await;
    let leader = cluster.wait_leader().await;
    let client = Arc::new(common::client(&cluster));
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut rounds = 0;
    // Rounds until one revoke was refused in its grant's entry and proposed
    // again (it takes the two landing in one batch in that order).
    while leader_counter(
        &cluster,
        leader,
        "tether_write_commands_proposed_again_total",
    ) == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no revoke shared an entry with its pod's grant in {rounds} rounds"
        );
        rounds += 1;
        let mut tasks = Vec::new();
        for i in 0..20usize {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let uid = format!("race-{rounds}-{i}");
                let key = lock(&uid);
                let claim = pb::PinKey {
                    set: "gpu-claims".into(),
                    member: uid.clone(),
                };
                let binding = pod(&uid);
                let (acquired, claimed, reported, revoked) = tokio::join!(
                    client.acquire(&key, &binding, vec![], Duration::ZERO, 0),
                    client.assign(
                        &claim,
                        vec![format!("node-{i}")],
                        &uid,
                        Duration::from_secs(60),
                        std::collections::HashMap::new(),
                        pb::Affinity::default(),
                    ),
                    client.report_pod(&uid, pb::PodPhase::PodRunning),
                    client.revoke_pod(&uid, "deleted as it binds"),
                );
                let hold = acquired.expect("a free lock is granted");
                let pin = claimed.expect("claimed").pin.expect("a pin");
                assert_eq!(pin.node, format!("node-{i}"));
                reported.expect("reported");
                let revoked = revoked.expect("the revoke is answered, never refused");
                let ended = revoked.released.contains(&key);
                let holder = client.holder(&key).await.unwrap();
                assert_eq!(
                    holder.is_none(),
                    ended,
                    "{uid}: holder {holder:?} after a revoke that released {:?}",
                    revoked.released
                );
                if let Some(holder) = holder {
                    assert_eq!(holder.token, hold.token);
                    client
                        .release(&key, &uid, hold.token, Outcome::Allocated)
                        .await
                        .unwrap();
                }
            }));
        }
        for task in tasks {
            tokio::time::timeout(DEADLINE, task)
                .await
                .expect("task finished")
                .unwrap();
        }
    }
    let entries = leader_counter(&cluster, leader, "tether_write_entries_total");
    let commands = leader_counter(&cluster, leader, "tether_write_commands_total");
    println!("{rounds} rounds: {commands} commands in {entries} entries");
    assert!(
        entries * 2 < commands,
        "{commands} commands went out in {entries} entries: claims and reports were not batched"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queueing_acquires_wait_for_the_release_and_share_its_entry() {
    // Held back for as long as it takes here: every acquire that would
    // queue must go out with the next release of its lock, none alone.
    let cluster = Cluster::start_with(3, |config| {
        config.batch_hold_queued = Duration::from_secs(30);
    })
    .await;
    let leader = cluster.wait_leader().await;
    let client = Arc::new(common::client(&cluster));
    let key = lock("node-contended");
    let mut tasks = Vec::new();
    for i in 0..3 {
        let (client, key) = (client.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let uid = format!("contender-{i}");
            let mut tokens = Vec::new();
            for _ in 0..10 {
                let hold = client
                    .acquire(&key, &pod(&uid), vec![], DEADLINE, 0)
                    .await
                    .unwrap();
                tokens.push(hold.token);
                client
                    .release(&key, &uid, hold.token, Outcome::Allocated)
                    .await
                    .unwrap();
            }
            tokens
        }));
    }
    let mut all_tokens = Vec::new();
    for task in tasks {
        let tokens = tokio::time::timeout(DEADLINE, task)
            .await
            .expect("a contender finished")
            .unwrap();
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "tokens {tokens:?} do not rise"
        );
        all_tokens.extend(tokens);
    }
    all_tokens.sort_unstable();
    all_tokens.dedup();
    assert_eq!(all_tokens.len(), 30, "two grants share a token");

    let joined = leader_counter(&cluster, leader, "tether_held_acquires_joined_total");
    let expired = leader_counter(&cluster, leader, "tether_held_acquires_expired_total");
    let entries = leader_counter(&cluster, leader, "tether_write_entries_total");
    let commands = leader_counter(&cluster, leader, "tether_write_commands_total");
    println!(
        "{commands} acquires and releases in {entries} entries; held acquires: {joined} went \
         with a release, {expired} ran out"
    );
    assert!(joined > 0, "no acquire was held back");
    assert_eq!(
        expired, 0,
        "a held acquire waited for a release that never came"
    );
    assert_eq!(commands, 60);
    assert_eq!(client.holder(&key).await.unwrap(), None);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_waiters_are_granted_in_fifo_order_exactly_once_with_increasing_tokens() {
    let cluster = Cluster::start(3).await;
    let client = Arc::new(common::client(&cluster));
    let key = lock("node-fifo");
    let first = client
        .acquire(&key, &pod("holder"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();

    let grants: Arc<Mutex<Vec<(usize, u64)>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..50usize {
        let (queued_tx, queued_rx) = tokio::sync::oneshot::channel();
        let queued_tx = Mutex::new(Some(queued_tx));
        let (client, key, grants) = (client.clone(), key.clone(), grants.clone());
        tasks.push(tokio::spawn(async move {
            let uid = format!("waiter-{i}");
            let hold = client
                .acquire_with_progress(&key, &pod(&uid), vec![], DEADLINE, 0, |p| {
                    if let AcquireProgress::Queued(_) = p
                        && let Some(tx) = queued_tx.lock().unwrap().take()
                    {
                        let _ = tx.send(());
                    }
                })
                .await
                .unwrap();
            grants.lock().unwrap().push((i, hold.token));
            client
                .release(&key, &uid, hold.token, Outcome::Allocated)
                .await
                .unwrap();
        }));
        // Queue them one after another so the FIFO order is known.
        queued_rx.await.expect("waiter queued");
    }
    let state = client.get(&key).await.unwrap();
    assert_eq!(state.waiters.len(), 50);
    client
        .release(&key, "holder", first.token, Outcome::Allocated)
        .await
        .unwrap();
    for task in tasks {
        tokio::time::timeout(DEADLINE, task)
            .await
            .expect("waiter finished")
            .unwrap();
    }
    let grants = grants.lock().unwrap().clone();
    let order: Vec<usize> = grants.iter().map(|(i, _)| *i).collect();
    assert_eq!(
        order,
        (0..50).collect::<Vec<_>>(),
        "grants out of FIFO order"
    );
    let mut last = first.token;
    for (i, token) in grants {
        assert!(
            token > last,
            "waiter {i} got token {token}, not above {last}"
        );
        last = token;
    }
    assert_eq!(client.holder(&key).await.unwrap(), None);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiter_whose_deadline_passes_leaves_the_queue_with_deadline_exceeded() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let key = lock("node-deadline");
    let hold = client
        .acquire(&key, &pod("u1"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let err = client
        .acquire(&key, &pod("u2"), vec![], Duration::from_millis(700), 0)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::DeadlineExceeded(_)), "{err}");
    let state = client.get(&key).await.unwrap();
    assert!(
        state.waiters.is_empty(),
        "the waiter must have left the queue: {state:?}"
    );
    // Releasing now frees the lock: nobody is granted behind our back.
    assert_eq!(
        client
            .release(&key, "u1", hold.token, Outcome::Failed)
            .await
            .unwrap(),
        None
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_killed_while_waiters_are_queued_keeps_queue_holder_and_token_order() {
    let mut cluster = Cluster::start(3).await;
    let client = Arc::new(common::client(&cluster));
    let key = lock("node-failover");
    let first = client
        .acquire(&key, &pod("a"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let mut waiters = Vec::new();
    for uid in ["b", "c"] {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tx = Mutex::new(Some(tx));
        let (client, key) = (client.clone(), key.clone());
        waiters.push(tokio::spawn(async move {
            client
                .acquire_with_progress(&key, &pod(uid), vec![], DEADLINE, 0, |p| {
                    if let AcquireProgress::Queued(_) = p
                        && let Some(tx) = tx.lock().unwrap().take()
                    {
                        let _ = tx.send(());
                    }
                })
                .await
        }));
        rx.await.unwrap();
    }

    let old_leader = cluster.wait_leader().await;
    cluster.stop(old_leader).await;
    let new_leader = cluster.wait_leader().await;
    assert_ne!(new_leader, old_leader);

    let state = client.get(&key).await.unwrap();
    assert_eq!(
        state.holder.as_ref().unwrap().token,
        first.token,
        "holder survived"
    );
    let queue: Vec<String> = state
        .waiters
        .iter()
        .map(|w| w.pod.clone().unwrap().uid)
        .collect();
    assert_eq!(queue, ["b", "c"], "queue survived in order");

    let next = client
        .release(&key, "a", first.token, Outcome::Allocated)
        .await
        .unwrap()
        .expect("b granted");
    assert_eq!(next.pod.as_ref().unwrap().uid, "b");
    assert!(next.token > first.token);
    let b = waiters
        .remove(0)
        .await
        .unwrap()
        .expect("b's acquire completes after the failover");
    assert_eq!(b.token, next.token);
    let c_next = client
        .release(&key, "b", b.token, Outcome::Allocated)
        .await
        .unwrap()
        .expect("c granted");
    assert!(c_next.token > b.token);
    let c = waiters.remove(0).await.unwrap().expect("c granted");
    assert_eq!(c.token, c_next.token);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoke_pod_releases_the_hold_and_hands_over_to_the_next_waiter() {
    let cluster = Cluster::start(3).await;
    let client = Arc::new(common::client(&cluster));
    let key = lock("node-revoke");
    let other = lock("node-other");
    client
        .acquire(&key, &pod("gone"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    client
        .acquire(&other, &pod("busy"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Mutex::new(Some(tx));
    let (c2, k2) = (client.clone(), key.clone());
    let next = tokio::spawn(async move {
        c2.acquire_with_progress(&k2, &pod("next"), b"plan".to_vec(), DEADLINE, 0, |_| {
            if let Some(tx) = tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
        })
        .await
    });
    rx.await.unwrap();
    // The revoked pod also waits on another lock: that wait goes too.
    let (c3, o3) = (client.clone(), other.clone());
    let gone_wait =
        tokio::spawn(async move { c3.acquire(&o3, &pod("gone"), vec![], DEADLINE, 0).await });
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while client.get(&other).await.unwrap().waiters.is_empty() {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let reply = client.revoke_pod("gone", "pod deleted").await.unwrap();
    assert_eq!(reply.released, vec![key.clone()]);
    assert_eq!(reply.dequeued, vec![other.clone()]);
    assert_eq!(reply.granted.len(), 1);
    let hold = next
        .await
        .unwrap()
        .expect("next waiter granted by the revoke");
    assert_eq!(hold.pod_uid(), "next");
    assert_eq!(hold.payload, b"plan");
    let err = gone_wait.await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Aborted(_)), "{err}");
    assert!(client.get(&other).await.unwrap().waiters.is_empty());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retried_request_after_a_leader_change_is_not_applied_twice() {
    let mut cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let key = lock("node-dedupe");
    let request = pb::AcquireRequest {
        request_id: Some(pb::RequestId {
            client_id: "retry-test".into(),
            sequence: 1,
            first_incomplete: 1,
        }),
        key: Some(key.clone()),
        pod: Some(pod("u1")),
        payload: vec![],
        wait_timeout_ms: 0,
        lease_id: 0,
        node_uid: String::new(),
    };
    let leader = cluster.wait_leader().await;
    let mut raw = LockServiceClient::connect(format!("http://{}", cluster.addrs[&leader]))
        .await
        .unwrap();
    let first = raw
        .acquire(request.clone())
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    let token = first.hold.unwrap().token;

    cluster.stop(leader).await;
    let new_leader = cluster.wait_leader().await;
    let mut raw = LockServiceClient::connect(format!("http://{}", cluster.addrs[&new_leader]))
        .await
        .unwrap();
    // While the hold stands, the retry gets it: the stored answer.
    let retry = raw
        .acquire(request.clone())
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        retry.hold.unwrap().token,
        token,
        "the retry gets the stored answer"
    );
    client
        .release(&key, "u1", token, Outcome::Allocated)
        .await
        .unwrap();
    // Once the hold has ended, a retry is told so: it neither gets a stale
    // "granted" nor takes the lock again.
    let err = raw.acquire(request).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Aborted, "{err}");
    assert!(
        err.message().contains(&format!("token {token}")) && err.message().contains("has ended"),
        "{err}"
    );
    assert_eq!(
        client.holder(&key).await.unwrap(),
        None,
        "the retry did not take the lock again"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn invalid_names_and_oversized_payloads_are_refused_and_change_nothing() {
    let cluster = Cluster::start_with(3, |c| c.max_payload_bytes = 1024).await;
    let client = common::client(&cluster);
    let leader = cluster.wait_leader().await;
    let before = cluster.applied(leader);
    let cases: Vec<(pb::LockKey, pb::Pod, usize, &str)> = vec![
        (
            pb::LockKey {
                scope: "GPU".into(),
                name: "n1".into(),
            },
            pod("u1"),
            0,
            "scope",
        ),
        (
            pb::LockKey {
                scope: "gpu".into(),
                name: "bad_name".into(),
            },
            pod("u1"),
            0,
            "name",
        ),
        (lock("n1"), pod("not/a/uid"), 0, "uid"),
    ];
    for (key, pod, size, what) in cases {
        let err = client
            .acquire(&key, &pod, vec![0; size], Duration::ZERO, 0)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{what}: {err}");
    }
    let err = client
        .acquire(&lock("n1"), &pod("u1"), vec![0; 1025], Duration::ZERO, 0)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::ResourceExhausted(m) if m.contains("1024")),
        "{err}"
    );
    let err = client.revoke_pod("", "x").await.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(client.list("").await.unwrap().is_empty());
    assert_eq!(
        cluster.applied(leader),
        before,
        "refused input must not reach the log"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn follower_answers_writes_with_unavailable_and_the_leader_address() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_leader().await;
    let follower = *cluster.addrs.keys().find(|id| **id != leader).unwrap();
    let mut raw = LockServiceClient::connect(format!("http://{}", cluster.addrs[&follower]))
        .await
        .unwrap();
    let request = pb::ReleaseRequest {
        key: Some(lock("n1")),
        pod_uid: "u1".into(),
        token: 1,
        ..Default::default()
    };
    let status = raw.release(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    let addr = status
        .metadata()
        .get(tether_client::proto::LEADER_ADDR_METADATA)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(addr, cluster.addrs[&leader].to_string());
    assert!(
        status.message().contains(&format!("node {leader}")),
        "{}",
        status.message()
    );
    cluster.shutdown().await;
}

/// Polls `done` every 20 ms until it holds or [`DEADLINE`] passes.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let give_up = tokio::time::Instant::now() + DEADLINE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < give_up,
            "{what} within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A queued acquire under request id `client`#1 on lock `name`, waiting up
/// to a minute.
fn queued_acquire(client: &str, name: &str, uid: &str) -> pb::AcquireRequest {
    pb::AcquireRequest {
        request_id: Some(pb::RequestId {
            client_id: client.into(),
            sequence: 1,
            first_incomplete: 1,
        }),
        key: Some(lock(name)),
        pod: Some(pod(uid)),
        payload: vec![],
        wait_timeout_ms: 60_000,
        lease_id: 0,
        node_uid: String::new(),
    }
}

/// The caller of a queued acquire goes away after the replica that served
/// it stopped leading: the give-up goes through the new leader, so the wait
/// does not stay queued until its deadline (a minute here, up to 15 in
/// production) to be granted to nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_whose_caller_went_away_is_given_up_through_the_new_leader() {
    let cluster = Cluster::start_with(3, |config| {
        config.abandoned_wait_grace = Duration::from_millis(300);
    })
    .await;
    let client = common::client(&cluster);
    let key = lock("node-abandon");
    client
        .acquire(&key, &pod("holder"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let leader = cluster.wait_leader().await;
    let mut raw = LockServiceClient::connect(format!("http://{}", cluster.addrs[&leader]))
        .await
        .unwrap();
    let mut stream = raw
        .acquire(queued_acquire("gone-caller", "node-abandon", "waiter"))
        .await
        .unwrap()
        .into_inner();
    let queued = stream.message().await.unwrap().unwrap();
    assert_eq!(queued.queue_position, 1);
    let target = (1..=3).find(|id| *id != leader).unwrap();
    assert_eq!(client.transfer_leader(target).await.unwrap(), target);
    drop(stream);
    drop(raw);
    let served = cluster.node(leader).core().clone();
    eventually("the abandoned wait removed through the new leader", || {
        served.metrics.abandoned_waits("removed") == 1
    })
    .await;
    let state = client.get(&key).await.unwrap();
    assert!(state.waiters.is_empty(), "{state:?}");
    assert_eq!(state.holder.unwrap().pod.unwrap().uid, "holder");
    cluster.shutdown().await;
}

/// A client whose queued acquire's connection resets retries it with the
/// same request id: it gets where it stands (queued at its place), and the
/// first stream's give-up, coming after the retry, keeps the wait; the
/// release then grants the retried stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_acquire_retried_after_a_reset_keeps_its_place() {
    let cluster = Cluster::start_with(3, |config| {
        config.abandoned_wait_grace = Duration::from_millis(300);
    })
    .await;
    let client = common::client(&cluster);
    let key = lock("node-reset");
    let hold = client
        .acquire(&key, &pod("holder"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let leader = cluster.wait_leader().await;
    let connect = || LockServiceClient::connect(format!("http://{}", cluster.addrs[&leader]));
    let request = queued_acquire("resetting-caller", "node-reset", "waiter");
    let mut first = connect().await.unwrap();
    let mut stream = first.acquire(request.clone()).await.unwrap().into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().queue_position, 1);
    // The reset: the stream and its connection go; the retry comes at once.
    drop(stream);
    drop(first);
    let mut second = connect().await.unwrap();
    let mut retried = second.acquire(request).await.unwrap().into_inner();
    let answer = retried.message().await.unwrap().unwrap();
    assert_eq!(
        (answer.state, answer.queue_position),
        (pb::acquire_response::State::Queued as i32, 1),
        "the retry is told where it stands"
    );
    let served = cluster.node(leader).core().clone();
    eventually("the first stream's give-up applied", || {
        served.metrics.abandoned_waits("taken_up") == 1
    })
    .await;
    let state = client.get(&key).await.unwrap();
    assert_eq!(state.waiters.len(), 1, "the wait kept its place: {state:?}");
    client
        .release(&key, "holder", hold.token, Outcome::Allocated)
        .await
        .unwrap();
    let granted = tokio::time::timeout(DEADLINE, retried.message())
        .await
        .expect("the grant reaches the retried stream")
        .unwrap()
        .unwrap();
    assert_eq!(granted.state, pb::acquire_response::State::Granted as i32);
    assert_eq!(granted.hold.unwrap().pod.unwrap().uid, "waiter");
    assert_eq!(served.metrics.abandoned_waits("removed"), 0);
    cluster.shutdown().await;
}

/// A queued acquire whose caller went away is granted during the abandoned
/// wait grace (the holder released at once): nobody will use that hold, so
/// the give-up hands it to the next waiter instead of leaving the node
/// with a holder nobody serves until the hold timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_that_raced_an_abandoned_wait_is_given_back_to_the_next_waiter() {
    let cluster = Cluster::start_with(3, |config| {
        config.abandoned_wait_grace = Duration::from_secs(2);
    })
    .await;
    let client = common::client(&cluster);
    let key = lock("node-raced");
    let hold = client
        .acquire(&key, &pod("holder"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let leader = cluster.wait_leader().await;
    let mut raw = LockServiceClient::connect(format!("http://{}", cluster.addrs[&leader]))
        .await
        .unwrap();
    let mut stream = raw
        .acquire(queued_acquire(
            "vanishing-caller",
            "node-raced",
            "abandoned",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().queue_position, 1);
    let next = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move {
            client
                .acquire(&key, &pod("next"), vec![], DEADLINE, 0)
                .await
        })
    };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while client.get(&key).await.unwrap().waiters.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the next pod queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The caller goes; the holder releases at once, inside the grace: the
    // abandoned wait is granted.
    drop(stream);
    drop(raw);
    let released = client
        .release(&key, "holder", hold.token, Outcome::Allocated)
        .await
        .unwrap();
    assert_eq!(released.unwrap().pod.unwrap().uid, "abandoned");
    let granted = tokio::time::timeout(DEADLINE, next)
        .await
        .expect("the next pod is granted once the abandoned grant is given back")
        .unwrap()
        .unwrap();
    assert_eq!(granted.pod_uid(), "next");
    // The give-up counts its outcome once the leader's answer reaches it,
    // which may be after the next pod saw its grant.
    let served = cluster.node(leader).core().clone();
    eventually("the give-up counted as a hold given back", || {
        served.metrics.abandoned_waits("given_back") == 1
    })
    .await;
    let history = client
        .history(&format!("lock/{}/{}", key.scope, key.name), 0, 0)
        .await
        .unwrap();
    assert!(
        history
            .events
            .iter()
            .any(|e| e.kind == "LockReleased" && e.reason.contains("caller had gone away")),
        "{history:?}"
    );
    cluster.shutdown().await;
}

/// `Withdraw` ends a pod's wait, or gives back its hold and grants the next
/// waiter in the same entry; a second one finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn withdraw_ends_a_wait_or_gives_back_a_hold_and_a_second_finds_nothing() {
    use pb::withdraw_response::Result as Withdrawn;
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let key = lock("node-withdraw");
    client
        .acquire(&key, &pod("holder"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let queue = |uid: &'static str| {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move { client.acquire(&key, &pod(uid), vec![], DEADLINE, 0).await })
    };
    let leaving = queue("leaving");
    let staying = queue("staying");
    let waiters = || async { client.get(&key).await.unwrap().waiters.len() };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while waiters().await < 2 {
        assert!(tokio::time::Instant::now() < deadline, "both queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ended = client.withdraw(&key, "leaving").await.unwrap();
    assert_eq!(ended.result, Withdrawn::WaitEnded as i32);
    let err = leaving.await.unwrap().unwrap_err();
    assert!(
        matches!(&err, Error::Aborted(m) if m.contains("withdrew")),
        "{err}"
    );
    let given = client.withdraw(&key, "holder").await.unwrap();
    assert_eq!(given.result, Withdrawn::HoldGivenBack as i32);
    assert_eq!(given.given_back.unwrap().pod.unwrap().uid, "holder");
    assert_eq!(given.next_holder.unwrap().pod.unwrap().uid, "staying");
    assert_eq!(staying.await.unwrap().unwrap().pod_uid(), "staying");
    for uid in ["holder", "leaving", "nobody"] {
        let again = client.withdraw(&key, uid).await.unwrap();
        assert_eq!(again.result, Withdrawn::NotInvolved as i32, "{uid}");
    }
    assert_eq!(
        client.holder(&key).await.unwrap().unwrap().pod.unwrap().uid,
        "staying"
    );
    cluster.shutdown().await;
}

/// Two bind attempts of one pod through two clients (kube-scheduler gave up
/// on the first and tried again through another extender replica): the
/// second client's acquire takes the pod's hold over with a new token, or
/// its wait over in its place, and the first client can end neither — its
/// token is stale, its withdrawal finds nothing of its own, and its queued
/// call is told the wait was taken over (format 9).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_clients_acquire_of_a_pod_takes_it_over_and_the_first_can_end_nothing() {
    use pb::withdraw_response::Result as Withdrawn;
    let cluster = Cluster::start(3).await;
    let first = common::client(&cluster);
    let second = common::client(&cluster);
    assert_ne!(first.client_id(), second.client_id());

    // A hold taken over.
    let key = lock("node-takeover");
    let held = first
        .acquire(&key, &pod("p"), b"plan-a".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap();
    let again = first
        .acquire(&key, &pod("p"), b"plan-a".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap();
    assert_eq!(
        again.token(),
        held.token(),
        "the same client gets its hold back"
    );
    let taken = second
        .acquire(&key, &pod("p"), b"plan-b".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(
        taken.token() > held.token(),
        "{} {}",
        taken.token(),
        held.token()
    );
    let withdrawn = first.withdraw(&key, "p").await.unwrap();
    assert_eq!(withdrawn.result, Withdrawn::TakenOver as i32);
    let stale = first
        .release(&key, "p", held.token(), Outcome::Failed)
        .await
        .unwrap_err();
    assert!(
        matches!(&stale, Error::FailedPrecondition(m) if m.contains("token")),
        "{stale}"
    );
    let now = first.holder(&key).await.unwrap().unwrap();
    assert_eq!(
        (now.token, now.payload.as_slice()),
        (taken.token(), &b"plan-b"[..])
    );

    // A wait taken over: the first call is told so, the second is granted.
    let queue = |client: &tether_client::Client, payload: &'static [u8]| {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move {
            client
                .acquire(&key, &pod("q"), payload.to_vec(), DEADLINE, 0)
                .await
        })
    };
    let first_wait = queue(&first, b"plan-qa");
    let waiters = || async { first.get(&key).await.unwrap().waiters };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while waiters().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second_wait = queue(&second, b"plan-qb");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while waiters().await[0].client_id != second.client_id() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the wait taken over"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(waiters().await.len(), 1, "one wait, in its place");
    let withdrawn = first.withdraw(&key, "q").await.unwrap();
    assert_eq!(withdrawn.result, Withdrawn::TakenOver as i32);
    second
        .release(&key, "p", taken.token(), Outcome::Allocated)
        .await
        .unwrap();
    let granted = second_wait.await.unwrap().unwrap();
    assert_eq!(granted.pod_uid(), "q");
    let told = first_wait.await.unwrap().unwrap_err();
    assert!(
        matches!(&told, Error::Aborted(m) if m.contains("taken over")),
        "{told}"
    );
    let now = second.holder(&key).await.unwrap().unwrap();
    assert_eq!(
        (now.token, now.payload.as_slice()),
        (granted.token(), &b"plan-qb"[..])
    );
    cluster.shutdown().await;
}

//! Unit and property tests of the state machine, driven directly (no Raft).

use std::collections::{BTreeMap, VecDeque};

use super::command::*;
use super::*;

const T0: u64 = 1_000_000;

/// A tiny harness: applies commands at increasing log indexes.
struct Machine {
    state: State,
    index: u64,
    now: u64,
    events: Vec<Event>,
    /// Every applied (index, request), to replay from a snapshot.
    log: Vec<(u64, Request)>,
}

impl Machine {
    fn new() -> Self {
        Self {
            state: State::default(),
            index: 0,
            now: T0,
            events: Vec::new(),
            log: Vec::new(),
        }
    }

    fn run_as(&mut self, id: Option<RequestId>, command: Command) -> Response {
        self.index += 1;
        let request = Request::new(id, self.now, command);
        let (response, events, _) = apply(&mut self.state, self.index, &request);
        self.events.extend(events);
        self.log.push((self.index, request));
        response
    }

    fn run(&mut self, command: Command) -> CommandResult {
        self.run_as(None, command).result
    }
}

fn pod(uid: &str) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "ns".into(),
        name: format!("pod-{uid}"),
    }
}

fn key(name: &str) -> LockKey {
    LockKey::new("gpu-bind", name)
}

fn acquire(name: &str, uid: &str, wait_ms: u64) -> Command {
    Command::Acquire(Acquire {
        key: key(name),
        pod: pod(uid),
        payload: format!("plan-{uid}").into_bytes(),
        wait_ms,
        lease_id: 0,
        client_id: "test".into(),
        queue_limit: 100,
    })
}

fn release(name: &str, uid: &str, token: u64) -> Command {
    Command::Release(Release {
        key: key(name),
        pod_uid: uid.into(),
        token,
        outcome: Outcome::Allocated,
    })
}

fn sweep(tenure_ms: u64, hold_timeout_ms: u64) -> Command {
    Command::Sweep(Sweep {
        leader_tenure_ms: tenure_ms,
        hold_timeout_ms,
        scope_hold_timeout_ms: BTreeMap::new(),
        session_idle_ms: u64::MAX / 2,
    })
}

fn granted(result: CommandResult) -> Hold {
    match result {
        Ok(Reply::Granted(hold)) => hold,
        other => panic!("expected a grant, got {other:?}"),
    }
}

#[test]
fn free_lock_is_granted_with_the_entry_index_as_token() {
    let mut m = Machine::new();
    m.run(acquire("a", "other", 0)).unwrap();
    let hold = granted(m.run(acquire("b", "u1", 0)));
    assert_eq!(hold.token, 2);
    assert_eq!(hold.payload, b"plan-u1");
    assert_eq!(hold.granted_at_ms, T0);
}

#[test]
fn same_uid_reacquiring_gets_the_same_hold() {
    let mut m = Machine::new();
    let first = granted(m.run(acquire("a", "u1", 0)));
    let again = granted(m.run(acquire("a", "u1", 5000)));
    assert_eq!(first, again);
}

#[test]
fn held_lock_refuses_a_non_waiting_acquire_naming_the_holder() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    let err = m.run(acquire("a", "u2", 0)).unwrap_err();
    assert!(
        matches!(&err, CommandError::LockHeld { token: 1, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("token 1"));
}

#[test]
fn release_hands_over_to_the_queue_head_in_the_same_entry() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    assert_eq!(
        m.run(acquire("a", "u2", 1000)),
        Ok(Reply::Queued { position: 1 })
    );
    assert_eq!(
        m.run(acquire("a", "u3", 1000)),
        Ok(Reply::Queued { position: 2 })
    );
    assert_eq!(
        m.run(acquire("a", "u2", 1000)),
        Ok(Reply::Queued { position: 1 }),
        "idempotent wait"
    );
    let reply = m.run(release("a", "u1", 1)).unwrap();
    let Reply::Released {
        next: Some(next), ..
    } = reply
    else {
        panic!("{reply:?}")
    };
    assert_eq!(next.pod.uid, "u2");
    assert_eq!(next.token, 5, "token = index of the releasing entry");
    assert_eq!(next.payload, b"plan-u2");
}

#[test]
fn release_refuses_non_holders_and_stale_tokens_and_changes_nothing() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    let before = m.state.clone();
    let err = m.run(release("a", "u2", 1)).unwrap_err();
    assert!(
        matches!(
            &err,
            CommandError::NotHolder {
                current: Some((_, 1)),
                ..
            }
        ),
        "{err:?}"
    );
    let err = m.run(release("a", "u1", 7)).unwrap_err();
    assert_eq!(
        err,
        CommandError::StaleToken {
            key: key("a"),
            presented: 7,
            current: 1
        }
    );
    let err = m.run(release("free", "u1", 1)).unwrap_err();
    assert!(matches!(err, CommandError::NotHolder { current: None, .. }));
    assert_eq!(m.state.locks, before.locks);
}

#[test]
fn revoke_pod_releases_holds_and_waits_in_one_entry() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "dead", 0)));
    granted(m.run(acquire("b", "u2", 0)));
    m.run(acquire("b", "dead", 1000)).unwrap();
    m.run(acquire("a", "u3", 1000)).unwrap();
    let reply = m
        .run(Command::RevokePod(RevokePod {
            pod_uid: "dead".into(),
            reason: "deleted".into(),
        }))
        .unwrap();
    let Reply::Revoked {
        released,
        dequeued,
        granted,
    } = reply
    else {
        panic!()
    };
    assert_eq!(released, vec![key("a")]);
    assert_eq!(dequeued, vec![key("b")]);
    assert_eq!(granted.len(), 1);
    assert_eq!(granted[0].1.pod.uid, "u3");
    assert_eq!(granted[0].1.token, 5);
    assert!(m.state.locks[&key("b")].waiters.is_empty());
    // Idempotent.
    let again = m
        .run(Command::RevokePod(RevokePod {
            pod_uid: "dead".into(),
            reason: "deleted".into(),
        }))
        .unwrap();
    assert_eq!(
        again,
        Reply::Revoked {
            released: vec![],
            dequeued: vec![],
            granted: vec![]
        }
    );
}

#[test]
fn cancel_after_grant_reports_the_grant() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    m.run(acquire("a", "u2", 1000)).unwrap();
    m.run(release("a", "u1", 1)).unwrap();
    let reply = m
        .run(Command::CancelWait(CancelWait {
            key: key("a"),
            pod_uid: "u2".into(),
        }))
        .unwrap();
    assert!(
        matches!(reply, Reply::WaitCancelled(CancelOutcome::AlreadyGranted(ref h)) if h.token == 3)
    );
    let reply = m
        .run(Command::CancelWait(CancelWait {
            key: key("a"),
            pod_uid: "u9".into(),
        }))
        .unwrap();
    assert_eq!(reply, Reply::WaitCancelled(CancelOutcome::NotWaiting));
}

#[test]
fn retried_request_is_answered_from_the_dedupe_table() {
    let mut m = Machine::new();
    let id = RequestId {
        client_id: "c1".into(),
        sequence: 1,
        first_incomplete: 1,
    };
    let first = m.run_as(Some(id.clone()), acquire("a", "u1", 0));
    m.run(release("a", "u1", 1)).unwrap();
    let retry = m.run_as(Some(id), acquire("a", "u1", 0));
    assert_eq!(first.result, retry.result);
    assert!(retry.deduplicated);
    assert!(
        m.state.locks.is_empty(),
        "the retry must not take the lock again"
    );
}

#[test]
fn acknowledged_sequences_are_forgotten_and_refused() {
    let mut m = Machine::new();
    let id = |sequence, first_incomplete| {
        Some(RequestId {
            client_id: "c".into(),
            sequence,
            first_incomplete,
        })
    };
    m.run_as(id(1, 1), acquire("a", "u1", 0));
    m.run_as(id(2, 1), acquire("b", "u1", 0));
    // Sequence 1 still incomplete: its answer is kept for a retry.
    assert!(m.run_as(id(1, 1), acquire("a", "u1", 0)).deduplicated);
    // The client has seen 1 and 2 answered: both are forgotten.
    m.run_as(id(3, 3), acquire("c", "u1", 0));
    assert_eq!(
        m.state.sessions["c"]
            .responses
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        vec![3]
    );
    let late = m.run_as(id(1, 1), acquire("z", "u9", 0));
    assert!(
        matches!(
            late.result,
            Err(CommandError::SequenceTooOld {
                sequence: 1,
                oldest_kept: 3,
                ..
            })
        ),
        "{late:?}"
    );
    assert!(
        !m.state.locks.contains_key(&key("z")),
        "a refused retry changes nothing"
    );
}

#[test]
fn unacknowledged_responses_are_bounded_per_client() {
    let mut m = Machine::new();
    for seq in 1..=(SESSION_MAX_RESPONSES as u64 + 10) {
        m.run_as(
            Some(RequestId {
                client_id: "c".into(),
                sequence: seq,
                first_incomplete: 0,
            }),
            acquire("a", "u1", 0),
        );
    }
    let session = &m.state.sessions["c"];
    assert_eq!(session.responses.len(), SESSION_MAX_RESPONSES);
    assert_eq!(session.acknowledged_below, 11);
}

#[test]
fn sweep_drops_waits_past_their_deadline() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    m.run(acquire("a", "u2", 500)).unwrap();
    m.run(acquire("a", "u3", 5000)).unwrap();
    m.now += 1000;
    assert!(sweep_due(
        &m.state,
        m.now,
        &Sweep {
            leader_tenure_ms: 0,
            hold_timeout_ms: 1 << 40,
            scope_hold_timeout_ms: BTreeMap::new(),
            session_idle_ms: 1 << 40
        }
    ));
    let reply = m.run(sweep(0, 1 << 40)).unwrap();
    assert!(matches!(
        reply,
        Reply::Swept {
            waits: 1,
            holds: 0,
            ..
        }
    ));
    let waiters: Vec<_> = m.state.locks[&key("a")]
        .waiters
        .iter()
        .map(|w| w.pod.uid.clone())
        .collect();
    assert_eq!(waiters, vec!["u3"]);
    assert!(m.events.iter().any(|e| matches!(&e.kind, EventKind::WaitEnded { pod, reason: WaitEndReason::DeadlineExceeded, .. } if pod.uid == "u2")));
}

#[test]
fn hold_timeout_waits_for_the_lock_delay_of_a_new_leader() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    m.run(acquire("a", "u2", 1 << 30)).unwrap();
    m.now += 10_000;
    // Timeout 5 s has passed on committed time, but the leader has led 1 s.
    assert!(matches!(
        m.run(sweep(1_000, 5_000)).unwrap(),
        Reply::Swept { holds: 0, .. }
    ));
    assert_eq!(
        m.state.locks[&key("a")].holder.as_ref().unwrap().pod.uid,
        "u1"
    );
    // After a full window of its own, it expires and hands over.
    assert!(matches!(
        m.run(sweep(5_000, 5_000)).unwrap(),
        Reply::Swept { holds: 1, .. }
    ));
    assert_eq!(
        m.state.locks[&key("a")].holder.as_ref().unwrap().pod.uid,
        "u2"
    );
}

#[test]
fn ttl_lease_expiry_releases_attached_holds() {
    let mut m = Machine::new();
    let Reply::Lease { lease_id, .. } = m
        .run(Command::GrantLease(GrantLease { ttl_ms: 3000 }))
        .unwrap()
    else {
        panic!()
    };
    let mut cmd = acquire("a", "u1", 0);
    if let Command::Acquire(a) = &mut cmd {
        a.lease_id = lease_id;
    }
    granted(m.run(cmd));
    m.now += 2000;
    assert_eq!(
        m.run(Command::KeepAliveLease(KeepAliveLease { lease_id }))
            .unwrap(),
        Reply::Lease {
            lease_id,
            ttl_ms: 3000
        }
    );
    m.now += 2000;
    assert!(
        matches!(
            m.run(sweep(1 << 40, 1 << 40)).unwrap(),
            Reply::Swept { leases: 0, .. }
        ),
        "kept alive"
    );
    m.now += 2000;
    assert!(matches!(
        m.run(sweep(1 << 40, 1 << 40)).unwrap(),
        Reply::Swept { leases: 1, .. }
    ));
    assert!(m.state.locks.is_empty());
    assert_eq!(
        m.run(Command::KeepAliveLease(KeepAliveLease { lease_id }))
            .unwrap(),
        Reply::Lease {
            lease_id,
            ttl_ms: 0
        }
    );
}

#[test]
fn committed_time_never_goes_backwards() {
    let mut m = Machine::new();
    m.run(acquire("a", "u1", 0)).unwrap();
    m.now -= 500; // a new leader whose clock is behind
    m.run(acquire("b", "u1", 0)).unwrap();
    assert_eq!(m.state.now_ms, T0);
}

/// Deterministic pseudo-random numbers (xorshift64*), so a failing seed
/// replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_command(rng: &mut Rng, m: &Machine) -> Command {
    let lock = format!("n{}", rng.below(3));
    let uid = format!("p{}", rng.below(8));
    match rng.below(10) {
        0..=3 => acquire(&lock, &uid, [0, 200, 5_000][rng.below(3) as usize]),
        4..=5 => {
            // Mostly the real holder and token, sometimes a wrong one.
            let holder = m
                .state
                .locks
                .get(&key(&lock))
                .and_then(|l| l.holder.clone());
            match (holder, rng.below(4)) {
                (Some(h), 0..=2) => release(&lock, &h.pod.uid, h.token),
                (Some(h), _) => release(&lock, &h.pod.uid, h.token + 1),
                (None, _) => release(&lock, &uid, rng.below(50)),
            }
        }
        6 => Command::RevokePod(RevokePod {
            pod_uid: uid,
            reason: "test".into(),
        }),
        7 => Command::CancelWait(CancelWait {
            key: key(&lock),
            pod_uid: uid,
        }),
        8 => Command::ForceRelease(ForceRelease {
            key: key(&lock),
            operator: "op".into(),
            reason: "test".into(),
        }),
        _ => sweep(rng.below(20_000), 3_000),
    }
}

/// Checks the invariants that must hold after every entry, and that grants
/// follow the queue order seen in earlier events.
fn check_invariants(
    state: &State,
    new_events: &[Event],
    queues: &mut BTreeMap<LockKey, VecDeque<String>>,
    last_token: &mut BTreeMap<LockKey, u64>,
    seed: u64,
) {
    for (k, lock) in &state.locks {
        assert!(
            lock.holder.is_some() || lock.waiters.is_empty(),
            "seed {seed}: {k} free but has waiters"
        );
        let mut uids: Vec<_> = lock.waiters.iter().map(|w| w.pod.uid.clone()).collect();
        if let Some(h) = &lock.holder {
            uids.push(h.pod.uid.clone());
        }
        let total = uids.len();
        uids.sort();
        uids.dedup();
        assert_eq!(
            uids.len(),
            total,
            "seed {seed}: {k} has a pod twice among holder and waiters"
        );
    }
    for event in new_events {
        match &event.kind {
            EventKind::LockQueued { key, pod, .. } => queues
                .entry(key.clone())
                .or_default()
                .push_back(pod.uid.clone()),
            EventKind::WaitEnded { key, pod, .. } => queues
                .entry(key.clone())
                .or_default()
                .retain(|u| u != &pod.uid),
            EventKind::LockGranted { key, hold } => {
                let queue = queues.entry(key.clone()).or_default();
                if queue.contains(&hold.pod.uid) {
                    assert_eq!(
                        queue.front(),
                        Some(&hold.pod.uid),
                        "seed {seed}: {key} granted out of FIFO order"
                    );
                    queue.pop_front();
                }
                let last = last_token.entry(key.clone()).or_default();
                assert!(
                    hold.token > *last,
                    "seed {seed}: token {} not above {} on {key}",
                    hold.token,
                    last
                );
                *last = hold.token;
            }
            _ => {}
        }
    }
}

#[test]
fn random_sequences_keep_mutual_exclusion_fifo_and_increasing_tokens() {
    let base_seed = std::env::var("TETHER_SM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_u64);
    for round in 0..40u64 {
        let seed = base_seed.wrapping_add(round).max(1);
        println!("state machine property test seed {seed} (replay: TETHER_SM_SEED={seed})");
        let mut rng = Rng(seed);
        let mut m = Machine::new();
        let mut queues = BTreeMap::new();
        let mut last_token = BTreeMap::new();
        let mut snapshot_at = None;
        for step in 0..400 {
            m.now += rng.below(400);
            let command = random_command(&mut rng, &m);
            let before = m.events.len();
            let id = (rng.below(2) == 0).then(|| RequestId {
                client_id: format!("c{}", rng.below(3)),
                sequence: m.index + 1,
                first_incomplete: m.index.saturating_sub(rng.below(4)),
            });
            m.run_as(id, command);
            check_invariants(
                &m.state,
                &m.events[before..],
                &mut queues,
                &mut last_token,
                seed,
            );
            if step == 200 {
                snapshot_at = Some((m.index, crate::store::encode(&m.state)));
            }
        }
        // Snapshot -> restore gives the identical state, and a replica that
        // installs the mid-run snapshot and applies the rest of the log ends
        // in the identical state.
        let restored: State = crate::store::decode(&crate::store::encode(&m.state)).unwrap();
        assert_eq!(
            restored, m.state,
            "seed {seed}: snapshot round trip changed the state"
        );
        let (snapshot_index, bytes) = snapshot_at.unwrap();
        let mut replica: State = crate::store::decode(&bytes).unwrap();
        for (index, request) in m.log.iter().filter(|(i, _)| *i > snapshot_index) {
            apply(&mut replica, *index, request);
        }
        assert_eq!(
            replica, m.state,
            "seed {seed}: snapshot + log replay diverged"
        );
    }
}

#[test]
fn replay_is_deterministic() {
    let run = |seed: u64| {
        let mut rng = Rng(seed);
        let mut m = Machine::new();
        for _ in 0..300 {
            m.now += rng.below(400);
            let command = random_command(&mut rng, &m);
            m.run(command).ok();
        }
        (crate::store::encode(&m.state), m.events)
    };
    assert_eq!(run(42), run(42));
}

//! Unit and property tests of the state machine, driven directly (no Raft).

use std::collections::{BTreeMap, VecDeque};

use super::affinity::*;
use super::command::*;
use super::*;
// Seeded, so a failing seed replays exactly.
use crate::fuzzing::XorShift as Rng;

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

    /// Applies `command` under request id `id`; an acquire acts for the
    /// client of its id, as the server makes it.
    fn run_as(&mut self, id: Option<RequestId>, command: Command) -> Response {
        let command = acting_for(id.as_ref(), command);
        self.run_request(Request::new(id, self.now, command))
    }

    /// Applies `request` as written, format version included.
    fn run_request(&mut self, request: Request) -> Response {
        self.index += 1;
        let (response, events, _) = apply(&mut self.state, self.index, &request);
        self.events.extend(events);
        self.log.push((self.index, request));
        response
    }

    fn run(&mut self, command: Command) -> CommandResult {
        self.run_as(None, command).result
    }
}

/// `command` as the server makes it for request `id`: an acquire acts for
/// the client of its request.
fn acting_for(id: Option<&RequestId>, mut command: Command) -> Command {
    if let (Some(id), Some(acquire)) = (id, acquire_in(&mut command)) {
        acquire.client_id = id.client_id.clone();
    }
    command
}

/// The acquire `command` makes, plain or for the node objects its caller
/// saw.
fn acquire_in(command: &mut Command) -> Option<&mut Acquire> {
    match command {
        Command::Acquire(acquire)
        | Command::ForNodeObjects(ForNodeObjects {
            command: NodeTaking::Acquire(acquire),
            ..
        }) => Some(acquire),
        _ => None,
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

fn sweep_settings(tenure_ms: u64, hold_timeout_ms: u64) -> Sweep {
    Sweep {
        leader_tenure_ms: tenure_ms,
        hold_timeout_ms,
        scope_hold_timeout_ms: BTreeMap::new(),
        session_idle_ms: u64::MAX / 2,
        node_tombstone_ms: u64::MAX / 2,
    }
}

fn sweep(tenure_ms: u64, hold_timeout_ms: u64) -> Command {
    Command::Sweep(sweep_settings(tenure_ms, hold_timeout_ms))
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
    granted(m.run(acquire("a", "u1", 0)));
    let id = RequestId {
        client_id: "c1".into(),
        sequence: 1,
        first_incomplete: 1,
    };
    let first = m.run_as(Some(id.clone()), release("a", "u1", 1));
    granted(m.run(acquire("a", "u2", 0)));
    let retry = m.run_as(Some(id), release("a", "u1", 1));
    assert_eq!(first.result, retry.result);
    assert!(retry.deduplicated);
    assert_eq!(
        m.state.locks[&key("a")].holder.as_ref().unwrap().pod.uid,
        "u2",
        "the retry must not release the lock again"
    );
}

fn request_id(client: &str, sequence: u64) -> RequestId {
    RequestId {
        client_id: client.into(),
        sequence,
        first_incomplete: sequence,
    }
}

fn batch(items: Vec<(Option<RequestId>, Command)>) -> Command {
    Command::Batch(Batch {
        items: items
            .into_iter()
            .map(|(request_id, mut command)| {
                // As the server makes it: an acquire acts for its client.
                if let (Some(id), Command::Acquire(acquire)) = (&request_id, &mut command) {
                    acquire.client_id = id.client_id.clone();
                }
                BatchItem {
                    request_id,
                    command,
                }
            })
            .collect(),
    })
}

fn batch_replies(response: Response) -> Vec<Response> {
    match response.result {
        Ok(Reply::Batch(replies)) => replies,
        other => panic!("expected the replies of a batch, got {other:?}"),
    }
}

#[test]
fn a_batch_applies_each_item_with_its_own_reply_dedupe_and_the_entry_token() {
    let mut m = Machine::new();
    m.run(acquire("a", "u1", 0)).unwrap();
    m.run(acquire("a", "u2", 60_000)).unwrap();
    // Release a (hands over to u2), take b, and fail a non-holder's release
    // of c: three clients, one entry.
    let response = m.run_as(
        None,
        batch(vec![
            (Some(request_id("c1", 1)), release("a", "u1", 1)),
            (Some(request_id("c3", 1)), acquire("b", "u3", 0)),
            (Some(request_id("c4", 1)), release("c", "u4", 9)),
        ]),
    );
    let replies = batch_replies(response);
    assert_eq!(replies.len(), 3);
    let Ok(Reply::Released {
        next: Some(next), ..
    }) = &replies[0].result
    else {
        panic!("the release hands over: {:?}", replies[0]);
    };
    assert_eq!((next.pod.uid.as_str(), next.token), ("u2", 3));
    assert_eq!(granted(replies[1].result.clone()).token, 3);
    assert!(matches!(
        replies[2].result,
        Err(CommandError::NotHolder { .. })
    ));
    // One entry's events: sub-indexes run on across the items.
    let revisions: Vec<(u64, u32)> = m
        .events
        .iter()
        .filter(|e| e.revision.index == 3)
        .map(|e| (e.revision.index, e.revision.sub))
        .collect();
    assert_eq!(revisions, vec![(3, 0), (3, 1), (3, 2)]);

    // Each item is in the dedupe table under its own id: a retry, alone or
    // in a later batch, gets the stored reply and changes nothing.
    let state = crate::store::encode(&m.state);
    let retry = m.run_as(Some(request_id("c3", 1)), acquire("b", "u3", 0));
    assert!(retry.deduplicated);
    assert_eq!(retry.result, replies[1].result);
    let retried = batch_replies(m.run_as(
        None,
        batch(vec![(Some(request_id("c1", 1)), release("a", "u1", 1))]),
    ));
    assert!(retried[0].deduplicated);
    assert_eq!(retried[0].result, replies[0].result);
    let mut sessions_only = m.state.clone();
    let mut before: State = crate::store::decode(&state).unwrap();
    sessions_only.now_ms = before.now_ms;
    before.sessions = sessions_only.sessions.clone();
    assert_eq!(before, sessions_only, "retries changed more than the clock");
}

#[test]
fn a_malformed_batch_is_refused_whole_and_changes_nothing() {
    let mut m = Machine::new();
    m.run(acquire("a", "u1", 0)).unwrap();
    let malformed = [
        ("empty", batch(vec![])),
        (
            "two commands on one lock",
            batch(vec![
                (None, release("a", "u1", 1)),
                (None, acquire("a", "u2", 0)),
            ]),
        ),
        (
            "not an acquire or release",
            batch(vec![
                (None, acquire("b", "u2", 0)),
                (None, plain_assign("m1", "u3", &["n1"], 0)),
            ]),
        ),
        (
            "a batch inside a batch",
            batch(vec![(None, batch(vec![(None, acquire("b", "u2", 0))]))]),
        ),
    ];
    for (what, command) in malformed {
        let items = match &command {
            Command::Batch(b) => b.items.len(),
            _ => unreachable!(),
        };
        let before = crate::store::encode(&m.state);
        let events = m.events.len();
        // As a format-3 leader wrote them: that format allows one command
        // per lock, and its entries must replay as they first applied.
        let mut request = Request::new(None, m.now, command);
        request.format_version = BATCH_FORMAT_VERSION;
        let replies = batch_replies(m.run_request(request));
        assert_eq!(replies.len(), items, "{what}");
        for reply in &replies {
            assert!(
                matches!(&reply.result, Err(CommandError::InvalidBatch { reason }) if !reason.is_empty()),
                "{what}: {reply:?}"
            );
        }
        let mut after = m.state.clone();
        after.now_ms = crate::store::decode::<State>(&before).unwrap().now_ms;
        assert_eq!(
            crate::store::encode(&after),
            before,
            "{what}: state changed"
        );
        assert_eq!(m.events.len(), events, "{what}: events emitted");
    }
    // A batch entry with a request id of its own is refused too: its items
    // carry the ids.
    let replies = batch_replies(m.run_as(
        Some(request_id("c1", 1)),
        batch(vec![(None, acquire("b", "u2", 0))]),
    ));
    assert!(matches!(
        replies[0].result,
        Err(CommandError::InvalidBatch { .. })
    ));
    assert!(!m.state.locks.contains_key(&key("b")));
}

#[test]
fn a_format_4_batch_carries_several_commands_on_one_lock_and_grants_it_once() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    // An acquire queueing behind the holder, the holder's release, and
    // another acquire: one entry, in format 4 at least (9 with this build's
    // acquire rules; 4 is its oldest form).
    let command = batch(vec![
        (Some(request_id("c2", 1)), acquire("a", "u2", 1000)),
        (Some(request_id("c1", 1)), release("a", "u1", 1)),
        (Some(request_id("c3", 1)), acquire("a", "u3", 1000)),
    ]);
    assert_eq!(command.oldest_form(), SHARED_LOCK_BATCH_FORMAT_VERSION);
    let request = Request::new(None, m.now, command);
    assert_eq!(request.format_version, TAKEOVER_FORMAT_VERSION);
    let replies = batch_replies(m.run_request(request));
    assert_eq!(replies[0].result, Ok(Reply::Queued { position: 1 }));
    let Ok(Reply::Released {
        next: Some(next), ..
    }) = &replies[1].result
    else {
        panic!("the release hands over: {:?}", replies[1]);
    };
    assert_eq!((next.pod.uid.as_str(), next.token), ("u2", 2));
    assert_eq!(replies[2].result, Ok(Reply::Queued { position: 1 }));

    // A release of the hold granted earlier in the same entry (its token is
    // the entry's index, which no client was told yet) is refused and not
    // remembered: the lock is not granted a second time under one token.
    let state = m.state.clone();
    let replies = batch_replies(m.run_as(
        None,
        batch(vec![
            (Some(request_id("c2", 2)), release("a", "u2", 2)),
            (Some(request_id("c3", 2)), release("a", "u3", 3)),
            (Some(request_id("c4", 1)), acquire("a", "u4", 1000)),
        ]),
    ));
    assert!(matches!(
        &replies[0].result,
        Ok(Reply::Released { next: Some(hold), .. }) if hold.pod.uid == "u3" && hold.token == 3
    ));
    assert!(
        matches!(&replies[1].result, Err(CommandError::InvalidBatch { reason }) if reason.contains("granted by this same entry")),
        "{:?}",
        replies[1]
    );
    assert_eq!(replies[2].result, Ok(Reply::Queued { position: 1 }));
    let lock = &m.state.locks[&key("a")];
    assert_eq!(lock.holder.as_ref().map(|h| h.token), Some(3));
    assert_eq!(lock.last_token, 3);
    assert!(
        !m.state.sessions["c3"].responses.contains_key(&2),
        "the refused item is not in the dedupe table"
    );
    assert_ne!(m.state, state);

    // The same request id in a later entry applies as new: u3 holds token 3
    // by then, and u4 is granted.
    let retry = m.run_as(Some(request_id("c3", 2)), release("a", "u3", 3));
    assert!(!retry.deduplicated);
    assert!(matches!(
        retry.result,
        Ok(Reply::Released { next: Some(hold), .. }) if hold.pod.uid == "u4" && hold.token == 4
    ));
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
fn a_request_id_reused_for_another_command_is_refused_and_changes_nothing() {
    let mut m = Machine::new();
    let first = m.run_as(Some(request_id("c", 1)), acquire("node-a", "u1", 0));
    granted(first.result.clone());
    // Another command under the same id (another caller forging it, or a
    // client that reuses sequences) must not get the first one's answer.
    let state_before = m.state.clone();
    let events_before = m.events.len();
    let reused = m.run_as(Some(request_id("c", 1)), acquire("node-b", "u2", 0));
    assert_eq!(
        reused.result,
        Err(CommandError::RequestIdReused {
            client_id: "c".into(),
            sequence: 1
        })
    );
    assert!(!reused.deduplicated);
    assert_eq!(m.state.locks, state_before.locks, "nothing was applied");
    assert_eq!(m.state.sessions, state_before.sessions);
    assert_eq!(m.events.len(), events_before);
    // The true retry still gets its answer.
    let retry = m.run_as(Some(request_id("c", 1)), acquire("node-a", "u1", 0));
    assert!(retry.deduplicated);
    assert_eq!(retry.result, first.result);
}

#[test]
fn a_format_5_retry_is_answered_as_format_5_answered_it() {
    // Entries written for a member of an older build (a rolling upgrade)
    // apply as that build applies them: no fingerprint is kept or checked.
    let mut m = Machine::new();
    let format_5 = |m: &Machine, command| Request {
        format_version: 5,
        request_id: Some(request_id("c", 1)),
        leader_time_ms: m.now,
        command,
    };
    let first = m.run_request(format_5(&m, acquire("node-a", "u1", 0)));
    assert_eq!(m.state.sessions["c"].responses[&1].fingerprint, None);
    granted(first.result);
    let other = m.run_request(format_5(&m, acquire("node-b", "u2", 0)));
    assert!(other.deduplicated, "format 5 answers from the table");
    assert!(!m.state.locks.contains_key(&key("node-b")));
    // A format-6 request meeting that unfingerprinted answer is answered
    // the same way: the answer has nothing to compare with.
    let newer = m.run_as(Some(request_id("c", 1)), acquire("node-b", "u2", 0));
    assert!(newer.deduplicated);
    assert!(!m.state.locks.contains_key(&key("node-b")));
}

#[test]
fn one_request_cannot_put_a_clients_next_sequences_below_its_floor() {
    let mut m = Machine::new();
    let id = |client: &str, sequence, first_incomplete| {
        Some(RequestId {
            client_id: client.into(),
            sequence,
            first_incomplete,
        })
    };
    m.run_as(id("c", 1, 1), acquire("a", "u1", 0));
    m.run_as(id("c", 2, 2), acquire("b", "u1", 0));
    // A forged request claims everything up to 2^62 is done.
    let far = 1 << 62;
    m.run_as(id("c", far, far), acquire("z", "u9", 0));
    assert_eq!(
        m.state.sessions["c"].acknowledged_below, 3,
        "the floor moved only over sequences the session had seen (1 and 2)"
    );
    // The client's own next request applies as new.
    let next = m.run_as(id("c", 3, 3), acquire("d", "u1", 0));
    granted(next.result);
    assert!(!next.deduplicated);
    // A new session's floor cannot start ahead either.
    m.run_as(id("fresh", far, far), acquire("e", "u1", 0));
    assert_eq!(m.state.sessions["fresh"].acknowledged_below, 0);
    granted(m.run_as(id("fresh", 1, 1), acquire("f", "u1", 0)).result);
}

fn abandon(name: &str, uid: &str, id: &RequestId, answered_at: u64) -> Command {
    Command::AbandonWait(AbandonWait {
        key: key(name),
        pod_uid: uid.into(),
        client_id: id.client_id.clone(),
        sequence: id.sequence,
        answered_at,
    })
}

#[test]
fn an_abandoned_wait_is_removed_unless_a_retry_answered_it_since() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "holder", 0)));
    // Queued by request c#1 (entry 2); its caller goes away and nothing
    // comes back for it: the wait is removed.
    let first = request_id("c", 1);
    let queued = m.run_as(Some(first.clone()), acquire("a", "u1", 60_000));
    assert_eq!(queued.result, Ok(Reply::Queued { position: 1 }));
    let queued_at = m.index;
    assert_eq!(
        m.run(abandon("a", "u1", &first, queued_at)),
        Ok(Reply::WaitCancelled(CancelOutcome::Removed))
    );
    assert!(matches!(
        &m.events.last().unwrap().kind,
        EventKind::WaitEnded {
            reason: WaitEndReason::Abandoned,
            ..
        }
    ));
    // Queued by c#2; the connection resets and the client retries c#2 at
    // once (a later entry answers it): the first stream's give-up, arriving
    // after the retry, keeps the wait.
    let second = request_id("c", 2);
    m.run_as(Some(second.clone()), acquire("a", "u2", 60_000));
    let stream_at = m.index;
    let retry = m.run_as(Some(second.clone()), acquire("a", "u2", 60_000));
    assert!(retry.deduplicated);
    assert_eq!(retry.result, Ok(Reply::Queued { position: 1 }));
    let retry_at = m.index;
    assert_eq!(
        m.run(abandon("a", "u2", &second, stream_at)),
        Ok(Reply::WaitCancelled(CancelOutcome::TakenUp))
    );
    assert_eq!(m.state.locks[&key("a")].position_of("u2"), Some(1));
    // The retry's own stream going away too ends it; a grant that won the
    // race is reported and kept.
    assert_eq!(
        m.run(abandon("a", "u2", &second, retry_at)),
        Ok(Reply::WaitCancelled(CancelOutcome::Removed))
    );
    let third = request_id("c", 3);
    m.run_as(Some(third.clone()), acquire("a", "u3", 60_000));
    let third_at = m.index;
    m.run(release("a", "holder", 1))
        .expect("the holder releases");
    assert!(matches!(
        m.run(abandon("a", "u3", &third, third_at)),
        Ok(Reply::WaitCancelled(CancelOutcome::AlreadyGranted(hold))) if hold.pod.uid == "u3"
    ));
}

#[test]
fn a_sweep_forgets_the_phases_of_pods_nothing_names() {
    let mut m = Machine::new();
    let report = |uid: &str, phase| {
        Command::ReportPod(ReportPod {
            pod_uid: uid.into(),
            phase,
        })
    };
    let held = granted(m.run(acquire("a", "holder", 0)));
    m.run(acquire("a", "waiter", 60_000)).unwrap();
    m.run(report("holder", PodPhase::Starting)).unwrap();
    m.run(report("waiter", PodPhase::Running)).unwrap();
    m.run(report("unnamed", PodPhase::Running)).unwrap();
    let settings = sweep_settings(0, 1 << 40);
    assert!(sweep_due(&m.state, m.now, &settings, FORMAT_VERSION));
    // A format-5 sweep (a rolling upgrade) keeps them, as format 5 did, and
    // is not due for them.
    assert!(!sweep_due(&m.state, m.now, &settings, 5));
    m.run_request(Request {
        format_version: 5,
        request_id: None,
        leader_time_ms: m.now,
        command: Command::Sweep(settings.clone()),
    });
    assert!(m.state.pods.contains_key("unnamed"));
    m.run(Command::Sweep(settings.clone())).unwrap();
    assert_eq!(
        m.state.pods.keys().collect::<Vec<_>>(),
        vec!["holder", "waiter"],
        "only the pod nothing names is forgotten"
    );
    // The holder releases (the waiter is granted): the holder is forgotten
    // at the next sweep, the new holder is not.
    m.run(release("a", "holder", held.token)).unwrap();
    m.run(Command::Sweep(settings.clone())).unwrap();
    assert_eq!(m.state.pods.keys().collect::<Vec<_>>(), vec!["waiter"]);
    assert!(!sweep_due(&m.state, m.now, &settings, FORMAT_VERSION));
}

#[test]
fn a_clients_kept_answers_are_bounded_by_bytes() {
    let mut m = Machine::new();
    // A client that never says it has seen an answer, with 60 KiB payloads
    // (each "granted" answer carries its hold's payload).
    let payload_acquire = |n: u64| {
        let mut command = acquire(&format!("lock-{n}"), "u1", 0);
        if let Command::Acquire(a) = &mut command {
            a.payload = vec![7; 60 << 10];
        }
        command
    };
    let id = |sequence| {
        Some(RequestId {
            client_id: "hoarder".into(),
            sequence,
            first_incomplete: 0,
        })
    };
    for n in 1..=100 {
        granted(m.run_as(id(n), payload_acquire(n)).result);
    }
    let session = &m.state.sessions["hoarder"];
    let kept: u64 = session.responses.values().map(answer_size).sum();
    assert_eq!(session.answer_bytes, kept);
    assert!(kept <= SESSION_MAX_ANSWER_BYTES, "{kept}");
    assert!(session.responses.len() < 100);
    let oldest_kept = session.acknowledged_below;
    assert!(oldest_kept > 1);
    // A retry of a forgotten one is refused, not applied again.
    let late = m.run_as(id(1), payload_acquire(1));
    assert!(matches!(
        late.result,
        Err(CommandError::SequenceTooOld { sequence: 1, .. })
    ));
    // One answer over the bound on its own is still kept (the request
    // applied; its client must be able to learn the answer).
    let mut huge = payload_acquire(1000);
    if let Command::Acquire(a) = &mut huge {
        a.payload = vec![7; (SESSION_MAX_ANSWER_BYTES + 1) as usize];
    }
    granted(m.run_as(id(1000), huge).result);
    assert_eq!(
        m.state.sessions["hoarder"]
            .responses
            .keys()
            .collect::<Vec<_>>(),
        vec![&1000]
    );
}

#[test]
fn a_request_opening_a_session_past_the_limit_is_refused_and_changes_nothing() {
    let mut m = Machine::new();
    for n in 0..MAX_SESSIONS {
        m.state
            .sessions
            .insert(format!("client-{n}"), ClientSession::default());
    }
    let before = m.state.clone();
    let refused = m.run_as(Some(request_id("one-more", 1)), acquire("a", "u1", 0));
    assert_eq!(
        refused.result,
        Err(CommandError::TooManySessions {
            limit: MAX_SESSIONS as u32
        })
    );
    assert_eq!(m.state.locks, before.locks);
    assert_eq!(m.state.sessions.len(), MAX_SESSIONS);
    // A client that has a session goes on.
    granted(
        m.run_as(Some(request_id("client-7", 1)), acquire("a", "u1", 0))
            .result,
    );
}

#[test]
fn waits_sessions_and_tombstones_end_only_after_the_lock_delay() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "holder", 0)));
    m.run_as(Some(request_id("c", 1)), acquire("a", "waiter", 1_000))
        .result
        .unwrap();
    m.run(report_node("n5", NodeState::Ready)).unwrap();
    m.run(report_node("n5", NodeState::Gone)).unwrap();
    // Everything is due on committed time, a minute on.
    m.now += 60_000;
    let sweep = |tenure_ms| Sweep {
        leader_tenure_ms: tenure_ms,
        hold_timeout_ms: 1 << 40,
        scope_hold_timeout_ms: BTreeMap::new(),
        session_idle_ms: 30_000,
        node_tombstone_ms: 20_000,
    };
    // A leader of 500 ms (its clock may run ahead of the last one's) ends
    // none of them, and is not asked to.
    assert!(!sweep_due(&m.state, m.now, &sweep(500), FORMAT_VERSION));
    m.run(Command::Sweep(sweep(500))).unwrap();
    assert_eq!(m.state.locks[&key("a")].waiters.len(), 1);
    assert!(m.state.sessions.contains_key("c"));
    assert!(m.state.nodes.contains_key("n5"));
    // Once it has led for the wait's length (1 s) the wait ends; for the
    // tombstone time (20 s) the tombstone goes; for the idle time (30 s)
    // the session.
    m.run(Command::Sweep(sweep(1_000))).unwrap();
    assert!(m.state.locks[&key("a")].waiters.is_empty());
    assert!(m.state.nodes.contains_key("n5"));
    m.run(Command::Sweep(sweep(20_000))).unwrap();
    assert!(!m.state.nodes.contains_key("n5"));
    assert!(m.state.sessions.contains_key("c"));
    m.run(Command::Sweep(sweep(30_000))).unwrap();
    assert!(!m.state.sessions.contains_key("c"));
}

#[test]
fn a_format_5_sweep_ends_waits_sessions_and_tombstones_as_format_5_did() {
    let mut m = Machine::new();
    m.run_as(Some(request_id("c", 1)), acquire("a", "u1", 0))
        .result
        .unwrap();
    m.now += 60_000;
    let sweep = Sweep {
        leader_tenure_ms: 1,
        hold_timeout_ms: 1 << 40,
        scope_hold_timeout_ms: BTreeMap::new(),
        session_idle_ms: 30_000,
        node_tombstone_ms: 20_000,
    };
    assert!(sweep_due(&m.state, m.now, &sweep, 5));
    m.run_request(Request {
        format_version: 5,
        request_id: None,
        leader_time_ms: m.now,
        command: Command::Sweep(sweep),
    });
    assert!(!m.state.sessions.contains_key("c"));
}

#[test]
fn sweep_drops_waits_past_their_deadline() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    m.run(acquire("a", "u2", 500)).unwrap();
    m.run(acquire("a", "u3", 5000)).unwrap();
    m.now += 1000;
    // A leader that has led for longer than the waits (the lock-delay).
    assert!(sweep_due(
        &m.state,
        m.now,
        &sweep_settings(5_000, 1 << 40),
        FORMAT_VERSION
    ));
    let reply = m.run(sweep(5_000, 1 << 40)).unwrap();
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

fn grant_lease(m: &mut Machine, ttl_ms: u64) -> u64 {
    match m.run(Command::GrantLease(GrantLease { ttl_ms })).unwrap() {
        Reply::Lease { lease_id, .. } => lease_id,
        other => panic!("expected a lease, got {other:?}"),
    }
}

fn acquire_on_lease(name: &str, uid: &str, wait_ms: u64, lease_id: u64) -> Command {
    let mut command = acquire(name, uid, wait_ms);
    if let Command::Acquire(a) = &mut command {
        a.lease_id = lease_id;
    }
    command
}

/// The `LockGranted` events of the entry at `index`.
fn grants_of_entry(m: &Machine, index: u64) -> Vec<(LockKey, Hold)> {
    m.events
        .iter()
        .filter(|e| e.revision.index == index)
        .filter_map(|e| match &e.kind {
            EventKind::LockGranted { key, hold } => Some((key.clone(), hold.clone())),
            _ => None,
        })
        .collect()
}

/// Lease 1's pod `u1` holds lock `a`, lease 2's pod `u2` waits behind it,
/// `u3` (no lease) waits behind that, and both leases are then past their
/// TTL. Returns lease 2.
fn two_leases_due_with_a_third_pod_queued(m: &mut Machine) -> u64 {
    let first = grant_lease(m, 1_000);
    let second = grant_lease(m, 1_000);
    granted(m.run(acquire_on_lease("a", "u1", 0, first)));
    m.run(acquire_on_lease("a", "u2", 60_000, second)).unwrap();
    m.run(acquire("a", "u3", 60_000)).unwrap();
    m.now += 2_000;
    second
}

/// Lease 1's pod holds, lease 2's pod waits behind it, a third pod waits
/// behind that; both leases come due in one sweep. Granting as each lease
/// ended gave the lock to lease 2's pod and then, under the same token, to
/// the third pod.
#[test]
fn two_ttl_leases_ending_in_one_sweep_grant_the_lock_once() {
    let mut m = Machine::new();
    let second = two_leases_due_with_a_third_pod_queued(&mut m);
    let reply = m.run(sweep(1 << 40, 1 << 40)).unwrap();
    assert!(matches!(reply, Reply::Swept { leases: 2, .. }), "{reply:?}");
    let grants = grants_of_entry(&m, m.index);
    assert_eq!(grants.len(), 1, "one grant in the sweep: {grants:?}");
    assert_eq!(grants[0].1.pod.uid, "u3");
    let lock = &m.state.locks[&key("a")];
    assert_eq!(lock.holder.as_ref().unwrap().pod.uid, "u3");
    assert_eq!(lock.holder.as_ref().unwrap().token, m.index);
    // Lease 2's pod left the queue with a reason its caller is told.
    assert!(m.events.iter().any(|e| matches!(&e.kind,
        EventKind::WaitEnded { pod, reason: WaitEndReason::LeaseEnded { lease_id }, .. }
            if pod.uid == "u2" && *lease_id == second)));
}

/// A hold timeout shorter than anything (the sm is safe even with 0; the
/// flag refuses it): the hold a lease's end grants in a sweep is not ended
/// by the hold timeout of that same sweep.
#[test]
fn a_hold_granted_by_a_sweep_is_not_timed_out_by_it() {
    let mut m = Machine::new();
    let lease = grant_lease(&mut m, 1_000);
    granted(m.run(acquire_on_lease("a", "u1", 0, lease)));
    m.run(acquire("a", "u2", 60_000)).unwrap();
    m.run(acquire("a", "u3", 60_000)).unwrap();
    m.now += 2_000;
    m.run(sweep(1 << 40, 0)).unwrap();
    let grants = grants_of_entry(&m, m.index);
    assert_eq!(grants.len(), 1, "{grants:?}");
    assert_eq!(
        m.state.locks[&key("a")].holder.as_ref().unwrap().pod.uid,
        "u2"
    );
}

/// Sweeps of format 2 (written before format 5, or while a member of an
/// older build is known) apply as they first did, so that a replica
/// replaying an old log reaches the state its peers reached.
#[test]
fn a_format_2_sweep_replays_as_it_first_applied() {
    let mut m = Machine::new();
    two_leases_due_with_a_third_pod_queued(&mut m);
    let mut request = Request::new(None, m.now, sweep(1 << 40, 1 << 40));
    assert_eq!(request.format_version, POD_CLEANUP_FORMAT_VERSION);
    request.format_version = 2;
    m.run_request(request);
    let granted_to: Vec<String> = grants_of_entry(&m, m.index)
        .into_iter()
        .map(|(_, h)| h.pod.uid)
        .collect();
    assert_eq!(granted_to, ["u2", "u3"], "the old order of grants");
}

#[test]
fn a_retried_acquire_whose_hold_ended_is_told_so() {
    let mut m = Machine::new();
    let id = request_id("c1", 1);
    let first = granted(m.run_as(Some(id.clone()), acquire("a", "u1", 0)).result);
    let retry = m.run_as(Some(id.clone()), acquire("a", "u1", 0));
    assert!(retry.deduplicated);
    assert_eq!(granted(retry.result), first, "the hold still stands");
    m.run(release("a", "u1", first.token)).unwrap();
    let retry = m.run_as(Some(id), acquire("a", "u1", 0));
    assert!(retry.deduplicated);
    assert_eq!(
        retry.result,
        Err(CommandError::HoldEnded {
            key: key("a"),
            pod_uid: "u1".into(),
            token: first.token,
        })
    );
    assert!(m.state.locks.is_empty(), "the retry took nothing");
}

#[test]
fn a_retried_queued_acquire_gets_where_it_stands_now() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "u1", 0)));
    m.run(acquire("a", "u2", 60_000)).unwrap();
    let id = request_id("c1", 1);
    let queued = m.run_as(Some(id.clone()), acquire("a", "u3", 60_000));
    assert_eq!(queued.result, Ok(Reply::Queued { position: 2 }));
    m.run(Command::CancelWait(CancelWait {
        key: key("a"),
        pod_uid: "u2".into(),
    }))
    .unwrap();
    let retry = m.run_as(Some(id.clone()), acquire("a", "u3", 60_000));
    assert_eq!(retry.result, Ok(Reply::Queued { position: 1 }));
    m.run(release("a", "u1", 1)).unwrap();
    let hold = granted(
        m.run_as(Some(id.clone()), acquire("a", "u3", 60_000))
            .result,
    );
    assert_eq!((hold.pod.uid.as_str(), hold.token), ("u3", m.index - 1));
    m.run(release("a", "u3", hold.token)).unwrap();
    let retry = m.run_as(Some(id), acquire("a", "u3", 60_000));
    assert_eq!(
        retry.result,
        Err(CommandError::WaitEnded {
            key: key("a"),
            pod_uid: "u3".into(),
        })
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

/// One of the live TTL leases, or none.
fn some_lease(rng: &mut Rng, m: &Machine) -> u64 {
    let leases: Vec<u64> = m.state.leases.keys().copied().collect();
    if leases.is_empty() || rng.below(3) == 0 {
        return 0;
    }
    leases[rng.below(leases.len() as u64) as usize]
}

fn random_command(rng: &mut Rng, m: &Machine) -> Command {
    let lock = format!("n{}", rng.below(3));
    let uid = format!("p{}", rng.below(8));
    match rng.below(19) {
        16 => Command::GrantLease(GrantLease {
            // Short TTLs, so that several come due in one sweep.
            ttl_ms: 300 + rng.below(3) * 200,
        }),
        17 => match (some_lease(rng, m), rng.below(2)) {
            (0, _) => Command::GrantLease(GrantLease { ttl_ms: 500 }),
            (lease_id, 0) => Command::KeepAliveLease(KeepAliveLease { lease_id }),
            (lease_id, _) => Command::RevokeLease(RevokeLease { lease_id }),
        },
        18 => {
            // An acquire on a TTL lease: leases end holds and waits of
            // several owners in one sweep.
            let mut command = acquire(&lock, &uid, [0, 5_000][rng.below(2) as usize]);
            if let Command::Acquire(a) = &mut command {
                a.lease_id = some_lease(rng, m);
            }
            command
        }
        // A third of them: a device plugin's claim correction, the kubelet
        // having chosen one or two of a node's four devices.
        10..=11 if rng.below(3) == 0 => {
            let node = format!("n{}", rng.below(NODES));
            let first = rng.below(4);
            let mut devices = vec![first];
            if rng.below(2) == 0 {
                devices.push((first + 1 + rng.below(3)) % 4);
            }
            device_claim(&uid, &node, &devices)
        }
        10..=11 => spread_assign(&format!("m{}", rng.below(6)), &uid, rng.below(3) * 1000),
        12 if rng.below(2) == 0 => Command::ReleasePin(ReleasePin {
            key: PinKey::new("spread", format!("m{}", rng.below(6))),
            reason: "test".into(),
        }),
        // A release on condition of one of the pin's labels, its value
        // right or wrong (a pin made again since by a later attempt).
        12 => {
            let pins: Vec<(PinKey, Pin)> = m
                .state
                .pins
                .as_map()
                .iter()
                .map(|(k, p)| (k.clone(), p.clone()))
                .collect();
            let (key, labels) = match pins.len() {
                0 => (
                    PinKey::new(CLAIMS, &uid),
                    BTreeMap::from([(format!("{DEVICE}d0"), "held".to_string())]),
                ),
                n => {
                    let (key, pin) = pins[rng.below(n as u64) as usize].clone();
                    let labels: Vec<(String, String)> = pin
                        .labels
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    let (name, value) = match labels.len() {
                        0 => ("app".to_string(), "spread".to_string()),
                        n => labels[rng.below(n as u64) as usize].clone(),
                    };
                    let value = if rng.below(2) == 0 {
                        value
                    } else {
                        format!("{value}-x")
                    };
                    (key, BTreeMap::from([(name, value)]))
                }
            };
            Command::ReleasePinIf(ReleasePinIf {
                key,
                reason: "test".into(),
                labels: labels.into(),
            })
        }
        13 => {
            let node = format!("n{}", rng.below(NODES));
            let state = [
                NodeState::Joined,
                NodeState::Ready,
                NodeState::NotReady,
                NodeState::Gone,
            ][rng.below(4) as usize];
            // Two incarnations of each node name: a gone node comes back
            // only under the other one's UID. A deletion mostly names the
            // registered object, as a bridge that saw it does.
            let mut command = report_node(&node, state);
            if let Command::ReportNode(report) = &mut command {
                let registered = m.state.nodes.get(&node).filter(|n| n.gone_at_ms.is_none());
                report.uid = match registered {
                    Some(live) if state == NodeState::Gone && rng.below(4) != 0 => live.uid.clone(),
                    _ => format!("uid-{node}-{}", rng.below(2)),
                };
            }
            command
        }
        14 => {
            let phase = [
                PodPhase::Starting,
                PodPhase::Running,
                PodPhase::Terminal,
                PodPhase::Gone,
            ][rng.below(4) as usize];
            Command::ReportPod(ReportPod {
                pod_uid: uid,
                phase,
            })
        }
        0..=3 => {
            // Half of them on a TTL lease (when there is one), so that
            // leases ending together end holds and waits of several owners.
            let mut command = acquire(&lock, &uid, [0, 200, 5_000][rng.below(3) as usize]);
            if let Command::Acquire(a) = &mut command
                && rng.below(2) == 0
            {
                a.lease_id = some_lease(rng, m);
            }
            command
        }
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
        // A wait's deadline on its replica, or its caller gone: the give-up
        // names a recent request, answered at or before a recent entry.
        7 if rng.below(2) == 0 => match rng.below(2) {
            0 => Command::CancelWait(CancelWait {
                key: key(&lock),
                pod_uid: uid,
            }),
            // A caller that gave up on an acquire: mostly a pod that holds
            // or waits.
            _ => {
                let involved = involved_pods(m);
                let (key, pod_uid) = match involved.len() {
                    0 => (key(&lock), uid),
                    n => involved[rng.below(n as u64) as usize].clone(),
                };
                if rng.below(3) == 0 {
                    Command::Withdraw(Withdraw { key, pod_uid })
                } else {
                    // Mostly the client the hold or wait is under; else
                    // another (an earlier attempt that was taken over).
                    let client_id = match rng.below(2) {
                        0 => attempt_client(&m.state, &key, &pod_uid),
                        _ => None,
                    }
                    .unwrap_or_else(|| format!("c{}", rng.below(3)));
                    Command::WithdrawOwn(WithdrawOwn {
                        key,
                        pod_uid,
                        client_id,
                    })
                }
            }
        },
        7 => {
            // Mostly a pod that waits or holds, and a kept answer given at,
            // or just after, the entry the abandoning stream names.
            let waiting = involved_pods(m);
            let answers: Vec<(String, u64, u64)> = m
                .state
                .sessions
                .iter()
                .flat_map(|(c, s)| {
                    s.responses
                        .iter()
                        .map(move |(q, a)| (c.clone(), *q, a.answered_at))
                })
                .collect();
            let (key, pod_uid) = match waiting.len() {
                0 => (key(&lock), uid),
                n => waiting[rng.below(n as u64) as usize].clone(),
            };
            let (client_id, sequence, answered_at) = match answers.len() {
                0 => ("c0".to_string(), m.index, m.index),
                n => {
                    let (c, q, at) = answers[rng.below(n as u64) as usize].clone();
                    (c, q, at.saturating_sub(rng.below(2)))
                }
            };
            // A third of them about a hold: the stream of the acquire that
            // queued it went away before the grant (answered just before
            // it), as when a holder releases inside the abandoned-wait
            // grace.
            let holders: Vec<(LockKey, Hold)> = m
                .state
                .locks
                .iter()
                .filter_map(|(k, l)| l.holder.clone().map(|h| (k.clone(), h)))
                .collect();
            let (key, pod_uid, client_id, answered_at) = match holders.len() {
                n if n > 0 && rng.below(3) == 0 => {
                    let (k, h) = holders[rng.below(n as u64) as usize].clone();
                    let at = h.token.saturating_sub(1 + rng.below(3));
                    (k, h.pod.uid, h.client_id, at)
                }
                _ => (key, pod_uid, client_id, answered_at),
            };
            // Three in four from the client the wait is under (format 9: a
            // wait another client took over is not the abandoner's).
            let (client_id, sequence, answered_at) = match attempt_client(&m.state, &key, &pod_uid)
            {
                Some(own) if rng.below(4) != 0 => {
                    let (sequence, at) = m
                        .state
                        .sessions
                        .get(&own)
                        .and_then(|s| s.responses.iter().last())
                        .map_or((sequence, answered_at), |(q, a)| {
                            (*q, a.answered_at.saturating_sub(rng.below(2)))
                        });
                    (own, sequence, at)
                }
                _ => (client_id, sequence, answered_at),
            };
            Command::AbandonWait(AbandonWait {
                key,
                pod_uid,
                client_id,
                sequence,
                answered_at,
            })
        }
        8 => Command::ForceRelease(ForceRelease {
            key: key(&lock),
            operator: "op".into(),
            reason: "test".into(),
        }),
        // Long and short hold timeouts: a short one makes holds due in the
        // very sweep whose lease ends grant them.
        _ => {
            let mut settings =
                sweep_settings(rng.below(20_000), [1, 100, 3_000][rng.below(3) as usize]);
            // Now and then idle sessions and old tombstones end too (the
            // sweep index finds them: `check_sweep_index`).
            if rng.below(6) == 0 {
                settings.session_idle_ms = 8_000;
                settings.node_tombstone_ms = 5_000;
            }
            Command::Sweep(settings)
        }
    }
}

/// A batch of up to four random acquires and releases, on distinct locks
/// (format 3) or, one batch in three, on any (format 4), each with its own
/// request id half of the time; a single random command when none of the
/// draws could go into a batch. A format-4 batch sometimes follows an
/// acquire with a release guessing the token the acquire would get (the
/// entry's own index), which apply must refuse. One batch in three also
/// takes the draws that name no lock (format 11: assignments, pod reports
/// and revokes), and sometimes follows an acquire with its pod's terminal
/// report or revoke, which apply must refuse if the acquire was granted.
fn random_batch(rng: &mut Rng, m: &Machine) -> Command {
    let mut commands = Vec::new();
    let mut locks = std::collections::BTreeSet::new();
    let shared_locks = rng.below(3) == 0;
    let lockless = rng.below(3) == 0;
    for _ in 0..1 + rng.below(4) {
        // Some acquires for node objects (format 10) among them.
        let command = random_command(rng, m);
        let command = for_seen_nodes(rng, &m.state, command);
        match batch_role(&command) {
            Some(BatchRole::Lock(lock)) if locks.insert(lock.clone()) || shared_locks => {
                let guess = match command.acquire() {
                    Some(a) if shared_locks && rng.below(2) == 0 => {
                        Some(Command::Release(Release {
                            key: a.key.clone(),
                            pod_uid: a.pod.uid.clone(),
                            token: m.index + 1,
                            outcome: Outcome::Allocated,
                        }))
                    }
                    Some(a) if lockless && rng.below(2) == 0 => Some(match rng.below(3) {
                        0 => report_pod(&a.pod.uid, PodPhase::Gone),
                        1 => report_pod(&a.pod.uid, PodPhase::Terminal),
                        _ => Command::RevokePod(RevokePod {
                            pod_uid: a.pod.uid.clone(),
                            reason: "deleted in the same entry".into(),
                        }),
                    }),
                    _ => None,
                };
                commands.push(command);
                commands.extend(guess);
            }
            Some(BatchRole::Lockless) if lockless => commands.push(command),
            _ => {}
        }
    }
    let mut items = Vec::new();
    for command in commands {
        let request_id = (rng.below(2) == 0).then(|| RequestId {
            client_id: format!("b{}", rng.below(3)),
            sequence: (m.index + 1) * 8 + items.len() as u64,
            first_incomplete: m.index * 8,
        });
        items.push(BatchItem {
            request_id,
            command,
        });
    }
    if items.is_empty() {
        return random_command(rng, m);
    }
    Command::Batch(Batch { items })
}

/// Checks the invariants that must hold after every entry, and that grants
/// follow the queue order seen in earlier events.
fn pinned(result: CommandResult) -> (Pin, bool) {
    match result {
        Ok(Reply::Pinned { pin, created }) => (pin, created),
        other => panic!("expected a pin, got {other:?}"),
    }
}

fn plain_assign(member: &str, pod_uid: &str, candidates: &[&str], lifetime_ms: u64) -> Command {
    Command::Assign(Assign {
        key: PinKey::new("slurm/set-a", member),
        candidates: candidates.iter().map(|c| c.to_string()).collect(),
        pod_uid: pod_uid.into(),
        lifetime_ms,
        labels: BTreeMap::new(),
        affinity: Affinity::default(),
    })
}

#[test]
fn assign_is_idempotent_and_a_new_pod_takes_over_the_pin() {
    let mut m = Machine::new();
    let (first, created) = pinned(m.run(plain_assign("3", "pod-a", &["n1", "n2"], 0)));
    assert!(created);
    assert_eq!(first.node, "n1");
    let (again, created) = pinned(m.run(plain_assign("3", "pod-a", &["n2"], 0)));
    assert!(!created);
    assert_eq!(again, first);
    // The member's pod is recreated: same pin, new owner.
    let (restarted, created) = pinned(m.run(plain_assign("3", "pod-b", &["n2"], 0)));
    assert!(!created);
    assert_eq!(restarted.node, "n1");
    assert_eq!(restarted.pod_uid, "pod-b");
}

#[test]
fn pin_lifetime_counts_only_after_the_pod_stops() {
    let mut m = Machine::new();
    pinned(m.run(plain_assign("0", "pod-a", &["n1"], 1_000)));
    m.run(Command::ReportPod(ReportPod {
        pod_uid: "pod-a".into(),
        phase: PodPhase::Running,
    }))
    .unwrap();
    m.now += 10_000;
    m.run(sweep(1 << 40, 1 << 40)).unwrap();
    assert!(
        m.state.pins.contains_key(&PinKey::new("slurm/set-a", "0")),
        "running pods keep their pins"
    );
    m.run(Command::ReportPod(ReportPod {
        pod_uid: "pod-a".into(),
        phase: PodPhase::Terminal,
    }))
    .unwrap();
    m.now += 500;
    m.run(sweep(1 << 40, 1 << 40)).unwrap();
    assert!(
        m.state.pins.contains_key(&PinKey::new("slurm/set-a", "0")),
        "lifetime not yet passed"
    );
    m.now += 600;
    // A new leader that has not led for a full lifetime does not expire it.
    m.run(sweep(500, 1 << 40)).unwrap();
    assert!(
        m.state.pins.contains_key(&PinKey::new("slurm/set-a", "0")),
        "lock-delay"
    );
    assert!(matches!(
        m.run(sweep(1 << 40, 1 << 40)).unwrap(),
        Reply::Swept { pins: 1, .. }
    ));
    assert!(m.state.pins.is_empty());
}

#[test]
fn permanent_pins_survive_pod_restarts_and_stops() {
    let mut m = Machine::new();
    pinned(m.run(plain_assign("0", "pod-a", &["n1"], 0)));
    m.run(Command::ReportPod(ReportPod {
        pod_uid: "pod-a".into(),
        phase: PodPhase::Gone,
    }))
    .unwrap();
    m.now += 1 << 30;
    m.run(sweep(1 << 40, 1 << 40)).unwrap();
    let (pin, created) = pinned(m.run(plain_assign("0", "pod-b", &["n2"], 0)));
    assert!(!created);
    assert_eq!(pin.node, "n1");
}

#[test]
fn a_gone_report_about_an_older_node_object_leaves_the_node_that_has_the_name() {
    let mut m = Machine::new();
    // The node was deleted and recreated under its name (new UID) before a
    // lagging reporter sent the old object's delete.
    let mut recreated = report_node("n1", NodeState::Ready);
    if let Command::ReportNode(report) = &mut recreated {
        report.uid = "uid-n1-new".into();
    }
    m.run(recreated).unwrap();
    pinned(m.run(plain_assign("0", "pod-a", &["n1"], 0)));
    granted(m.run(acquire("n1", "pod-x", 0)));
    let before = m.state.clone();
    let reply = m.run(report_node("n1", NodeState::Gone)).unwrap();
    assert_eq!(
        reply,
        Reply::NodeReported {
            changed: false,
            pins_released: 0,
            locks_released: 0
        }
    );
    assert_eq!(m.state.pins, before.pins);
    assert_eq!(m.state.locks, before.locks);
    // The delete of the object that has the name ends it.
    let mut current = report_node("n1", NodeState::Gone);
    if let Command::ReportNode(report) = &mut current {
        report.uid = "uid-n1-new".into();
    }
    let reply = m.run(current).unwrap();
    assert!(matches!(
        reply,
        Reply::NodeReported {
            changed: true,
            pins_released: 1,
            locks_released: 1
        }
    ));
}

/// A node deleted and re-created under its name (a new UID) while no
/// reporter saw the delete: a report naming the new object is refused and
/// changes nothing until the old object is reported gone; then the old
/// object's pins, claims, holder and queue end, the new one joins, and a
/// lagging report naming the old object is refused in turn.
#[test]
fn a_report_naming_another_node_object_is_refused_until_the_old_one_is_gone() {
    let mut m = Machine::new();
    m.run(report_node("n1", NodeState::Ready)).unwrap();
    pinned(m.run(plain_assign("0", "pod-a", &["n1"], 0)));
    m.run(device_claim("pod-c", "n1", &[0, 1])).unwrap();
    granted(m.run(acquire("n1", "pod-x", 0)));
    m.run(acquire("n1", "pod-y", 10_000)).unwrap();
    let with_uid = |state, uid: &str| {
        let mut command = report_node("n1", state);
        if let Command::ReportNode(report) = &mut command {
            report.uid = uid.into();
        }
        command
    };
    let before = m.state.clone();
    let events = m.events.len();
    for state in [NodeState::Joined, NodeState::Ready, NodeState::NotReady] {
        let refused = m.run(with_uid(state, "uid-n1-new")).unwrap_err();
        assert_eq!(
            refused,
            CommandError::NodeObjectMismatch {
                node: "n1".into(),
                registered_uid: "uid-n1".into(),
                reported_uid: "uid-n1-new".into(),
            }
        );
        assert!(refused.to_string().contains("report uid-n1 gone first"));
    }
    assert_eq!(m.state.nodes, before.nodes);
    assert_eq!(m.state.pins, before.pins);
    assert_eq!(m.state.locks, before.locks);
    assert_eq!(m.events.len(), events, "a refused report emits nothing");
    // The old object reported gone: everything it held ends.
    let reply = m.run(with_uid(NodeState::Gone, "uid-n1")).unwrap();
    assert_eq!(
        reply,
        Reply::NodeReported {
            changed: true,
            pins_released: 2,
            locks_released: 1
        }
    );
    assert!(m.state.pins.is_empty());
    assert!(
        m.state
            .locks
            .get(&key("n1"))
            .is_none_or(|l| l.holder.is_none() && l.waiters.is_empty())
    );
    // The new object joins.
    let joined_before = m.events.len();
    m.run(with_uid(NodeState::Joined, "uid-n1-new")).unwrap();
    assert!(m.events[joined_before..]
        .iter()
        .any(|e| matches!(&e.kind, EventKind::NodeJoined { node, info } if node == "n1" && info.uid == "uid-n1-new")));
    // A lagging reporter still naming the old object changes nothing and
    // says so.
    let stale = m.run(with_uid(NodeState::Ready, "uid-n1")).unwrap_err();
    assert!(
        matches!(stale, CommandError::NodeObjectMismatch { ref registered_uid, .. } if registered_uid == "uid-n1-new")
    );
    assert_eq!(m.state.nodes["n1"].uid, "uid-n1-new");
    // A report without a UID (an operator's, by name) is about the node
    // that has the name.
    assert!(matches!(
        m.run(with_uid(NodeState::Ready, "")).unwrap(),
        Reply::NodeReported { changed: true, .. }
    ));
}

/// Format-7 node reports replay as they first applied: another UID was
/// adopted under the name, and nothing the old object held ended.
#[test]
fn a_format_7_node_report_under_another_uid_replays_as_it_first_applied() {
    let mut m = Machine::new();
    m.run(report_node("n1", NodeState::Ready)).unwrap();
    pinned(m.run(plain_assign("0", "pod-a", &["n1"], 0)));
    let mut command = report_node("n1", NodeState::Ready);
    if let Command::ReportNode(report) = &mut command {
        report.uid = "uid-n1-new".into();
    }
    let mut request = Request::new(None, m.now, command);
    assert_eq!(request.format_version, NODE_REPLACED_FORMAT_VERSION);
    request.format_version = 7;
    assert!(matches!(
        m.run_request(request).result,
        Ok(Reply::NodeReported { changed: true, .. })
    ));
    assert_eq!(m.state.nodes["n1"].uid, "uid-n1-new");
    assert_eq!(m.state.pins.len(), 1);
}

#[test]
fn node_gone_releases_its_pins_and_locks_and_blocks_new_pins_there() {
    let mut m = Machine::new();
    for node in ["n1", "n2"] {
        m.run(report_node(node, NodeState::Ready)).unwrap();
    }
    pinned(m.run(plain_assign("0", "pod-a", &["n1", "n2"], 0)));
    granted(m.run(acquire("n1", "pod-x", 0)));
    m.run(acquire("n1", "pod-y", 10_000)).unwrap();
    let reply = m.run(report_node("n1", NodeState::Gone)).unwrap();
    assert_eq!(
        reply,
        Reply::NodeReported {
            changed: true,
            pins_released: 1,
            locks_released: 1
        }
    );
    assert!(m.state.pins.is_empty());
    assert!(
        m.state.locks.is_empty(),
        "holder released and queue dropped"
    );
    assert!(m.events.iter().any(|e| matches!(
        &e.kind,
        EventKind::PinReleased {
            reason: PinReleaseReason::NodeGone,
            ..
        }
    )));
    // Idempotent.
    assert_eq!(
        m.run(report_node("n1", NodeState::Gone)).unwrap(),
        Reply::NodeReported {
            changed: false,
            pins_released: 0,
            locks_released: 0
        }
    );
    // The next assignment of the member picks a live candidate.
    let (pin, _) = pinned(m.run(plain_assign("0", "pod-a", &["n1", "n2"], 0)));
    assert_eq!(pin.node, "n2");
}

#[test]
fn node_reports_are_idempotent_and_emit_transitions_once() {
    let mut m = Machine::new();
    m.run(report_node("n1", NodeState::Joined)).unwrap();
    m.run(report_node("n1", NodeState::Ready)).unwrap();
    m.run(report_node("n1", NodeState::Ready)).unwrap();
    m.run(report_node("n1", NodeState::NotReady)).unwrap();
    let kinds: Vec<&str> = m
        .events
        .iter()
        .map(|e| match e.kind {
            EventKind::NodeJoined { .. } => "joined",
            EventKind::NodeReady { .. } => "ready",
            EventKind::NodeNotReady { .. } => "not-ready",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["joined", "ready", "not-ready"]);
}

/// A lagging reporter's Ready or NotReady for a deleted node, naming its UID
/// or none, changes nothing; a new Node object (another UID) under the same
/// name joins.
#[test]
fn a_stale_report_does_not_bring_a_gone_node_back() {
    let mut m = Machine::new();
    m.run(report_node("n1", NodeState::Ready)).unwrap();
    m.run(report_node("n1", NodeState::Gone)).unwrap();
    let joined = |m: &Machine| {
        m.events
            .iter()
            .filter(|e| matches!(&e.kind, EventKind::NodeJoined { node, .. } if node == "n1"))
            .count()
    };
    assert_eq!(joined(&m), 1);
    for (state, uid) in [
        (NodeState::Ready, "uid-n1"),
        (NodeState::NotReady, "uid-n1"),
        (NodeState::Joined, ""),
        (NodeState::Ready, ""),
    ] {
        let mut command = report_node("n1", state);
        if let Command::ReportNode(report) = &mut command {
            report.uid = uid.into();
        }
        let reply = m.run(command).unwrap();
        assert_eq!(
            reply,
            Reply::NodeReported {
                changed: false,
                pins_released: 0,
                locks_released: 0
            },
            "{state:?} with uid {uid:?}"
        );
    }
    assert_eq!(joined(&m), 1, "the deleted node stayed deleted");
    assert!(m.state.nodes["n1"].gone_at_ms.is_some());
    let mut recreated = report_node("n1", NodeState::Ready);
    if let Command::ReportNode(report) = &mut recreated {
        report.uid = "uid-n1-new".into();
    }
    assert!(matches!(
        m.run(recreated).unwrap(),
        Reply::NodeReported { changed: true, .. }
    ));
    assert_eq!(joined(&m), 2);
    assert_eq!(m.state.nodes["n1"].uid, "uid-n1-new");
    assert!(m.state.nodes["n1"].gone_at_ms.is_none());
}

/// Node reports of format 2 apply as they first did: a report for a
/// tombstoned node brought it back.
#[test]
fn a_format_2_node_report_replays_as_it_first_applied() {
    let mut m = Machine::new();
    m.run(report_node("n1", NodeState::Ready)).unwrap();
    m.run(report_node("n1", NodeState::Gone)).unwrap();
    let mut request = Request::new(None, m.now, report_node("n1", NodeState::Ready));
    assert_eq!(request.format_version, NODE_REPLACED_FORMAT_VERSION);
    request.format_version = 2;
    assert!(matches!(
        m.run_request(request).result,
        Ok(Reply::NodeReported { changed: true, .. })
    ));
    assert!(m.state.nodes["n1"].gone_at_ms.is_none());
}

#[test]
fn a_hold_whose_pod_has_not_started_is_kept_past_the_timeout_and_reported_once() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "slow", 0)));
    m.run(acquire("a", "next", 1 << 30)).unwrap();
    m.run(Command::ReportPod(ReportPod {
        pod_uid: "slow".into(),
        phase: PodPhase::Starting,
    }))
    .unwrap();
    m.now += 10_000;
    assert!(matches!(
        m.run(sweep(1 << 40, 5_000)).unwrap(),
        Reply::Swept {
            holds: 0,
            stuck: 1,
            ..
        }
    ));
    assert!(
        !sweep_due(
            &m.state,
            m.now,
            &sweep_settings(1 << 40, 5_000),
            FORMAT_VERSION
        ),
        "reported once, not at every sweep"
    );
    assert_eq!(
        m.state.locks[&key("a")].holder.as_ref().unwrap().pod.uid,
        "slow"
    );
    // Once the pod runs (Allocate happened) the timeout may hand over.
    m.run(Command::ReportPod(ReportPod {
        pod_uid: "slow".into(),
        phase: PodPhase::Running,
    }))
    .unwrap();
    assert!(matches!(
        m.run(sweep(1 << 40, 5_000)).unwrap(),
        Reply::Swept { holds: 1, .. }
    ));
    assert_eq!(
        m.state.locks[&key("a")].holder.as_ref().unwrap().pod.uid,
        "next"
    );
}

#[test]
fn terminal_pod_report_revokes_its_holds() {
    let mut m = Machine::new();
    granted(m.run(acquire("a", "done", 0)));
    m.run(Command::ReportPod(ReportPod {
        pod_uid: "done".into(),
        phase: PodPhase::Terminal,
    }))
    .unwrap();
    assert!(m.state.locks.is_empty());
}

#[test]
fn anti_affinity_by_zone_is_never_violated_and_the_error_names_each_candidate() {
    let mut m = Machine::new();
    for i in 0..NODES {
        m.run(report_node(&format!("n{i}"), NodeState::Ready))
            .unwrap();
    }
    for member in 0..3 {
        pinned(m.run(spread_assign(&member.to_string(), "", 0)));
    }
    let err = m.run(spread_assign("3", "", 0)).unwrap_err();
    let text = err.to_string();
    for i in 0..NODES {
        assert!(text.contains(&format!("n{i}: pin spread/")), "{text}");
    }
    check_pin_invariants(&m.state, 0);
}

/// Nodes of the property test: `n0`..`n5`, zone = index % 3 (fixed, so
/// anti-affinity by zone is checkable on the state alone).
const NODES: u64 = 6;

fn zone_of(node: &str) -> String {
    let index: u64 = node.trim_start_matches('n').parse().unwrap();
    format!("z{}", index % 3)
}

fn report_node(node: &str, state: NodeState) -> Command {
    Command::ReportNode(ReportNode {
        name: node.into(),
        uid: format!("uid-{node}"),
        state,
        labels: Some(BTreeMap::from([("zone".to_string(), zone_of(node))])),
        unschedulable: None,
    })
}

/// An assignment in the `spread` set: required anti-affinity by zone
/// against the set's own pins.
/// The set device claims live in, in the property test, and the prefix of
/// their device labels.
const CLAIMS: &str = "claims";
const DEVICE: &str = "dev/";

/// `pod_uid`'s device claim on `node` made to name exactly `devices`
/// (`Reclaim`), as the device plugin corrects it.
fn device_claim(pod_uid: &str, node: &str, devices: &[u64]) -> Command {
    Command::Reclaim(Reclaim {
        key: PinKey::new(CLAIMS, pod_uid),
        node: node.into(),
        pod_uid: pod_uid.into(),
        lifetime_ms: 1000,
        labels: devices
            .iter()
            .map(|d| (format!("{DEVICE}d{d}"), "held".to_string()))
            .collect(),
        exclusive_prefix: DEVICE.into(),
    })
}

fn spread_assign(member: &str, pod_uid: &str, lifetime_ms: u64) -> Command {
    let term = AffinityTerm {
        selector: LabelSelector {
            match_labels: BTreeMap::from([("app".into(), "spread".into())]),
            ..Default::default()
        },
        topology_key: "zone".into(),
    };
    Command::Assign(Assign {
        key: PinKey::new("spread", member),
        candidates: (0..NODES).map(|i| format!("n{i}")).collect(),
        pod_uid: pod_uid.into(),
        lifetime_ms,
        labels: BTreeMap::from([("app".into(), "spread".into())]),
        affinity: Affinity {
            required_anti: vec![term],
            ..Default::default()
        },
    })
}

/// A pin expires only once its owner has stopped and its whole lifetime
/// has passed since it last ran, by the entry's committed time.
fn check_pin_expiries(before: &BTreeMap<PinKey, Pin>, entry: &[Event], now_ms: u64, seed: u64) {
    for event in entry {
        let EventKind::PinReleased {
            key,
            reason: PinReleaseReason::Expired { .. },
            ..
        } = &event.kind
        else {
            continue;
        };
        let pin = before.get(key).expect("an expired pin existed");
        assert!(
            pin.owner == OwnerState::Stopped && pin.last_running_at_ms + pin.lifetime_ms <= now_ms,
            "seed {seed}: pin {key} expired at {now_ms} before its lifetime passed: {pin:?}"
        );
    }
}

/// No pin on a gone node; no two `spread` pins in one zone.
fn check_pin_invariants(state: &State, seed: u64) {
    let mut zones = BTreeMap::new();
    // A device is named by one claim per node.
    let mut devices: BTreeMap<(String, String), PinKey> = BTreeMap::new();
    for (key, pin) in &state.pins {
        let node = state.nodes.get(&pin.node);
        assert!(
            node.is_none_or(|n| n.gone_at_ms.is_none()),
            "seed {seed}: pin {key} on gone node {}",
            pin.node
        );
        if key.set == "spread" {
            let zone = zone_of(&pin.node);
            if let Some(other) = zones.insert(zone.clone(), key.clone()) {
                panic!("seed {seed}: pins {other} and {key} share zone {zone}");
            }
        }
        if key.set == CLAIMS {
            for (label, _) in pin.labels.iter().filter(|(l, _)| l.starts_with(DEVICE)) {
                let device = (pin.node.clone(), label.clone());
                if let Some(other) = devices.insert(device, key.clone()) {
                    panic!(
                        "seed {seed}: claims {other} and {key} both name device {label} on node {}",
                        pin.node
                    );
                }
            }
        }
    }
}

fn check_invariants(
    state: &State,
    new_events: &[Event],
    queues: &mut BTreeMap<LockKey, VecDeque<String>>,
    last_token: &mut BTreeMap<LockKey, u64>,
    seed: u64,
) {
    crate::fuzzing::check_lock_invariants(
        state,
        new_events,
        queues,
        last_token,
        &format!("seed {seed}"),
    );
}

/// Every (lock, pod) that holds or waits, holders first.
fn involved_pods(m: &Machine) -> Vec<(LockKey, String)> {
    let holders = m
        .state
        .locks
        .iter()
        .filter_map(|(k, l)| l.holder.as_ref().map(|h| (k.clone(), h.pod.uid.clone())));
    let waiters = m.state.locks.iter().flat_map(|(k, l)| {
        l.waiters
            .iter()
            .map(move |w| (k.clone(), w.pod.uid.clone()))
    });
    holders.chain(waiters).collect()
}

/// Whether an `AbandonWait` finds a hold nobody will use, as format 7
/// defines it: the pod holds the lock by a grant of the abandoning client's
/// wait made after the abandoned answer, and nothing from that client has
/// applied since the grant. Read before the command applies.
fn grant_nobody_took_up(state: &State, abandon: &AbandonWait) -> bool {
    let Some(hold) = state
        .locks
        .get(&abandon.key)
        .and_then(|l| l.holder.as_ref())
    else {
        return false;
    };
    let retried = state
        .sessions
        .get(&abandon.client_id)
        .and_then(|s| s.responses.get(&abandon.sequence))
        .is_some_and(|a| a.answered_at > abandon.answered_at);
    let seen = state
        .sessions
        .get(&abandon.client_id)
        .is_some_and(|s| s.last_seen_ms >= hold.granted_at_ms);
    hold.pod.uid == abandon.pod_uid
        && hold.client_id == abandon.client_id
        && hold.token > abandon.answered_at
        && !retried
        && !seen
}

/// After a `Withdraw` of `pod_uid` from `key` applied (not answered from the
/// dedupe table): the pod neither holds nor waits for the lock. After an
/// `AbandonWait`: a grant nobody took up was given back (and only such a
/// grant), so the node goes to its next waiter rather than to nobody.
fn check_give_ups(
    before: &State,
    after: &State,
    command: &Command,
    response: &Response,
    seed: u64,
    index: u64,
) {
    if response.deduplicated {
        return;
    }
    // A release on condition of labels ends the pin exactly when it
    // carried them; refused, it changes nothing.
    if let Command::ReleasePinIf(release) = command {
        if matches!(&response.result, Err(e) if !matches!(e, CommandError::PinLabelsDiffer { .. }))
        {
            return;
        }
        let carried = before.pins.get(&release.key).map(|pin| {
            release
                .labels
                .iter()
                .all(|(name, value)| pin.labels.get(name) == Some(value))
        });
        let after_pin = after.pins.get(&release.key);
        match carried {
            Some(true) => assert!(
                after_pin.is_none(),
                "seed {seed} entry {index}: pin {} carried {:?} and was kept",
                release.key,
                release.labels
            ),
            Some(false) => assert_eq!(
                after_pin,
                before.pins.get(&release.key),
                "seed {seed} entry {index}: pin {} lacked {:?} and was changed",
                release.key,
                release.labels
            ),
            None => {}
        }
        return;
    }
    if response.result.is_err() {
        return;
    }
    let holds_or_waits = |key: &LockKey, uid: &str| {
        after.locks.get(key).is_some_and(|l| {
            l.holder.as_ref().is_some_and(|h| h.pod.uid == uid)
                || l.waiters.iter().any(|w| w.pod.uid == uid)
        })
    };
    let attempt = |state: &State, key: &LockKey, uid: &str| -> Option<(String, Option<u64>)> {
        let lock = state.locks.get(key)?;
        match &lock.holder {
            Some(h) if h.pod.uid == uid => Some((h.client_id.clone(), Some(h.token))),
            _ => lock
                .waiters
                .iter()
                .find(|w| w.pod.uid == uid)
                .map(|w| (w.client_id.clone(), None)),
        }
    };
    match command {
        // Format 9: another client's acquire of a pod takes its hold over
        // with this entry's token, or its wait over in place; the same
        // client's gets it back unchanged.
        Command::Acquire(acquire) => {
            let (key, uid) = (&acquire.key, acquire.pod.uid.as_str());
            if let Some((client, token)) = attempt(before, key, uid) {
                let now = attempt(after, key, uid);
                let expected = if client == acquire.client_id {
                    (client, token)
                } else {
                    (acquire.client_id.clone(), token.map(|_| index))
                };
                assert_eq!(
                    now,
                    Some(expected),
                    "seed {seed} entry {index}: pod {uid} acquired {key} again from client {} \
                     (it was {:?})",
                    acquire.client_id,
                    attempt(before, key, uid)
                );
            }
        }
        Command::WithdrawOwn(withdraw) => {
            let (key, uid) = (&withdraw.key, withdraw.pod_uid.as_str());
            match attempt(before, key, uid) {
                Some((client, _)) if client != withdraw.client_id => assert_eq!(
                    attempt(after, key, uid),
                    attempt(before, key, uid),
                    "seed {seed} entry {index}: client {} withdrew pod {uid}'s {key}, which \
                     client {client} had taken over",
                    withdraw.client_id
                ),
                _ => assert!(
                    !holds_or_waits(key, uid),
                    "seed {seed} entry {index}: a withdrawn pod {uid} still holds or waits for {key}"
                ),
            }
        }
        Command::Withdraw(withdraw) => assert!(
            !holds_or_waits(&withdraw.key, &withdraw.pod_uid),
            "seed {seed}: a withdrawn pod {} still holds or waits for {}: {:?}",
            withdraw.pod_uid,
            withdraw.key,
            response.result
        ),
        Command::AbandonWait(abandon) => {
            let nobody = grant_nobody_took_up(before, abandon);
            let gave_back = matches!(
                response.result,
                Ok(Reply::WaitCancelled(CancelOutcome::GaveBack { .. }))
            );
            assert!(
                !nobody || gave_back,
                "seed {seed}: a grant nobody took up was kept for a caller that went away ({} on {})",
                abandon.pod_uid,
                abandon.key
            );
            assert!(
                nobody || !gave_back,
                "seed {seed}: a hold its client may have taken up was given back ({} on {})",
                abandon.pod_uid,
                abandon.key
            );
        }
        _ => {}
    }
}

/// How often the property test's generator reached what the invariants are
/// about.
#[derive(Debug, Default)]
struct Reached {
    pins_assigned: u32,
    pin_expiries: u32,
    nodes_gone: u32,
    grants: u32,
    batches: u32,
    /// Batches with commands that name no lock (format 11), and their
    /// terminal reports and revokes refused for a hold the same entry
    /// granted.
    lockless_batches: u32,
    own_grant_ends_refused: u32,
    lease_expiries: u32,
    hold_timeouts: u32,
    /// Sweeps that ended a hold of a lock and a TTL lease's wait on that
    /// same lock: where granting as each end applied granted twice.
    sweeps_ending_a_hold_and_a_lease_wait: u32,
    /// Sweeps that evicted an idle session, and that dropped a node
    /// tombstone.
    sweeps_evicting_sessions: u32,
    sweeps_dropping_tombstones: u32,
    /// Requests sent again with their id and command, id still kept.
    retries: u32,
    /// Ids sent again with another command, id still kept.
    reused_ids: u32,
    /// Abandoned waits removed, and kept because a retry answered later.
    abandons_removed: u32,
    abandons_taken_up: u32,
    /// Abandoned waits' grants given back to the next waiter.
    abandons_given_back: u32,
    /// Withdrawals that ended a wait, and that gave a hold back.
    withdrawals_ended_a_wait: u32,
    withdrawals_gave_back: u32,
    /// Claim corrections that took a device from another claim.
    reclaims_taking: u32,
    /// Nodes that joined under a name whose last object had another UID
    /// (deleted and re-created), and reports refused for naming another
    /// object than the registered one.
    nodes_replaced: u32,
    node_reports_refused: u32,
    /// Another client's acquire that took a pod's hold over (format 9).
    holds_taken_over: u32,
    /// Another client's acquire that took a pod's wait over.
    waits_taken_over: u32,
    /// Withdrawals that found the pod's hold or wait another client's.
    withdrawals_left_alone: u32,
    /// Releases on condition of labels, done and refused.
    pin_releases_if_done: u32,
    pin_releases_if_refused: u32,
    /// Takings for the node objects their callers saw: let through, and
    /// refused for another object registered under a name (format 10).
    node_takings_checked: u32,
    node_takings_refused: u32,
    /// Holds, waits and pins a `Gone` report ended that were taken for
    /// the very object it reported gone.
    gone_ended_what_was_taken_for_it: u32,
}

/// The client a pod's hold or wait of `key` is under.
fn attempt_client(state: &State, key: &LockKey, uid: &str) -> Option<String> {
    let lock = state.locks.get(key)?;
    match &lock.holder {
        Some(h) if h.pod.uid == uid => Some(h.client_id.clone()),
        _ => lock
            .waiters
            .iter()
            .find(|w| w.pod.uid == uid)
            .map(|w| w.client_id.clone()),
    }
}

/// Counts the format-9 paths an entry took.
fn count_attempts(
    before: Option<&State>,
    command: &Command,
    response: &Response,
    reached: &mut Reached,
) {
    let Some(before) = before.filter(|_| !response.deduplicated) else {
        return;
    };
    match (command, &response.result) {
        (Command::Acquire(a), Ok(_)) => {
            let lock = before.locks.get(&a.key);
            if lock
                .and_then(|l| l.holder.as_ref())
                .is_some_and(|h| h.pod.uid == a.pod.uid && h.client_id != a.client_id)
            {
                reached.holds_taken_over += 1;
            }
            if lock.is_some_and(|l| {
                l.waiters
                    .iter()
                    .any(|w| w.pod.uid == a.pod.uid && w.client_id != a.client_id)
            }) {
                reached.waits_taken_over += 1;
            }
        }
        (Command::WithdrawOwn(_), Ok(Reply::WaitCancelled(CancelOutcome::TakenOver))) => {
            reached.withdrawals_left_alone += 1
        }
        (Command::ReleasePinIf(_), Ok(Reply::PinReleased { pin: Some(_) })) => {
            reached.pin_releases_if_done += 1
        }
        (Command::ReleasePinIf(_), Err(CommandError::PinLabelsDiffer { .. })) => {
            reached.pin_releases_if_refused += 1
        }
        _ => {}
    }
}

/// One acquire, assignment or reclaim in two taken for the node objects
/// its caller saw (format 10): each node name has two objects in these
/// histories (the node reports name one or the other); a caller mostly
/// sees the registered one, else either.
fn for_seen_nodes(rng: &mut Rng, state: &State, command: Command) -> Command {
    let (taking, names) = match command {
        Command::Acquire(a) => {
            let names = vec![a.key.name.clone()];
            (NodeTaking::Acquire(a), names)
        }
        Command::Assign(a) => {
            let names = a.candidates.clone();
            (NodeTaking::Assign(a), names)
        }
        Command::Reclaim(r) => {
            let names = vec![r.node.clone()];
            (NodeTaking::Reclaim(r), names)
        }
        other => return other,
    };
    if rng.below(2) != 0 {
        return taking.into_command();
    }
    let nodes = names
        .into_iter()
        .map(|name| {
            let registered = state.nodes.get(&name).filter(|n| n.gone_at_ms.is_none());
            let uid = match registered {
                Some(node) if rng.below(4) != 0 => node.uid.clone(),
                _ => format!("uid-{name}-{}", rng.below(2)),
            };
            SeenNode { uid, name }
        })
        .collect();
    Command::ForNodeObjects(ForNodeObjects {
        nodes,
        command: taking,
    })
}

/// Whether Tether has another object than `seen` registered under its
/// name, or has `seen` gone: what a node-object check refuses.
fn another_object(state: &State, seen: &SeenNode) -> bool {
    state.nodes.get(&seen.name).is_some_and(|node| {
        !node.uid.is_empty()
            && !seen.uid.is_empty()
            && match node.gone_at_ms {
                None => node.uid != seen.uid,
                Some(_) => node.uid == seen.uid,
            }
    })
}

/// After a node-object check applied (not answered from the dedupe
/// table): a refusal names a node registered as another object and leaves
/// every lock and pin as it was. The command it let through, if it did.
fn check_node_object_refusal(
    before: &State,
    after: &State,
    taking: &ForNodeObjects,
    response: &Response,
    reached: &mut Reached,
    seed: u64,
    index: u64,
) -> Option<Command> {
    let refused = matches!(
        response.result,
        Err(CommandError::NodeObjectMismatch { .. } | CommandError::NodeObjectGone { .. })
    );
    if !refused {
        reached.node_takings_checked += u32::from(!response.deduplicated);
        return Some(taking.command.clone().into_command());
    }
    if response.deduplicated {
        return None;
    }
    reached.node_takings_refused += 1;
    assert!(
        taking.nodes.iter().any(|seen| another_object(before, seen)),
        "seed {seed} entry {index}: refused though every node is the object seen: {:?}",
        response.result
    );
    assert!(
        before.locks == after.locks && before.pins.as_map() == after.pins.as_map(),
        "seed {seed} entry {index}: a refused node-object check changed locks or pins"
    );
    None
}

/// The node object each hold or wait (by lock and pod) and each pin (by
/// key and node) was taken for, when its taking named one Tether had
/// registered (live or gone) under the node's name. A holding taken plainly
/// has no entry: it may end with any object's `Gone`.
type TakenFor = BTreeMap<(String, String), String>;

fn lock_holding(key: &LockKey, pod_uid: &str) -> (String, String) {
    (format!("lock {key}"), pod_uid.to_string())
}

fn pin_holding(key: &PinKey, node: &str) -> (String, String) {
    (format!("pin {key}"), node.to_string())
}

/// Per entry: a `Gone` report about one node object ends only what was
/// taken for that object (or taken without naming one) — never a claim,
/// hold or wait taken for another object under the same name (issue 62
/// case 3: a re-created node's holdings ended by the old one's `Gone`).
/// Then forgets what ended in the entry and records what a node-object
/// check let through, and for which object.
#[allow(clippy::too_many_arguments)]
fn check_what_gone_ended(
    nodes_before: &BTreeMap<String, NodeInfo>,
    command: &Command,
    response: &Response,
    events: &[Event],
    taken_for: &mut TakenFor,
    reached: &mut Reached,
    seed: u64,
    index: u64,
) {
    if response.deduplicated {
        return;
    }
    for event in events {
        let (holding, by_gone) = match &event.kind {
            EventKind::LockReleased {
                key, pod, reason, ..
            } => (
                lock_holding(key, &pod.uid),
                *reason == ReleaseReason::NodeGone,
            ),
            EventKind::WaitEnded { key, pod, reason } => (
                lock_holding(key, &pod.uid),
                *reason == WaitEndReason::NodeGone,
            ),
            EventKind::PinReleased { key, node, reason } => (
                pin_holding(key, node),
                *reason == PinReleaseReason::NodeGone,
            ),
            _ => continue,
        };
        let Some(object) = taken_for.remove(&holding) else {
            continue;
        };
        if let (true, Command::ReportNode(report)) = (by_gone, command) {
            assert_eq!(
                object, report.uid,
                "seed {seed} entry {index}: the report that node object {} of {} is gone ended \
                 {} {}, taken for object {object}",
                report.uid, report.name, holding.0, holding.1
            );
            reached.gone_ended_what_was_taken_for_it += 1;
        }
    }
    match (command, &response.result) {
        (Command::ForNodeObjects(taking), Ok(reply)) => {
            record_taking(taking, reply, nodes_before, taken_for)
        }
        // A batch's acquires for node objects, item by item.
        (Command::Batch(batch), Ok(Reply::Batch(replies))) => {
            for (item, reply) in batch.items.iter().zip(replies) {
                if let (Command::ForNodeObjects(taking), Ok(reply), false) =
                    (&item.command, &reply.result, reply.deduplicated)
                {
                    record_taking(taking, reply, nodes_before, taken_for);
                }
            }
        }
        _ => {}
    }
}

/// Records what `taking` took (its `reply`) and for which object, when
/// Tether had one registered under the node's name (live or gone).
fn record_taking(
    taking: &ForNodeObjects,
    reply: &Reply,
    nodes_before: &BTreeMap<String, NodeInfo>,
    taken_for: &mut TakenFor,
) {
    let (holding, node) = match (&taking.command, reply) {
        (NodeTaking::Acquire(a), _) => (lock_holding(&a.key, &a.pod.uid), a.key.name.clone()),
        (NodeTaking::Assign(a), Reply::Pinned { pin, .. }) => {
            (pin_holding(&a.key, &pin.node), pin.node.clone())
        }
        (NodeTaking::Reclaim(r), _) => (pin_holding(&r.key, &r.node), r.node.clone()),
        _ => return,
    };
    let object = taking
        .nodes
        .iter()
        .find(|seen| seen.name == node && nodes_before.contains_key(&node));
    match object {
        Some(seen) => taken_for.insert(holding, seen.uid.clone()),
        None => taken_for.remove(&holding),
    };
}

fn report_pod(uid: &str, phase: PodPhase) -> Command {
    Command::ReportPod(ReportPod {
        pod_uid: uid.into(),
        phase,
    })
}

/// From format 11 a batch carries assignments and pod reports and revokes
/// beside acquires and releases; an older entry may not. A terminal report
/// or revoke of a pod whose hold this same entry granted is refused and
/// changes nothing (the lock would be granted twice under one token); one
/// of a pod holding from an earlier entry applies and hands the lock over.
#[test]
fn a_format_11_batch_carries_claims_and_pod_reports_but_ends_no_hold_it_granted() {
    let mut m = Machine::new();
    let command = batch(vec![
        (Some(request_id("c1", 1)), acquire("a", "u1", 0)),
        (
            Some(request_id("c1", 2)),
            plain_assign("1", "u1", &["n1", "n2"], 0),
        ),
        (None, report_pod("u1", PodPhase::Running)),
    ]);
    assert_eq!(command.format_version(), LOCKLESS_BATCH_FORMAT_VERSION);
    assert_eq!(command.oldest_form(), LOCKLESS_BATCH_FORMAT_VERSION);
    let Command::Batch(b) = &command else {
        unreachable!("a batch")
    };
    assert!(
        b.check(NODE_OBJECT_FORMAT_VERSION)
            .is_err_and(|reason| reason.contains("names no lock")),
        "a format-10 entry may not carry an assignment"
    );
    let replies = batch_replies(m.run_as(None, command));
    assert_eq!(granted(replies[0].result.clone()).token, 1);
    let (pin, created) = pinned(replies[1].result.clone());
    assert!(created);
    assert_eq!(pin.node, "n1");
    assert_eq!(
        m.state
            .pins
            .get(&PinKey::new("slurm/set-a", "1"))
            .map(|p| p.owner),
        Some(OwnerState::Running),
        "the report later in the entry saw the pin"
    );
    assert!(replies[2].result.is_ok());

    // u2 takes lock b in this entry; its gone report in the same entry is
    // refused, while u1's revoke (its hold is from entry 1) ends it and
    // hands lock a to u3, queued in the same entry.
    let before_u2 = m.state.sessions.get("c2").cloned();
    let replies = batch_replies(m.run_as(
        None,
        batch(vec![
            (Some(request_id("c2", 1)), acquire("b", "u2", 0)),
            (Some(request_id("c3", 1)), acquire("a", "u3", 1000)),
            (Some(request_id("r", 1)), report_pod("u2", PodPhase::Gone)),
            (
                Some(request_id("r", 2)),
                Command::RevokePod(RevokePod {
                    pod_uid: "u1".into(),
                    reason: "deleted".into(),
                }),
            ),
        ]),
    ));
    assert_eq!(granted(replies[0].result.clone()).token, 2);
    assert_eq!(replies[1].result, Ok(Reply::Queued { position: 1 }));
    assert!(
        matches!(&replies[2].result, Err(CommandError::InvalidBatch { reason }) if reason.contains("granted by this same entry")),
        "{:?}",
        replies[2]
    );
    let Ok(Reply::Revoked {
        released, granted, ..
    }) = &replies[3].result
    else {
        panic!("the revoke applies: {:?}", replies[3]);
    };
    assert_eq!(released, &[key("a")]);
    assert_eq!(granted.len(), 1);
    assert_eq!(
        (granted[0].1.pod.uid.as_str(), granted[0].1.token),
        ("u3", 2)
    );
    assert_eq!(
        m.state.locks[&key("b")].holder.as_ref().unwrap().pod.uid,
        "u2"
    );
    assert!(
        !m.state.sessions["r"].responses.contains_key(&1),
        "the refused report is not in the dedupe table"
    );
    assert!(before_u2.is_none());

    // Proposed again in an entry of its own, the report applies as new.
    let again = m.run_as(Some(request_id("r", 1)), report_pod("u2", PodPhase::Gone));
    assert!(!again.deduplicated);
    assert!(matches!(
        again.result,
        Ok(Reply::Revoked { ref released, .. }) if released == &[key("b")]
    ));
}

/// An acquire for a node object goes into a batch like a plain one, in an
/// entry of format 10; an older entry may not carry it.
#[test]
fn a_batch_carries_acquires_for_node_objects_from_format_10() {
    let Command::Acquire(plain) = acquire("n1", "p1", 0) else {
        unreachable!("an acquire")
    };
    let wrapped = Command::ForNodeObjects(ForNodeObjects {
        nodes: vec![SeenNode {
            name: "n1".into(),
            uid: "uid-n1".into(),
        }],
        command: NodeTaking::Acquire(plain),
    });
    assert_eq!(batchable_lock(&wrapped), Some(&key("n1")));
    let batch = Batch {
        items: vec![BatchItem {
            request_id: None,
            command: wrapped,
        }],
    };
    assert_eq!(
        Command::Batch(batch.clone()).format_version(),
        NODE_OBJECT_FORMAT_VERSION
    );
    assert!(batch.check(NODE_OBJECT_FORMAT_VERSION - 1).is_err());
    assert!(batch.check(NODE_OBJECT_FORMAT_VERSION).is_ok());
}

/// Issue 62 case 3, step by step: node n1 deleted and re-created while the
/// bridge was away. What a caller takes for the new object is refused
/// while the old one is registered; once the old one's `Gone` applied (it
/// ends what was taken for it) the new object's claims and lock are
/// taken, and a late `Gone` for the old object leaves them.
#[test]
fn a_taking_for_another_node_object_than_the_registered_one_is_refused() {
    let mut m = Machine::new();
    let (old, new) = ("uid-n1-old", "uid-n1-new");
    let report = |uid: &str, state| {
        let mut command = report_node("n1", state);
        if let Command::ReportNode(report) = &mut command {
            report.uid = uid.into();
        }
        command
    };
    let for_object = |uid: &str, command: Command| {
        let taking = match command {
            Command::Acquire(a) => NodeTaking::Acquire(a),
            Command::Reclaim(r) => NodeTaking::Reclaim(r),
            other => panic!("{other:?}"),
        };
        Command::ForNodeObjects(ForNodeObjects {
            nodes: vec![SeenNode {
                name: "n1".into(),
                uid: uid.into(),
            }],
            command: taking,
        })
    };
    m.run(report(old, NodeState::Ready)).unwrap();
    // Taken for the registered object.
    let held = granted(m.run(for_object(old, acquire("n1", "p-old", 0))));
    m.run(for_object(old, device_claim("p-old", "n1", &[0])))
        .unwrap();
    m.run(release("n1", "p-old", held.token)).unwrap();
    // For the new object: refused, nothing taken.
    let locks = m.state.locks.clone();
    for refused in [
        m.run(for_object(new, acquire("n1", "p-new", 0))),
        m.run(for_object(new, device_claim("p-new", "n1", &[1]))),
    ] {
        match refused {
            Err(CommandError::NodeObjectMismatch {
                registered_uid,
                reported_uid,
                ..
            }) => assert_eq!((registered_uid.as_str(), reported_uid.as_str()), (old, new)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(m.state.locks, locks);
    assert!(m.state.pins.get(&PinKey::new(CLAIMS, "p-new")).is_none());
    // The bridge back: the old object gone (its claim ends), the new joined.
    m.run(report(old, NodeState::Gone)).unwrap();
    assert!(m.state.pins.get(&PinKey::new(CLAIMS, "p-old")).is_none());
    // Nothing more for the gone object.
    assert!(matches!(
        m.run(for_object(old, acquire("n1", "p-late", 0))),
        Err(CommandError::NodeObjectGone { .. })
    ));
    m.run(report(new, NodeState::Ready)).unwrap();
    let hold = granted(m.run(for_object(new, acquire("n1", "p-new", 0))));
    m.run(for_object(new, device_claim("p-new", "n1", &[1])))
        .unwrap();
    // A late deletion of the old object ends none of it.
    let reply = m.run(report(old, NodeState::Gone)).unwrap();
    assert!(matches!(reply, Reply::NodeReported { changed: false, .. }));
    assert_eq!(
        m.state.locks[&key("n1")].holder.as_ref().map(|h| h.token),
        Some(hold.token)
    );
    assert!(m.state.pins.get(&PinKey::new(CLAIMS, "p-new")).is_some());
}

/// Per entry: a live node keeps its object. A name registered live under
/// one UID before the entry and under another after it changed objects
/// without the old one going (its pins, claims and locks would stay with
/// the name).
fn check_node_objects(
    before: &BTreeMap<String, NodeInfo>,
    after: &BTreeMap<String, NodeInfo>,
    seed: u64,
    index: u64,
) {
    for (name, now) in after.iter().filter(|(_, n)| n.gone_at_ms.is_none()) {
        if let Some(was) = before.get(name).filter(|n| n.gone_at_ms.is_none())
            && !was.uid.is_empty()
            && was.uid != now.uid
        {
            panic!(
                "seed {seed} entry {index}: node {name} went from object {} to {} without the \
                 old one reported gone",
                was.uid, now.uid
            );
        }
    }
}

/// A request under a kept `id`, first sent with `first`, now with `command`:
/// it is never applied again (no events), and it gets an answer from the
/// dedupe table only if it is the same command; another command under the
/// id is refused.
fn check_retry_answer(
    id: &RequestId,
    first: &Command,
    command: &Command,
    response: &Response,
    entry: &[Event],
    seed: u64,
) {
    let at = format!("seed {seed}, request {}#{}", id.client_id, id.sequence);
    assert!(
        entry.is_empty(),
        "{at}: a request whose id was kept applied again: {entry:?}"
    );
    if first != command {
        assert!(
            !response.deduplicated,
            "{at}: the answer to another command was given for {command:?}: {response:?}"
        );
        assert!(
            matches!(
                response.result,
                Err(CommandError::RequestIdReused { .. } | CommandError::SequenceTooOld { .. })
            ),
            "{at}: another command under a kept id was not refused: {response:?}"
        );
    }
}

/// `rounds` seeded runs of 400 random entries from `base_seed`, checking
/// after every entry: one holder per lock, at most one grant per lock per
/// entry, every grant and "granted" answer standing at the entry's end,
/// FIFO grants, strictly rising tokens, pin rules; and at the end snapshot
/// round trips and replays. Panics at the first violation, naming the seed.
fn property_rounds(base_seed: u64, rounds: u64) -> Reached {
    let mut reached = Reached::default();
    for round in 0..rounds {
        let seed = base_seed.wrapping_add(round).max(1);
        println!("state machine property test seed {seed} (replay: TETHER_SM_SEED={seed})");
        let mut rng = Rng(seed);
        let mut m = Machine::new();
        let mut queues = BTreeMap::new();
        let mut last_token = BTreeMap::new();
        let mut snapshot_at = None;
        // Every client request applied as new, by (client, sequence).
        let mut sent: BTreeMap<(String, u64), (RequestId, Command)> = BTreeMap::new();
        // The node object each hold, wait and pin was last taken for.
        let mut taken_for = TakenFor::new();
        for step in 0..400 {
            m.now += rng.below(400);
            let command = if rng.below(4) == 0 {
                random_batch(&mut rng, &m)
            } else {
                random_command(&mut rng, &m)
            };
            let command = for_seen_nodes(&mut rng, &m.state, command);
            reached.batches += u32::from(matches!(command, Command::Batch(_)));
            let before = m.events.len();
            let is_batch = matches!(command, Command::Batch(_));
            // Client requests: mostly fresh ids; some retries of an earlier
            // request (same id, same command), some reuses of an earlier id
            // for another command (a forging caller), some far-ahead ids
            // that claim everything before them done.
            let (id, command, earlier) = match rng.below(12) {
                0 | 1 if !is_batch && !sent.is_empty() => {
                    let (id, first): (RequestId, Command) = sent
                        .values()
                        .nth(rng.below(sent.len() as u64) as usize)
                        .cloned()
                        .expect("non-empty");
                    let retried = if rng.below(2) == 0 {
                        first.clone()
                    } else {
                        command
                    };
                    (Some(id), retried, Some(first))
                }
                2 if !is_batch => {
                    let far = (1 << 40) + m.index;
                    let id = RequestId {
                        client_id: format!("c{}", rng.below(3)),
                        sequence: far,
                        first_incomplete: far,
                    };
                    (Some(id), command, None)
                }
                _ => {
                    let id = (rng.below(2) == 0 && !is_batch).then(|| RequestId {
                        client_id: format!("c{}", rng.below(3)),
                        sequence: m.index + 1,
                        first_incomplete: m.index.saturating_sub(rng.below(4)),
                    });
                    // As the server does: an acquire acts for the client of
                    // its request (its holds and waits name it).
                    let mut command = command;
                    if let (Some(id), Some(acquire)) = (&id, acquire_in(&mut command)) {
                        acquire.client_id = id.client_id.clone();
                    }
                    (id, command, None)
                }
            };
            let command = acting_for(id.as_ref(), command);
            // Whether the session still remembers the id (an evicted
            // session starts afresh, so a retry after it applies as new).
            let remembered = id.as_ref().is_some_and(|id| {
                m.state.sessions.get(&id.client_id).is_some_and(|session| {
                    id.sequence < session.acknowledged_below
                        || session.responses.contains_key(&id.sequence)
                })
            });
            // A wait that a retry answered after the abandoning stream's
            // answer must be kept.
            let taken_up = match &command {
                Command::AbandonWait(abandon) => m
                    .state
                    .sessions
                    .get(&abandon.client_id)
                    .and_then(|session| session.responses.get(&abandon.sequence))
                    .is_some_and(|answer| answer.answered_at > abandon.answered_at),
                _ => false,
            };
            let pins_before = m.state.pins.as_map().clone();
            let nodes_before = m.state.nodes.clone();
            let state_before = matches!(
                command,
                Command::AbandonWait(_)
                    | Command::Withdraw(_)
                    | Command::WithdrawOwn(_)
                    | Command::Acquire(_)
                    | Command::ReleasePinIf(_)
                    | Command::ForNodeObjects(_)
            )
            .then(|| m.state.clone());
            let response = m.run_as(id.clone(), command.clone());
            // What applied: a node-object check's command once it let it
            // through; nothing if it refused (checked to change nothing).
            let applied = match (&command, &state_before) {
                (Command::ForNodeObjects(taking), Some(state_before)) => check_node_object_refusal(
                    state_before,
                    &m.state,
                    taking,
                    &response,
                    &mut reached,
                    seed,
                    m.index,
                ),
                _ => Some(command.clone()),
            };
            if let (Some(state_before), Some(applied)) = (&state_before, &applied) {
                check_give_ups(state_before, &m.state, applied, &response, seed, m.index);
            }
            if let Some(applied) = &applied {
                count_attempts(state_before.as_ref(), applied, &response, &mut reached);
            }
            check_what_gone_ended(
                &nodes_before,
                &command,
                &response,
                &m.events[before..],
                &mut taken_for,
                &mut reached,
                seed,
                m.index,
            );
            check_pin_expiries(&pins_before, &m.events[before..], m.state.now_ms, seed);
            check_node_objects(&nodes_before, &m.state.nodes, seed, m.index);
            if let (Command::Batch(batch), Ok(Reply::Batch(replies))) = (&command, &response.result)
                && batch.has_lockless()
            {
                reached.lockless_batches += 1;
                reached.own_grant_ends_refused += batch
                    .items
                    .iter()
                    .zip(replies)
                    .filter(|(item, reply)| {
                        ends_holds_of(&item.command).is_some()
                            && matches!(reply.result, Err(CommandError::InvalidBatch { .. }))
                    })
                    .count() as u32;
            }
            if let Command::ReportNode(report) = &command
                && !response.deduplicated
            {
                match &response.result {
                    Err(CommandError::NodeObjectMismatch { .. }) => {
                        reached.node_reports_refused += 1
                    }
                    Ok(Reply::NodeReported { changed: true, .. })
                        if nodes_before
                            .get(&report.name)
                            .is_some_and(|n| n.gone_at_ms.is_some() && n.uid != report.uid) =>
                    {
                        reached.nodes_replaced += 1
                    }
                    _ => {}
                }
            }
            if taken_up {
                let ended = m.events[before..]
                    .iter()
                    .find(|e| matches!(e.kind, EventKind::WaitEnded { .. }));
                assert!(
                    ended.is_none(),
                    "seed {seed} entry {}: a wait a retry came back for was given up: {ended:?}",
                    m.index
                );
            }
            if matches!(command, Command::AbandonWait(_)) {
                match &response.result {
                    Ok(Reply::WaitCancelled(CancelOutcome::Removed)) => {
                        reached.abandons_removed += 1
                    }
                    Ok(Reply::WaitCancelled(CancelOutcome::TakenUp)) => {
                        reached.abandons_taken_up += 1
                    }
                    Ok(Reply::WaitCancelled(CancelOutcome::GaveBack { .. })) => {
                        reached.abandons_given_back += 1
                    }
                    _ => {}
                }
            }
            if let Ok(Reply::Reclaimed(done)) = &response.result
                && !response.deduplicated
                && !done.taken_from.is_empty()
            {
                reached.reclaims_taking += 1;
            }
            if matches!(command, Command::Withdraw(_) | Command::WithdrawOwn(_))
                && !response.deduplicated
            {
                match &response.result {
                    Ok(Reply::WaitCancelled(CancelOutcome::Removed)) => {
                        reached.withdrawals_ended_a_wait += 1
                    }
                    Ok(Reply::WaitCancelled(CancelOutcome::GaveBack { .. })) => {
                        reached.withdrawals_gave_back += 1
                    }
                    _ => {}
                }
            }
            if let (Some(id), Some(first)) = (&id, &earlier)
                && remembered
            {
                check_retry_answer(id, first, &command, &response, &m.events[before..], seed);
                reached.retries += u32::from(*first == command);
                reached.reused_ids += u32::from(*first != command);
            } else if let Some(id) = &id
                && !response.deduplicated
            {
                sent.insert(
                    (id.client_id.clone(), id.sequence),
                    (id.clone(), command.clone()),
                );
            }
            crate::fuzzing::check_granted_replies(
                &m.state,
                m.index,
                applied.as_ref().unwrap_or(&command),
                &response,
                &format!("seed {seed} entry {}", m.index),
            );
            assert_eq!(
                unreferenced_pods(&m.state),
                unreferenced_pods_by_collecting(&m.state),
                "seed {seed} entry {}: the walk over the pin owners' index and the \
                 collection of every pin's owner name different pods",
                m.index
            );
            check_sweep_index(&m.state, seed, m.index);
            if matches!(command, Command::Sweep(_)) {
                // One that applied (not a retry answered from the table, nor
                // a refused reuse of an id).
                if !response.deduplicated && matches!(response.result, Ok(Reply::Swept { .. })) {
                    assert_eq!(
                        unreferenced_pods(&m.state),
                        Vec::<String>::new(),
                        "seed {seed}: a sweep left phases of pods nothing names"
                    );
                }
                let entry = &m.events[before..];
                let chained = entry.iter().any(|ended| {
                    let EventKind::LockReleased { key, .. } = &ended.kind else {
                        return false;
                    };
                    entry.iter().any(|e| matches!(&e.kind,
                        EventKind::WaitEnded { key: k, reason: WaitEndReason::LeaseEnded { .. }, .. }
                            if k == key))
                });
                reached.sweeps_ending_a_hold_and_a_lease_wait += u32::from(chained);
                if let Ok(Reply::Swept { sessions, .. }) = &response.result
                    && !response.deduplicated
                {
                    reached.sweeps_evicting_sessions += u32::from(*sessions > 0);
                }
                reached.sweeps_dropping_tombstones +=
                    u32::from(m.state.nodes.len() < nodes_before.len());
            }
            check_pin_invariants(&m.state, seed);
            for (client, session) in &m.state.sessions {
                let kept: u64 = session.responses.values().map(answer_size).sum();
                assert_eq!(
                    session.answer_bytes, kept,
                    "seed {seed}: session {client} miscounts its answers' bytes"
                );
                assert!(session.responses.len() <= SESSION_MAX_RESPONSES);
            }
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
        // The log is the source of truth: re-applying it on a fresh state
        // machine gives byte-identical state and the same event stream.
        let mut fresh = State::default();
        let mut events = Vec::new();
        for (index, request) in &m.log {
            events.extend(apply(&mut fresh, *index, request).1);
        }
        assert_eq!(
            crate::store::encode(&fresh),
            crate::store::encode(&m.state),
            "seed {seed}: replay diverged"
        );
        assert_eq!(events, m.events, "seed {seed}: replay emitted other events");
        for event in &m.events {
            match event.kind {
                EventKind::LockReleased {
                    reason: ReleaseReason::LeaseExpired { .. },
                    ..
                } => reached.lease_expiries += 1,
                EventKind::LockReleased {
                    reason: ReleaseReason::HoldTimeout { .. },
                    ..
                } => reached.hold_timeouts += 1,
                EventKind::PinAssigned { .. } => reached.pins_assigned += 1,
                EventKind::PinReleased {
                    reason: PinReleaseReason::Expired { .. },
                    ..
                } => reached.pin_expiries += 1,
                EventKind::NodeGone { .. } => reached.nodes_gone += 1,
                EventKind::LockGranted { .. } => reached.grants += 1,
                _ => {}
            }
        }
    }
    reached
}

#[test]
fn random_sequences_keep_mutual_exclusion_fifo_and_increasing_tokens() {
    let base_seed = std::env::var("TETHER_SM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_u64);
    let reached = property_rounds(base_seed, 40);
    println!("property test reached: {reached:?}");
    // The generator must exercise what the invariants are about.
    assert!(
        reached.pins_assigned > 100
            && reached.pin_expiries > 5
            && reached.nodes_gone > 20
            && reached.grants > 100
            && reached.batches > 100
            && reached.lockless_batches > 100
            && reached.own_grant_ends_refused > 10
            && reached.lease_expiries > 50
            && reached.hold_timeouts > 50
            && reached.sweeps_ending_a_hold_and_a_lease_wait > 10
            && reached.sweeps_evicting_sessions > 10
            && reached.sweeps_dropping_tombstones > 5
            && reached.retries > 100
            && reached.reused_ids > 100
            && reached.abandons_removed > 10
            && reached.abandons_taken_up > 10
            && reached.abandons_given_back > 5
            && reached.withdrawals_ended_a_wait > 10
            && reached.withdrawals_gave_back > 10
            && reached.reclaims_taking > 10
            && reached.nodes_replaced > 10
            && reached.node_reports_refused > 10
            && reached.holds_taken_over > 10
            && reached.waits_taken_over > 10
            && reached.withdrawals_left_alone > 10
            && reached.pin_releases_if_done > 10
            && reached.pin_releases_if_refused > 10
            && reached.node_takings_checked > 100
            && reached.node_takings_refused > 50
            && reached.gone_ended_what_was_taken_for_it > 5,
        "{reached:?}"
    );
}

/// The property test run with `failpoint` (a deliberate bug) switched on:
/// the message of the violation it reports. Panics if it reports none. The
/// failpoints are process-wide, so these tests are ignored by a plain
/// `cargo test` and run alone: `./dev test` runs them with `--ignored
/// planted_ --test-threads=1` in a process of their own.
#[cfg(feature = "failpoints")]
fn caught_by_the_property_test(failpoint: &str) -> String {
    let scenario = fail::FailScenario::setup();
    fail::cfg(failpoint, "return").unwrap();
    // Ten times the plain test's rounds: a bug that needs a rare
    // interleaving is met whatever the generator's mix.
    let caught = std::panic::catch_unwind(|| property_rounds(0x5eed, 400));
    fail::remove(failpoint);
    scenario.teardown();
    let message = match caught {
        Ok(reached) => panic!("the planted bug {failpoint} went unnoticed: {reached:?}"),
        Err(payload) => payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default(),
    };
    println!("{failpoint} caught: {message}");
    message
}

/// Another client's acquire of a pod sharing the pod's hold and token (the
/// rule before format 9): the earlier bind attempt could end the hold the
/// later one bound the pod with.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_acquire_sharing_another_attempts_hold_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-acquire-shares-attempts");
    assert!(message.contains("acquired"), "{message}");
}

/// A withdrawal ending whichever client's hold or wait it finds.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_withdraw_ignoring_the_client_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-withdraw-ignores-client");
    assert!(message.contains("had taken over"), "{message}");
}

/// An acquire, assignment or reclaim taken for whatever node object the
/// caller saw, without comparing it to the registered one (the rule before
/// format 10): the old object's `Gone` then ends what was taken for the new.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_taking_for_an_unchecked_node_object_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-node-object-unchecked");
    assert!(message.contains("taken for object"), "{message}");
}

/// A conditional pin release ending a pin without the labels it named.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_pin_release_ignoring_its_labels_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-release-pin-ignores-labels");
    assert!(message.contains("lacked"), "{message}");
}

/// A batched terminal report or revoke ending its pod's hold that the same
/// entry granted: the lock is granted again under the same token.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_batched_revoke_ending_its_entrys_grant_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-batch-revoke-ends-own-grant");
    assert!(
        message.contains("granted twice in one entry")
            || message.contains("by an entry that also ended that hold")
            || message.contains("token"),
        "{message}"
    );
}

/// A retry answered from the dedupe table whatever command it carries (the
/// forged-answer bug that format 6 fixed).
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_dedupe_ignoring_the_command_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-dedupe-ignore-command");
    assert!(
        message.contains("the answer to another command was given"),
        "{message}"
    );
}

/// The sweep granting as each end applies (the double grant that format 5
/// fixed).
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_sweep_double_grant_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-sweep-grant-per-end");
    assert!(
        message.contains("granted twice in one entry")
            || message.contains("by an entry that also ended that hold"),
        "{message}"
    );
}

/// The grant after a force release, or after a hold timeout, reusing the
/// ended hold's token.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_token_reuse_after_a_force_release_or_hold_timeout_is_caught_by_the_property_test() {
    for failpoint in [
        "sm-force-release-reuses-token",
        "sm-hold-timeout-reuses-token",
    ] {
        let message = caught_by_the_property_test(failpoint);
        assert!(message.contains("token"), "{failpoint}: {message}");
    }
}

/// Node-gone releasing the holder before it empties the queue, so the
/// first waiter is granted a lock on a node that is gone.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_node_gone_hand_over_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-node-gone-hands-over");
    assert!(message.contains("because its node is gone"), "{message}");
}

/// A node report under another UID adopted as format 7 did: the name
/// changes objects and what the old object held stays on it.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_node_adopting_another_object_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-node-adopts-another-object");
    assert!(
        message.contains("without the old one reported gone"),
        "{message}"
    );
}

/// `AbandonWait` giving a wait up although a retry came back for it.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_abandon_ignoring_a_retry_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-abandon-ignores-retry");
    // A wait, or the hold a wait became, that a retry took up.
    assert!(
        message.contains("a wait a retry came back for was given up")
            || message.contains("a hold its client may have taken up was given back"),
        "{message}"
    );
}

/// `AbandonWait` keeping a grant that raced it for a caller that went
/// away (format 6's rule): the node waited for the hold timeout.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_abandon_keeping_a_raced_grant_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-abandon-keeps-grant");
    assert!(
        message.contains("a grant nobody took up was kept"),
        "{message}"
    );
}

/// `Withdraw` ending only waits: a pod granted before its caller gave up
/// keeps the lock.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_withdraw_keeping_a_hold_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-withdraw-keeps-hold");
    assert!(message.contains("still holds or waits"), "{message}");
}

/// A claim correction that leaves other claims their devices: two claims
/// name one device on a node.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_reclaim_keeping_other_claims_devices_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-reclaim-keeps-others");
    assert!(message.contains("both name device"), "{message}");
}

/// A sweep index that does not re-judge a pod whose last pin ended: the
/// sweep would keep the phase of a pod nothing names.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_sweep_index_missing_a_pod_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-sweep-index-misses-owner");
    assert!(
        message.contains("the sweep index and a full scan")
            || message.contains("unreferenced pods"),
        "{message}"
    );
}

/// A sweep index that files no hold: no hold times out.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_sweep_index_missing_a_hold_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-sweep-index-misses-holds");
    assert!(
        message.contains("the sweep index and a full scan"),
        "{message}"
    );
}

/// Pins expiring when half their lifetime has passed.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "sets a process-wide failpoint: run alone, with --ignored --test-threads=1 (./dev test does)"]
fn planted_early_pin_expiry_is_caught_by_the_property_test() {
    let message = caught_by_the_property_test("sm-pin-expires-early");
    assert!(message.contains("before its lifetime passed"), "{message}");
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

#[test]
fn pin_labels_are_stored_exactly_as_the_map_they_replaced() {
    let map = BTreeMap::from([
        ("zone".to_string(), "a".to_string()),
        ("app".to_string(), "db".to_string()),
    ]);
    let labels = Labels::from(map.clone());
    // Same bytes: logs and snapshots written before the change still read.
    assert_eq!(crate::store::encode(&labels), crate::store::encode(&map));
    let read: Labels = crate::store::decode(&crate::store::encode(&map)).unwrap();
    assert_eq!(read, labels);
    assert_eq!(labels.get("app").map(String::as_str), Some("db"));
    assert_eq!(labels.get("zone").map(String::as_str), Some("a"));
    assert_eq!(labels.get("tier"), None);
    let keys: Vec<&str> = labels.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["app", "zone"]);
    assert_eq!((labels.len(), Labels::default().is_empty()), (2, true));
}

/// The sweep index answers what a full scan of the state answers: what a
/// sweep would end now and later, with and without the lock-delay, under
/// hold timeouts of every scope and of one, for every format a sweep can be
/// written in. Also checked inside every `Sweep` this test applies
/// (`sweep.rs`'s `checked`).
fn check_sweep_index(state: &State, seed: u64, index: u64) {
    let now = state.now_ms;
    let mut one_scope = sweep_settings(2_000, 8_000);
    one_scope
        .scope_hold_timeout_ms
        .insert("gpu-bind".into(), 1_000);
    one_scope.session_idle_ms = 5_000;
    one_scope.node_tombstone_ms = 3_000;
    let settings = [
        sweep_settings(0, 0),
        sweep_settings(1 << 40, 1 << 40),
        sweep_settings(1 << 40, 1_000),
        one_scope,
    ];
    for sweep in &settings {
        for at in [now, now + 1_000, now + 60_000] {
            for format in [5, FORMAT_VERSION] {
                let (indexed, scanned) = due_by_index_and_by_scan(state, at, sweep, format)
                    .unwrap_or_else(|| {
                        panic!("seed {seed} entry {index}: the state is not indexed")
                    });
                assert_eq!(
                    indexed, scanned,
                    "seed {seed} entry {index}: the sweep index and a full scan find different \
                     things due at {at} (format {format}, {sweep:?})"
                );
            }
        }
    }
}

/// [`unreferenced_pods`] as it was written before the pin table's index of
/// owners was walked instead: every hold's, wait's and pin's pod collected
/// into one set.
fn unreferenced_pods_by_collecting(state: &State) -> Vec<String> {
    let mut named: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    for lock in state.locks.values() {
        named.extend(lock.holder.iter().map(|h| h.pod.uid.as_str()));
        named.extend(lock.waiters.iter().map(|w| w.pod.uid.as_str()));
    }
    named.extend(state.pins.values().map(|p| p.pod_uid.as_str()));
    state
        .pods
        .keys()
        .filter(|uid| !named.contains(uid.as_str()))
        .cloned()
        .collect()
}

//! Linearizability of the try-acquire locks against a sequential model, by
//! the Wing–Gong–Lowe search (as in Porcupine / Knossos): find an order of
//! the operations that respects real time (an operation answered before
//! another was sent comes first) and in which each answer is what a single
//! in-memory lock would have said. Unknown operations may take effect at
//! any point after they were sent, or never.
//!
//! The model, per lock (locks are independent, so each is searched alone):
//! - try-acquire by pod U: free -> granted with a token above every earlier
//!   one; held by U -> granted with U's token; held by another -> busy;
//! - release by U with token T: the holder is (U, T) -> released; otherwise
//!   rejected and nothing changes;
//! - revoke of pod U: ends U's hold; its answer lists the lock iff U held it.
//!
//! A search that runs out of its time budget is reported as undecided, not
//! as a violation. Proves: these operations behaved as one atomic lock. Does
//! not cover queued acquires (see `fifo`) or hold timeouts (the workload
//! sets none).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use super::Evidence;
use crate::history::{Call, Op, Outcome, Value};

/// Model state of one lock.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Lock {
    /// Holder and token (None: granted by an unknown operation).
    holder: Option<(String, Option<u64>)>,
    /// Highest token known to have been granted.
    last_token: u64,
}

/// Applies `op` to `state`; None when its answer is impossible there.
fn step(state: &Lock, op: &Op, key: &str) -> Option<Lock> {
    let known = match &op.outcome {
        Outcome::Ok(value) => Some(value),
        _ => None,
    };
    let mut next = state.clone();
    match &op.call {
        Call::Acquire { uid, .. } => {
            let holder = state.holder.as_ref();
            match (holder, known) {
                (Some((h, token)), Some(Value::Granted(t))) if h == uid => {
                    if token.is_some_and(|token| token != *t) {
                        return None;
                    }
                    next.holder = Some((uid.clone(), Some(*t)));
                    next.last_token = state.last_token.max(*t);
                }
                (None, Some(Value::Granted(t))) => {
                    if *t <= state.last_token {
                        return None;
                    }
                    next.holder = Some((uid.clone(), Some(*t)));
                    next.last_token = *t;
                }
                (Some((h, _)), Some(Value::Busy)) if h != uid => {}
                (_, Some(_)) => return None,
                // Unknown: it took effect now, with whatever answer.
                (None, None) => next.holder = Some((uid.clone(), None)),
                (Some(_), None) => {}
            }
        }
        Call::Release { uid, token } => {
            let holds = state
                .holder
                .as_ref()
                .is_some_and(|(h, t)| h == uid && t.is_none_or(|t| t == *token));
            match known {
                Some(Value::Released) if holds => next.holder = None,
                Some(Value::Rejected) if !holds => {}
                Some(_) => return None,
                None if holds => next.holder = None,
                None => {}
            }
        }
        Call::RevokePod { uid } => {
            let holds = state.holder.as_ref().is_some_and(|(h, _)| h == uid);
            if let Some(Value::Revoked(keys)) = known
                && keys.iter().any(|k| k == key) != holds
            {
                return None;
            }
            if holds {
                next.holder = None;
            }
        }
        Call::Assign { .. } | Call::Withdraw { .. } => {}
    }
    Some(next)
}

/// How the search of one lock ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A valid order exists.
    Linearizable,
    /// None exists; the operations that could not be placed.
    Violation(String),
    /// The budget ran out.
    Undecided,
}

/// Searches one lock's operations (`ops` must all concern `key`).
pub fn check_lock(key: &str, ops: &[Op], budget: Duration) -> Verdict {
    // Entries: (time, is_return, op index). Unknown ops never return.
    const NONE: usize = usize::MAX;
    let n = ops.len();
    let mut entries: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * n);
    for (i, op) in ops.iter().enumerate() {
        entries.push((op.invoke_us, false, i));
        if let Some(done) = op.complete_us.filter(|_| op.is_ok()) {
            entries.push((done, true, i));
        }
    }
    // Calls before returns at equal times: the more permissive order.
    entries.sort_by_key(|&(time, is_return, i)| (time, is_return, i));
    let len = entries.len();
    // Doubly linked list over entries, slot `len` is the head sentinel.
    let mut next: Vec<usize> = (1..=len).collect();
    next.push(0);
    if len > 0 {
        next[len - 1] = NONE;
    }
    next[len] = if len > 0 { 0 } else { NONE };
    let mut prev: Vec<usize> = (0..=len)
        .map(|i| if i == 0 { len } else { i - 1 })
        .collect();
    prev[len] = NONE;
    let mut return_of = vec![NONE; n];
    for (slot, &(_, is_return, i)) in entries.iter().enumerate() {
        if is_return {
            return_of[i] = slot;
        }
    }
    let mut definite_left = ops.iter().filter(|op| op.is_ok()).count();

    let unlink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, slot: usize| {
        let (p, q) = (prev[slot], next[slot]);
        next[p] = q;
        if q != NONE {
            prev[q] = p;
        }
    };
    let relink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, slot: usize| {
        let (p, q) = (prev[slot], next[slot]);
        next[p] = slot;
        if q != NONE {
            prev[q] = slot;
        }
    };

    let started = Instant::now();
    let mut state = Lock {
        holder: None,
        last_token: 0,
    };
    let words = n.div_ceil(64).max(1);
    let mut linearized = vec![0u64; words];
    let mut seen: HashSet<(Vec<u64>, Lock)> = HashSet::new();
    let mut stack: Vec<(usize, Lock)> = Vec::new();
    let mut cursor = next[len];
    let mut steps = 0u64;
    while definite_left > 0 {
        steps += 1;
        if steps.is_multiple_of(4096) && started.elapsed() > budget {
            return Verdict::Undecided;
        }
        if cursor == NONE {
            // Only unknown calls remain ahead but a definite op is left: it
            // was skipped; backtrack.
            let Some((slot, old)) = stack.pop() else {
                return Verdict::Violation(format!("{key}: no order places every answer"));
            };
            let i = entries[slot].2;
            undo(&mut state, old, &mut linearized, i, ops, &mut definite_left);
            relink_op(&mut next, &mut prev, slot, return_of[i], relink);
            cursor = next[slot];
            continue;
        }
        let (_, is_return, i) = entries[cursor];
        if !is_return {
            let op = &ops[i];
            if let Some(new_state) = step(&state, op, key) {
                let mut bits = linearized.clone();
                bits[i / 64] |= 1 << (i % 64);
                if seen.insert((bits.clone(), new_state.clone())) {
                    stack.push((cursor, state.clone()));
                    state = new_state;
                    linearized = bits;
                    if op.is_ok() {
                        definite_left -= 1;
                    }
                    unlink(&mut next, &mut prev, cursor);
                    if return_of[i] != NONE {
                        unlink(&mut next, &mut prev, return_of[i]);
                    }
                    cursor = next[len];
                    continue;
                }
            }
            cursor = next[cursor];
        } else {
            // A return reached before its call was placed: backtrack.
            let Some((slot, old)) = stack.pop() else {
                let op = &ops[i];
                return Verdict::Violation(format!(
                    "{key}: op {} ({:?} -> {:?}, process {}) fits no order of the {} operations",
                    op.id,
                    op.call,
                    op.outcome,
                    op.process,
                    ops.len()
                ));
            };
            let j = entries[slot].2;
            undo(&mut state, old, &mut linearized, j, ops, &mut definite_left);
            relink_op(&mut next, &mut prev, slot, return_of[j], relink);
            cursor = next[slot];
        }
    }
    Verdict::Linearizable
}

fn undo(
    state: &mut Lock,
    old: Lock,
    linearized: &mut [u64],
    i: usize,
    ops: &[Op],
    definite_left: &mut usize,
) {
    *state = old;
    linearized[i / 64] &= !(1 << (i % 64));
    if ops[i].is_ok() {
        *definite_left += 1;
    }
}

/// Puts an operation's call (and return) back, in reverse order of removal.
fn relink_op(
    next: &mut Vec<usize>,
    prev: &mut Vec<usize>,
    call: usize,
    ret: usize,
    relink: impl Fn(&mut Vec<usize>, &mut Vec<usize>, usize),
) {
    if ret != usize::MAX {
        relink(next, prev, ret);
    }
    relink(next, prev, call);
}

/// Violations found, and the locks whose search ran out of budget
/// (undecided: neither a pass nor a violation).
pub fn check(evidence: &Evidence, budget: Duration) -> (Vec<String>, Vec<String>) {
    let mut violations = Vec::new();
    let mut undecided = Vec::new();
    for (key, verdict) in verdicts(evidence, budget) {
        match verdict {
            Verdict::Violation(why) => violations.push(why),
            Verdict::Undecided => undecided.push(key),
            Verdict::Linearizable => {}
        }
    }
    (violations, undecided)
}

fn verdicts(evidence: &Evidence, budget: Duration) -> Vec<(String, Verdict)> {
    let mut by_key: BTreeMap<&str, Vec<Op>> = BTreeMap::new();
    // Refused operations certainly did nothing: leave them out.
    for op in evidence
        .ops
        .iter()
        .filter(|op| !matches!(op.outcome, Outcome::Fail(_)))
    {
        match &op.call {
            Call::RevokePod { .. } => {
                // A revoke concerns every lock; each search sees it.
                for key in &evidence.try_locks {
                    by_key.entry(key).or_default().push(op.clone());
                }
            }
            _ if evidence.try_locks.contains(&op.key) => {
                by_key.entry(&op.key).or_default().push(op.clone());
            }
            _ => {}
        }
    }
    by_key
        .into_iter()
        .filter(|(_, ops)| !ops.is_empty())
        .map(|(key, ops)| (key.to_string(), check_lock(key, &ops, budget)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(id: usize, process: u64, call: Call, span: (u64, Option<u64>), outcome: Outcome) -> Op {
        Op {
            id,
            process,
            key: "lock/t/a".into(),
            call,
            invoke_us: span.0,
            complete_us: span.1,
            outcome,
        }
    }
    fn acquire(uid: &str) -> Call {
        Call::Acquire {
            uid: uid.into(),
            wait_ms: 0,
        }
    }
    fn release(uid: &str, token: u64) -> Call {
        Call::Release {
            uid: uid.into(),
            token,
        }
    }
    const BUDGET: Duration = Duration::from_secs(10);

    #[test]
    fn sequential_lock_use_is_linearizable() {
        let ops = vec![
            op(
                0,
                1,
                acquire("a"),
                (0, Some(10)),
                Outcome::Ok(Value::Granted(5)),
            ),
            op(1, 2, acquire("b"), (11, Some(20)), Outcome::Ok(Value::Busy)),
            op(
                2,
                1,
                release("a", 5),
                (21, Some(30)),
                Outcome::Ok(Value::Released),
            ),
            op(
                3,
                2,
                acquire("b"),
                (31, Some(40)),
                Outcome::Ok(Value::Granted(9)),
            ),
        ];
        assert_eq!(check_lock("lock/t/a", &ops, BUDGET), Verdict::Linearizable);
    }

    #[test]
    fn two_holders_at_once_are_caught() {
        let ops = vec![
            op(
                0,
                1,
                acquire("a"),
                (0, Some(10)),
                Outcome::Ok(Value::Granted(5)),
            ),
            op(
                1,
                2,
                acquire("b"),
                (11, Some(20)),
                Outcome::Ok(Value::Granted(7)),
            ),
        ];
        assert!(matches!(
            check_lock("lock/t/a", &ops, BUDGET),
            Verdict::Violation(_)
        ));
    }

    #[test]
    fn concurrent_ops_may_be_reordered_and_unknown_ops_may_apply_late() {
        // b's acquire overlaps a's release: busy-then-free orders are fine.
        let ops = vec![
            op(
                0,
                1,
                acquire("a"),
                (0, Some(10)),
                Outcome::Ok(Value::Granted(5)),
            ),
            op(
                1,
                1,
                release("a", 5),
                (20, Some(40)),
                Outcome::Ok(Value::Released),
            ),
            op(
                2,
                2,
                acquire("b"),
                (25, Some(35)),
                Outcome::Ok(Value::Granted(8)),
            ),
            // An unknown release of c's never-granted hold changes nothing.
            op(
                3,
                3,
                release("c", 1),
                (1, None),
                Outcome::Unknown("timeout".into()),
            ),
            // An unknown acquire by d: it may have happened after b released...
            op(
                4,
                4,
                acquire("d"),
                (2, None),
                Outcome::Unknown("timeout".into()),
            ),
            op(
                5,
                2,
                release("b", 8),
                (50, Some(60)),
                Outcome::Ok(Value::Released),
            ),
            // ...which explains e finding the lock busy afterwards.
            op(6, 5, acquire("e"), (70, Some(80)), Outcome::Ok(Value::Busy)),
        ];
        assert_eq!(check_lock("lock/t/a", &ops, BUDGET), Verdict::Linearizable);
    }

    #[test]
    fn a_token_that_goes_backwards_is_caught() {
        let ops = vec![
            op(
                0,
                1,
                acquire("a"),
                (0, Some(10)),
                Outcome::Ok(Value::Granted(5)),
            ),
            op(
                1,
                1,
                release("a", 5),
                (11, Some(20)),
                Outcome::Ok(Value::Released),
            ),
            op(
                2,
                2,
                acquire("b"),
                (21, Some(30)),
                Outcome::Ok(Value::Granted(4)),
            ),
        ];
        assert!(matches!(
            check_lock("lock/t/a", &ops, BUDGET),
            Verdict::Violation(_)
        ));
    }

    #[test]
    fn a_release_answered_for_a_non_holder_is_caught() {
        let ops = vec![
            op(
                0,
                1,
                acquire("a"),
                (0, Some(10)),
                Outcome::Ok(Value::Granted(5)),
            ),
            op(
                1,
                2,
                release("b", 5),
                (11, Some(20)),
                Outcome::Ok(Value::Released),
            ),
        ];
        assert!(matches!(
            check_lock("lock/t/a", &ops, BUDGET),
            Verdict::Violation(_)
        ));
    }
}

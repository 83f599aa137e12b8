//! Two attempts at one pod never share a hold, and neither ends the
//! other's (format 9: another client's acquire of a pod takes its hold
//! over with a new token; a withdrawal ends only the withdrawing client's
//! own):
//! - one token of a lock is answered "granted" to one process only, for a
//!   pod that two processes (two clients: the retrier's two attempts)
//!   acquire;
//! - a withdrawal that answers "gave back token T" gave back a hold its
//!   own process was granted, never one granted to another process.
//!
//! Proves: in this run's histories, a bind attempt that the scheduler gave
//! up on could not end the hold a later attempt of the same pod holds.
//! Judges only definite answers.

use std::collections::{BTreeMap, BTreeSet};

use super::Evidence;
use crate::history::{Call, Value};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    // (lock, token) -> (pod, processes answered it).
    let mut granted: BTreeMap<(&str, u64), (&str, BTreeSet<u64>)> = BTreeMap::new();
    for op in &evidence.ops {
        if let (Call::Acquire { uid, .. }, Some(Value::Granted(token))) = (&op.call, op.value()) {
            granted
                .entry((op.key.as_str(), *token))
                .or_insert((uid.as_str(), BTreeSet::new()))
                .1
                .insert(op.process);
        }
    }
    for ((key, token), (uid, processes)) in &granted {
        if processes.len() > 1 {
            out.push(format!(
                "{key}: token {token} of {uid} was answered to two attempts (processes \
                 {processes:?}): one could end the hold the other binds with"
            ));
        }
    }
    for op in &evidence.ops {
        let (Call::Withdraw { uid }, Some(Value::GaveBack(token))) = (&op.call, op.value()) else {
            continue;
        };
        if let Some((_, processes)) = granted.get(&(op.key.as_str(), *token))
            && !processes.contains(&op.process)
        {
            out.push(format!(
                "{}: process {}'s withdrawal of {uid} (op {}) gave back token {token}, which \
                 processes {processes:?} were granted: it ended another attempt's hold",
                op.key, op.process, op.id
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkers::testkit::granted;
    use crate::history::{Op, Outcome};

    const K: &str = "lock/t/a";

    fn withdrew(id: usize, process: u64, uid: &str, token: u64) -> Op {
        Op {
            id,
            process,
            key: K.into(),
            call: Call::Withdraw { uid: uid.into() },
            invoke_us: 50,
            complete_us: Some(60),
            outcome: Outcome::Ok(Value::GaveBack(token)),
        }
    }

    #[test]
    fn a_shared_hold_and_a_withdrawal_of_another_attempts_hold_are_caught() {
        let mut evidence = Evidence {
            ops: vec![
                granted(0, K, "p", 5, (0, 10)),
                granted(1, K, "p", 8, (20, 30)),
            ],
            ..Evidence::default()
        };
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        // The first attempt withdraws its own hold: fine.
        evidence.ops.push(withdrew(2, 0, "p", 5));
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        // ... or the second attempt's.
        evidence.ops.push(withdrew(3, 0, "p", 8));
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("another attempt's hold"), "{found:?}");
        // Both attempts told the same token.
        let shared = Evidence {
            ops: vec![
                granted(0, K, "p", 5, (0, 10)),
                granted(1, K, "p", 5, (20, 30)),
            ],
            ..Evidence::default()
        };
        let found = check(&shared);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("two attempts"), "{found:?}");
    }
}

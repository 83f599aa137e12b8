//! A lease kept alive ends, and a wait ends unserved, only once its time
//! has run out in real time.
//!
//! Committed time (what TTLs and wait deadlines are measured on) may advance
//! up to [`SLEW_PERCENT`] faster than the leader's monotonic clock while it
//! catches up with a wall clock that stepped, and a new leader ends nothing
//! it has not led for as long as it lasts (the lock-delay). So a lease that
//! a request sent at `t` found alive (its grant, or a keep-alive answered
//! with a TTL) cannot end before `t + TTL / (1 + SLEW_PERCENT/100)` on any
//! clock in this process, and a wait of `w` sent at `t` cannot end unserved
//! before `t + w / (1 + SLEW_PERCENT/100)`. The lease keeper (`keeper.rs`)
//! holds a lock on such a lease with a waiter behind it; the lease ended
//! early when, before the keeper sent its release:
//! - its waiter was told it was granted before that moment, or
//! - a keep-alive was answered that the lease is gone before it;
//!
//! and the waiter's wait ended early when it was told so before its own.
//! Stamping entries with the wall clock as read (issue 34's defect 4: a
//! sitting leader's clock stepped 10 minutes ahead ended kept-alive leases,
//! and every wait, at its next sweep) is what this catches.

use crate::history::KeptLease;

use super::Evidence;

/// How much faster than real time committed time may run (the server's
/// `replica::clock::SLEW_PERCENT`).
pub const SLEW_PERCENT: u64 = 10;

/// What the checker found: violations.
pub fn check(evidence: &Evidence) -> Vec<String> {
    evidence.kept_leases.iter().flat_map(judge).collect()
}

/// The earliest something lasting `ms` may end, when a request sent at
/// `sent_us` found it alive.
fn earliest_end_us(sent_us: u64, ms: u64) -> u64 {
    sent_us + ms * 1000 * 100 / (100 + SLEW_PERCENT)
}

fn judge(kept: &KeptLease) -> Vec<String> {
    let mut out = Vec::new();
    let held = |at: u64| kept.release_sent_us.is_none_or(|sent| at < sent);
    // The last request sent before `at` that found the lease alive.
    let alive_before = |at: u64| {
        kept.alive_sent_us
            .iter()
            .copied()
            .filter(|sent| *sent <= at)
            .max()
    };
    let seen_ended = [
        (kept.waiter_granted_us, "its waiter was granted"),
        (
            kept.gone_answered_us,
            "a keep-alive was answered that it is gone",
        ),
    ];
    for (at, what) in seen_ended {
        let Some(at) = at.filter(|at| held(*at)) else {
            continue;
        };
        let Some(alive_us) = alive_before(at) else {
            continue;
        };
        let earliest = earliest_end_us(alive_us, kept.ttl_ms);
        if at < earliest {
            out.push(format!(
                "{}: lease {} (TTL {} ms) was alive at {:.3} s, yet {what} at {:.3} s, {} ms \
                 later, while its keeper held: it may not end before {:.3} s",
                kept.key,
                kept.lease,
                kept.ttl_ms,
                alive_us as f64 / 1e6,
                at as f64 / 1e6,
                (at - alive_us) / 1000,
                earliest as f64 / 1e6
            ));
        }
    }
    if let Some(ended) = kept.waiter_ended_us {
        let earliest = earliest_end_us(kept.waiter_sent_us, kept.waiter_wait_ms);
        if ended < earliest {
            out.push(format!(
                "{}: a wait of {} ms sent at {:.3} s ended unserved at {:.3} s: it may not end \
                 before {:.3} s",
                kept.key,
                kept.waiter_wait_ms,
                kept.waiter_sent_us as f64 / 1e6,
                ended as f64 / 1e6,
                earliest as f64 / 1e6
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round with the lease alive at `alive`, the release sent at
    /// `release`; the waiter sent at 0 with a wait of 8 s.
    fn round(alive: &[u64], release: Option<u64>) -> KeptLease {
        KeptLease {
            key: "lock/chaos/k".into(),
            lease: 7,
            ttl_ms: 1800,
            alive_sent_us: alive.to_vec(),
            gone_answered_us: None,
            release_sent_us: release,
            waiter_sent_us: 0,
            waiter_wait_ms: 8000,
            waiter_granted_us: None,
            waiter_ended_us: None,
        }
    }

    fn found(kept: KeptLease) -> Vec<String> {
        check(&Evidence {
            kept_leases: vec![kept],
            ..Evidence::default()
        })
    }

    #[test]
    fn ends_after_the_release_or_after_a_lapse_are_no_violation() {
        // Granted after the keeper's release.
        let mut kept = round(&[0, 300_000, 600_000], Some(900_000));
        kept.waiter_granted_us = Some(910_000);
        assert!(found(kept).is_empty());
        // Keep-alives stopped (a fault): the lease lapsed after its TTL.
        let mut kept = round(&[0, 300_000], None);
        kept.gone_answered_us = Some(1_990_000);
        kept.waiter_granted_us = Some(2_000_000);
        assert!(found(kept).is_empty());
        // 1.8 s at 10 % fast is 1.636 s: ending just after that is allowed.
        let mut kept = round(&[0], None);
        kept.waiter_granted_us = Some(1_640_000);
        assert!(found(kept).is_empty());
        // The wait ran its 8 s (7.27 s at 10 % fast).
        let mut kept = round(&[0], Some(500_000));
        kept.waiter_ended_us = Some(7_300_000);
        assert!(found(kept).is_empty());
    }

    #[test]
    fn a_kept_alive_lease_or_a_wait_ending_early_is_caught() {
        // The hand-made flaw, a clock step that ended the lease at once:
        // kept alive at 0.6 s, its waiter granted at 0.7 s.
        let mut kept = round(&[0, 300_000, 600_000], Some(1_200_000));
        kept.waiter_granted_us = Some(700_000);
        let problems = found(kept);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("waiter was granted"), "{problems:?}");
        // Keep-alives sent after the grant do not count.
        let mut kept = round(&[0, 800_000], None);
        kept.waiter_granted_us = Some(700_000);
        assert_eq!(found(kept).len(), 1);
        // The keeper told its lease is gone 0.3 s after it was alive, and
        // the waiter's 8 s wait ended with it.
        let mut kept = round(&[0, 300_000], Some(700_000));
        kept.gone_answered_us = Some(620_000);
        kept.waiter_ended_us = Some(610_000);
        let problems = found(kept);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("keep-alive"), "{problems:?}");
        assert!(problems[1].contains("ended unserved"), "{problems:?}");
    }
}

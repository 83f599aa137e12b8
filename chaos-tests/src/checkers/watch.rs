//! Watch streams: what each watcher received, through disconnects, leader
//! changes and faults, is exactly the log's events under its prefix from
//! its first revision to its last — in order, none missing, none twice.
//!
//! A watcher told to re-list (its position was compacted away on the
//! replica it resumed on) legitimately misses the events up to where it was
//! told to continue; the runner marks that point with a `Relist` entry and
//! each stretch between marks is checked on its own.
//!
//! Proves: resuming watches neither skip nor repeat silently. Does not judge
//! events after the last one a watcher received (it may simply have
//! stopped).

use std::collections::BTreeSet;

use tether_client::proto as pb;

use super::{Evidence, rev};

/// Kind of the marker the runner records where a watcher was told to
/// re-list.
pub const RELIST: &str = "Relist";

fn position(event: &pb::Event) -> (u64, u32) {
    event.revision.map_or((0, 0), |r| (r.index, r.sub))
}

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    if !evidence.events_complete {
        return out;
    }
    let stretches = evidence
        .watches
        .iter()
        .enumerate()
        .flat_map(|(n, (prefix, all))| {
            all.split(|e| e.kind == RELIST)
                .map(move |stretch| (n, (prefix, stretch)))
        });
    for (n, (prefix, received)) in stretches {
        let logged: BTreeSet<(u64, u32)> = evidence
            .events
            .iter()
            .filter(|(key, _)| key.starts_with(prefix.as_str()))
            .flat_map(|(_, events)| events.iter().map(position))
            .collect();
        let (Some(first), Some(last)) = (received.first(), received.last()) else {
            continue;
        };
        for pair in received.windows(2) {
            if position(&pair[1]) <= position(&pair[0]) {
                out.push(format!(
                    "watcher {n}: {} came after {}",
                    rev(&pair[1]),
                    rev(&pair[0])
                ));
            }
        }
        let got: BTreeSet<(u64, u32)> = received.iter().map(position).collect();
        let expected: BTreeSet<(u64, u32)> = logged
            .range(position(first)..=position(last))
            .copied()
            .collect();
        for missing in expected.difference(&got) {
            out.push(format!("watcher {n}: missed {}.{}", missing.0, missing.1));
        }
        for extra in got.difference(&expected) {
            out.push(format!(
                "watcher {n}: received {}.{} which is not in the log",
                extra.0, extra.1
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkers::testkit::event;

    const K: &str = "lock/t/a";

    #[test]
    fn gaps_repeats_and_disorder_are_caught_except_across_a_relist() {
        let log: Vec<pb::Event> = (1..=5)
            .map(|i| event("LockGranted", K, "a", i, i))
            .collect();
        let mut evidence = Evidence {
            events_complete: true,
            ..Evidence::default()
        };
        evidence.events.insert(K.into(), log.clone());
        let watched = |picks: &[usize]| {
            vec![(
                "lock/t/".to_string(),
                picks.iter().map(|&i| log[i].clone()).collect::<Vec<_>>(),
            )]
        };
        evidence.watches = watched(&[1, 2, 3]);
        assert!(check(&evidence).is_empty());
        evidence.watches = watched(&[0, 2, 3]);
        assert_eq!(check(&evidence).len(), 1, "a gap");
        evidence.watches = watched(&[0, 2, 1, 2]);
        assert!(!check(&evidence).is_empty(), "disorder and a repeat");
        // Told to re-list between 1 and 3: the gap is announced, not silent.
        let mut with_relist = watched(&[0, 1])[0].1.clone();
        with_relist.push(pb::Event {
            kind: RELIST.into(),
            ..Default::default()
        });
        with_relist.push(log[3].clone());
        evidence.watches = vec![("lock/t/".to_string(), with_relist)];
        assert!(check(&evidence).is_empty());
    }
}

//! The Kleppmann test. Each holder reads the lock's shadow resource and then
//! writes it, presenting its fencing token both times; the resource refuses
//! any token lower than the highest it has seen. If fencing works, an
//! accepted write always finds the value its writer read: nobody slipped in
//! between. A write that finds something else is a lost update.
//!
//! Proves: stale holders (paused, partitioned, revoked) could not corrupt
//! the resource. Does not prove the lock itself was exclusive — fencing is
//! what makes a lapse harmless.

use super::Evidence;

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    evidence
        .shadow
        .iter()
        .filter(|w| w.found != w.read)
        .map(|w| {
            format!(
                "{}: write with token {} read {} but found {}: an update was lost",
                w.key, w.token, w.read, w.found
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::ShadowWrite;

    #[test]
    fn a_write_that_found_another_value_is_a_lost_update() {
        let write = |token, read, found| ShadowWrite {
            key: "lock/t/a".into(),
            token,
            read,
            found,
        };
        let mut evidence = Evidence {
            shadow: vec![write(5, 0, 0), write(7, 1, 1)],
            ..Evidence::default()
        };
        assert!(check(&evidence).is_empty());
        evidence.shadow.push(write(9, 1, 2));
        assert_eq!(check(&evidence).len(), 1);
    }
}

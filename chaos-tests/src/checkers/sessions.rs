//! One identity cannot fill the session table (issue 34, defect 5): the
//! session flooder's identity gets at most its quota of sessions, and the
//! bridge's role is never refused one.
//!
//! From what the flooder (`sessions.rs`) recorded: new clients of the
//! flooding identity admitted in one run may not exceed its quota (the
//! quota is counted on the leader's applied state; the flooder sends one
//! request at a time, so at most one more may slip in while the leader
//! changes); no refusal of the bridge, or for another identity's sake.
//! Does not prove: the reserved places of the table (65,536 sessions do
//! not fit a run; `server/tests/security.rs` and the admission rule's unit
//! tests cover them).

use super::Evidence;

/// Admissions past the quota a leader change may let in.
const SLACK: usize = 1;

/// What the checker found: violations.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    for flood in &evidence.session_floods {
        if flood.admitted > flood.quota + SLACK {
            out.push(format!(
                "one identity opened {} sessions in one run (and {} were refused), its quota is {}",
                flood.admitted, flood.refused, flood.quota
            ));
        }
        out.extend(flood.wrong_refusals.iter().cloned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::SessionFlood;

    fn found(flood: SessionFlood) -> Vec<String> {
        check(&Evidence {
            session_floods: vec![flood],
            ..Evidence::default()
        })
    }

    #[test]
    fn a_flood_held_at_its_quota_is_no_violation() {
        let flood = SessionFlood {
            quota: 64,
            admitted: 64,
            refused: 36,
            bridge_calls: 25,
            ..SessionFlood::default()
        };
        assert!(found(flood).is_empty());
    }

    #[test]
    fn a_flood_past_its_quota_or_a_refused_bridge_is_caught() {
        // The hand-made flaw: no quota.
        let flood = SessionFlood {
            quota: 64,
            admitted: 100,
            ..SessionFlood::default()
        };
        assert_eq!(found(flood).len(), 1);
        let flood = SessionFlood {
            quota: 64,
            admitted: 10,
            wrong_refusals: vec!["the bridge was refused a session: full".into()],
            ..SessionFlood::default()
        };
        assert_eq!(found(flood), ["the bridge was refused a session: full"]);
    }
}

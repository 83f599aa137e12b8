//! The stamps a leader puts on the entries it proposes (`leader_time_ms`),
//! from which apply folds committed time (`State::now_ms`): what every
//! TTL lease, hold timeout, wait deadline, pin lifetime and session idle
//! time is measured on.
//!
//! Stamping the wall clock as read made committed time jump with it: a
//! sitting leader whose clock stepped 10 minutes ahead (a VM resumed, NTP
//! stepped) expired kept-alive leases and their holds within seconds, and
//! one stepped back froze committed time (nothing expired until the wall
//! clock caught up again). So within a leadership term committed time
//! follows this replica's monotonic clock, and only slews towards the wall
//! clock: between two stamps it advances by the monotonic time between
//! them, at most [`SLEW_PERCENT`] more or less. A client that keeps a lease
//! alive every third of its TTL stays far inside it either way. A new term
//! starts from the later of the wall clock and committed time, as before: a
//! new leader whose clock runs ahead is held back by the lock-delay (a
//! sweep's `leader_tenure_ms`), and one that runs behind by this slew.

use std::sync::Mutex;
use std::time::Instant;

use super::wall_clock_ms;
use crate::store::StateHandle;

/// How much faster or slower than the monotonic clock committed time may
/// advance while it catches up with a wall clock that stepped.
pub const SLEW_PERCENT: u64 = 10;

/// The previous stamp of this term.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    term: u64,
    stamp_us: u64,
    at: Instant,
}

/// The next stamp, in µs since the epoch: `previous` is the last stamp of
/// this term and the monotonic time since it (None at a term's first
/// stamp). Pure, for tests; [`CommitClock::stamp`] feeds it.
pub fn next_stamp_us(previous: Option<(u64, u64)>, wall_ms: u64, committed_ms: u64) -> u64 {
    let wall_us = wall_ms.saturating_mul(1000);
    let committed_us = committed_ms.saturating_mul(1000);
    let Some((stamp_us, elapsed_us)) = previous else {
        return wall_us.max(committed_us);
    };
    let base = stamp_us.max(committed_us);
    let slack = elapsed_us * SLEW_PERCENT / 100;
    let earliest = base.saturating_add(elapsed_us - slack);
    let latest = base.saturating_add(elapsed_us + slack);
    wall_us.clamp(earliest, latest)
}

/// Stamps for this replica's proposals (see the module doc).
pub struct CommitClock {
    state: StateHandle,
    anchor: Mutex<Option<Anchor>>,
}

impl CommitClock {
    /// A clock reading committed time from `state`.
    pub fn new(state: StateHandle) -> Self {
        Self {
            state,
            anchor: Mutex::new(None),
        }
    }

    /// The stamp for an entry proposed now in `term`, in ms since the epoch.
    pub fn stamp(&self, term: u64) -> u64 {
        let committed_ms = self.state.read().state.now_ms;
        let wall_ms = wall_clock_ms();
        // A planted bug for the chaos suite (`clock-stamps-wall`, failpoints
        // builds): stamps follow the wall clock as read, as before issue 34,
        // which the `leases` checker must catch under a clock step.
        if fail::eval("clock-stamps-wall", |_| ()).is_some() {
            return wall_ms.max(committed_ms);
        }
        let now = Instant::now();
        let mut anchor = self.anchor.lock().unwrap_or_else(|p| p.into_inner());
        let previous = anchor
            .filter(|a| a.term == term)
            .map(|a| (a.stamp_us, now.duration_since(a.at).as_micros() as u64));
        let stamp_us = next_stamp_us(previous, wall_ms, committed_ms);
        *anchor = Some(Anchor {
            term,
            stamp_us,
            at: now,
        });
        stamp_us / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_790_000_000_000;

    #[test]
    fn a_term_starts_at_the_later_of_the_wall_clock_and_committed_time() {
        assert_eq!(next_stamp_us(None, T, T - 5), T * 1000);
        assert_eq!(next_stamp_us(None, T, T + 5), (T + 5) * 1000);
    }

    #[test]
    fn a_true_clock_is_followed_to_the_microsecond() {
        let previous = Some((T * 1000, 250_000));
        assert_eq!(next_stamp_us(previous, T + 250, T), (T + 250) * 1000);
    }

    #[test]
    fn a_wall_clock_step_is_followed_at_the_slew_rate_in_either_direction() {
        // 10 minutes ahead, one second after the last stamp: 1.1 s on.
        let ahead = next_stamp_us(Some((T * 1000, 1_000_000)), T + 600_000, T);
        assert_eq!(ahead, T * 1000 + 1_100_000);
        // 10 minutes behind: committed time still moves on, 0.9 s.
        let behind = next_stamp_us(Some((T * 1000, 1_000_000)), T - 600_000, T);
        assert_eq!(behind, T * 1000 + 900_000);
        // Stamps taken every millisecond under load still catch up.
        let mut stamp = T * 1000;
        for _ in 0..1000 {
            stamp = next_stamp_us(Some((stamp, 1000)), T + 600_000, T);
        }
        assert_eq!(stamp, T * 1000 + 1_100_000);
    }

    #[test]
    fn committed_time_ahead_of_this_term_is_the_base() {
        // An earlier leader's clock ran ahead: this term's stamps start
        // from committed time and move on at the slew rate, never freeze.
        let next = next_stamp_us(Some((T * 1000, 1_000_000)), T + 1000, T + 60_000);
        assert_eq!(next, (T + 60_000) * 1000 + 900_000);
    }
}

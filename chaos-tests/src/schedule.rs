//! Fault schedules: what goes wrong, when, and for how long, all drawn from
//! one seed so a seed replays its schedule (the timing of the processes and
//! the network is not replayed: a replay runs the same faults at the same
//! offsets on a fresh cluster).

use std::fmt;
use std::time::Duration;

use crate::rng::Rng;

/// Who a fault picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The leader at the moment the fault starts.
    Leader,
    /// A follower (the n-th, modulo their count).
    Follower(u64),
}

/// One kind of fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Cut every link between a random minority and the rest.
    Partition {
        /// Seed for picking the minority.
        pick: u64,
    },
    /// The leader alone on one side.
    IsolateLeader,
    /// Links from one replica to another cut one way only.
    OneWay {
        /// Seed for picking the links.
        pick: u64,
    },
    /// Every link into and out of one replica delayed.
    Delay {
        /// Whose links.
        target: Target,
        /// Added per chunk.
        millis: u64,
    },
    /// Connections on every link reset at random.
    Flaky {
        /// Chance per chunk, per mille.
        per_mille: u32,
    },
    /// `kill -9`, restarted when the fault ends.
    Kill(Target),
    /// SIGSTOP, SIGCONT when the fault ends.
    Pause(Target),
    /// Leadership handed to a follower.
    TransferLeader,
    /// A follower replaced by a new member (remove, wipe, add, promote).
    Replace,
    /// A follower restarted with a failpoint armed; it crashes there, and
    /// is restarted normally when the fault ends. Needs a `failpoints` build.
    Crash {
        /// The failpoint (see the README's catalogue).
        point: &'static str,
        /// Let it fall behind first, so the leader sends a snapshot.
        lag_first: bool,
    },
    /// A follower armed to crash when it applies a membership entry, while
    /// another follower is replaced: it dies between the joint and the
    /// final configuration and must come back into the new one. Needs a
    /// `failpoints` build.
    CrashInMembershipChange,
    /// A follower restarted with its clock moved by `offset_ms` (ahead or
    /// behind) and handed the lead, so its clock stamps the entries; it is
    /// restarted with a true clock when the fault ends. Needs a `failpoints`
    /// build (`clock-offset-ms`).
    ClockSkew {
        /// How far its clock is off, ms.
        offset_ms: i64,
    },
    /// The sitting leader's wall clock steps by `offset_ms` (a VM resumed,
    /// an NTP step) while it leads, and steps back when the fault ends.
    /// Needs a `failpoints` build (`clock-offset-ms`, set through the
    /// replica's HTTP port).
    ClockStep {
        /// The step, ms (negative: back).
        offset_ms: i64,
    },
    /// A power cut on a random minority (one replica or more, the leader
    /// perhaps among them): `kill -9`, then every write they had not
    /// fsynced is lost (LazyFS's cache cleared); restarted on what their
    /// disks kept when the fault ends. Needs a cluster on LazyFS.
    PowerLoss {
        /// Seed for picking the minority.
        pick: u64,
    },
    /// A power cut on every replica at once; all restarted on what their
    /// disks kept when the fault ends. Needs a cluster on LazyFS.
    PowerLossAll,
}

impl Fault {
    /// The name summaries count faults under.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Partition { .. } => "partition",
            Fault::IsolateLeader => "isolate-leader",
            Fault::OneWay { .. } => "one-way",
            Fault::Delay { .. } => "delay",
            Fault::Flaky { .. } => "flaky",
            Fault::Kill(_) => "kill",
            Fault::Pause(_) => "pause",
            Fault::TransferLeader => "transfer-leader",
            Fault::Replace => "replace-member",
            Fault::Crash { .. } => "failpoint-crash",
            Fault::CrashInMembershipChange => "membership-crash",
            Fault::ClockSkew { .. } => "clock-skew",
            Fault::ClockStep { .. } => "clock-step",
            Fault::PowerLoss { .. } => "power-loss",
            Fault::PowerLossAll => "power-loss-all",
        }
    }
}

/// Crash points a `failpoints` build has, with whether the replica should
/// lag first (snapshot install only happens to a replica that fell behind).
/// `log-append-error` is no crash: the disk refuses a log write, Raft's core
/// stops and the replica must exit on its own (counted as `core_restarts`).
pub const CRASH_POINTS: [(&str, bool); 7] = [
    ("sm-apply-before-write", false),
    ("sm-apply-after-write", false),
    ("log-append-before-write", false),
    ("log-append-before-ack", false),
    ("sm-install-snapshot-before", true),
    ("sm-install-snapshot-after", true),
    (CORE_STOP_POINT, false),
];

/// The failpoint that stops a replica's Raft core (a refused log write).
pub const CORE_STOP_POINT: &str = "log-append-error";

/// A fault at an offset.
#[derive(Debug, Clone)]
pub struct Step {
    /// From the start of the workload.
    pub at: Duration,
    /// How long before it heals.
    pub lasts: Duration,
    /// What.
    pub fault: Fault,
}

/// One schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Its seed.
    pub seed: u64,
    /// How long clients run.
    pub workload: Duration,
    /// Faults, in time order, never overlapping.
    pub steps: Vec<Step>,
}

/// What kinds of faults a run may draw.
#[derive(Debug, Clone, Copy)]
pub struct FaultOptions {
    /// Failpoint crashes (the `tetherd` is a `failpoints` build).
    pub failpoints: bool,
    /// Member replacement (needs free slots; slow).
    pub membership: bool,
    /// Only this kind (one of [`KINDS`]), for chasing one kind of fault.
    pub only: Option<&'static str>,
    /// Power-loss schedules (the replicas' data on LazyFS): each schedule's
    /// first fault is a power cut, of a minority or of every replica (half
    /// the schedules each); its second, if any, is drawn from the rest,
    /// power cuts included.
    pub power_loss: bool,
}

/// Every fault kind's name.
pub const KINDS: [&str; 15] = [
    "partition",
    "isolate-leader",
    "one-way",
    "delay",
    "flaky",
    "kill",
    "pause",
    "transfer-leader",
    "replace-member",
    "failpoint-crash",
    "membership-crash",
    "clock-skew",
    "clock-step",
    "power-loss",
    "power-loss-all",
];

impl Schedule {
    /// The schedule of `seed`.
    pub fn generate(seed: u64, options: FaultOptions, workload: Duration) -> Schedule {
        let mut rng = Rng::new(seed);
        // One or two faults, each long enough to outlast an election
        // (openraft elects after the election timeout plus the old
        // leader's lease: about 1 s with the chaos clusters' 300 ms).
        let count = rng.between(1, 2);
        let total = workload.as_millis() as u64;
        let slot = total / count;
        let mut steps = Vec::new();
        for n in 0..count {
            let fault = if n == 0 && options.power_loss && options.only.is_none() {
                if rng.percent(50) {
                    Fault::PowerLoss {
                        pick: rng.next_u64(),
                    }
                } else {
                    Fault::PowerLossAll
                }
            } else {
                draw(&mut rng, options)
            };
            let at = n * slot + rng.between(0, slot / 4);
            let lasts = rng.between(slot / 2, slot * 3 / 4).max(100);
            steps.push(Step {
                at: Duration::from_millis(at),
                lasts: Duration::from_millis(lasts),
                fault,
            });
        }
        Schedule {
            seed,
            workload,
            steps,
        }
    }
}

fn target(rng: &mut Rng) -> Target {
    if rng.percent(50) {
        Target::Leader
    } else {
        Target::Follower(rng.below(8))
    }
}

fn draw(rng: &mut Rng, options: FaultOptions) -> Fault {
    loop {
        // Power cuts only where drawn for: other runs draw as before, so a
        // seed keeps its schedule.
        let kinds = if options.power_loss { 17 } else { 15 };
        let fault = match rng.below(kinds) {
            0 | 1 => Fault::Partition {
                pick: rng.next_u64(),
            },
            2 => Fault::IsolateLeader,
            3 => Fault::OneWay {
                pick: rng.next_u64(),
            },
            4 => Fault::Delay {
                target: target(rng),
                millis: rng.between(5, 60),
            },
            5 => Fault::Flaky {
                per_mille: rng.between(5, 50) as u32,
            },
            6 | 7 => Fault::Kill(target(rng)),
            8 => Fault::Pause(target(rng)),
            9 => Fault::TransferLeader,
            10 if options.membership => Fault::Replace,
            11 if options.failpoints => {
                let (point, lag_first) = *rng.pick(&CRASH_POINTS);
                Fault::Crash { point, lag_first }
            }
            12 if options.failpoints && options.membership => Fault::CrashInMembershipChange,
            // The case: a leader whose clock is 10 s off.
            13 if options.failpoints => Fault::ClockSkew {
                offset_ms: if rng.percent(50) { 10_000 } else { -10_000 },
            },
            // Issue 34's case: 10 minutes either way, on the sitting leader.
            14 if options.failpoints => Fault::ClockStep {
                offset_ms: if rng.percent(50) { 600_000 } else { -600_000 },
            },
            15 if options.power_loss => Fault::PowerLoss {
                pick: rng.next_u64(),
            },
            16 if options.power_loss => Fault::PowerLossAll,
            _ => continue,
        };
        if options.only.is_some_and(|only| only != fault.kind()) {
            continue;
        }
        return fault;
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {}:", self.seed)?;
        for step in &self.steps {
            write!(
                f,
                " {}@{}ms+{}ms",
                step.fault.kind(),
                step.at.as_millis(),
                step.lasts.as_millis()
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_schedule_and_steps_do_not_overlap() {
        let options = FaultOptions {
            failpoints: true,
            membership: true,
            only: None,
            power_loss: false,
        };
        for seed in 0..200 {
            let a = Schedule::generate(seed, options, Duration::from_millis(2500));
            let b = Schedule::generate(seed, options, Duration::from_millis(2500));
            assert_eq!(a.to_string(), b.to_string());
            for pair in a.steps.windows(2) {
                assert!(pair[0].at + pair[0].lasts <= pair[1].at, "{a}");
            }
        }
    }

    #[test]
    fn power_cuts_open_every_power_loss_schedule_and_no_other() {
        let mut options = FaultOptions {
            failpoints: true,
            membership: true,
            only: None,
            power_loss: false,
        };
        let cut = |f: &Fault| matches!(f, Fault::PowerLoss { .. } | Fault::PowerLossAll);
        for seed in 0..200 {
            let plain = Schedule::generate(seed, options, Duration::from_millis(2500));
            assert!(!plain.steps.iter().any(|s| cut(&s.fault)), "{plain}");
        }
        options.power_loss = true;
        let mut whole = 0;
        for seed in 0..200 {
            let schedule = Schedule::generate(seed, options, Duration::from_millis(2500));
            assert!(cut(&schedule.steps[0].fault), "{schedule}");
            whole += usize::from(matches!(schedule.steps[0].fault, Fault::PowerLossAll));
        }
        assert!(
            (60..140).contains(&whole),
            "{whole} of 200 cut every replica"
        );
    }
}

//! The systems a run compares on the same nodes and the same workloads:
//! Tether as shipped, HAMi's annotation lock with HAMi's client rate limits
//! and once more without them, and no lock at all (the floor).

use crate::annotation::RateLimit;

/// One system under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum System {
    /// The extender and the device plugin as shipped, on 3 Tether replicas.
    Tether,
    /// No lock, no device planning: the scheduler and the API server's cost.
    NoLock,
    /// HAMi's node annotation lock with HAMi's client rate limits (QPS 5,
    /// burst 10, per process).
    AnnotationLock,
    /// The same lock with no client-side rate limit.
    AnnotationLockUnlimited,
}

impl System {
    /// The system's name in reports and charts.
    pub fn name(self) -> &'static str {
        match self {
            System::Tether => "tether",
            System::NoLock => "no lock",
            System::AnnotationLock => "annotation lock (QPS 5, burst 10)",
            System::AnnotationLockUnlimited => "annotation lock (no rate limit)",
        }
    }

    /// The client rate limit of an annotation-lock system's processes.
    pub fn rate_limit(self) -> Option<RateLimit> {
        match self {
            System::AnnotationLock => Some(RateLimit::HAMI),
            _ => None,
        }
    }
}

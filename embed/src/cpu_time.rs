//! The CPU a future spends on a core, apart from its wall time: the sum, over
//! its polls, of the polling thread's CPU clock across each poll. A task
//! may move between a runtime's threads between polls, but each poll runs on
//! one, so the sum counts this future's work and nothing another task did.
//! What the filter's `tether_extender_filter_cpu_seconds` counts: on a busy
//! machine a call's wall time includes waiting for a core.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// The calling thread's CPU time so far (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_time() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        now.tv_sec.max(0) as u64,
        now.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// `inner`, answering with its output and the CPU its polls took.
pub struct CpuTimed<F> {
    inner: Pin<Box<F>>,
    cpu: Duration,
}

impl<F: Future> CpuTimed<F> {
    /// Times `inner`'s polls.
    pub fn new(inner: F) -> Self {
        Self {
            inner: Box::pin(inner),
            cpu: Duration::ZERO,
        }
    }
}

impl<F: Future> Future for CpuTimed<F> {
    type Output = (F::Output, Duration);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let before = thread_cpu_time();
        let polled = self.inner.as_mut().poll(cx);
        let spent = thread_cpu_time().saturating_sub(before);
        self.cpu += spent;
        polled.map(|output| (output, self.cpu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work on a core counts; time asleep (a poll that returned pending,
    /// then the timer's wake) does not.
    #[tokio::test]
    async fn counts_the_work_and_not_the_waiting() {
        let (spun, cpu) = CpuTimed::new(async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let started = thread_cpu_time();
            let mut x = 0u64;
            while thread_cpu_time().saturating_sub(started) < Duration::from_millis(20) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            x
        })
        .await;
        assert!(spun > 0);
        assert!(cpu >= Duration::from_millis(20), "{cpu:?}");
        assert!(
            cpu < Duration::from_millis(200),
            "the sleep counted: {cpu:?}"
        );
    }
}

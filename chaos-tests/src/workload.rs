//! Lock workloads: clients looping acquire + release, on their own locks
//! (uncontended) or all on one lock (contended, where the interesting figure
//! is the hand-over: release sent → next waiter's grant observed).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether_client::Client;
use tether_client::proto::{LockKey, Outcome, Pod};

use crate::stats::Samples;

/// What a run measured.
#[derive(Debug, Default, Clone)]
pub struct Run {
    /// Completed acquire + release pairs.
    pub pairs: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Latency of each pair (acquire sent → release answered).
    pub pair_latency: Samples,
    /// Hand-over latencies (contended runs only).
    pub handover: Samples,
    /// Calls that failed (counted, not retried).
    pub errors: u64,
    /// The first error seen, for the report.
    pub first_error: Option<String>,
}

impl Run {
    /// The sum of the workers' runs, timed from `started`.
    pub async fn gather(tasks: Vec<tokio::task::JoinHandle<Run>>, started: Instant) -> Run {
        let mut total = Run::default();
        for task in tasks {
            let run = task.await.expect("a workload task");
            total.pairs += run.pairs;
            total.errors += run.errors;
            total.first_error = total.first_error.or(run.first_error);
            total.pair_latency.extend(run.pair_latency);
            total.handover.extend(run.handover);
        }
        total.elapsed = started.elapsed();
        total
    }

    /// Records one operation sent at `sent`: a completed pair with its
    /// latency, or a failure (the first one's message kept).
    pub fn record<T, E: std::fmt::Display>(&mut self, sent: Instant, result: Result<T, E>) {
        match result {
            Ok(_) => {
                self.pairs += 1;
                self.pair_latency.push(sent.elapsed());
            }
            Err(err) => {
                self.errors += 1;
                self.first_error.get_or_insert(err.to_string());
            }
        }
    }

    /// Pairs per second.
    pub fn rate(&self) -> f64 {
        self.pairs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

fn pod(uid: String) -> Pod {
    Pod {
        uid,
        namespace: "bench".into(),
        name: "bench".into(),
    }
}

/// `clients` workers, each on its own lock, for `duration`.
pub async fn uncontended(client: &Client, clients: usize, duration: Duration, tag: &str) -> Run {
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for i in 0..clients {
        let client = client.clone();
        let key = LockKey {
            scope: "bench".into(),
            name: format!("{tag}-u{i}"),
        };
        let owner = pod(format!("{tag}-u{i}"));
        tasks.push(tokio::spawn(async move {
            let mut run = Run::default();
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let done = async {
                    let held = client
                        .acquire(&key, &owner, Vec::new(), Duration::ZERO, 0)
                        .await?;
                    held.release(Outcome::Allocated).await
                };
                run.record(t0, done.await);
            }
            run
        }));
    }
    Run::gather(tasks, started).await
}

/// `clients` workers reading one lock's holder (`Holder`, a linearizable
/// read: the leader confirms its leadership with a heartbeat round to the
/// voters, ReadIndex, and answers from its applied state; nothing is
/// written to the log) in a loop for `duration`. A completed read counts
/// as a pair.
pub async fn reads(client: &Client, clients: usize, duration: Duration, tag: &str) -> Run {
    let started = Instant::now();
    let deadline = started + duration;
    let key = LockKey {
        scope: "bench".into(),
        name: format!("{tag}-r"),
    };
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (client, key) = (client.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut run = Run::default();
            while Instant::now() < deadline {
                let t0 = Instant::now();
                run.record(t0, client.holder(&key).await);
            }
            run
        }));
    }
    Run::gather(tasks, started).await
}

/// `clients` workers all on one lock, for `duration`: each waits its turn,
/// releases at once, and queues again.
pub async fn contended(client: &Client, clients: usize, duration: Duration, tag: &str) -> Run {
    let started = Instant::now();
    let deadline = started + duration;
    let key = LockKey {
        scope: "bench".into(),
        name: format!("{tag}-c"),
    };
    // When the last release was sent; the next grant completes a hand-over.
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (client, key, released_at) = (client.clone(), key.clone(), released_at.clone());
        let owner = pod(format!("{tag}-c{i}"));
        tasks.push(tokio::spawn(async move {
            let mut run = Run::default();
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let held = match client
                    .acquire(&key, &owner, Vec::new(), Duration::from_secs(60), 0)
                    .await
                {
                    Ok(held) => held,
                    Err(_) => {
                        run.errors += 1;
                        continue;
                    }
                };
                if let Some(at) = released_at.lock().unwrap().take() {
                    run.handover.push(at.elapsed());
                }
                *released_at.lock().unwrap() = Some(Instant::now());
                match held.release(Outcome::Allocated).await {
                    Ok(_) => {
                        run.pairs += 1;
                        run.pair_latency.push(t0.elapsed());
                    }
                    Err(_) => run.errors += 1,
                }
            }
            run
        }));
    }
    Run::gather(tasks, started).await
}

/// One bind of the mixed scenario: when it arrives (from the start of the
/// run) and which node's lock it takes.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    /// Offset from the start of the run.
    pub at: Duration,
    /// Node index in `0..nodes`.
    pub node: usize,
}

/// Binds arriving as a Poisson process of `rate` per second for `duration`
/// over `nodes` nodes, from `seed`: the same list drives every system.
pub fn poisson_arrivals(rate: f64, nodes: usize, duration: Duration, seed: u64) -> Vec<Arrival> {
    let mut rng = crate::rng::Rng::new(seed);
    let mut at = 0.0f64;
    let mut out = Vec::new();
    loop {
        // Exponential gaps: -ln(U) / rate, U uniform in (0, 1].
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        at += -(1.0 - u).ln() / rate.max(1e-9);
        if at >= duration.as_secs_f64() {
            return out;
        }
        out.push(Arrival {
            at: Duration::from_secs_f64(at),
            node: rng.below(nodes as u64) as usize,
        });
    }
}

/// How long a bind holds its node's lock (HAMi's measured hold).
pub const MIXED_HOLD: Duration = Duration::from_millis(20);

/// Arrival-to-grant latencies the mixed scenario would show on a lock
/// service whose every commit takes exactly `commit` and nothing else
/// takes time: a bind is granted one commit after it arrives, or, when its
/// node's lock is held, by the commit of the holder's release, which starts
/// [`MIXED_HOLD`] after the holder's grant. With `commit` zero it is the
/// queueing the arrivals themselves cause (binds to a node already
/// binding wait), under any system.
pub fn mixed_floor(arrivals: &[Arrival], commit: Duration) -> crate::stats::Samples {
    let mut free_at: std::collections::HashMap<usize, Duration> = Default::default();
    let mut latencies = crate::stats::Samples::default();
    for arrival in arrivals {
        let released = free_at.get(&arrival.node).copied().unwrap_or_default();
        let granted = (arrival.at + commit).max(released);
        latencies.push(granted - arrival.at);
        free_at.insert(arrival.node, granted + MIXED_HOLD + commit);
    }
    latencies
}

/// The mixed scenario: each arrival takes its node's lock (queueing behind
/// a bind in progress there), holds it [`MIXED_HOLD`], releases it. The
/// figure is the scheduler-perceived bind latency: arrival → lock granted.
/// Open loop: arrivals do not wait for earlier binds.
pub async fn mixed(client: &Client, arrivals: &[Arrival], tag: &str) -> Run {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (n, arrival) in arrivals.iter().copied().enumerate() {
        let client = client.clone();
        let key = LockKey {
            scope: "bench".into(),
            name: format!("{tag}-node-{}", arrival.node),
        };
        let owner = pod(format!("{tag}-b{n}"));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((started + arrival.at).into()).await;
            let arrived = Instant::now();
            let mut run = Run::default();
            match client
                .acquire(&key, &owner, Vec::new(), Duration::from_secs(60), 0)
                .await
            {
                Ok(held) => {
                    run.pair_latency.push(arrived.elapsed());
                    tokio::time::sleep(MIXED_HOLD).await;
                    match held.release(Outcome::Allocated).await {
                        Ok(_) => run.pairs += 1,
                        Err(e) => {
                            run.errors += 1;
                            run.first_error = Some(e.to_string());
                        }
                    }
                }
                Err(e) => {
                    run.errors += 1;
                    run.first_error = Some(e.to_string());
                }
            }
            run
        }));
    }
    Run::gather(tasks, started).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal within the histogram's precision (3 significant digits).
    fn assert_about(got: Duration, want: Duration) {
        let slack = want / 200 + Duration::from_micros(1);
        assert!(got.abs_diff(want) <= slack, "{got:?}, not {want:?}");
    }

    fn at(ms: u64, node: usize) -> Arrival {
        Arrival {
            at: Duration::from_millis(ms),
            node,
        }
    }

    #[test]
    fn a_bind_to_a_free_node_waits_one_commit() {
        let floor = mixed_floor(&[at(0, 1), at(3, 2), at(50, 1)], Duration::from_millis(1));
        assert_eq!(floor.len(), 3);
        assert_about(floor.quantile(0.0), Duration::from_millis(1));
        assert_about(floor.quantile(1.0), Duration::from_millis(1));
    }

    #[test]
    fn a_bind_to_a_busy_node_waits_for_the_release_to_commit() {
        // Granted at 1 ms, released from 21 ms, the release committed at
        // 22 ms: the second bind, arrived at 5 ms, waited 17 ms.
        let floor = mixed_floor(&[at(0, 7), at(5, 7)], Duration::from_millis(1));
        assert_about(floor.quantile(1.0), Duration::from_millis(17));
        // With no commit time it is the hold's remainder alone.
        let floor = mixed_floor(&[at(0, 7), at(5, 7)], Duration::ZERO);
        assert_about(floor.quantile(1.0), Duration::from_millis(15));
    }

    #[test]
    fn the_floor_rises_with_the_arrival_rate() {
        let seconds = Duration::from_secs(5);
        let p99 = |rate| {
            mixed_floor(&poisson_arrivals(rate, 1000, seconds, 1), Duration::ZERO).quantile(0.99)
        };
        // At 100 binds/s a bind rarely meets another on its node; at 1,000
        // about 2 % do (1 bind/s per node x 20 ms), and the p99 waits.
        assert_about(p99(100.0), Duration::ZERO);
        assert!(p99(1000.0) > Duration::from_millis(5), "{:?}", p99(1000.0));
    }
}

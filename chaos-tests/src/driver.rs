//! Runs many schedules: `lanes` clusters side by side, each taking the next
//! seed, with a fresh cluster every `per_cluster` schedules (and after any
//! schedule that could not finish). Sums the reports into one [`Summary`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cluster::{ClusterSpec, ProcessCluster};
use crate::runner::{self, Report, RunConfig};
use crate::schedule::{FaultOptions, Schedule};

/// How to run.
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// The `tetherd` binary.
    pub tetherd: PathBuf,
    /// Voters per cluster (3 or 5).
    pub replicas: usize,
    /// Stop after this many schedules...
    pub schedules: u64,
    /// ...or when this much time has passed (soak), whichever comes first.
    pub duration: Option<Duration>,
    /// Schedule n uses seed `seed + n`.
    pub seed: u64,
    /// Clusters run side by side.
    pub lanes: usize,
    /// Schedules per cluster before a fresh one.
    pub per_cluster: u64,
    /// How long clients run per schedule.
    pub workload: Duration,
    /// Which faults may be drawn.
    pub faults: FaultOptions,
    /// FAILPOINTS for every replica (a deliberately broken build).
    pub failpoints_env: Option<String>,
    /// Workload shape.
    pub run: RunConfig,
    /// Print every schedule, not only failing ones.
    pub verbose: bool,
    /// RUST_LOG of the replicas (None: warnings only).
    pub replica_log: Option<String>,
    /// Keep each failing schedule's evidence and replica logs in a
    /// directory of its own (the planted-bug tests, which expect
    /// violations, do not).
    pub keep_evidence: bool,
}

/// Totals of a driver run.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Schedules completed (with or without violations).
    pub schedules: u64,
    /// Operations recorded.
    pub ops: u64,
    /// Of which unknown.
    pub unknown: u64,
    /// Faults injected by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Failpoint crashes that fired.
    pub crashes_fired: u64,
    /// Replicas restarted after their Raft core stopped.
    pub core_restarts: u64,
    /// Elections (Raft terms passed).
    pub elections: u64,
    /// Schedules whose whole event log no replica kept (log checkers
    /// skipped).
    pub partial_logs: u64,
    /// Watch re-lists.
    pub relists: u64,
    /// Violations by checker (every checker listed, zeros included).
    pub violations: BTreeMap<&'static str, u64>,
    /// Linearizability searches that ran out of budget.
    pub undecided: u64,
    /// Seeds with violations or that could not finish, with the first
    /// problem of each.
    pub failing: Vec<(u64, String)>,
    /// Wall time.
    pub elapsed: Duration,
    /// Times for a lock due to move on to reach its next waiter.
    pub recoveries: crate::stats::Samples,
    /// Recoveries the progress bound was judged on.
    pub recoveries_judged: u64,
    /// The judged recoveries that came, timed from when they were due or
    /// from the heal of the fault near them (`progress::judged_times`).
    pub judged_times: crate::stats::Samples,
}

impl Summary {
    /// Whether every checker found nothing and every schedule finished.
    pub fn clean(&self) -> bool {
        self.failing.is_empty()
    }

    fn add(&mut self, seed: u64, report: &Report) {
        self.schedules += 1;
        self.ops += report.ops as u64;
        self.unknown += report.unknown as u64;
        self.crashes_fired += report.crashes_fired;
        self.core_restarts += report.core_restarts;
        self.elections += report.elections;
        self.partial_logs += u64::from(!report.events_complete);
        self.relists += report.relists;
        self.undecided += report.undecided.len() as u64;
        for time in &report.recoveries {
            self.recoveries.push(*time);
        }
        self.recoveries_judged += report.recoveries_judged;
        for time in &report.judged_times {
            self.judged_times.push(*time);
        }
        for (kind, n) in &report.faults {
            *self.faults.entry(kind).or_default() += n;
        }
        for (checker, found) in &report.violations {
            *self.violations.entry(checker).or_default() += found.len() as u64;
        }
        if let Some((checker, first)) = report
            .violations
            .iter()
            .find_map(|(c, v)| v.first().map(|f| (c, f)))
        {
            self.failing.push((seed, format!("{checker}: {first}")));
        }
    }

    /// The one-line summary.
    pub fn line(&self, options: &DriverOptions) -> String {
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        let violations: Vec<String> = self
            .violations
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        format!(
            "chaos summary: schedules={} operations={} unknown={} faults[{}] failpoint_crashes={} \
             core_restarts={} elections={} watch_relists={} partial_logs={} violations[{}] undecided_searches={} failed_seeds={} \
             recovery_ms[n={} judged={} p50={} p99={} max={} after_heal_max={} bound={}] | {} replicas, {} lanes, first seed {}, {:.0} s",
            self.schedules,
            self.ops,
            self.unknown,
            faults.join(" "),
            self.crashes_fired,
            self.core_restarts,
            self.elections,
            self.relists,
            self.partial_logs,
            violations.join(" "),
            self.undecided,
            self.failing.len(),
            self.recoveries.len(),
            self.recoveries_judged,
            crate::stats::ms(self.recoveries.quantile(0.5)),
            crate::stats::ms(self.recoveries.quantile(0.99)),
            crate::stats::ms(self.recoveries.quantile(1.0)),
            crate::stats::ms(self.judged_times.quantile(1.0)),
            crate::stats::ms(crate::checkers::progress::BOUND),
            options.replicas,
            options.lanes,
            options.seed,
            self.elapsed.as_secs_f64()
        )
    }
}

async fn fresh_cluster(options: &DriverOptions) -> anyhow::Result<ProcessCluster> {
    chaos_cluster_on(
        options.tetherd.clone(),
        options.replicas,
        options.failpoints_env.clone(),
        options.replica_log.clone(),
        options.faults.power_loss,
    )
    .await
}

/// A cluster as the chaos runs use it: proxied links, short election
/// timeouts, frequent snapshots, four spare ids for replacements, the pin
/// nodes registered, development tokens (workers call as `admin`; the
/// session flooder as a device plugin, under a small session quota).
pub async fn chaos_cluster(
    tetherd: PathBuf,
    replicas: usize,
    failpoints: Option<String>,
) -> anyhow::Result<ProcessCluster> {
    chaos_cluster_on(tetherd, replicas, failpoints, None, false).await
}

/// [`chaos_cluster`] whose replicas log with RUST_LOG `replica_log` (None:
/// warnings only), each replica's data on a LazyFS mount of its own when
/// `lazyfs` (the power-loss runs).
pub async fn chaos_cluster_on(
    tetherd: PathBuf,
    replicas: usize,
    failpoints: Option<String>,
    replica_log: Option<String>,
    lazyfs: bool,
) -> anyhow::Result<ProcessCluster> {
    let cluster = ProcessCluster::start_spec(ClusterSpec {
        tetherd,
        voters: replicas,
        // Spare ids for member replacements.
        slots: replicas + 4,
        proxied: true,
        extra_args: vec![
            "--heartbeat-interval=50ms".into(),
            "--election-timeout=300ms".into(),
            // Frequent snapshots and short logs: lagging replicas get
            // snapshots, which the snapshot failpoints need.
            "--snapshot-every=200".into(),
            "--keep-logs-after-snapshot=50".into(),
            // The abandoner's rounds wait out the grace within a workload.
            format!(
                "--abandoned-wait-grace={}ms",
                crate::abandon::ABANDONED_WAIT_GRACE.as_millis()
            ),
            // The session flooder's identity meets its quota within a run.
            format!(
                "--max-sessions-per-identity={}",
                crate::sessions::SESSION_QUOTA
            ),
            // The ender's hold-timeout scope.
            format!(
                "--scope-hold-timeouts={}={}ms",
                crate::workers::HOLD_TIMEOUT_SCOPE,
                crate::workers::HOLD_TIMEOUT.as_millis()
            ),
        ],
        failpoints,
        log_filter: replica_log,
        tokens: true,
        lazyfs,
    })
    .await?;
    // The nodes the pin assigner places pins on, once per cluster.
    crate::workers::register_pin_nodes(&cluster.client()).await?;
    Ok(cluster)
}

/// Writes a failing schedule's evidence and copies its cluster's replica
/// logs (every run of every slot so far) to a directory that outlives the
/// run; returns it. On LazyFS (power-loss runs) each replica's data
/// directory is copied too (`data-<id>`, as the replica sees it, read while
/// it runs), so its Raft log and state can be read afterwards.
fn keep_evidence(cluster: &ProcessCluster, seed: u64, dump: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("tether-chaos-s{seed}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("evidence.txt"), dump)?;
    for id in cluster.slots() {
        let log = cluster.log_path(id);
        if log.exists() {
            std::fs::copy(&log, dir.join(format!("tetherd-{id}.log")))?;
        }
        if cluster.on_lazyfs() && cluster.data_path(id).exists() {
            // `cp -r`: std has no recursive copy; a failed copy loses
            // only this extra evidence.
            let copied = std::process::Command::new("cp")
                .arg("-r")
                .arg(cluster.data_path(id))
                .arg(dir.join(format!("data-{id}")))
                .status();
            if !copied.is_ok_and(|s| s.success()) {
                eprintln!("could not copy replica {id}'s data into {}", dir.display());
            }
        }
    }
    Ok(dir)
}

/// Runs schedules until the count or the time is reached.
pub async fn run_many(options: DriverOptions) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let summary = Arc::new(Mutex::new(Summary::default()));
    let mut lanes = Vec::new();
    for _ in 0..options.lanes.max(1) {
        let (options, next, summary) = (options.clone(), next.clone(), summary.clone());
        lanes.push(tokio::spawn(async move {
            let mut cluster: Option<ProcessCluster> = None;
            let mut used = 0;
            loop {
                if options.duration.is_some_and(|d| started.elapsed() >= d) {
                    return Ok::<(), anyhow::Error>(());
                }
                let n = next.fetch_add(1, Ordering::SeqCst);
                if n >= options.schedules {
                    return Ok(());
                }
                let seed = options.seed + n;
                if cluster.is_none() || used >= options.per_cluster {
                    // Stop the old replicas before starting new ones, off
                    // the runtime's threads (killing, reaping and deleting
                    // their data blocks).
                    if let Some(old) = cluster.take() {
                        let _ = tokio::task::spawn_blocking(move || drop(old)).await;
                    }
                    cluster = Some(fresh_cluster(&options).await?);
                    used = 0;
                }
                used += 1;
                let schedule = Schedule::generate(seed, options.faults, options.workload);
                let current = cluster.as_mut().expect("started above");
                let result =
                    runner::run(current, &schedule, &format!("s{seed}"), &options.run).await;
                // Written before the summary is locked: the other lanes
                // wait for that lock.
                let kept = match &result {
                    Ok(report) if options.keep_evidence => report
                        .evidence_dump
                        .as_ref()
                        .map(|dump| keep_evidence(current, seed, dump)),
                    _ => None,
                };
                let mut summary = summary.lock().unwrap_or_else(|p| p.into_inner());
                match result {
                    Ok(report) => {
                        if options.verbose || report.violation_count() > 0 {
                            println!(
                                "{} | ops {} unknown {} elections {} | violations {}",
                                report.schedule,
                                report.ops,
                                report.unknown,
                                report.elections,
                                report.violation_count()
                            );
                            if options.verbose {
                                println!("  outcomes {:?}", report.outcomes);
                                println!("  phases {:?}", report.phases);
                                println!("  slowest to stop {:?}", report.slowest_to_stop);
                            }
                            for (checker, found) in &report.violations {
                                for v in found.iter().take(5) {
                                    println!("  seed {seed} {checker}: {v}");
                                }
                            }
                            if let Some(digest) = &report.progress_digest {
                                println!("  seed {seed} progress evidence:\n{digest}");
                                for id in current.running() {
                                    println!(
                                        "  tetherd {id} log tail:\n{}",
                                        current.log_tail(id, 12)
                                    );
                                }
                            }
                            match &kept {
                                Some(Ok(dir)) => println!(
                                    "  seed {seed}: evidence and replica logs in {}",
                                    dir.display()
                                ),
                                Some(Err(err)) => {
                                    println!("  seed {seed}: evidence not kept: {err:#}")
                                }
                                None => {}
                            }
                        }
                        summary.add(seed, &report);
                    }
                    Err(err) => {
                        println!("{schedule} | could not finish: {err:#}");
                        if let Some(mut failed) = cluster.take() {
                            // Taken before the logs are printed and the
                            // replicas are killed: a replica that stopped
                            // answering is still stuck where it stopped.
                            let threads: Vec<(u64, String)> = failed
                                .running()
                                .into_iter()
                                .map(|id| (id, failed.thread_report(id)))
                                .collect();
                            for id in failed.running() {
                                println!("  tetherd {id} log tail:\n{}", failed.log_tail(id, 15));
                            }
                            for (id, report) in &threads {
                                println!(
                                    "  tetherd {id} {}",
                                    ProcessCluster::thread_digest(report)
                                );
                            }
                            let kept = failed.keep();
                            for (id, report) in threads {
                                let path = kept.join(format!("tetherd-{id}.threads"));
                                if let Err(err) = std::fs::write(&path, report) {
                                    println!("  tetherd {id}'s threads not kept: {err}");
                                }
                            }
                            println!(
                                "  data, logs and each replica's threads (tetherd-N.threads) kept in {}",
                                kept.display()
                            );
                        }
                        summary.schedules += 1;
                        *summary.violations.entry("process").or_default() += 1;
                        summary
                            .failing
                            .push((seed, format!("could not finish: {err:#}")));
                        // Start over on a fresh cluster.
                        cluster = None;
                    }
                }
                if summary.schedules % 25 == 0 {
                    println!(
                        "... {} schedules, {} operations, {} failing, {:.0} s",
                        summary.schedules,
                        summary.ops,
                        summary.failing.len(),
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }));
    }
    for lane in lanes {
        lane.await??;
    }
    let mut summary = summary.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for checker in crate::checkers::CHECKERS.into_iter().chain(["process"]) {
        summary.violations.entry(checker).or_default();
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}

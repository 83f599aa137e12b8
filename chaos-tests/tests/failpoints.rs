//! Failpoint crashes and a deliberately broken build, on `tetherd-failpoints`
//! (tether-server with its `failpoints` feature; `./dev test` builds it and
//! runs this file with `--features failpoints`).
//!
//! - every crash point fires at least once and the run that crashed there
//!   shows no violation (nothing acknowledged lost, no double holder, ...);
//! - with `sm-acquire-ignore-holder` switched on, the state machine grants a
//!   held lock: the checkers must say so, naming the seed;
//! - with `sm-sweep-grant-per-end` switched on, a sweep that ends two TTL
//!   leases grants as each ends (the double grant log format 5 fixed): the
//!   lease workload must reach it and the tokens checker must report it.

use std::path::PathBuf;
use std::time::Duration;

use tether_chaos::cluster::sibling_binary;
use tether_chaos::driver::{DriverOptions, chaos_cluster, run_many};
use tether_chaos::runner::{self, RunConfig};
use tether_chaos::schedule::{CRASH_POINTS, Fault, FaultOptions, Schedule, Step};

fn tetherd_failpoints() -> PathBuf {
    let path = sibling_binary("tetherd-failpoints");
    assert!(
        path.exists(),
        "no {}: build it with `cargo build -p tether-server --features failpoints` and copy \
         target/debug/tetherd to tetherd-failpoints (./dev test does both)",
        path.display()
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_fires_and_the_histories_stay_clean() {
    let mut cluster = chaos_cluster(tetherd_failpoints(), 3, None)
        .await
        .expect("a cluster");
    let mut faults: Vec<Fault> = CRASH_POINTS
        .iter()
        .map(|&(point, lag_first)| Fault::Crash { point, lag_first })
        .collect();
    faults.push(Fault::CrashInMembershipChange);
    let config = RunConfig::default();
    let mut seed = 70_000;
    for fault in faults {
        let mut fired = 0;
        // A crash point needs its code path to run while armed; a run where
        // it did not (rare) is tried again with the next seed.
        for _attempt in 0..4 {
            seed += 1;
            let schedule = Schedule {
                seed,
                workload: Duration::from_millis(2500),
                steps: vec![Step {
                    at: Duration::from_millis(200),
                    lasts: Duration::from_millis(1500),
                    fault: fault.clone(),
                }],
            };
            let report = runner::run(&mut cluster, &schedule, &format!("f{seed}"), &config)
                .await
                .unwrap_or_else(|e| panic!("{schedule}: {e:#}"));
            println!(
                "{} | ops {} | crashes {} | violations {}",
                report.schedule,
                report.ops,
                report.crashes_fired,
                report.violation_count()
            );
            assert_eq!(
                report.violation_count(),
                0,
                "{}: {:#?}",
                report.schedule,
                report.violations
            );
            fired += report.crashes_fired;
            if fired > 0 {
                break;
            }
        }
        assert!(fired > 0, "{fault:?} never fired in 4 runs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_that_grants_held_locks_is_caught_with_its_seed() {
    let options = DriverOptions {
        tetherd: tetherd_failpoints(),
        replicas: 3,
        schedules: 2,
        duration: None,
        seed: 90_000,
        lanes: 1,
        per_cluster: 25,
        workload: Duration::from_millis(1500),
        faults: FaultOptions {
            failpoints: false,
            membership: false,
            only: Some("delay"),
        },
        failpoints_env: Some("sm-acquire-ignore-holder=return".into()),
        run: RunConfig::default(),
        verbose: false,
    };
    let summary = run_many(options.clone()).await.expect("the runs finish");
    println!("{}", summary.line(&options));
    for (seed, problem) in &summary.failing {
        println!("seed {seed}: {problem}");
    }
    assert!(!summary.clean(), "the broken build went unnoticed");
    assert!(summary.violations["mutual_exclusion"] > 0);
    assert!(summary.violations["linearizability"] > 0);
    // Each failing schedule is reported with its seed, to replay it.
    let seeds: Vec<u64> = summary.failing.iter().map(|(s, _)| *s).collect();
    assert!(
        seeds.iter().all(|s| (90_000..90_002).contains(s)),
        "{seeds:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_that_grants_twice_in_one_sweep_is_caught_with_its_seed() {
    let options = DriverOptions {
        tetherd: tetherd_failpoints(),
        replicas: 3,
        schedules: 3,
        duration: None,
        seed: 91_000,
        lanes: 1,
        per_cluster: 25,
        workload: Duration::from_millis(2500),
        faults: FaultOptions {
            failpoints: false,
            membership: false,
            only: Some("delay"),
        },
        failpoints_env: Some("sm-sweep-grant-per-end=return".into()),
        // Three lease scenarios side by side in each schedule: each reaches
        // the double grant only when its two leases end in one sweep.
        run: RunConfig {
            lease_workers: 3,
            ..RunConfig::default()
        },
        verbose: false,
    };
    let summary = run_many(options.clone()).await.expect("the runs finish");
    println!("{}", summary.line(&options));
    for (seed, problem) in &summary.failing {
        println!("seed {seed}: {problem}");
    }
    assert!(!summary.clean(), "the broken build went unnoticed");
    assert!(summary.violations["tokens"] > 0, "{:?}", summary.violations);
    let seeds: Vec<u64> = summary.failing.iter().map(|(s, _)| *s).collect();
    assert!(
        seeds.iter().all(|s| (91_000..91_003).contains(s)),
        "{seeds:?}"
    );
}

//! Pod-lifecycle traces through the bridge's logic against three real
//! replicas (see `tether_chaos::trace`), and the bridge's planted bugs the
//! replay must catch. Seeds are printed; TETHER_TRACE_SEED replays one.
//! The planted bugs are switched on with `fail::cfg`, which is process-wide:
//! the tests here take turns (`TURN`).

use std::time::Duration;

use tether_chaos::cluster::{ProcessCluster, sibling_binary};
use tether_chaos::trace::{Outcome, Step, Trace, replay};

/// One test at a time: a planted bug is on for the whole process.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Switches a planted bug on, and off again when dropped (a failed
/// assertion included).
struct Planted(&'static str);

impl Planted {
    fn on(name: &'static str) -> Planted {
        fail::cfg(name, "return").expect("a failpoint action");
        Planted(name)
    }
}

impl Drop for Planted {
    fn drop(&mut self) {
        fail::remove(self.0);
    }
}

fn describe(seed: u64, trace: &Trace, outcome: &Outcome) -> String {
    let count = |f: fn(&Step) -> bool| trace.steps.iter().filter(|s| f(s)).count();
    format!(
        "trace seed {seed}: {} steps ({} pods, {} removals, {} late binds, {} node removals), {} binds, {} \
         abandoned while queued, {} bridge commands, {} reports lost and {} corrected, {} violations",
        trace.steps.len(),
        count(|s| matches!(s, Step::CreatePod { .. })),
        count(|s| matches!(s, Step::Remove(_))),
        count(|s| matches!(s, Step::LateBind(_))),
        count(|s| matches!(s, Step::RemoveNode(_))),
        outcome.binds,
        outcome.binds_abandoned,
        outcome.commands,
        outcome.lost_reports,
        outcome.corrections,
        outcome.violations.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_leave_no_lock_or_pin_to_what_is_gone() {
    let _turn = TURN.lock().await;
    let cluster = ProcessCluster::start(&sibling_binary("tetherd"), 3)
        .await
        .expect("three replicas");
    let client = cluster.client_with(Duration::from_secs(30));
    let seeds: Vec<u64> = match std::env::var("TETHER_TRACE_SEED") {
        Ok(seed) => vec![seed.parse().expect("TETHER_TRACE_SEED is a number")],
        Err(_) => (1..=6).collect(),
    };
    let mut corrections = 0;
    for seed in seeds {
        let trace = Trace::generate(seed, 4, 40);
        let outcome = replay(&client, &trace)
            .await
            .unwrap_or_else(|e| panic!("trace seed {seed}: {e}"));
        println!("{}", describe(seed, &trace, &outcome));
        corrections += outcome.corrections;
        assert!(
            outcome.violations.is_empty(),
            "trace seed {seed} (replay: TETHER_TRACE_SEED={seed}): {:#?}",
            outcome.violations
        );
        assert!(
            outcome.binds > 0,
            "trace seed {seed}: nothing was ever bound"
        );
    }
    // The workload drives reconciliation: some lost report mattered.
    assert!(
        corrections > 0,
        "no lost report was still due at the final resync: nothing drove reconciliation"
    );
}

/// Runs seeds 1.. with `failpoint` on until a violation names `symptom`;
/// fails if six seeds pass.
async fn planted_bug_is_caught(failpoint: &'static str, symptom: &str) {
    let _turn = TURN.lock().await;
    let cluster = ProcessCluster::start(&sibling_binary("tetherd"), 3)
        .await
        .expect("three replicas");
    let client = cluster.client_with(Duration::from_secs(30));
    let _planted = Planted::on(failpoint);
    for seed in 1..=6 {
        let trace = Trace::generate(seed, 4, 40);
        let outcome = replay(&client, &trace)
            .await
            .unwrap_or_else(|e| panic!("trace seed {seed}: {e}"));
        println!("{failpoint}: {}", describe(seed, &trace, &outcome));
        if let Some(caught) = outcome.violations.iter().find(|v| v.contains(symptom)) {
            println!("{failpoint} caught with trace seed {seed}: {caught}");
            return;
        }
    }
    panic!("the planted bug {failpoint} went unnoticed in trace seeds 1 to 6");
}

/// Defect 1 of issue 34: a report whose send failed was never sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_that_never_sends_a_lost_report_again_is_caught() {
    planted_bug_is_caught("bridge-forgets-lost-reports", "Tether says its owner").await;
}

/// Defect 3 of issue 34: a bound pod being deleted counted as gone while
/// its init container still ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_that_counts_a_terminating_bound_pod_gone_is_caught() {
    planted_bug_is_caught("bridge-deleting-is-gone", "bound and being deleted").await;
}

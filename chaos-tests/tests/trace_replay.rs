//! Pod-lifecycle traces through the bridge's logic against three real
//! replicas (see `tether_chaos::trace`). Seeds are printed; TETHER_TRACE_SEED
//! replays one.

use std::time::Duration;

use tether_chaos::cluster::{ProcessCluster, sibling_binary};
use tether_chaos::trace::{Step, Trace, replay};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_leave_no_lock_or_pin_to_what_is_gone() {
    let cluster = ProcessCluster::start(&sibling_binary("tetherd"), 3)
        .await
        .expect("three replicas");
    let client = cluster.client_with(Duration::from_secs(30));
    let seeds: Vec<u64> = match std::env::var("TETHER_TRACE_SEED") {
        Ok(seed) => vec![seed.parse().expect("TETHER_TRACE_SEED is a number")],
        Err(_) => (1..=6).collect(),
    };
    for seed in seeds {
        let trace = Trace::generate(seed, 4, 40);
        let count = |f: fn(&Step) -> bool| trace.steps.iter().filter(|s| f(s)).count();
        let outcome = replay(&client, &trace)
            .await
            .unwrap_or_else(|e| panic!("trace seed {seed}: {e}"));
        println!(
            "trace seed {seed}: {} steps ({} pods, {} removals, {} late binds, {} node removals), {} binds, {} \
             abandoned while queued, {} bridge commands, {} violations",
            trace.steps.len(),
            count(|s| matches!(s, Step::CreatePod { .. })),
            count(|s| matches!(s, Step::Remove(_))),
            count(|s| matches!(s, Step::LateBind(_))),
            count(|s| matches!(s, Step::RemoveNode(_))),
            outcome.binds,
            outcome.binds_abandoned,
            outcome.commands,
            outcome.violations.len()
        );
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
}

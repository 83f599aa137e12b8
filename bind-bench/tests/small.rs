//! The bind bench, small (10 nodes x 4 GPUs, the burst), as CI runs it:
//! every pod is bound and allocated through the real kube-scheduler, the
//! extender and Tether, with no device given twice, and the report's
//! measures are filled in; then the same on the same nodes with no lock
//! and with the annotation lock (without its rate limit, which would make
//! the test minutes long), every pod bound there too; then the mixed
//! workload's pods of several GPUs through Tether. The churn through Tether
//! is a second test; HAMi-core #246's pods of two device kinds a third.

use std::time::Duration;

use tether_bind_bench::run::{self, Churn, RunOptions, Workload};
use tether_bind_bench::system::System;
use tether_bind_bench::world::{World, WorldOptions};
use tether_chaos::cluster::sibling_binary;
use tether_kube_testenv::ControlPlane;

/// The small world's size: 10 nodes x 4 GPUs.
const NODES: usize = 10;
const GPUS: usize = 4;

/// What each run of these tests asks for: `workload` on the small world,
/// 20 pods replaced by the churn.
fn options(workload: Workload) -> RunOptions {
    RunOptions {
        workload,
        nodes: NODES,
        gpus: GPUS,
        deadline: Duration::from_secs(300),
        churn: Churn {
            pods: Some(20),
            ..Churn::default()
        },
    }
}

/// The world on `plane`, with the tetherd built beside the tests.
/// RUST_LOG=tether_embed=info,tether_k8s_bridge=info shows each bind and
/// report; warnings only otherwise.
async fn small_world(plane: ControlPlane, npus: usize) -> World {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,kube_client::client::builder=off".into()),
        )
        .with_test_writer()
        .try_init();
    World::start(
        plane,
        &WorldOptions {
            tetherd: sibling_binary("tetherd"),
            nodes: NODES,
            gpus: GPUS,
            npus,
        },
    )
    .await
    .expect("the world starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_burst_binds_every_pod_with_no_device_given_twice() {
    let Some(plane) =
        ControlPlane::start_or_skip("a_small_burst_binds_every_pod_with_no_device_given_twice")
            .await
    else {
        return;
    };
    let (nodes, gpus) = (NODES, GPUS);
    let mut world = small_world(plane, 0).await;
    let mut reports = Vec::new();
    for system in [
        System::Tether,
        System::NoLock,
        System::AnnotationLockUnlimited,
    ] {
        world.use_system(system).await.expect("the system in use");
        let report = run::run(&world, system, &options(Workload::Burst))
            .await
            .expect("the burst runs");
        print!("{}", report.to_text());
        assert_eq!(report.pods, 40);
        assert!(
            report.all_allocated.is_some(),
            "{}: not every pod allocated",
            report.system
        );
        assert!(
            report.failed.is_empty(),
            "{}: {:?}",
            report.system,
            report.failed
        );
        assert_eq!(report.create_to_bound.len(), 40);
        assert_eq!(report.bound_to_allocated.len(), 40);
        // Each pod is at least created, bound and set Running: the API
        // server's own count must see them.
        assert!(
            report.api_requests >= 3.0 * 40.0,
            "{}: {} API requests",
            report.system,
            report.api_requests
        );
        assert_eq!(report.replica_rss_mib.len(), 3);
        if system == System::Tether {
            assert!(
                report.double_allocations.is_empty(),
                "{:?}",
                report.double_allocations
            );
            assert!(report.replica_cpu_seconds > 0.0);
        }
        reports.push(report);
    }
    print!("{}", run::comparison(&reports));
    let svg = run::chart(&reports, "10 x 4, burst");
    assert!(svg.contains("<svg") && svg.contains("no lock"), "{svg}");

    // Pods of several GPUs (on 4-GPU nodes the mixed workload is one
    // 4-GPU pod a node) through Tether: each gets all its devices, none
    // shared.
    world
        .use_system(System::Tether)
        .await
        .expect("the system in use");
    let mixed = run::run(&world, System::Tether, &options(Workload::Mixed))
        .await
        .expect("the mixed workload runs");
    print!("{}", mixed.to_text());
    assert_eq!(mixed.pods, nodes);
    assert!(mixed.all_allocated.is_some(), "not every pod allocated");
    assert!(mixed.failed.is_empty(), "{:?}", mixed.failed);
    assert!(
        mixed.double_allocations.is_empty(),
        "{:?}",
        mixed.double_allocations
    );
    assert_eq!(mixed.devices_given, nodes * gpus);
}

/// The churn through Tether, 10 x 4: every GPU taken, then pods deleted at
/// random (some before they were bound) and new ones created; each new pod
/// binds once a deleted pod's GPU is free again, none shares one.
///
/// A pod the churn deletes while the simulated kubelet admits it may fail
/// its admission (its hold and claim end with it); that is no failure, as
/// nobody waits for the pod. Every pod still there must get its devices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_binds_every_new_pod_once_a_deleted_pods_gpu_is_free() {
    let Some(plane) =
        ControlPlane::start_or_skip("churn_binds_every_new_pod_once_a_deleted_pods_gpu_is_free")
            .await
    else {
        return;
    };
    let (nodes, gpus) = (NODES, GPUS);
    let mut world = small_world(plane, 0).await;
    world
        .use_system(System::Tether)
        .await
        .expect("the system in use");
    let churn = run::run(&world, System::Tether, &options(Workload::Churn))
        .await
        .expect("the churn runs");
    print!("{}", churn.to_text());
    let summary = churn.churn.expect("the churn's summary");
    assert_eq!(summary.replaced, 20);
    assert_eq!(churn.pods, 20);
    assert!(churn.all_allocated.is_some(), "not every new pod allocated");
    assert!(churn.failed.is_empty(), "{:?}", churn.failed);
    assert!(
        churn.double_allocations.is_empty(),
        "{:?}",
        churn.double_allocations
    );
    // Every GPU is given again: the live pods are as many as the GPUs.
    assert_eq!(churn.devices_given, nodes * gpus);
    assert_eq!(
        churn.create_to_bound.len(),
        20 - summary.deleted_unbound,
        "every new pod not deleted first was bound"
    );
}

/// HAMi-core #246's case, 10 nodes x 4 GPUs and 4 devices of a second
/// kind: 40 pods, each asking for one GPU and one device of the second
/// kind. Through Tether (a node lock per kind, taken in one order) every
/// pod is bound and given one device of each kind, none twice. Through the
/// annotation comparator (HAMi's one node lock, taken once per kind, as
/// its code was before HAMi #2255) no pod is bound: each is refused by its
/// own first lock, which shows the workload drives the case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_of_two_device_kinds_bind_through_tether_and_not_through_one_shared_lock() {
    let Some(plane) = ControlPlane::start_or_skip(
        "pods_of_two_device_kinds_bind_through_tether_and_not_through_one_shared_lock",
    )
    .await
    else {
        return;
    };
    let (nodes, gpus) = (NODES, GPUS);
    let mut world = small_world(plane, GPUS).await;
    world
        .use_system(System::Tether)
        .await
        .expect("the system in use");
    let tether = run::run(&world, System::Tether, &options(Workload::TwoKinds))
        .await
        .expect("the two-kinds workload runs");
    print!("{}", tether.to_text());
    assert_eq!(tether.pods, nodes * gpus);
    assert!(tether.all_allocated.is_some(), "not every pod allocated");
    assert!(tether.failed.is_empty(), "{:?}", tether.failed);
    assert!(
        tether.double_allocations.is_empty(),
        "{:?}",
        tether.double_allocations
    );
    // One device of each kind for every pod: every device of both kinds.
    assert_eq!(tether.devices_given, 2 * nodes * gpus);

    let system = System::AnnotationLockUnlimited;
    world.use_system(system).await.expect("the system in use");
    let shared = run::run(
        &world,
        system,
        &RunOptions {
            deadline: Duration::from_secs(20),
            ..options(Workload::TwoKinds)
        },
    )
    .await
    .expect("the two-kinds workload runs");
    print!("{}", shared.to_text());
    assert!(shared.all_bound.is_none());
    assert_eq!(
        shared.create_to_bound.len(),
        0,
        "a pod of two kinds got past one shared lock taken twice"
    );
}

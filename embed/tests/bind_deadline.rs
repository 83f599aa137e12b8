//! One deadline for a whole bind (issue 34, defect 7): the extender takes
//! the node's lock, then Tether loses its quorum while the bind claims
//! devices. The bind must answer by `bind_deadline`, under the scheduler's
//! `httpTimeout`, however long its client would retry each call on its own.
//! Before, each call of the bind retried up to the client's budget (15 s by
//! default), and the planted bug `extender-bind-unbounded` (switched on with
//! `fail::cfg`, process-wide: the tests here take turns) brings that back:
//! the same check must catch it.
//!
//! Three in-process replicas; the Kubernetes side is a binder that answers
//! from memory (this is about Tether calls, the real API server's part is
//! in `e2e.rs` and `real_scheduler.rs`), and stops two replicas when the
//! bind reads the node, which it does right after taking the lock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    Container, Node as KubeNode, NodeStatus, Pod as KubePod, PodSpec, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tether_client::{Client, Options};
use tether_embed::accounting::DeviceLedger;
use tether_embed::extender::{Binder, Extender, ExtenderBindingArgs, ExtenderConfig};
use tether_embed::requeue::Nudged;
use tether_http::Departure;
use tether_server::testing::Cluster;
use tokio::sync::{mpsc, oneshot};

const RESOURCE: &str = "tether.io/gpu";
const NODE: &str = "gpu-node-1";
/// The bind's deadline, as `--bind-deadline` sets it.
const BIND_DEADLINE: Duration = Duration::from_secs(3);
/// What a loaded machine may add to it.
const SLACK: Duration = Duration::from_secs(2);
/// The client's own retry budget per call: far beyond the deadline, so only
/// the deadline can end the bind in time.
const RETRY_BUDGET: Duration = Duration::from_secs(12);

/// One test at a time: the planted bug is on for the whole process.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The API server's answers, from memory; reading the node asks the test
/// to take Tether's quorum away first (and waits until it has).
struct QuorumTaker {
    node_read: mpsc::Sender<oneshot::Sender<()>>,
}

impl Binder for QuorumTaker {
    async fn pod(&self, namespace: &str, name: &str) -> Result<KubePod, String> {
        let limits = BTreeMap::from([(RESOURCE.to_string(), Quantity("1".into()))]);
        Ok(KubePod {
            metadata: ObjectMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "main".into(),
                    resources: Some(ResourceRequirements {
                        limits: Some(limits),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..KubePod::default()
        })
    }

    async fn node(&self, name: &str) -> Result<KubeNode, String> {
        let (taken, quorum_gone) = oneshot::channel();
        if self.node_read.send(taken).await.is_ok() {
            let _ = quorum_gone.await;
        }
        Ok(KubeNode {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            status: Some(NodeStatus {
                allocatable: Some(BTreeMap::from([(
                    RESOURCE.to_string(),
                    Quantity("8".into()),
                )])),
                ..NodeStatus::default()
            }),
            ..KubeNode::default()
        })
    }

    async fn bind(&self, _args: &ExtenderBindingArgs) -> Result<(), String> {
        Ok(())
    }

    async fn unbound_pods(&self) -> Result<Vec<KubePod>, String> {
        Ok(Vec::new())
    }

    async fn nudge(&self, _: &str, _: &str, _: &str, _: &str) -> Result<Nudged, String> {
        Ok(Nudged::Asked)
    }
}

/// Binds one pod while Tether loses its quorum after the lock is taken;
/// returns how long the bind took to answer, and its error.
async fn bind_while_the_quorum_goes() -> (Duration, String) {
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_leader().await;
    let client = Client::new(
        cluster.endpoints(),
        Options {
            retry_timeout: RETRY_BUDGET,
            ..Options::default()
        },
    )
    .expect("a client");
    let (node_read, mut node_reads) = mpsc::channel(1);
    let extender = Extender::new(
        client.clone(),
        DeviceLedger::new(client, Duration::from_secs(600)),
        QuorumTaker { node_read },
        ExtenderConfig {
            scope: "gpu-bind".into(),
            resource: RESOURCE.into(),
            wait: Duration::from_secs(2),
            bind_deadline: BIND_DEADLINE,
            device_prefix: "gpu".into(),
            inventory_ttl: Duration::from_secs(30),
            also_kinds: Vec::new(),
        },
    );
    let args = ExtenderBindingArgs {
        pod_name: "trainer".into(),
        pod_namespace: "ml".into(),
        pod_uid: "uid-trainer".into(),
        node: NODE.into(),
    };
    let bind = tokio::spawn(async move {
        let started = Instant::now();
        let answer = extender.bind(&args, &Departure::never()).await;
        (started.elapsed(), answer.error)
    });
    // The bind holds the node's lock and reads the node: the leader and one
    // follower stop, and no quorum is left.
    let taken = tokio::time::timeout(Duration::from_secs(60), node_reads.recv())
        .await
        .expect("the bind reads the node within 60 s")
        .expect("the bind reads the node");
    let follower = [1, 2, 3]
        .into_iter()
        .find(|id| *id != leader)
        .expect("a follower");
    cluster.stop(leader).await;
    cluster.stop(follower).await;
    let _ = taken.send(());
    let answered = tokio::time::timeout(RETRY_BUDGET * 4, bind)
        .await
        .expect("the bind answers at last")
        .expect("the bind task");
    cluster.shutdown().await;
    answered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_that_loses_tethers_quorum_after_the_lock_answers_by_its_deadline() {
    let _turn = TURN.lock().await;
    let (elapsed, error) = bind_while_the_quorum_goes().await;
    println!("the bind answered after {elapsed:?}: {error}");
    assert!(!error.is_empty(), "no quorum, yet the bind succeeded");
    assert!(
        elapsed <= BIND_DEADLINE + SLACK,
        "the bind answered after {elapsed:?}, past its {BIND_DEADLINE:?} deadline: {error}"
    );
}

/// The planted bug: the bind's calls retry on their own budgets. The check
/// above must fail on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_without_one_deadline_is_caught() {
    /// Switches the planted bug off again, a failed assertion included.
    struct Planted;
    impl Drop for Planted {
        fn drop(&mut self) {
            fail::remove("extender-bind-unbounded");
        }
    }
    let _turn = TURN.lock().await;
    fail::cfg("extender-bind-unbounded", "return").expect("a failpoint action");
    let _planted = Planted;
    let (elapsed, error) = bind_while_the_quorum_goes().await;
    println!("with extender-bind-unbounded the bind answered after {elapsed:?}: {error}");
    assert!(
        elapsed > BIND_DEADLINE + SLACK,
        "the planted bug went unnoticed: the bind answered after {elapsed:?}"
    );
}

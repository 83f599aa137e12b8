//! `tether-bind-bench`: GPU pods bound through the whole path an operator
//! feels — the real kube-scheduler, the extender's filter and bind, the
//! node's lock, the binding, the kubelet's `Allocate`, the release — on
//! this machine, at the size of a GPU cluster (issue 52).
//!
//! One run starts ([`world`]):
//! - the real control plane from `../shared/kube` (etcd, kube-apiserver,
//!   kube-scheduler), the scheduler running the KubeSchedulerConfiguration
//!   of `deploy/optional/gpu/scheduler.yaml` as deployed (its one profile
//!   `tether-gpu` and the extender), with two changes it cannot avoid: the
//!   extender's URL points at the bench's extender on loopback, and
//!   `clientConnection` names a kubeconfig (klog level 2, not the tests'
//!   4);
//! - 3 Tether replicas (`tetherd` processes next to this binary, fsync
//!   on, loopback, plain TCP without tokens: every caller may do
//!   anything, which a deployment's mutual TLS would not allow);
//! - the extender (`tether_embed::extender`, the library `tether-extender`
//!   is built on, with `tether-extender`'s default flags) and the bridge
//!   (`tether_k8s_bridge`), in this process, each as its service account
//!   with the manifests' RBAC;
//! - N simulated GPU nodes ([`node`]).
//!
//! **What a simulated node does.** 200 real kubelets cannot run on one
//! machine, so each node is the part of a kubelet and of our device plugin
//! that the bind path touches, in this process:
//! - the Node object, registered once with `status.allocatable` of
//!   `tether.io/gpu` = its GPU count, Ready, its `not-ready` taint removed
//!   (as the node lifecycle controller does); after that nothing updates
//!   it, as a real, quiet node reports an unchanged status only every 5
//!   minutes;
//! - the device plugin: `tether_embed::device_plugin::GpuPlugin` (the
//!   library `tether-device-plugin` runs) over fake devices `gpu0..`, its
//!   own Tether client, its devices published in Tether once at start;
//! - the kubelet's device manager, for pods bound to the node (seen on one
//!   watch of the bench's pods, as each kubelet watches its node's): one
//!   pod at a time per node, as the kubelet admits them; for each
//!   container asking for GPUs, `GetPreferredAllocation` over the node's
//!   free devices, then `Allocate` with the ids picked, both called on the
//!   plugin directly rather than over its socket; an `Allocate` error fails
//!   the pod, as the kubelet's `UnexpectedAdmissionError` does;
//! - the pod's status set to `Running` once it is allocated;
//! - a pod deleted with a grace period (the churn workload's) admitted no
//!   more, and, once any admission of it under way has ended, deleted for
//!   good, as the kubelet does once the pod's containers have stopped
//!   (there are none to stop).
//!
//! It does not run containers, report pod IPs or container statuses, send
//! node heartbeats or leases, or evict; it follows only app containers
//! (the workloads have no init containers), and a deleted pod's devices
//! return to the free list when its deletion is seen.
//!
//! The same nodes and workloads run, one system after another, against
//! Tether, HAMi's annotation lock ([`annotation`]: with HAMi's client rate
//! limits and without) and no lock at all ([`nolock`]); [`system`] names
//! them. [`run`] drives a workload and measures it; the binary prints the
//! reports and can draw the chart.

pub mod annotation;
pub mod node;
pub mod nolock;
pub mod run;
pub mod system;
pub mod verbs;
pub mod world;

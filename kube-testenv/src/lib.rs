//! `tether-kube-testenv`: real Kubernetes control planes for tests, started
//! from Kubernetes binaries `./dev` builds from the Go module proxy and the
//! Debian-built parts in `../shared/kube`, the way controller-runtime's
//! envtest starts its assets.
//!
//! A test asks for a plane and gets `None` (reported as skipped, one loud
//! line saying what is missing) on a machine without them; under `CI=true`
//! that is a failure instead:
//!
//! ```no_run
//! # async fn example() {
//! use tether_kube_testenv::ControlPlane;
//! let Some(plane) = ControlPlane::shared_or_skip("my_test") else { return };
//! let namespace = plane.namespace("my-test").await;
//! let client = plane.client().await;
//! # }
//! ```
//!
//! # Layout
//! - `apply.rs` — manifest objects of any kind applied (or dry-run) by
//!   server-side apply with strict validation.
//! - `assets.rs` — finding the built Kubernetes binaries and the compressed
//!   Debian ones, unpacking and checking those once into the build cache,
//!   reporting skips.
//! - `process.rs` — child processes that die with the test process (a
//!   watchdog beside each), killed on drop: the control plane's, and the
//!   `tetherd` replicas of the server's process tests and the chaos
//!   harness; `unused_port`. Without the default `control-plane` feature
//!   too.
//! - `control_plane.rs` — etcd and kube-apiserver on free loopback ports
//!   with a throwaway CA, an admin token, kubeconfigs and service-account
//!   tokens; outages (API server stop and start, a second API server on the
//!   same etcd), etcd compaction; kube-scheduler and kube-controller-manager
//!   on demand.
//! - `gpu_manifests.rs` — `deploy/optional/gpu` read as deployed: the
//!   RBAC of the extender, the bridge and the scheduler, and the
//!   scheduler's configuration pointed at a test's extender.
//! - `lazyfs.rs` — directories on the project's lazy file system
//!   (`tether-lazyfs`), which loses every write not synced at a power cut,
//!   each mount in a mount namespace of its own. Without the
//!   `control-plane` feature too.
//! - `node.rs` — a real node beside a control plane: containerd and a
//!   kubelet in a mount namespace and a cgroup tree of their own, running
//!   pods from local images and serving device plugins, all stopped and
//!   removed on drop.

#[cfg(feature = "control-plane")]
pub mod apply;
#[cfg(feature = "control-plane")]
pub mod assets;
#[cfg(feature = "control-plane")]
pub mod control_plane;
#[cfg(feature = "control-plane")]
pub mod gpu_manifests;
pub mod lazyfs;
#[cfg(feature = "control-plane")]
pub mod node;
pub mod process;

#[cfg(feature = "control-plane")]
pub use assets::{ASSETS_VAR, Assets, assets_or_skip, node_assets_or_skip};
#[cfg(feature = "control-plane")]
pub use control_plane::{
    ControlPlane, ExtraApiServer, Plane, client_from, watch_error_code, yaml_documents,
};
#[cfg(feature = "control-plane")]
pub use node::{NodeOptions, RealNode};
pub use process::{Process, unused_port};

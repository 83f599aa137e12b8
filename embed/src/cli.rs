//! The command lines of `tether-extender` and `tether-device-plugin`, here
//! rather than in the binaries so the deployment test can check every
//! setting the manifests give them.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// `tether-extender`'s flags.
#[derive(Parser, Debug)]
#[command(
    name = "tether-extender",
    version,
    about = "Scheduler-extender filter and bind verbs on Tether locks and device claims"
)]
pub struct ExtenderArgs {
    /// The Tether replicas and the credentials for them.
    #[command(flatten)]
    pub tether: tether_client::ConnectArgs,
    /// Address to serve the extender on.
    #[arg(long, env = "TETHER_EXTENDER_LISTEN", default_value = "127.0.0.1:8890")]
    pub listen: std::net::SocketAddr,
    /// Lock scope.
    #[arg(long, env = "TETHER_EXTENDER_SCOPE", default_value = "gpu-bind")]
    pub scope: String,
    /// How long a bind waits in the node's queue. kube-scheduler gives an
    /// extender `httpTimeout` (5 s unless configured) for the whole call:
    /// keep this below it, minus the binding call, so the extender gives up
    /// before the scheduler does.
    #[arg(long, env = "TETHER_EXTENDER_BIND_WAIT", default_value = "3s", value_parser = humantime::parse_duration)]
    pub bind_wait: Duration,
    /// The deadline of one whole bind (the wait, the device claim and the
    /// binding call's Tether side together; giving back what it took is
    /// not cut short). Keep it below the scheduler's `httpTimeout`
    /// (`deploy/optional/gpu/scheduler.yaml`: 10 s), which is what the
    /// scheduler allows the call.
    #[arg(long, env = "TETHER_EXTENDER_BIND_DEADLINE", default_value = "8s", value_parser = humantime::parse_duration)]
    pub bind_deadline: Duration,
    /// The extended resource whose devices are planned (what the device
    /// plugin advertises).
    #[arg(
        long,
        env = "TETHER_EXTENDER_RESOURCE",
        default_value = "tether.io/gpu"
    )]
    pub resource: String,
    /// Device id prefix, as the device plugin's `--device-prefix`. A
    /// node's device ids are `<prefix>0..N`, N its allocatable count of
    /// the resource (`status.allocatable`, which the kubelet fills from
    /// the plugin's healthy devices).
    #[arg(long, env = "TETHER_EXTENDER_DEVICE_PREFIX", default_value = "gpu")]
    pub device_prefix: String,
    /// How long the filter verb trusts a node's allocatable count it read
    /// (kube-scheduler sends node names only, with `nodeCacheCapable`);
    /// the bind verb always reads the node afresh.
    #[arg(long, env = "TETHER_EXTENDER_INVENTORY_TTL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub inventory_ttl: Duration,
    /// A further device kind to plan, `RESOURCE=PREFIX` (repeat for more):
    /// its lock scope is `PREFIX-bind`, its claims and its plugins'
    /// inventories the pin sets `PREFIX-devices` and `PREFIX-inventory`
    /// (give its device plugin those as `--scope`, `--claim-set` and
    /// `--inventory-set`). A pod asking for several kinds takes each kind's
    /// node lock, in the order of the scopes' names.
    #[arg(
        long = "also-kind",
        env = "TETHER_EXTENDER_ALSO_KINDS",
        value_delimiter = ','
    )]
    pub also_kinds: Vec<String>,
}

impl ExtenderArgs {
    /// The extender's settings these flags give, or why they are wrong.
    pub fn extender_config(&self) -> Result<crate::extender::ExtenderConfig, String> {
        let also_kinds = self
            .also_kinds
            .iter()
            .map(|spec| crate::kind::DeviceKind::parse(spec))
            .collect::<Result<Vec<_>, _>>()?;
        let config = crate::extender::ExtenderConfig {
            scope: self.scope.clone(),
            resource: self.resource.clone(),
            wait: self.bind_wait,
            bind_deadline: self.bind_deadline,
            device_prefix: self.device_prefix.clone(),
            inventory_ttl: self.inventory_ttl,
            also_kinds,
        };
        crate::kind::check_distinct(&config.kinds())?;
        Ok(config)
    }
}

/// `tether-device-plugin`'s flags.
#[derive(Parser, Debug)]
#[command(
    name = "tether-device-plugin",
    version,
    about = "Kubelet device plugin that serves the pod holding gpu-bind/<node>"
)]
pub struct DevicePluginArgs {
    /// The Tether replicas and the credentials for them.
    #[command(flatten)]
    pub tether: tether_client::ConnectArgs,
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Lock scope.
    #[arg(long, default_value = "gpu-bind")]
    pub scope: String,
    /// Extended resource name.
    #[arg(long, default_value = "tether.io/gpu")]
    pub resource_name: String,
    /// The pin set of this device kind's claims. The first kind (the
    /// extender's `--resource`) uses the default; a kind the extender is
    /// given with `--also-kind RESOURCE=PREFIX` uses `PREFIX-devices`.
    #[arg(long, default_value = crate::accounting::DEVICE_SET)]
    pub claim_set: String,
    /// The pin set this plugin publishes its node's devices in: the default
    /// for the first kind, `PREFIX-inventory` for a kind given with
    /// `--also-kind RESOURCE=PREFIX`.
    #[arg(long, default_value = crate::inventory::INVENTORY_SET)]
    pub inventory_set: String,
    /// The devices to advertise: `nvidia` (the node's NVIDIA GPUs, read
    /// under `--host-root`, advertised by UUID) or `fake:N` (N fake
    /// devices `<device-prefix>0..N`, for tests and demos).
    #[arg(long, env = "TETHER_DEVICES", default_value = "fake:8")]
    pub devices: String,
    /// The node's root directory as this container mounts it (read-only
    /// is enough): `--devices nvidia` reads the driver's GPU list, device
    /// nodes and PCI NUMA nodes under it.
    #[arg(long, env = "TETHER_HOST_ROOT", default_value = "/")]
    pub host_root: PathBuf,
    /// How often `--devices nvidia` reads the GPUs again, for their health.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub rescan: Duration,
    /// This plugin's pod UID (the downward API's metadata.uid): the owner
    /// of the node's devices it publishes in Tether, which end after a
    /// while once the pod has stopped. Default: an id made from the node
    /// name, owned by no pod (the list then ends with the node only).
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,
    /// Fake device id prefix (`--devices fake:N`).
    #[arg(long, default_value = "gpu")]
    pub device_prefix: String,
    /// The kubelet's device-plugin directory.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    pub plugin_dir: PathBuf,
    /// This plugin's socket file name in that directory.
    #[arg(long, default_value = "tether-gpu.sock")]
    pub socket_name: String,
    /// The deadline of one whole `Allocate`, all its Tether calls together
    /// (retried across an election, say): past it, it fails. The kubelet
    /// never retries a failed Allocate: the pod fails. The kubelet waits for
    /// the answer while it admits the pod, so keep this to seconds.
    #[arg(long, env = "TETHER_ALLOCATE_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    pub allocate_timeout: Duration,
    /// Address of the HTTP server for `/health` and `/metrics`.
    #[arg(
        long,
        env = "TETHER_DEVICE_PLUGIN_HTTP_LISTEN",
        default_value = "127.0.0.1:8892"
    )]
    pub http_listen: std::net::SocketAddr,
}

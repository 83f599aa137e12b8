//! A real Kubernetes node for tests: containerd and a kubelet (v1.36, from
//! the assets) registered with a [`ControlPlane`], running pods from the
//! local images, and driving device plugins over the real v1beta1 API.
//!
//! What it takes on these machines is `../shared/kube/README.md`'s "A real
//! node"; each point is here:
//! - **A mount namespace of its own** (`unshare --mount --propagation
//!   private`), held by a small shell process (the *holder*), with tmpfs over
//!   `/var/lib/kubelet` (the device-plugin directory is fixed at
//!   `/var/lib/kubelet/device-plugins`), `/run/containerd` and
//!   `/var/log/containers`, so nodes of several tests run side by side and
//!   leave nothing there. `/dev` in the namespace is an overlay of the host's,
//!   so device nodes a test asks for (`mknod`, e.g. GPUs named after
//!   `/dev/null`'s numbers, which the devices cgroup lets a container open)
//!   exist for this node alone. containerd, the kubelet and `ctr` enter the
//!   namespace with `nsenter`; a device plugin in the test process serves
//!   the kubelet through the holder's view of the file system
//!   (`/proc/<holder>/root/var/lib/kubelet/device-plugins`, see
//!   [`RealNode::device_plugin_dir`]): a unix socket bound there is the
//!   kubelet's. The mount points are created on the host when missing
//!   (empty directories; `mkdir` is not namespaced).
//! - **A cgroup tree of its own** (`/tether-node-<test pid>-<n>` in every v1
//!   hierarchy): the kubelet's `cgroupRoot`, and in the `pids` hierarchy
//!   also the home of containerd and the kubelet (`daemons`), so their
//!   shims inherit it. Everything the node runs is then in one tree, and
//!   stopping the node kills every process in it and removes it.
//! - **containerd** (config version 3) with its root, state, socket and
//!   `opt` path in the node's directory, `restrict_oom_score_adj` (root here
//!   may not lower `oom_score_adj`), CDI enabled with the node's own spec
//!   directory ([`RealNode::cdi_dir`]), runc without systemd, the local pause
//!   image pinned as the sandbox image, and a CNI config of the `dummy`
//!   plugin (pods use `hostNetwork`; the config only makes the node Ready).
//!   The local images are imported before the kubelet starts.
//! - **The kubelet** with the admin's kubeconfig, listening on loopback
//!   ports of its own, `failCgroupV1: false` (1.36 refuses cgroup v1
//!   otherwise), `cgroupDriver: cgroupfs`, low eviction thresholds, and pod
//!   logs under the node's directory ([`RealNode::container_log`]); the
//!   node reports status at the kubelet's own cadence (nothing here makes it
//!   chattier than a real one).
//!
//! Stopping ([`Drop`], also while a test panics): the kubelet and containerd
//! are killed with every process of the cgroup tree, the tree is removed,
//! and the holder exits, taking the namespace and its mounts with it. If
//! the test process dies outright, the holder (which watches it) does the
//! same, and the shell around it then removes the node's directory; a node
//! whose holder was killed too is swept by the next [`RealNode::start`]
//! (its tree names a test process that is gone).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::assets::Assets;
use crate::control_plane::ControlPlane;
use crate::process::Process;
use crate::process::unused_port;

/// The local images' references (`node-images.tar`).
pub const BUSYBOX_IMAGE: &str = "localhost/tether/busybox:1";
pub const PAUSE_IMAGE: &str = "localhost/tether/pause:1";

/// How long a node may take to be Ready (1–2 s measured; a loaded 2-core
/// machine is slower).
const READY_DEADLINE: Duration = Duration::from_secs(90);

/// The prefix of every node's cgroup tree.
const CGROUP_PREFIX: &str = "tether-node-";

/// What the node is asked to have.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    /// Device nodes made in the node's `/dev`: (name under `/dev`, major,
    /// minor).
    pub device_nodes: Vec<(String, u32, u32)>,
}

/// The holder's script: makes the mounts and the cgroup tree, says it is
/// ready, then waits for the test process to die or the node to be stopped,
/// and cleans up. Arguments: the test's
/// pid, the node's directory, the cgroup tree's name, then device nodes as
/// `name:major:minor`.
const HOLDER_SCRIPT: &str = r#"
set -eu
test_pid=$1 dir=$2 cgroup=$3
shift 3
echo $$ > "$dir/holder-pid"
for point in /var/lib/kubelet /run/containerd /var/log/containers; do
    mkdir -p "$point"
    mount -t tmpfs tmpfs "$point"
done
# /dev: an overlay of the host's, its submounts carried over.
mkdir -p "$dir/dev"
mount -t tmpfs tmpfs "$dir/dev"
mkdir "$dir/dev/upper" "$dir/dev/work" "$dir/dev/pts" "$dir/dev/shm"
mount --bind /dev/pts "$dir/dev/pts"
mount --bind /dev/shm "$dir/dev/shm"
mount -t overlay overlay -o "lowerdir=/dev,upperdir=$dir/dev/upper,workdir=$dir/dev/work" /dev
mount --move "$dir/dev/pts" /dev/pts
mount --move "$dir/dev/shm" /dev/shm
for node in "$@"; do
    name=${node%%:*}
    numbers=${node#*:}
    mknod "/dev/$name" c "${numbers%%:*}" "${numbers#*:}"
done
for hierarchy in /sys/fs/cgroup/*/; do
    case $hierarchy in */unified/) continue ;; esac
    mkdir -p "$hierarchy$cgroup"
done
mkdir -p "/sys/fs/cgroup/pids/$cgroup/daemons"
touch "$dir/holder-ready"
while kill -0 "$test_pid" 2>/dev/null && [ ! -e "$dir/stop" ]; do
    sleep 0.5
done
sh "$dir/cleanup.sh" "$cgroup"
"#;

/// Runs the holder (in the new namespace) and, once it has exited, removes
/// the node's directory if the test process is gone (its own `Drop` never
/// ran). Outside the namespace: the directory holds the holder's mount
/// points. Arguments: the holder's script, then the holder's.
const OUTER_SCRIPT: &str = r#"
holder=$1
shift
unshare --mount --propagation private -- sh -c "$holder" tether-node-holder "$@"
kill -0 "$1" 2>/dev/null || rm -rf -- "$2"
"#;

/// Kills every process of a node's cgroup tree (`$1`), then removes the
/// tree from every hierarchy.
const CLEANUP_SCRIPT: &str = r#"
cgroup=$1
round=0
while [ $round -lt 100 ]; do
    round=$((round + 1))
    left=0
    for procs in $(find "/sys/fs/cgroup/pids/$cgroup" -name cgroup.procs 2>/dev/null); do
        for pid in $(cat "$procs" 2>/dev/null); do
            kill -KILL "$pid" 2>/dev/null
            left=1
        done
    done
    [ $left = 0 ] && break
    sleep 0.1
done
for tree in /sys/fs/cgroup/*/"$cgroup"; do
    [ -d "$tree" ] && find "$tree" -depth -type d -exec rmdir {} + 2>/dev/null
done
exit 0
"#;

/// A running node (see the module doc); stopped on drop.
pub struct RealNode {
    name: String,
    dir: tempfile::TempDir,
    assets: &'static Assets,
    cgroup: String,
    /// The shell around the holder ([`OUTER_SCRIPT`]).
    holder: Child,
    /// The holder's pid: the namespace's.
    holder_pid: u32,
    containerd: Option<Process>,
    kubelet: Option<Process>,
    client: kube::Client,
    kubeconfig: PathBuf,
    /// How long it took to be Ready.
    pub started_in: Duration,
}

impl RealNode {
    /// Starts node `name` for `plane` and waits until it is Ready, the local
    /// images imported.
    pub async fn start(
        plane: &ControlPlane,
        name: &str,
        options: NodeOptions,
    ) -> anyhow::Result<RealNode> {
        let started = Instant::now();
        let assets = crate::assets::node_assets().map_err(anyhow::Error::msg)?;
        sweep_orphaned_trees();
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let cgroup = format!(
            "{CGROUP_PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let dir = tempfile::Builder::new()
            .prefix("tether-node-")
            .tempdir()
            .context("the node's directory")?;
        let path = dir.path();
        std::fs::write(path.join("cleanup.sh"), CLEANUP_SCRIPT)?;
        for sub in [
            "cdi",
            "cni/conf",
            "cni/data",
            "pod-logs",
            "volume-plugins",
            "pki",
        ] {
            std::fs::create_dir_all(path.join(sub))?;
        }
        let cni_bin = cni_bin_dir(assets)?;
        let holder = start_holder(path, &cgroup, &options)?;
        let mut node = RealNode {
            name: name.to_string(),
            assets,
            cgroup,
            holder,
            holder_pid: 0,
            containerd: None,
            kubelet: None,
            client: plane.client().await,
            kubeconfig: plane.kubeconfig(),
            started_in: Duration::ZERO,
            dir,
        };
        node.wait_for_holder()?;
        node.write_configs(&cni_bin)?;
        node.start_containerd().await?;
        node.import_images()?;
        node.start_kubelet()?;
        node.wait_ready().await?;
        node.started_in = started.elapsed();
        Ok(node)
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name of the node's cgroup tree (the kubelet's `cgroupRoot`).
    pub fn cgroup(&self) -> &str {
        &self.cgroup
    }

    /// The kubelet's device-plugin directory as the test process reaches it
    /// (through the holder's view): bind a plugin socket here and register
    /// it on `kubelet.sock` here.
    pub fn device_plugin_dir(&self) -> PathBuf {
        self.namespace_path("/var/lib/kubelet/device-plugins")
    }

    /// `path` of the node's mount namespace, as the test process reaches it.
    pub fn namespace_path(&self, path: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.holder_pid)).join(path.trim_start_matches('/'))
    }

    /// containerd's CDI spec directory: a spec written here names devices
    /// an `Allocate` answer may use.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    /// The node's own directory (its configuration and logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What container `container` of pod `namespace/pod` wrote so far, from
    /// the kubelet's log files (every restart's, in order); empty when
    /// there is none yet.
    pub fn container_log(&self, namespace: &str, pod: &str, container: &str) -> String {
        let mut text = String::new();
        for (_, line) in self.container_log_lines(namespace, pod, container) {
            text.push_str(&line);
            text.push('\n');
        }
        text
    }

    /// [`RealNode::container_log`] line by line, each with the time the
    /// container runtime logged it (RFC 3339, as in the CRI log file).
    pub fn container_log_lines(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
    ) -> Vec<(String, String)> {
        let prefix = format!("{namespace}_{pod}_");
        let mut lines = Vec::new();
        let Ok(pods) = std::fs::read_dir(self.dir.path().join("pod-logs")) else {
            return lines;
        };
        for entry in pods.flatten() {
            if !entry.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let mut files: Vec<PathBuf> = std::fs::read_dir(entry.path().join(container))
                .map(|d| d.flatten().map(|f| f.path()).collect())
                .unwrap_or_default();
            files.sort();
            for file in files {
                // CRI log lines: "<time> <stream> <tag> <text>".
                for line in std::fs::read_to_string(file).unwrap_or_default().lines() {
                    let mut parts = line.splitn(4, ' ');
                    let time = parts.next().unwrap_or("").to_string();
                    let text_part = parts.nth(2).unwrap_or("").to_string();
                    lines.push((time, text_part));
                }
            }
        }
        lines
    }

    /// Stops the kubelet (as a restart does: its containers keep running)
    /// and starts it again; waits until it serves again (its node Ready).
    pub async fn restart_kubelet(&mut self) -> anyhow::Result<()> {
        if let Some(mut kubelet) = self.kubelet.take() {
            kubelet.signal("TERM");
            let deadline = Instant::now() + Duration::from_secs(10);
            while kubelet.exited().is_none() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            kubelet.kill();
        }
        self.start_kubelet()?;
        self.wait_ready().await
    }

    /// The last lines of the kubelet's and containerd's logs, for a failure
    /// message.
    pub fn log_tails(&self, lines: usize) -> String {
        [&self.kubelet, &self.containerd]
            .into_iter()
            .flatten()
            .map(|p| p.log_tail(lines))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn wait_for_holder(&mut self) -> anyhow::Result<()> {
        let ready = self.dir.path().join("holder-ready");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready.exists() {
            if let Some(status) = self.holder.try_wait()? {
                let log =
                    std::fs::read_to_string(self.dir.path().join("holder.log")).unwrap_or_default();
                bail!("the node's namespace holder exited ({status}) before it was ready: {log}");
            }
            if Instant::now() > deadline {
                bail!("the node's namespace holder was not ready within 20 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.holder_pid = std::fs::read_to_string(self.dir.path().join("holder-pid"))?
            .trim()
            .parse()
            .context("the holder's pid")?;
        Ok(())
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    fn write_configs(&self, cni_bin: &Path) -> anyhow::Result<()> {
        let dir = self.dir.path();
        let d = |sub: &str| dir.join(sub).display().to_string();
        let containerd = format!(
            r#"version = 3
root = '{root}'
state = '{state}'

[grpc]
  address = '{socket}'

[plugins.'io.containerd.internal.v1.opt']
  path = '{opt}'

# NRI is on by default in containerd 2 and listens on the host's
# /var/run/nri/nri.sock: a node killed on drop leaves the socket file, and
# the next node's containerd then fails to start ("address already in
# use"). Each node gets its own.
[plugins.'io.containerd.nri.v1.nri']
  socket_path = '{nri}'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE_IMAGE}'

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ['{cdi}']
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '{runc}'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{cni_bin}']
    conf_dir = '{cni_conf}'
"#,
            root = d("containerd/root"),
            state = d("containerd/state"),
            socket = self.socket().display(),
            opt = d("containerd/opt"),
            nri = d("nri.sock"),
            cdi = d("cdi"),
            runc = self.assets.binary("runc").display(),
            cni_bin = cni_bin.display(),
            cni_conf = d("cni/conf"),
        );
        std::fs::write(dir.join("containerd.toml"), containerd)?;
        let cni = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "tether-test",
            "plugins": [{
                "type": "dummy",
                "ipam": {
                    "type": "host-local",
                    "dataDir": d("cni/data"),
                    "ranges": [[{"subnet": "10.244.0.0/24"}]],
                },
            }],
        });
        std::fs::write(dir.join("cni/conf/10-tether.conflist"), cni.to_string())?;
        let kubelet = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: {port}
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
readOnlyPort: 0
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://{socket}
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
failCgroupV1: false
failSwapOn: false
resolvConf: ""
podLogsDir: {logs}
volumePluginDir: {volumes}
evictionHard:
  memory.available: 1Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
"#,
            port = unused_port(),
            healthz = unused_port(),
            socket = self.socket().display(),
            cgroup = self.cgroup,
            logs = d("pod-logs"),
            volumes = d("volume-plugins"),
        );
        std::fs::write(dir.join("kubelet.yaml"), kubelet)?;
        Ok(())
    }

    /// A command run inside the node's namespace, in the node's cgroup
    /// tree (`pids` hierarchy) when `in_tree`.
    fn in_namespace(&self, program: &Path, in_tree: bool) -> Command {
        let mut command = Command::new("nsenter");
        command
            .arg("-t")
            .arg(self.holder_pid.to_string())
            .arg("-m")
            .arg("--");
        if in_tree {
            command.arg("sh").arg("-c").arg(format!(
                "echo $$ > /sys/fs/cgroup/pids/{}/daemons/cgroup.procs && exec \"$0\" \"$@\"",
                self.cgroup
            ));
        }
        command.arg(program);
        // containerd finds its shim on PATH.
        let path = std::env::var("PATH").unwrap_or_default();
        command.env("PATH", format!("{}:{path}", self.assets.bin_dir.display()));
        command
    }

    async fn start_containerd(&mut self) -> anyhow::Result<()> {
        let mut command = self.in_namespace(&self.assets.binary("containerd"), true);
        command
            .arg("--config")
            .arg(self.dir.path().join("containerd.toml"));
        let log = self.dir.path().join("containerd.log");
        self.containerd = Some(Process::spawn("containerd", command, &log, None)?);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = self
                .in_namespace(&self.assets.binary("ctr"), false)
                .arg("-a")
                .arg(self.socket())
                .arg("version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()?;
            if status.success() {
                return Ok(());
            }
            if let Some(status) = self.containerd.as_mut().and_then(Process::exited) {
                bail!("containerd exited ({status}):\n{}", self.log_tails(30));
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd did not serve within 30 s:\n{}",
                    self.log_tails(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn import_images(&self) -> anyhow::Result<()> {
        self.import_image(&self.assets.binary("node-images.tar"))
    }

    /// Imports an image archive (OCI layout or `docker save`) into the
    /// node's containerd, where the kubelet finds it by its name.
    pub fn import_image(&self, archive: &Path) -> anyhow::Result<()> {
        let output = self
            .in_namespace(&self.assets.binary("ctr"), false)
            .arg("-a")
            .arg(self.socket())
            .arg("-n")
            .arg("k8s.io")
            .arg("images")
            .arg("import")
            .arg(archive)
            .output()?;
        if !output.status.success() {
            bail!(
                "ctr images import failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }

    fn start_kubelet(&mut self) -> anyhow::Result<()> {
        let dir = self.dir.path();
        let mut command = self.in_namespace(&self.assets.binary("kubelet"), true);
        command
            .arg("--config")
            .arg(dir.join("kubelet.yaml"))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--root-dir")
            .arg("/var/lib/kubelet")
            .arg("--cert-dir")
            .arg(dir.join("pki"))
            .arg("--hostname-override")
            .arg(&self.name)
            .arg("--v=2");
        let log = dir.join("kubelet.log");
        self.kubelet = Some(Process::spawn_appending("kubelet", command, &log)?);
        Ok(())
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let deadline = Instant::now() + READY_DEADLINE;
        loop {
            if let Ok(Some(node)) = nodes.get_opt(&self.name).await
                && node_ready(&node)
            {
                return Ok(());
            }
            if let Some(status) = self.kubelet.as_mut().and_then(Process::exited) {
                bail!("the kubelet exited ({status}):\n{}", self.log_tails(40));
            }
            if Instant::now() > deadline {
                bail!(
                    "node {} was not Ready within {READY_DEADLINE:?}:\n{}",
                    self.name,
                    self.log_tails(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Whether the Node's `Ready` condition is `True`.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

impl Drop for RealNode {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.path().join("stop"), "");
        if let Some(mut kubelet) = self.kubelet.take() {
            kubelet.kill();
        }
        if let Some(mut containerd) = self.containerd.take() {
            containerd.kill();
        }
        // The holder sees the stop within half a second, cleans up and
        // exits, taking the namespace with it.
        let deadline = Instant::now() + Duration::from_secs(15);
        while matches!(self.holder.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(self.holder.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .arg("-KILL")
                .arg(self.holder_pid.to_string())
                .status();
            let _ = self.holder.kill();
        }
        let _ = self.holder.wait();
        // A holder that died (or was killed) before it cleaned up.
        if Path::new("/sys/fs/cgroup/pids").join(&self.cgroup).exists() {
            let _ = Command::new("sh")
                .arg(self.dir.path().join("cleanup.sh"))
                .arg(&self.cgroup)
                .status();
        }
    }
}

fn start_holder(dir: &Path, cgroup: &str, options: &NodeOptions) -> anyhow::Result<Child> {
    let log = std::fs::File::create(dir.join("holder.log"))?;
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(OUTER_SCRIPT)
        .arg("tether-node-outer")
        .arg(HOLDER_SCRIPT)
        .arg(std::process::id().to_string())
        .arg(dir)
        .arg(cgroup);
    for (name, major, minor) in &options.device_nodes {
        command.arg(format!("{name}:{major}:{minor}"));
    }
    use std::os::unix::process::CommandExt;
    command
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("cannot start the node's namespace holder")
}

/// The CNI plugins under the names containerd looks for (`dummy`, ...),
/// as links beside the unpacked `cni-*` binaries.
fn cni_bin_dir(assets: &Assets) -> anyhow::Result<PathBuf> {
    let dir = assets.bin_dir.join("cni");
    std::fs::create_dir_all(&dir)?;
    for name in ["dummy", "host-local", "loopback"] {
        let link = dir.join(name);
        if link.exists() {
            continue;
        }
        // Made under a name of this process and renamed: two test binaries
        // may do this at once.
        let partial = dir.join(format!(".{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&partial);
        std::os::unix::fs::symlink(assets.binary(&format!("cni-{name}")), &partial)?;
        std::fs::rename(&partial, &link)?;
    }
    Ok(dir)
}

/// Removes the cgroup trees of nodes whose test process is gone (killed
/// before its node's holder could clean up).
fn sweep_orphaned_trees() {
    let Ok(trees) = std::fs::read_dir("/sys/fs/cgroup/pids") else {
        return;
    };
    for tree in trees.flatten() {
        let name = tree.file_name().to_string_lossy().to_string();
        let Some(pid) = name
            .strip_prefix(CGROUP_PREFIX)
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if Path::new("/proc").join(pid).exists() {
            continue;
        }
        let _ = Command::new("sh")
            .arg("-c")
            .arg(CLEANUP_SCRIPT)
            .arg("tether-node-sweep")
            .arg(&name)
            .status();
    }
}

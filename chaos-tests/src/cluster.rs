//! Real `tetherd` processes on loopback, each with its own temp data dir, and
//! the controls the chaos runs need: `kill -9` and restart (optionally with
//! failpoints armed), SIGSTOP / SIGCONT, leader transfer, replacing a member
//! (remove, wipe, add a new id as learner, promote), and per-link network
//! faults through [`Proxy`]s. Everything is killed when the cluster drops,
//! and each replica also when the harness dies (`Process`'s watchdog).
//!
//! Ids are slots fixed at start (`slots` >= initial voters): each slot has
//! its ports and, when proxied, a proxy for every directed link to every
//! other slot, so a replica added later is reached through proxies too.
//! Ids are never reused: a replaced member's slot stays empty.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use tether_client::{Client, Options, proto as pb};
use tether_kube_testenv::Process;
use tether_kube_testenv::lazyfs::LazyFs;

use crate::proxy::{LinkMode, Proxy};

/// How to start a cluster.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The `tetherd` binary.
    pub tetherd: PathBuf,
    /// Replicas that bootstrap the cluster (ids 1..=voters).
    pub voters: usize,
    /// Ids that may ever run (>= voters); the rest are for replacements.
    pub slots: usize,
    /// Route every replica-to-replica link through a fault proxy.
    pub proxied: bool,
    /// More `tetherd` flags for every replica.
    pub extra_args: Vec<String>,
    /// FAILPOINTS for every start that does not set its own (a
    /// `failpoints` build only).
    pub failpoints: Option<String>,
    /// RUST_LOG of the replicas (`None` = warnings only).
    pub log_filter: Option<String>,
    /// Run the replicas with development tokens (`--auth-tokens`, the
    /// [`tokens`] module's): clients of the cluster then call as `admin`,
    /// or as another role through [`ProcessCluster::client_as`].
    pub tokens: bool,
    /// Each slot's data directory on a LazyFS mount of its own (mounted at
    /// the slot's first start), so that [`ProcessCluster::power_cut`] can
    /// drop what a replica had not fsynced.
    pub lazyfs: bool,
}

impl ClusterSpec {
    /// `voters` replicas of `tetherd` in as many slots, linked directly,
    /// with a 50 ms heartbeat and a 300 ms election timeout (a test that
    /// causes elections sees them end in well under a second); nothing
    /// else set. Change fields with `..ClusterSpec::quick(..)`.
    pub fn quick(tetherd: PathBuf, voters: usize) -> ClusterSpec {
        ClusterSpec {
            tetherd,
            voters,
            slots: voters,
            proxied: false,
            extra_args: vec![
                "--heartbeat-interval=50ms".into(),
                "--election-timeout=300ms".into(),
            ],
            failpoints: None,
            log_filter: None,
            tokens: false,
            lazyfs: false,
        }
    }
}

/// The bearer tokens of a cluster started with [`ClusterSpec::tokens`].
pub mod tokens {
    /// Role `replica`: what the replicas send each other.
    pub const REPLICA: &str = "chaos-replica-0123456789";
    /// Role `admin`: every chaos worker's.
    pub const ADMIN: &str = "chaos-admin-0123456789ab";
    /// Role `device-plugin:chaos-node-0`: a node's device plugin.
    pub const DEVICE_PLUGIN: &str = "chaos-plugin-0123456789a";
    /// The identity of [`DEVICE_PLUGIN`], as quota refusals name it.
    pub const DEVICE_PLUGIN_IDENTITY: &str = "token:device-plugin:chaos-node-0";
    /// Role `bridge`.
    pub const BRIDGE: &str = "chaos-bridge-0123456789a";

    /// The token file: one `TOKEN ROLE` line each.
    pub fn file() -> String {
        format!(
            "{REPLICA} replica\n{ADMIN} admin\n{DEVICE_PLUGIN} device-plugin:chaos-node-0\n\
             {BRIDGE} bridge\n"
        )
    }
}

/// One id's ports and process.
struct Replica {
    port: u16,
    http: u16,
    child: Option<Process>,
    paused: bool,
    /// Ever started (its data dir may hold a member's state).
    started: bool,
}

/// A cluster of `tetherd` child processes.
pub struct ProcessCluster {
    spec: ClusterSpec,
    replicas: BTreeMap<u64, Replica>,
    /// Each started slot's LazyFS (with [`ClusterSpec::lazyfs`]); dropped
    /// after the replicas, whose processes use it.
    disks: BTreeMap<u64, LazyFs>,
    proxies: BTreeMap<(u64, u64), Proxy>,
    /// gRPC endpoints of every slot, `127.0.0.1:PORT` (ids 1, 2, ...).
    pub endpoints: Vec<String>,
    initial_members: String,
    dir: tempfile::TempDir,
    /// The cluster's one bridge client ([`ProcessCluster::bridge_client`]).
    bridge: std::sync::OnceLock<Client>,
    /// Replicas that run another `tetherd` than the spec's (a rolling
    /// upgrade, [`ProcessCluster::restart_on`]).
    binaries: BTreeMap<u64, PathBuf>,
}

/// A loopback port for a replica or a proxy (`tether_kube_testenv`'s,
/// below the ephemeral range: a proxy or a client connection cannot take
/// it while its replica restarts).
pub(crate) fn free_port() -> u16 {
    tether_kube_testenv::unused_port()
}

/// The voters' ids in a replica's status.
fn voter_ids(status: &pb::StatusResponse) -> Vec<u64> {
    status
        .members
        .iter()
        .filter(|m| m.voter)
        .map(|m| m.node_id)
        .collect()
}

/// `tetherd` next to the running executable (same target directory).
pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    let dir = exe.parent().expect("a directory");
    // Examples and tests live one level deeper than the binaries.
    [
        dir.join(name),
        dir.parent().map(|d| d.join(name)).unwrap_or_default(),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| dir.join(name))
}

impl ProcessCluster {
    /// Starts `n` replicas that bootstrap one cluster, with direct links;
    /// waits for a leader.
    pub async fn start(tetherd: &Path, n: usize) -> anyhow::Result<ProcessCluster> {
        Self::start_spec(ClusterSpec {
            tetherd: tetherd.to_path_buf(),
            voters: n,
            slots: n,
            proxied: false,
            extra_args: Vec::new(),
            failpoints: None,
            log_filter: None,
            tokens: false,
            lazyfs: false,
        })
        .await
    }

    /// Starts a cluster as `spec` says; waits for a leader.
    pub async fn start_spec(spec: ClusterSpec) -> anyhow::Result<ProcessCluster> {
        anyhow::ensure!(
            spec.tetherd.exists(),
            "no tetherd at {} (cargo build -p tether-server)",
            spec.tetherd.display()
        );
        anyhow::ensure!(spec.voters >= 1 && spec.slots >= spec.voters);
        let dir = tempfile::tempdir()?;
        if spec.tokens {
            std::fs::write(dir.path().join("tokens"), tokens::file())?;
        }
        let mut replicas = BTreeMap::new();
        for id in 1..=spec.slots as u64 {
            replicas.insert(
                id,
                Replica {
                    port: free_port(),
                    http: free_port(),
                    child: None,
                    paused: false,
                    started: false,
                },
            );
        }
        let mut proxies = BTreeMap::new();
        if spec.proxied {
            for &from in replicas.keys() {
                for (&to, target) in &replicas {
                    if from != to {
                        let addr = SocketAddr::from(([127, 0, 0, 1], target.port));
                        proxies.insert((from, to), Proxy::start(addr, from * 1000 + to).await?);
                    }
                }
            }
        }
        let initial_members = replicas
            .iter()
            .take(spec.voters)
            .map(|(id, r)| format!("{id}=127.0.0.1:{}", r.port))
            .collect::<Vec<_>>()
            .join(",");
        let endpoints = replicas
            .values()
            .map(|r| format!("127.0.0.1:{}", r.port))
            .collect();
        let mut cluster = ProcessCluster {
            spec,
            replicas,
            disks: BTreeMap::new(),
            proxies,
            endpoints,
            initial_members,
            dir,
            bridge: std::sync::OnceLock::new(),
            binaries: BTreeMap::new(),
        };
        for id in 1..=cluster.spec.voters as u64 {
            cluster.spawn(id, None)?;
        }
        cluster.wait_for_leader(Duration::from_secs(60)).await?;
        Ok(cluster)
    }

    /// The gRPC address of `id`.
    pub fn addr(&self, id: u64) -> String {
        format!("127.0.0.1:{}", self.replicas[&id].port)
    }

    /// Where `id` keeps its data, as its `tetherd` sees it (on LazyFS, the
    /// mount point inside the replica's namespace).
    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("d{id}"))
    }

    /// `id`'s data as this process reaches it (through LazyFS's namespace
    /// when the data is on LazyFS).
    pub fn data_path(&self, id: u64) -> PathBuf {
        match self.disks.get(&id) {
            Some(disk) => disk.path(),
            None => self.data_dir(id),
        }
    }

    /// Every slot's id, running or not.
    pub fn slots(&self) -> Vec<u64> {
        (1..=self.spec.slots as u64).collect()
    }

    /// `id`'s log (stderr of all its runs, appended).
    pub fn log_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("tetherd-{id}.log"))
    }

    /// The last `lines` lines of `id`'s log.
    pub fn log_tail(&self, id: u64, lines: usize) -> String {
        // Lossy: a crash can cut a line in the middle of a character.
        let bytes = std::fs::read(self.log_path(id)).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// What `id`'s process is doing, for a schedule that could not finish
    /// (a replica that stops answering leaves no trace in its log): each
    /// thread's name, scheduler state (`D` is an uninterruptible wait, as
    /// on a FUSE mount that stopped answering) and kernel stack from
    /// `/proc`, then every thread's backtrace from `gdb` where it is
    /// installed. Bounded: gdb gets 60 s.
    pub fn thread_report(&self, id: u64) -> String {
        let Some(pid) = self.pid(id) else {
            return format!("tetherd {id}: not running\n");
        };
        let mut out = format!("tetherd {id}: pid {pid}\n");
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|dir| dir.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default();
        for task in tasks {
            let read = |name: &str| std::fs::read_to_string(task.join(name)).unwrap_or_default();
            let stat = read("stat");
            // Field 3 of stat, after the parenthesised name, is the state.
            let state = stat.rsplit_once(") ").map_or("?", |(_, rest)| &rest[..1]);
            out.push_str(&format!(
                "thread {} {:?} state {state} wchan {}\n{}",
                task.file_name().and_then(|n| n.to_str()).unwrap_or("?"),
                read("comm").trim(),
                read("wchan").trim(),
                read("stack"),
            ));
        }
        let gdb = Command::new("timeout")
            .args([
                "60",
                "gdb",
                "-batch",
                "-p",
                &pid.to_string(),
                "-ex",
                "thread apply all bt",
            ])
            .output();
        match gdb {
            Ok(o) => {
                out.push_str(&String::from_utf8_lossy(&o.stdout));
                out.push_str(&String::from_utf8_lossy(&o.stderr));
            }
            Err(err) => out.push_str(&format!("no backtraces: gdb: {err}\n")),
        }
        out
    }

    /// The part of a [`Self::thread_report`] worth printing where only the
    /// output survives (CI): the count of threads per state, every thread
    /// stuck in the kernel (`D`) with its kernel stack, and the first frames
    /// of each backtrace that runs through Tether's own code.
    pub fn thread_digest(report: &str) -> String {
        let mut states: BTreeMap<String, usize> = BTreeMap::new();
        let mut out = String::new();
        let mut in_stuck = false;
        for line in report.lines() {
            if line.starts_with("thread ") {
                let state = line
                    .split_once(" state ")
                    .map_or("?", |(_, rest)| rest.split(' ').next().unwrap_or("?"));
                *states.entry(state.to_string()).or_default() += 1;
                in_stuck = state == "D";
                if in_stuck {
                    out.push_str(line);
                    out.push('\n');
                }
            } else if in_stuck && line.starts_with('[') {
                out.push_str(line);
                out.push('\n');
            } else {
                in_stuck = false;
            }
        }
        for block in report.split("\nThread ").skip(1) {
            if block.contains("tether_") {
                out.push_str("Thread ");
                for line in block.lines().take(16) {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        let counts: Vec<String> = states.iter().map(|(s, n)| format!("{n} {s}")).collect();
        format!("threads by state: {}\n{out}", counts.join(", "))
    }

    /// Keeps the data and logs after the cluster is dropped; returns where.
    pub fn keep(&mut self) -> PathBuf {
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("a temp dir"));
        dir.keep()
    }

    /// Starts `id`'s process; `failpoints` is the FAILPOINTS setting (only
    /// a `failpoints` build acts on it).
    fn spawn(&mut self, id: u64, failpoints: Option<&str>) -> anyhow::Result<()> {
        let tetherd = self.binaries.get(&id).unwrap_or(&self.spec.tetherd).clone();
        let mut command = if self.spec.lazyfs {
            self.disk(id)?.command(&tetherd)
        } else {
            Command::new(&tetherd)
        };
        let replica = &self.replicas[&id];
        command
            .arg(format!("--node-id={id}"))
            .arg(format!("--listen=127.0.0.1:{}", replica.port))
            .arg(format!("--http-listen=127.0.0.1:{}", replica.http))
            .arg(format!("--data-dir={}", self.data_dir(id).display()))
            .arg(format!("--initial-members={}", self.initial_members))
            .args(&self.spec.extra_args)
            .args(
                self.spec
                    .tokens
                    .then(|| format!("--auth-tokens={}", self.dir.path().join("tokens").display())),
            )
            .env(
                "RUST_LOG",
                self.spec.log_filter.as_deref().unwrap_or("warn"),
            )
            .env_remove("FAILPOINTS");
        if self.spec.proxied {
            let dial = self
                .proxies
                .iter()
                .filter(|((from, _), _)| *from == id)
                .map(|((_, to), proxy)| format!("{to}={}", proxy.addr))
                .collect::<Vec<_>>()
                .join(",");
            command.arg(format!("--peer-dial={dial}"));
        }
        if let Some(failpoints) = failpoints.or(self.spec.failpoints.as_deref()) {
            command.env("FAILPOINTS", failpoints);
        }
        let child = Process::spawn_appending(&format!("tetherd-{id}"), command, &self.log_path(id))
            .with_context(|| format!("starting {}", tetherd.display()))?;
        let replica = self.replicas.get_mut(&id).expect("a slot");
        replica.child = Some(child);
        replica.paused = false;
        replica.started = true;
        Ok(())
    }

    /// A client of every slot, with short retry budgets so calls during
    /// faults end (as unknown) instead of waiting for the fault to heal.
    pub fn client(&self) -> Client {
        self.client_with(Duration::from_secs(60))
    }

    /// A client whose calls retry for at most `retry_timeout` (as `admin`
    /// on a cluster with tokens).
    pub fn client_with(&self, retry_timeout: Duration) -> Client {
        self.client_as(tokens::ADMIN, retry_timeout)
    }

    /// A client calling with bearer `token` (on a cluster with tokens; on
    /// one without, the token is not sent).
    pub fn client_as(&self, token: &str, retry_timeout: Duration) -> Client {
        let options = Options {
            call_timeout: Duration::from_secs(2).min(retry_timeout),
            retry_timeout,
            bearer_token: self.spec.tokens.then(|| token.to_string()),
            ..Options::default()
        };
        Client::new(self.endpoints.clone(), options).expect("endpoints are valid")
    }

    /// The cluster's bridge, as one long-lived process has it: the same
    /// client (one session) for every run on this cluster, calling as the
    /// `bridge` role on a cluster with tokens. Its calls retry for 800 ms,
    /// as the runs' workers' do, so a fault in force at a run's end does
    /// not hold up the wind-down.
    pub fn bridge_client(&self) -> Client {
        self.bridge
            .get_or_init(|| self.client_as(tokens::BRIDGE, Duration::from_millis(800)))
            .clone()
    }

    /// Whether the replicas run with development tokens.
    pub fn has_tokens(&self) -> bool {
        self.spec.tokens
    }

    /// Ids with a process (running or paused).
    pub fn running(&self) -> Vec<u64> {
        self.replicas
            .iter()
            .filter(|(_, r)| r.child.is_some())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Ids with a process that is not paused.
    pub fn live(&self) -> Vec<u64> {
        self.replicas
            .iter()
            .filter(|(_, r)| r.child.is_some() && !r.paused)
            .map(|(id, _)| *id)
            .collect()
    }

    /// The process id of `id`'s running `tetherd`.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.replicas
            .get(&id)
            .and_then(|r| r.child.as_ref())
            .map(|c| c.id())
    }

    /// `kill -9`.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut child) = self.replicas.get_mut(&id).and_then(|r| r.child.take()) {
            child.kill();
        }
    }

    /// Sets (`Some(actions)`, as in `FAILPOINTS`) or removes (`None`)
    /// failpoint `name` in `id`'s running process through its HTTP port
    /// (`PUT` / `DELETE /failpoints/{name}`, served by `failpoints` builds
    /// only).
    ///
    /// One HTTP/1.1 request over a blocking loopback socket, written out
    /// here rather than pulling in an HTTP client for it: the harness sends
    /// a handful per run to its own replicas, and `heal` is not async.
    pub fn set_failpoint(&self, id: u64, name: &str, actions: Option<&str>) -> anyhow::Result<()> {
        let (method, body) = match actions {
            Some(actions) => ("PUT", actions),
            None => ("DELETE", ""),
        };
        let path = format!("/failpoints/{name}");
        let (status, _) = self.http(id, method, &path, body)?;
        anyhow::ensure!(
            status.contains(" 200 "),
            "replica {id}: {method} {path} answered {status:?} (a failpoints build?)"
        );
        Ok(())
    }

    /// Replica `id`'s `/metrics` (OpenMetrics text).
    pub fn metrics_text(&self, id: u64) -> anyhow::Result<String> {
        let (status, answer) = self.http(id, "GET", "/metrics", "")?;
        anyhow::ensure!(
            status.contains(" 200 "),
            "replica {id}: GET /metrics answered {status:?}"
        );
        Ok(answer
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_string())
            .unwrap_or_default())
    }

    /// One request to replica `id`'s HTTP port: its status line and the
    /// whole answer.
    fn http(
        &self,
        id: u64,
        method: &str,
        path: &str,
        body: &str,
    ) -> anyhow::Result<(String, String)> {
        use std::io::{Read, Write};
        let replica = self.replicas.get(&id).context("no such replica")?;
        let addr = SocketAddr::from(([127, 0, 0, 1], replica.http));
        let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .with_context(|| format!("replica {id}'s HTTP port"))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        let status = answer.lines().next().unwrap_or_default().to_string();
        Ok((status, answer))
    }

    /// Starts a stopped replica again with its data.
    pub fn restart(&mut self, id: u64, failpoints: Option<&str>) -> anyhow::Result<()> {
        self.kill(id);
        self.spawn(id, failpoints)
    }

    /// Stops replica `id` (SIGKILL) and starts it again with its data on
    /// another `tetherd` build, which it keeps from then on.
    pub fn restart_on(&mut self, id: u64, tetherd: &Path) -> anyhow::Result<()> {
        anyhow::ensure!(tetherd.exists(), "no tetherd at {}", tetherd.display());
        self.binaries.insert(id, tetherd.to_path_buf());
        self.restart(id, None)
    }

    /// How replica `id`'s process ended, if it has (then it is marked
    /// stopped); None while it runs or when it has no process.
    pub fn exit_status(&mut self, id: u64) -> Option<std::process::ExitStatus> {
        let replica = self.replicas.get_mut(&id)?;
        let status = replica.child.as_mut()?.exited()?;
        replica.child = None;
        Some(status)
    }

    /// Ids whose process exited on its own (a failpoint crash); they are
    /// marked stopped.
    pub fn reap_exited(&mut self) -> Vec<u64> {
        let mut exited = Vec::new();
        for (id, replica) in &mut self.replicas {
            if let Some(child) = replica.child.as_mut()
                && child.exited().is_some()
            {
                replica.child = None;
                exited.push(*id);
            }
        }
        exited
    }

    fn signal(&mut self, id: u64, signal: &str, paused: bool) {
        let Some(replica) = self.replicas.get_mut(&id) else {
            return;
        };
        if let Some(child) = &replica.child {
            child.signal(signal);
            replica.paused = paused;
        }
    }

    /// SIGSTOP: the process freezes with its sockets open. Returns once the
    /// kernel shows it stopped (a signal is delivered asynchronously), or
    /// gone (a process that already exited stops nothing). Polls with the
    /// runtime's sleep: the proxies and clients of the run share this
    /// process's runtime, and a blocked worker thread stalls them.
    pub async fn pause(&mut self, id: u64) {
        self.signal(id, "STOP", true);
        let Some(pid) = self
            .replicas
            .get(&id)
            .and_then(|r| r.child.as_ref())
            .map(|c| c.id())
        else {
            return;
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            // Field 3 of /proc/PID/stat is the state; T = stopped.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            // T: stopped; Z, X: exited (not reaped yet); none: gone.
            if matches!(state, None | Some('T' | 'Z' | 'X')) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// SIGCONT.
    pub fn resume(&mut self, id: u64) {
        self.signal(id, "CONT", false);
    }

    /// Sets one directed link's mode (no-op when not proxied).
    pub fn set_link(&self, from: u64, to: u64, mode: LinkMode) {
        if let Some(proxy) = self.proxies.get(&(from, to))
            && proxy.mode() != mode
        {
            proxy.set(mode);
        }
    }

    /// Cuts every link between the two groups, both ways.
    pub fn partition(&self, side_a: &[u64], side_b: &[u64]) {
        for &a in side_a {
            for &b in side_b {
                self.set_link(a, b, LinkMode::Blackhole);
                self.set_link(b, a, LinkMode::Blackhole);
            }
        }
    }

    /// Every link back to pass, every paused replica resumed.
    pub fn heal_network(&mut self) {
        for proxy in self.proxies.values() {
            if proxy.mode() != LinkMode::Pass {
                proxy.set(LinkMode::Pass);
            }
        }
        let paused: Vec<u64> = self
            .replicas
            .iter()
            .filter(|(_, r)| r.paused)
            .map(|(id, _)| *id)
            .collect();
        for id in paused {
            self.resume(id);
        }
    }

    /// Status of every live replica that answers within a second.
    pub async fn statuses(&self, client: &Client) -> BTreeMap<u64, pb::StatusResponse> {
        let mut out = BTreeMap::new();
        for id in self.live() {
            let addr = self.addr(id);
            let call = client.status_of(&addr);
            if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(1), call).await {
                out.insert(id, status);
            }
        }
        out
    }

    /// The current leader as the live replicas see it.
    pub async fn leader(&self, client: &Client) -> Option<pb::StatusResponse> {
        self.statuses(client)
            .await
            .into_values()
            .find(|s| s.role == "leader")
    }

    /// Waits until some replica is leader.
    pub async fn wait_for_leader(&self, within: Duration) -> anyhow::Result<pb::StatusResponse> {
        let client = self.client_with(Duration::from_secs(1));
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(leader) = self.leader(&client).await {
                return Ok(leader);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "no leader within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until one leader is agreed on and every running member has
    /// applied everything in its log: the state to check histories against.
    pub async fn wait_converged(&self, within: Duration) -> anyhow::Result<pb::StatusResponse> {
        let client = self.client_with(Duration::from_secs(1));
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let statuses = self.statuses(&client).await;
            let last;
            if let Some(leader) = statuses.values().find(|s| s.role == "leader") {
                let target = leader.last_log_index;
                let behind: Vec<String> = leader
                    .members
                    .iter()
                    .filter(|m| self.running().contains(&m.node_id))
                    .filter_map(|m| match statuses.get(&m.node_id) {
                        Some(s) if s.applied_index >= target && s.leader_id == leader.node_id => {
                            None
                        }
                        Some(s) => Some(format!(
                            "{} applied {} (leader {})",
                            m.node_id, s.applied_index, s.leader_id
                        )),
                        None => Some(format!("{} did not answer", m.node_id)),
                    })
                    .collect();
                if behind.is_empty() && leader.applied_index >= target {
                    return Ok(leader.clone());
                }
                last = format!(
                    "leader {} at {target}; {}",
                    leader.node_id,
                    behind.join(", ")
                );
            } else {
                last = format!("no leader among {:?}", statuses.keys().collect::<Vec<_>>());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "not converged within {within:?}: {last}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until replica `id` has applied what the leader had applied when
    /// the wait began. Unlike [`Self::wait_converged`] this needs no pause in
    /// the writes: under a running workload the leader always has entries
    /// in flight, so "everyone applied the whole log" may never be seen.
    pub async fn wait_caught_up(&self, id: u64, within: Duration) -> anyhow::Result<()> {
        let client = self.client_with(Duration::from_secs(1));
        let deadline = tokio::time::Instant::now() + within;
        let target = loop {
            if let Some(leader) = self.leader(&client).await {
                break leader.applied_index;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "no leader within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        loop {
            let addr = self.addr(id);
            let applied =
                match tokio::time::timeout(Duration::from_secs(1), client.status_of(&addr)).await {
                    Ok(Ok(status)) => status.applied_index,
                    _ => 0,
                };
            if applied >= target {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "replica {id} applied {applied} of {target} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Voters of the current membership, from the leader.
    pub async fn voters(&self, client: &Client) -> Vec<u64> {
        self.leader(client)
            .await
            .map_or_else(Vec::new, |leader| voter_ids(&leader))
    }

    /// Replaces voter `old` the way an operator replaces a member whose
    /// disk was lost: remove it, wipe it, start a fresh id, add it as a
    /// learner, promote it. Returns the new id; `None` when no slot is left.
    pub async fn replace(&mut self, old: u64) -> anyhow::Result<Option<u64>> {
        if self.spare_slot().is_none() {
            return Ok(None);
        }
        let client = self.client_with(Duration::from_secs(30));
        // Right after a crash or a partition heals there may be no leader
        // for an election timeout, and then no membership to read.
        let leader = self
            .wait_for_leader(Duration::from_secs(30))
            .await
            .context("replacing a member needs a leader")?;
        let voters = voter_ids(&leader);
        anyhow::ensure!(voters.contains(&old), "{old} is not a voter of {voters:?}");
        let remaining: Vec<u64> = voters.iter().copied().filter(|v| *v != old).collect();
        client
            .change_membership(remaining.clone(), false)
            .await
            .context("removing the old member")?;
        self.wipe(old);
        self.add_member(remaining).await
    }

    /// An id never started yet.
    pub fn spare_slot(&self) -> Option<u64> {
        self.replicas
            .iter()
            .find(|(_, r)| !r.started)
            .map(|(id, _)| *id)
    }

    /// Kills `id` and deletes its data (a lost disk); its id is not reused.
    pub fn wipe(&mut self, id: u64) {
        self.kill(id);
        match self.disks.get(&id) {
            // The mount's root stays; what is in it goes, through LazyFS.
            Some(disk) => {
                for entry in std::fs::read_dir(disk.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let _ = std::fs::remove_dir_all(entry.path())
                        .or_else(|_| std::fs::remove_file(entry.path()));
                }
            }
            None => {
                let _ = std::fs::remove_dir_all(self.data_dir(id));
            }
        }
    }

    /// `id`'s LazyFS, mounted on first use over `disk-<id>` in the
    /// cluster's directory, at its data directory.
    fn disk(&mut self, id: u64) -> anyhow::Result<&LazyFs> {
        if !self.disks.contains_key(&id) {
            let dir = self.dir.path();
            let disk = LazyFs::mount(
                dir,
                &format!("lazyfs-{id}"),
                &dir.join(format!("disk-{id}")),
                &self.data_dir(id),
            )
            .map_err(anyhow::Error::msg)?;
            self.disks.insert(id, disk);
        }
        Ok(&self.disks[&id])
    }

    /// A power cut on `id`: `kill -9`, then every write it had not fsynced
    /// is lost (its LazyFS cache cleared). Restart it with
    /// [`ProcessCluster::restart`]. Needs [`ClusterSpec::lazyfs`].
    pub fn power_cut(&mut self, id: u64) -> anyhow::Result<()> {
        anyhow::ensure!(self.spec.lazyfs, "a power cut needs the data on LazyFS");
        self.kill(id);
        if let Some(disk) = self.disks.get(&id) {
            disk.clear_cache().map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }

    /// Whether the replicas' data is on LazyFS.
    pub fn on_lazyfs(&self) -> bool {
        self.spec.lazyfs
    }

    /// Starts a spare id empty, adds it as a learner and promotes it next to
    /// `voters`. Returns its id; `None` when no slot is left.
    pub async fn add_member(&mut self, voters: Vec<u64>) -> anyhow::Result<Option<u64>> {
        let Some(new) = self.spare_slot() else {
            return Ok(None);
        };
        let client = self.client_with(Duration::from_secs(30));
        self.spawn(new, None)?;
        client
            .add_learner(new, &self.addr(new), true)
            .await
            .context("adding the new member as a learner")?;
        let mut promoted = voters;
        promoted.push(new);
        client
            .change_membership(promoted, false)
            .await
            .context("promoting the new member")?;
        Ok(Some(new))
    }
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        let ids: Vec<u64> = self.replicas.keys().copied().collect();
        for id in ids {
            // A stopped process cannot be killed until it is continued.
            self.resume(id);
            self.kill(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ProcessCluster;

    #[test]
    fn a_thread_digest_names_stuck_threads_and_tethers_frames_only() {
        let report = "tetherd 2: pid 7\n\
            thread 7 \"tetherd\" state S wchan futex_do_wait\n\
            [<0>] futex_wait_queue+0x60/0x90\n\
            thread 9 \"rocksdb:low\" state D wchan fuse_request_end\n\
            [<0>] request_wait_answer+0x1d/0x40\n\
            [<0>] fuse_simple_request+0x5c/0x90\n\
            \n\
            Thread 2 (Thread 0x1 (LWP 9) \"rocksdb:low\"):\n\
            #0  syscall ()\n\
            #1  rocksdb::port::CondVar::Wait ()\n\
            \n\
            Thread 1 (Thread 0x2 (LWP 7) \"tetherd\"):\n\
            #0  futex_wait ()\n\
            #1  tether_server::store::state_machine::StateHandle::read ()\n";
        let digest = ProcessCluster::thread_digest(report);
        assert!(
            digest.starts_with("threads by state: 1 D, 1 S\n"),
            "{digest}"
        );
        assert!(
            digest.contains("state D wchan fuse_request_end"),
            "{digest}"
        );
        assert!(digest.contains("fuse_simple_request"), "{digest}");
        assert!(!digest.contains("futex_wait_queue"), "{digest}");
        assert!(digest.contains("StateHandle::read"), "{digest}");
        assert!(!digest.contains("rocksdb::port::CondVar"), "{digest}");
    }
}

//! The filter verb: which of the scheduler's candidate nodes have enough
//! free devices of every kind a pod asks for, judged from the watched copy
//! of the claims and inventories (Tether read directly while the copy is
//! not whole), with a reason for every node refused; and the refusals
//! remembered, so a refused pod is asked about again when devices free.

use super::*;

/// Why each node that cannot take `needed` devices for `pod_uid` fails.
/// A node's devices are its inventory (`inventory`: node -> device ids, or
/// why they could not be read); its free devices are those no other pod
/// claims (`claims`: node -> device -> pod uid; the pod's own claim counts
/// as free, so a retried bind still fits). Needing more than a node has at
/// all is unresolvable; needing more than is free now is not (pods may end
/// or be preempted), nor is a node whose inventory could not be read.
pub fn unfit_nodes(
    candidates: &[String],
    needed: usize,
    inventory: &BTreeMap<String, Result<Vec<String>, String>>,
    claims: &BTreeMap<String, BTreeMap<String, String>>,
    pod_uid: &str,
    resource: &str,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let (mut failed, mut unresolvable) = (BTreeMap::new(), BTreeMap::new());
    for node in candidates {
        let devices = inventory
            .get(node)
            .map(|read| read.as_deref().map_err(String::as_str));
        match unfit_node(node, needed, devices, claims.get(node), pod_uid, resource) {
            Some(Unfit::Now(why)) => {
                failed.insert(node.clone(), why);
            }
            Some(Unfit::Never(why)) => {
                unresolvable.insert(node.clone(), why);
            }
            None => {}
        }
    }
    (failed, unresolvable)
}

/// A filter call's judgement of its candidates.
#[derive(Debug, Default)]
struct Verdicts {
    /// Nodes that do not fit now, and why.
    failed: BTreeMap<String, String>,
    /// Nodes that can never fit the pod, and why.
    unresolvable: BTreeMap<String, String>,
    /// How many devices each failed node has, where they were read (what
    /// a refusal remembers).
    device_counts: BTreeMap<String, usize>,
}

impl Verdicts {
    pub(super) fn note(
        &mut self,
        node: &str,
        unfit: Option<Unfit>,
        devices: Option<Result<&[String], &str>>,
    ) {
        match unfit {
            Some(Unfit::Now(why)) => {
                self.failed.insert(node.to_string(), why);
                if let Some(Ok(devices)) = devices {
                    self.device_counts.insert(node.to_string(), devices.len());
                }
            }
            Some(Unfit::Never(why)) => {
                self.unresolvable.insert(node.to_string(), why);
            }
            None => {}
        }
    }
}

/// Why `node` cannot take `needed` devices for `pod_uid`, or None if it
/// can ([`unfit_nodes`] for one node): `devices` its device ids (None:
/// unknown; `Err`: why they could not be read), `claims` its claims of live
/// pods (device -> pod uid).
pub fn unfit_node(
    node: &str,
    needed: usize,
    devices: Option<Result<&[String], &str>>,
    claims: Option<&BTreeMap<String, String>>,
    pod_uid: &str,
    resource: &str,
) -> Option<Unfit> {
    if needed == 0 {
        return None;
    }
    let node_devices = match devices {
        Some(Ok(devices)) => devices,
        Some(Err(why)) => return Some(Unfit::Now(why.to_string())),
        None => {
            return Some(Unfit::Now(format!(
                "the {resource} devices of node {node} are unknown"
            )));
        }
    };
    if needed > node_devices.len() {
        return Some(Unfit::Never(format!(
            "the pod needs {needed} {resource} devices; the node has {}",
            node_devices.len()
        )));
    }
    // Counted without copying: this runs for every candidate of every
    // filter call.
    let taken_by_another = |device: &String| {
        claims
            .and_then(|c| c.get(device))
            .is_some_and(|uid| uid != pod_uid)
    };
    if node_devices.iter().filter(|d| !taken_by_another(d)).count() >= needed {
        return None;
    }
    // Refused: `pick_free` says why, in its words.
    let taken: std::collections::BTreeSet<String> = claims
        .into_iter()
        .flatten()
        .filter(|(_, uid)| *uid != pod_uid)
        .map(|(device, _)| device.clone())
        .collect();
    pick_free(node_devices, &taken, needed)
        .err()
        .map(|why| Unfit::Now(format!("{resource}: {why} {REFUSED_MARK}")))
}

/// Adds `why` to `node`'s reasons in `reasons` (a node may be refused for
/// more than one device kind).
pub(super) fn add_reason(reasons: &mut BTreeMap<String, String>, node: &str, why: &str) {
    match reasons.get_mut(node) {
        Some(reasons) => {
            reasons.push_str("; ");
            reasons.push_str(why);
        }
        None => {
            reasons.insert(node.to_string(), why.to_string());
        }
    }
}

impl<B: Binder> Extender<B> {
    /// The device ids of `kind` of `nodes` from their Node objects (read
    /// unless read within the inventory TTL), a few at a time.
    pub(super) async fn read_node_devices(
        &self,
        kind: &Kind,
        nodes: Vec<&String>,
    ) -> Vec<(String, Result<Vec<String>, String>)> {
        use futures::StreamExt as _;
        let ttl = self.config.inventory_ttl;
        let reads = nodes.into_iter().cloned().map(|name| async move {
            let devices = self.devices_of(kind, &name, ttl).await;
            (name, devices)
        });
        futures::stream::iter(reads)
            .buffer_unordered(NODE_READS_IN_FLIGHT)
            .collect()
            .await
    }

    /// The candidates judged from Tether read directly (while the watched
    /// copy is not whole): every live claim and every published inventory
    /// listed, the Node objects of the candidates `inventory` lacks read.
    async fn judge_from_tether(
        &self,
        kind: &Kind,
        candidates: &[String],
        needed: usize,
        mut inventory: BTreeMap<String, Result<Vec<String>, String>>,
        uid: &str,
    ) -> Result<Verdicts, String> {
        let claims = kind
            .ledger
            .live_claims_by_node()
            .await
            .map_err(|err| format!("cannot read the device claims: {err}"))?;
        let published = published_inventories(&self.client, &kind.spec.inventory_set)
            .await
            .map_err(|err| format!("cannot read the devices the nodes published: {err}"))?;
        let unread: Vec<&String> = candidates
            .iter()
            .filter(|n| !inventory.contains_key(*n))
            .collect();
        let read = self.read_node_devices(kind, unread).await;
        inventory.extend(read);
        for (node, ids) in inventory.iter_mut() {
            if let Some(devices) = published.get(node) {
                *ids = Ok(healthy_ids(devices));
            }
        }
        let mut verdicts = Verdicts::default();
        for node in candidates {
            let devices = inventory
                .get(node)
                .map(|read| read.as_deref().map_err(String::as_str));
            let unfit = unfit_node(
                node,
                needed,
                devices,
                claims.get(node),
                uid,
                &kind.spec.resource,
            );
            verdicts.note(node, unfit, devices);
        }
        Ok(verdicts)
    }

    /// Records a pod that no candidate fits because devices are claimed
    /// (the scheduler parks it until some event; [`crate::requeue`] makes
    /// one when devices free up), or forgets it once a node fits. `judged`
    /// is, per kind the pod asks for: the kind's index, how many devices
    /// it needs, and the kind's verdicts. The refusal is of the first kind
    /// that refused nodes for want of free devices.
    fn note_refusal(
        &self,
        pod: &KubePod,
        judged: &[(usize, usize, Verdicts)],
        candidates: &[String],
        fits: &dyn Fn(&str) -> bool,
    ) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if uid.is_empty() {
            return;
        }
        if candidates.iter().any(|n| fits(n)) {
            self.refusals.settled(&uid);
            return;
        }
        // Every kind the pod asks for, and each node's kinds refused for
        // claimed devices (those whose devices were read): the pod is asked
        // about again once a node has every kind it was short of there.
        let mut needs = BTreeMap::new();
        let mut nodes: BTreeMap<String, BTreeMap<usize, usize>> = BTreeMap::new();
        for (kind, needed, verdicts) in judged {
            needs.insert(*kind, *needed);
            for node in verdicts.failed.keys() {
                if let Some(count) = verdicts.device_counts.get(node) {
                    nodes.entry(node.clone()).or_default().insert(*kind, *count);
                }
            }
        }
        if !nodes.is_empty() {
            self.refusals
                .refused(Refusal::of(pod, uid, needs, nodes, false));
        }
    }

    /// The filter verb: drops the candidate nodes without enough free
    /// devices for the pod, of every kind it asks for, with a reason for
    /// each (a stopped pod's claim counts free), and remembers a pod it
    /// leaves without any node.
    pub async fn filter(&self, args: ExtenderArgs) -> ExtenderFilterResult {
        let started = Instant::now();
        let (result, cpu) = crate::cpu_time::CpuTimed::new(self.filter_nodes(args)).await;
        self.metrics.filter(
            result.error.is_empty(),
            started.elapsed().as_secs_f64(),
            cpu.as_secs_f64(),
        );
        result
    }

    pub(super) async fn filter_nodes(&self, args: ExtenderArgs) -> ExtenderFilterResult {
        let Some(pod) = args.pod else {
            return ExtenderFilterResult {
                error: "filter request without a Pod".into(),
                ..Default::default()
            };
        };
        // (kind index, devices needed) of each kind the pod asks for.
        let mut needs = Vec::new();
        for (index, kind) in self.kinds.iter().enumerate() {
            match kubelet::demands(&pod, &kind.spec.resource) {
                Ok(demands) => {
                    let needed = kubelet::admission(&demands).devices() as usize;
                    if needed > 0 {
                        needs.push((index, needed));
                    }
                }
                Err(err) => {
                    return ExtenderFilterResult {
                        error: err,
                        ..Default::default()
                    };
                }
            }
        }
        let candidates: Vec<String> = match (&args.node_names, &args.nodes) {
            (Some(names), _) => names.clone(),
            (None, Some(list)) => list
                .items
                .iter()
                .filter_map(|n| n.metadata.name.clone())
                .collect(),
            (None, None) => Vec::new(),
        };
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        // A node fits when it fits every kind the pod asks for.
        let mut judged = Vec::with_capacity(needs.len());
        for (index, needed) in needs {
            let kind = &self.kinds[index];
            match self
                .judge(kind, &candidates, needed, args.nodes.as_ref(), uid)
                .await
            {
                Ok(verdicts) => judged.push((index, needed, verdicts)),
                Err(error) => {
                    return ExtenderFilterResult {
                        error,
                        ..Default::default()
                    };
                }
            }
        }
        let (mut failed, mut unresolvable) = (BTreeMap::new(), BTreeMap::<String, String>::new());
        for (_, _, verdicts) in &judged {
            for (node, why) in &verdicts.unresolvable {
                add_reason(&mut unresolvable, node, why);
            }
            for (node, why) in &verdicts.failed {
                add_reason(&mut failed, node, why);
            }
        }
        failed.retain(|node, _| !unresolvable.contains_key(node));
        let fits = |name: &str| !failed.contains_key(name) && !unresolvable.contains_key(name);
        if !judged.is_empty() {
            self.note_refusal(&pod, &judged, &candidates, &fits);
        }
        ExtenderFilterResult {
            node_names: args
                .node_names
                .map(|names| names.into_iter().filter(|n| fits(n)).collect()),
            nodes: args.nodes.map(|mut list| {
                list.items
                    .retain(|n| n.metadata.name.as_deref().is_some_and(fits));
                list
            }),
            failed_nodes: failed,
            failed_and_unresolvable_nodes: unresolvable,
            error: String::new(),
        }
    }

    /// Judges `candidates` for `needed` devices of `kind` (for the pod
    /// `uid`): from the watched copy when it is whole, else from Tether.
    /// `nodes` are the candidates' Node objects when the scheduler sent
    /// them.
    async fn judge(
        &self,
        kind: &Kind,
        candidates: &[String],
        needed: usize,
        nodes: Option<&k8s_openapi::List<KubeNode>>,
        uid: &str,
    ) -> Result<Verdicts, String> {
        let mut inventory = BTreeMap::new();
        // Reads past their TTL go, so nodes that left the cluster do not
        // stay in the cache for ever; the pass costs what the call's own
        // candidate list does.
        kind.inventory
            .lock()
            .expect("inventory lock")
            .retain(|_, (read, _)| read.elapsed() <= self.config.inventory_ttl);
        let resource = kind.spec.resource.as_str();
        // One pass under the copy's lock (when it is whole), from references
        // into it: the candidates whose plugin published its devices are
        // judged by what they published; the others (usually none) are
        // judged below from their Node objects.
        let in_view = kind.view.read(|pins| {
            let mut verdicts = Verdicts::default();
            let mut unpublished = Vec::new();
            for node in candidates {
                // Most candidates of a filter call fit, and the copy keeps
                // each node's free count: one look, not one per device.
                if pins.free(node).is_some_and(|free| free >= needed) {
                    continue;
                }
                match pins.healthy(node) {
                    Some(healthy) => {
                        let devices = Some(Ok(healthy));
                        let unfit =
                            unfit_node(node, needed, devices, pins.claims_on(node), uid, resource);
                        verdicts.note(node, unfit, devices);
                    }
                    None => unpublished.push(node),
                }
            }
            (verdicts, unpublished)
        });
        let unread: Vec<&String> = match &in_view {
            Some((_, unpublished)) => unpublished.clone(),
            None => candidates.iter().collect(),
        };
        match nodes {
            Some(list) => {
                let wanted: std::collections::BTreeSet<&str> =
                    unread.iter().map(|name| name.as_str()).collect();
                for node in &list.items {
                    if let Some(name) = node.metadata.name.as_deref()
                        && wanted.contains(name)
                    {
                        inventory.insert(name.to_string(), self.remember(kind, node));
                    }
                }
            }
            None => {
                inventory.extend(self.read_node_devices(kind, unread).await);
            }
        }
        let Some((mut verdicts, unpublished)) = in_view else {
            return self
                .judge_from_tether(kind, candidates, needed, inventory, uid)
                .await;
        };
        if unpublished.is_empty() {
            return Ok(verdicts);
        }
        // The unpublished candidates, by their Node objects (or what they
        // published meanwhile), against the copy's claims.
        let judged = kind.view.read(|pins| {
            for node in unpublished {
                let devices = match pins.healthy(node) {
                    Some(healthy) => Some(Ok(healthy)),
                    None => inventory
                        .get(node)
                        .map(|read| read.as_deref().map_err(String::as_str)),
                };
                let unfit = unfit_node(node, needed, devices, pins.claims_on(node), uid, resource);
                verdicts.note(node, unfit, devices);
            }
            verdicts
        });
        match judged {
            Some(verdicts) => Ok(verdicts),
            // The copy stopped being whole in between: judge them all from
            // Tether.
            None => {
                self.judge_from_tether(kind, candidates, needed, inventory, uid)
                    .await
            }
        }
    }
}

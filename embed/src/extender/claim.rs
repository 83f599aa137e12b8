//! One bind's device claim: the devices a pod gets on the node whose lock
//! its bind holds, planned from the watched copy of the claims and decided
//! by Tether (each device's anti-affinity), with the cases an earlier
//! attempt of the same pod leaves behind; and the claim given back when a
//! bind fails.

use super::*;

impl<B: Binder> Extender<B> {
    /// Claims `count` free devices of the node for the pod: its existing
    /// claim there if it has one, else free ones on as few NUMA nodes as
    /// the plugin's published topology allows ([`pick_free_near`]).
    pub(super) async fn claim_devices(
        &self,
        kind: &Kind,
        args: &ExtenderBindingArgs,
        node_uid: &str,
        count: usize,
        attempt: u64,
        scheduler: &Departure,
    ) -> Result<Vec<String>, String> {
        // The node's published devices from the watched copy when it has
        // them (a read saved per bind), else from Tether. A copy behind a
        // change of health steers the plan to a device the kubelet then
        // does not give; the last `Allocate` corrects the claim to the
        // kubelet's choice, as it does for a change after a read.
        let from_copy = kind.view.read(|pins| pins.published(&args.node)).flatten();
        let published = match from_copy {
            Some(devices) => Some(devices),
            None => published_inventory(&self.client, &kind.spec.inventory_set, &args.node)
                .await
                .map_err(|err| {
                    format!(
                        "cannot read the devices node {} published: {err}",
                        args.node
                    )
                })?,
        };
        // The Node object is read only for a node whose plugin published
        // nothing (its device count).
        let node_devices = match published.as_deref() {
            Some(devices) => healthy_ids(devices),
            None => self.devices_of(kind, &args.node, Duration::ZERO).await?,
        };
        let numa_of: BTreeMap<String, u32> = published
            .iter()
            .flatten()
            .filter_map(|d| Some((d.id.clone(), d.numa_node?)))
            .collect();
        if node_devices.len() < count {
            return Err(format!(
                "pod {}/{} needs {count} {} devices; node {} has {} allocatable",
                args.pod_namespace,
                args.pod_name,
                kind.spec.resource,
                args.node,
                node_devices.len()
            ));
        }
        let mut last_loss = String::new();
        let mut attempts = 0;
        let stopped_wait_until = Instant::now() + STOPPED_CLAIM_WAIT;
        // The first plan from the watched copy of the claims, when it has
        // one: a read of the node's claims saved. Tether decides the claim
        // all the same (each device's anti-affinity refuses one that
        // another claim holds), so a copy that has not yet seen a claim
        // costs a refusal and a plan from a read, never a device given
        // twice.
        let mut from_copy = plan_from_copy(kind, args, &node_devices, &numa_of, count);
        while attempts < CLAIM_ATTEMPTS {
            let planned_from_copy = from_copy.is_some();
            let devices = if let Some(devices) = from_copy.take() {
                devices
            } else {
                let in_use = kind.ledger.claims_on(&args.node).await.map_err(|e| {
                    format!("cannot read the device claims of node {}: {e}", args.node)
                })?;
                let taken = in_use
                    .iter()
                    .filter(|(_, by)| by.pod_uid != args.pod_uid)
                    .map(|(device, _)| device.clone())
                    .collect();
                let ours: Vec<String> = in_use
                    .iter()
                    .filter(|(_, by)| by.pod_uid == args.pod_uid)
                    .map(|(device, _)| device.clone())
                    .collect();
                // The pod's claim here by another bind attempt: a later one's
                // is not this attempt's to touch; an earlier one's is ended
                // (this attempt holds the node's lock now) and made again.
                let other_attempt = in_use
                    .values()
                    .find(|by| by.pod_uid == args.pod_uid && by.attempt != Some(attempt))
                    .map(|by| by.attempt);
                if let Some(other) = other_attempt {
                    attempts += 1;
                    self.end_earlier_claim(kind, args, attempt, other).await?;
                    last_loss = format!("the pod's claim by bind attempt {other:?}");
                    continue;
                }
                if ours.len() == count {
                    ours
                } else {
                    match pick_free_near(&node_devices, &numa_of, &taken, count) {
                        Ok(devices) => devices,
                        // The filter counted the claims of stopped pods free
                        // (Tether's word, or the pod watch's delete event ahead
                        // of the bridge's report): they end at the next sweep;
                        // wait for that.
                        Err(_)
                            if in_use.values().any(|by| {
                                by.owner_stopped || kind.view.is_deleted(&by.pod_uid)
                            }) && Instant::now() < stopped_wait_until =>
                        {
                            tokio::time::sleep(STOPPED_CLAIM_POLL).await;
                            continue;
                        }
                        Err(e) => {
                            return Err(format!(
                                "node {} cannot take {}/{}: {}: {e}",
                                args.node, args.pod_namespace, args.pod_name, kind.spec.resource
                            ));
                        }
                    }
                }
            };
            // A refused plan from the copy does not count against the
            // attempts: it is made once.
            attempts += usize::from(!planned_from_copy);
            match kind
                .ledger
                .claim_for(
                    &args.node,
                    ClaimOwner {
                        uid: &args.pod_uid,
                        namespace: &args.pod_namespace,
                        name: &args.pod_name,
                    },
                    &devices,
                    Some(attempt),
                    node_uid,
                )
                .await
                .map_err(|e| format!("cannot claim devices on {}: {e}", args.node))?
            {
                Claim::Held(held) if held.len() == count => return Ok(held),
                Claim::Held(held) => {
                    // The pod's own claim from an earlier attempt, changed
                    // since (another pod's claim correction took a device
                    // from it, issue 53): ended and made again, or every
                    // later bind to this node would find it short.
                    tracing::info!(
                        pod_uid = args.pod_uid,
                        node = args.node,
                        ?held,
                        count,
                        "the pod's claim from an earlier bind names other devices than it needs; making it again"
                    );
                    kind.ledger
                        .release(
                            &args.pod_uid,
                            "the pod's claim from an earlier bind was short; made again",
                        )
                        .await
                        .map_err(|e| {
                            format!(
                                "pod {}/{} claims {held:?} on {} but needs {count} devices, and \
                                 the claim cannot be ended: {e}",
                                args.pod_namespace, args.pod_name, args.node
                            )
                        })?;
                    last_loss = format!("the pod's own claim named {held:?}");
                }
                Claim::OtherAttempt { token, .. } => {
                    self.end_earlier_claim(kind, args, attempt, token).await?;
                    last_loss = format!("the pod's claim by bind attempt {token:?}");
                }
                Claim::OnOtherNode { .. } if scheduler.is_gone() => {
                    // The claim elsewhere may be a later attempt's, made
                    // after the scheduler gave up on this one.
                    return Err(format!(
                        "the scheduler gave up on binding {}/{}; the pod's claim on another \
                         node is left as it is",
                        args.pod_namespace, args.pod_name
                    ));
                }
                Claim::OnOtherNode { node, devices } => {
                    tracing::info!(
                        pod_uid = args.pod_uid,
                        from = node,
                        ?devices,
                        to = args.node,
                        "moving a device claim left by an earlier bind"
                    );
                    kind.ledger
                        .release(&args.pod_uid, "the pod is being bound to another node")
                        .await
                        .map_err(|e| format!("cannot release the claim on {node}: {e}"))?;
                }
                Claim::Taken(why) => {
                    if planned_from_copy {
                        self.metrics.stale_plan();
                        tracing::debug!(
                            pod_uid = args.pod_uid,
                            node = args.node,
                            why,
                            "the plan from the watched copy was refused; reading the claims"
                        );
                    }
                    last_loss = why;
                }
            }
        }
        Err(format!(
            "could not claim {count} {} devices on {} in {CLAIM_ATTEMPTS} attempts: {last_loss}",
            kind.spec.resource, args.node
        ))
    }

    /// Ends the pod's claim on the node made by bind attempt `other` (its
    /// lock token, `None` for a claim that names none) so that attempt
    /// `attempt`, which holds the node's lock now, can claim afresh; a
    /// later attempt's claim is refused.
    pub(super) async fn end_earlier_claim(
        &self,
        kind: &Kind,
        args: &ExtenderBindingArgs,
        attempt: u64,
        other: Option<u64>,
    ) -> Result<(), String> {
        let who = format!("{}/{}", args.pod_namespace, args.pod_name);
        let ended = match other {
            Some(later) if later > attempt => {
                return Err(format!(
                    "a later bind attempt of {who} (lock token {later}) claims its devices on {}; \
                     this attempt (token {attempt}) keeps nothing",
                    args.node
                ));
            }
            Some(earlier) => {
                kind.ledger
                    .release_attempt(
                        &args.pod_uid,
                        earlier,
                        "made by an earlier bind attempt of the pod",
                    )
                    .await
            }
            None => kind
                .ledger
                .release(&args.pod_uid, "made by an earlier bind attempt of the pod")
                .await
                .map(|()| true),
        };
        tracing::info!(
            pod_uid = args.pod_uid,
            node = args.node,
            attempt,
            earlier = ?other,
            ?ended,
            "ending the pod's claim made by an earlier bind attempt"
        );
        ended
            .map(|_| ())
            .map_err(|e| format!("cannot end the claim an earlier bind attempt of {who} made: {e}"))
    }

    /// Ends the claim this attempt made, unless a later attempt of the
    /// pod made it again since (it carries that attempt's token then).
    pub(super) async fn release_claim(
        &self,
        claim: &Claimed<'_>,
        args: &ExtenderBindingArgs,
        reason: &str,
    ) {
        let ledger = &claim.kind.ledger;
        match unbounded(ledger.release_attempt(&args.pod_uid, claim.attempt, reason)).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(
                    pod_uid = args.pod_uid,
                    node = args.node,
                    attempt = claim.attempt,
                    "the device claim was made again by a later bind attempt of the pod; kept"
                )
            }
            Err(err) => {
                tracing::error!(pod_uid = args.pod_uid, node = args.node, %err, "cannot release a device claim; it ends with its pod")
            }
        }
    }
}

/// `count` devices of `node_devices` that no claim in the watched copy of
/// `kind`'s claims holds on the node (a stopped pod's neither), on as few
/// NUMA nodes as it can, if the copy is whole and shows no claim of the pod
/// there: a claim of the pod's own is an earlier attempt's, whose bind
/// token only Tether's record gives. `None` sends the bind to read the claims from Tether.
pub(super) fn plan_from_copy(
    kind: &Kind,
    args: &ExtenderBindingArgs,
    node_devices: &[String],
    numa_of: &BTreeMap<String, u32>,
    count: usize,
) -> Option<Vec<String>> {
    kind.view
        .read(|pins| {
            // Stopped pods' claims too: Tether refuses their devices until
            // the sweep ends them, and the read path waits for that.
            let claims = pins.all_claims_on(&args.node);
            if claims.values().any(|uid| *uid == args.pod_uid) {
                return None;
            }
            let taken: BTreeSet<String> = claims.into_keys().collect();
            pick_free_near(node_devices, numa_of, &taken, count).ok()
        })
        .flatten()
}

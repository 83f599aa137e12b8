//! The pin workers: the assigner (one pin per node, racing itself) and the
//! lifetime worker (a 600 ms pin whose pod is reported terminal).

use super::*;

/// Required anti-affinity "one per node" against the pins labelled
/// `label=value`.
fn one_per_node(label: &str, value: &str) -> pb::Affinity {
    let selector = pb::LabelSelector {
        match_labels: HashMap::from([(label.to_string(), value.to_string())]),
        match_expressions: vec![],
    };
    pb::Affinity {
        required_anti: vec![pb::AffinityTerm {
            label_selector: Some(selector),
            topology_key: "kubernetes.io/hostname".into(),
        }],
        ..Default::default()
    }
}

/// [`PIN_NODES`] in a seeded order, so assignment races differ per
/// schedule.
fn shuffled_pin_nodes(rng: &mut Rng) -> Vec<String> {
    let mut candidates: Vec<String> = PIN_NODES.iter().map(|n| n.to_string()).collect();
    for i in (1..candidates.len()).rev() {
        candidates.swap(i, rng.below(i as u64 + 1) as usize);
    }
    candidates
}

/// Pins of the run: `members` pins of set `prefix`, one per node at most.
pub async fn pin_assigner(shared: Arc<Shared>, process: u64, members: usize, mut rng: Rng) {
    let affinity = one_per_node("run", &shared.prefix);
    for member in 0..members {
        if shared.stopped() {
            return;
        }
        let key = pb::PinKey {
            set: shared.prefix.clone(),
            member: member.to_string(),
        };
        let event_key = format!("pin/{}/{}", key.set, key.member);
        let uid = format!("{}-pin{member}", shared.prefix);
        let candidates = shuffled_pin_nodes(&mut rng);
        for _ in 0..3 {
            let invoked =
                shared
                    .history
                    .invoke(process, &event_key, Call::Assign { uid: uid.clone() });
            let result = shared
                .client
                .assign(
                    &key,
                    candidates.clone(),
                    &uid,
                    Duration::ZERO,
                    HashMap::from([("run".to_string(), shared.prefix.clone())]),
                    affinity.clone(),
                )
                .await;
            let outcome = match result {
                Ok(response) => Outcome::Ok(Value::Assigned(
                    response.pin.map(|p| p.node).unwrap_or_default(),
                )),
                Err(Error::FailedPrecondition(_)) => Outcome::Ok(Value::Unsatisfiable),
                Err(err) => error_outcome(&err),
            };
            let definite = matches!(outcome, Outcome::Ok(_) | Outcome::Fail(_));
            shared.history.complete(invoked, outcome);
            if definite {
                break;
            }
        }
    }
}

/// Lifetime of the pins of [`pin_lifetimes`].
pub const PIN_LIFETIME: Duration = Duration::from_millis(600);

/// The event key of the pin [`pin_lifetimes`] assigns in a run of `prefix`.
pub fn pin_lifetime_event_key(prefix: &str) -> String {
    format!("pin/{prefix}-life/0")
}

/// Pins with a lifetime, one member of set `{prefix}-life`, `rounds` times:
/// assign it for a new pod (one per node, like the run's other pins, among
/// the pins of this set), report that pod terminal as the bridge would, and
/// wait for the pin to expire ([`PIN_LIFETIME`] after its owner stopped, on
/// committed time, once the leader has led that long). The next round's
/// assignment may land on another node. The pins checker checks from the
/// log that no pin expired before its lifetime.
pub async fn pin_lifetimes(shared: Arc<Shared>, process: u64, rounds: usize, mut rng: Rng) {
    let set = format!("{}-life", shared.prefix);
    let affinity = one_per_node("life", &shared.prefix);
    let key = pb::PinKey {
        set: set.clone(),
        member: "0".into(),
    };
    let event_key = pin_lifetime_event_key(&shared.prefix);
    for round in 0..rounds {
        if shared.stopped() {
            return;
        }
        let uid = format!("{}-life{round}", shared.prefix);
        let candidates = shuffled_pin_nodes(&mut rng);
        let invoked = shared
            .history
            .invoke(process, &event_key, Call::Assign { uid: uid.clone() });
        let result = shared
            .client
            .assign(
                &key,
                candidates,
                &uid,
                PIN_LIFETIME,
                HashMap::from([("life".to_string(), shared.prefix.clone())]),
                affinity.clone(),
            )
            .await;
        let outcome = match &result {
            Ok(response) => Outcome::Ok(Value::Assigned(
                response
                    .pin
                    .as_ref()
                    .map(|p| p.node.clone())
                    .unwrap_or_default(),
            )),
            Err(Error::FailedPrecondition(_)) => Outcome::Ok(Value::Unsatisfiable),
            Err(err) => error_outcome(err),
        };
        shared.history.complete(invoked, outcome);
        // The owner stops (reported again until it is known to be): the
        // countdown starts. Then until the pin expires. A round that cannot
        // see its pin gone in time ends the worker, so the next assignment
        // never takes over a pin that still stands.
        let give_up = tokio::time::Instant::now() + Duration::from_secs(15);
        let mut reported = false;
        loop {
            if shared.stopped() || tokio::time::Instant::now() >= give_up {
                return;
            }
            if !reported {
                reported = shared
                    .client
                    .report_pod(&uid, pb::PodPhase::PodTerminal)
                    .await
                    .is_ok();
            } else {
                match shared.client.get_pin(&key).await {
                    Ok(Some(pin)) if pin.pod_uid == uid => {}
                    Ok(Some(_)) => return,
                    Ok(None) => break,
                    Err(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Registers the pin nodes (idempotent).
pub async fn register_pin_nodes(client: &Client) -> tether_client::Result<()> {
    for name in PIN_NODES {
        client
            .report_node(pb::ReportNodeRequest {
                name: name.to_string(),
                uid: format!("{name}-uid"),
                state: pb::NodeState::NodeReady as i32,
                set_labels: true,
                labels: BTreeMap::from([("kubernetes.io/hostname".to_string(), name.to_string())])
                    .into_iter()
                    .collect(),
                unschedulable: Some(false),
                ..Default::default()
            })
            .await?;
    }
    Ok(())
}

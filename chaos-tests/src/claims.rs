//! The claimer: device claims corrected in one command (`Reclaim`), as the
//! device plugin corrects them when the kubelet chose other devices than
//! the extender planned.
//!
//! Each round, three pods of set `{prefix}-claims` claim two of three
//! devices of one node (`dev/gpu0` .. `dev/gpu2`, labels of their pins), all
//! at once, each taking the devices it names out of every other pin of the
//! set on that node; a pin left with none is released. Unknown answers are
//! retried. Whatever order the log puts them in, no device of a node is in
//! two pins of the set afterwards: the `pins` checker reads the final pins
//! ([`Evidence::claims`]). A correction that released and claimed in two
//! steps could leave one in two pins or in none; one that kept the other
//! pins' labels (the planted `sm-reclaim-keeps-others`) leaves it in two.
//!
//! [`Evidence::claims`]: crate::checkers::Evidence::claims

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tether_client::proto as pb;

use crate::rng::Rng;
use crate::workers::{PIN_NODES, Shared};

/// The label prefix of device claims, as the device plugin writes them.
pub const DEVICE_PREFIX: &str = "dev/";

/// The set the claimer's pins are in, for a run of `prefix`.
pub fn claims_set(prefix: &str) -> String {
    format!("{prefix}-claims")
}

/// The label naming the bind attempt that made a claim (the extender's
/// `bind.tether.io/lock-token`).
pub const ATTEMPT_LABEL: &str = "attempt";

/// Two bind attempts at one pod's claim: attempt 1 makes it, attempt 2
/// ends it on condition of attempt 1's label and makes it again, then
/// attempt 1 (whose scheduler left) asks to end it on condition of its own
/// label, which must be refused. Claims no device (its pin has no `dev/`
/// label), so the round's claims are untouched. A remade claim whose every
/// answer was definite is recorded for the `pins` checker.
async fn remake_claim(shared: &Shared, set: &str, node: &str, round: u64) {
    let uid = format!("{}-c{round}d", shared.prefix);
    let key = pb::PinKey {
        set: set.to_string(),
        member: format!("{round}d"),
    };
    let attempt = |n: &str| HashMap::from([(ATTEMPT_LABEL.to_string(), n.to_string())]);
    let made = |n: &'static str| {
        let (key, uid) = (key.clone(), uid.clone());
        async move {
            shared
                .client
                .reclaim(&key, node, &uid, Duration::ZERO, attempt(n), DEVICE_PREFIX)
                .await
                .is_ok()
        }
    };
    if !made("1").await {
        return;
    }
    let ended = shared
        .client
        .release_pin_if(&key, "made again by attempt 2", attempt("1"))
        .await;
    if ended.is_err() || !made("2").await {
        return;
    }
    // Attempt 1 leaves: refused, the pin is attempt 2's.
    match shared
        .client
        .release_pin_if(&key, "attempt 1 left", attempt("1"))
        .await
    {
        Err(tether_client::Error::FailedPrecondition(_)) | Ok(_) => shared
            .remade_claims
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(key.member.clone()),
        Err(_) => {}
    }
}

/// The claimer's rounds, until stopped.
pub async fn claimer(shared: Arc<Shared>, mut rng: Rng) {
    let set = claims_set(&shared.prefix);
    let mut round = 0u64;
    while !shared.stopped() {
        round += 1;
        let node = *rng.pick(&PIN_NODES);
        // Each pod names two of the three devices; every device is named
        // twice.
        let wanted = [("a", [0, 1]), ("b", [1, 2]), ("c", [2, 0])];
        let mut tasks = Vec::new();
        for (pod, devices) in wanted {
            let (shared, set) = (shared.clone(), set.clone());
            let delay = Duration::from_millis(rng.between(0, 20));
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let uid = format!("{}-c{round}{pod}", shared.prefix);
                let key = pb::PinKey {
                    set,
                    member: format!("{round}{pod}"),
                };
                let labels: HashMap<String, String> = devices
                    .iter()
                    .map(|d| (format!("{DEVICE_PREFIX}gpu{d}"), uid.clone()))
                    .collect();
                for _ in 0..3 {
                    let answer = shared
                        .client
                        .reclaim(
                            &key,
                            node,
                            &uid,
                            Duration::ZERO,
                            labels.clone(),
                            DEVICE_PREFIX,
                        )
                        .await;
                    if answer.is_ok() || shared.stopped() {
                        break;
                    }
                }
            }));
        }
        for task in tasks {
            let _ = task.await;
        }
        remake_claim(&shared, &set, node, round).await;
        tokio::time::sleep(Duration::from_millis(rng.between(50, 150))).await;
    }
}

//! The session flooder: one node's device plugin opening ever new client
//! sessions (issue 34, defect 5), and the bridge opening its one session
//! beside it.
//!
//! The chaos clusters run with development tokens and
//! `--max-sessions-per-identity` [`SESSION_QUOTA`]. Every 100 ms the flooder
//! makes four new clients as `device-plugin:chaos-node-0`, each sending one
//! release of a hold nobody has: refused by the lock rules, but it opens a
//! session, until the identity is at its quota; from then on the answer is
//! `RESOURCE_EXHAUSTED`. Each round the cluster's bridge client (one for
//! the cluster's life, as one bridge process keeps one) reports a pod no
//! run has: the bridge's role must always get its session. (The bridge is
//! counted too, under its own identity: a bridge restarted more than the
//! quota's times within `--session-idle` would be refused, which with the
//! default quota of 1024 takes more restarts than a crash loop's back-off
//! allows.) Sessions outlive a schedule
//! (`--session-idle`, an hour), so the flooder's identity stays at its
//! quota for the cluster's life. What was admitted and refused is recorded
//! as a [`SessionFlood`] for the `sessions` checker.

use std::sync::Arc;
use std::time::Duration;

use tether_client::proto as pb;
use tether_client::{Client, Error};

use crate::cluster::tokens;
use crate::history::SessionFlood;
use crate::workers::Shared;

/// `--max-sessions-per-identity` of the chaos clusters.
pub const SESSION_QUOTA: usize = 16;

/// New clients the flooder makes a round.
const PER_ROUND: usize = 4;

/// A new client of the cluster as `token` (with the run's client's
/// endpoints and budgets): a new session at its first write.
fn new_client(shared: &Shared, token: &str) -> Client {
    let options = tether_client::Options {
        bearer_token: Some(token.to_string()),
        ..shared.client.options().clone()
    };
    Client::new(shared.client.endpoints().to_vec(), options).expect("the run's endpoints")
}

/// The flooder's rounds, until stopped.
pub async fn flooder(shared: Arc<Shared>, bridge: Client) {
    let mut flood = SessionFlood {
        quota: SESSION_QUOTA,
        ..SessionFlood::default()
    };
    let absent = format!("{}-nobody", shared.prefix);
    // A device plugin may release only its node's lock.
    let key = pb::LockKey {
        scope: crate::workers::SCOPE.into(),
        name: crate::workers::PIN_NODES[0].into(),
    };
    while !shared.stopped() {
        for _ in 0..PER_ROUND {
            let plugin = new_client(&shared, tokens::DEVICE_PLUGIN);
            match plugin.release(&key, &absent, 1, pb::Outcome::Failed).await {
                // Refused by the lock rules: a session was opened.
                Err(Error::FailedPrecondition(_)) | Ok(_) => flood.admitted += 1,
                Err(Error::ResourceExhausted(message)) => {
                    flood.refused += 1;
                    if !message.contains(tokens::DEVICE_PLUGIN_IDENTITY) {
                        flood.wrong_refusals.push(format!(
                            "the flooder was refused for another reason: {message}"
                        ));
                    }
                }
                // Unknown (a fault): may or may not have opened one.
                Err(_) => flood.unknown += 1,
            }
        }
        match bridge
            .revoke_pod(&absent, "chaos: the bridge's report")
            .await
        {
            Err(Error::ResourceExhausted(message)) => flood
                .wrong_refusals
                .push(format!("the bridge was refused a session: {message}")),
            _ => flood.bridge_calls += 1,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shared.history.record_session_flood(flood);
}

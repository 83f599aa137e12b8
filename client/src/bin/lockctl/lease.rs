//! `lockctl lease`: TTL leases (grant, keep-alive, revoke) and what the
//! bridge reports of pods (revoke-pod, report-pod).

use super::*;

/// `lockctl lease ...`.
pub(crate) async fn command(client: &Client, out: &Out, cmd: LeaseCmd) -> Result<(), Error> {
    match cmd {
        LeaseCmd::RevokePod { pod_uid, reason } => {
            let reply = client.revoke_pod(&pod_uid, &reason).await?;
            let keys = |keys: &[pb::LockKey]| {
                keys.iter()
                    .map(|k| format!("{}/{}", k.scope, k.name))
                    .collect::<Vec<_>>()
            };
            let released = keys(&reply.released);
            let dequeued = keys(&reply.dequeued);
            out.print(json!({"released": released, "dequeued": dequeued, "granted": reply.granted.len()}), || {
                format!("pod {pod_uid}: released {released:?}, left queues {dequeued:?}, {} next waiters granted", reply.granted.len())
            });
        }
        LeaseCmd::Grant { ttl } => {
            let id = client.grant_lease(ttl).await?;
            out.print(json!({"lease_id": id}), || id.to_string());
        }
        LeaseCmd::KeepAlive { lease_id, count } => {
            for round in 1.. {
                let ttl = client.keep_alive_once(lease_id).await?;
                if ttl == 0 {
                    return Err(Error::NotFound(format!(
                        "lease {lease_id} expired or was revoked"
                    )));
                }
                out.print(json!({"lease_id": lease_id, "ttl_ms": ttl}), || {
                    format!(
                        "lease {lease_id} kept alive (ttl {})",
                        humantime::format_duration(Duration::from_millis(ttl))
                    )
                });
                if count.is_some_and(|n| round >= n) {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ttl / 3)) => {}
                    _ = tokio::signal::ctrl_c() => return Ok(()),
                }
            }
        }
        LeaseCmd::ReportPod { pod_uid, state } => {
            let phase = match state {
                PodStateArg::Alive => pb::PodPhase::PodStarting,
                PodStateArg::Running => pb::PodPhase::PodRunning,
                PodStateArg::Terminal => pb::PodPhase::PodTerminal,
                PodStateArg::Gone => pb::PodPhase::PodGone,
            };
            let reply = client.report_pod(&pod_uid, phase).await?;
            out.print(
                json!({"released": reply.released.len(), "dequeued": reply.dequeued.len()}),
                || {
                    format!(
                        "pod {pod_uid} reported; {} holds released, {} waits dropped",
                        reply.released.len(),
                        reply.dequeued.len()
                    )
                },
            );
        }
        LeaseCmd::Revoke { lease_id } => {
            let reply = client.revoke_lease(lease_id).await?;
            out.print(
                json!({"released": reply.released.len(), "dequeued": reply.dequeued.len()}),
                || {
                    format!(
                        "lease {lease_id} revoked: {} holds released, {} waits dropped",
                        reply.released.len(),
                        reply.dequeued.len()
                    )
                },
            );
        }
    }
    Ok(())
}

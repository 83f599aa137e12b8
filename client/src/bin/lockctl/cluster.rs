//! `lockctl cluster`: status (with why a cluster cannot serve), membership,
//! leader transfer, snapshots.

use super::*;

/// `lockctl cluster ...`.
pub(crate) async fn command(client: &Client, out: &Out, cmd: ClusterCmd) -> Result<(), Error> {
    match cmd {
        ClusterCmd::Status => cluster_status(client, out).await?,
        ClusterCmd::AddLearner {
            node_id,
            addr,
            no_wait,
        } => {
            let index = client.add_learner(node_id, &addr, !no_wait).await?;
            out.print(json!({"node_id": node_id, "log_index": index}), || {
                format!("node {node_id} added as learner (log index {index})")
            });
        }
        ClusterCmd::ChangeMembership { voters, retain } => {
            let index = client.change_membership(voters.clone(), retain).await?;
            out.print(json!({"voters": voters, "log_index": index}), || {
                format!("voters are now {voters:?} (log index {index})")
            });
        }
        ClusterCmd::TransferLeader { node_id } => {
            let leader = client.transfer_leader(node_id).await?;
            out.print(json!({"leader_id": leader}), || {
                format!("leader is now node {leader}")
            });
        }
        ClusterCmd::Promote { node_id } => {
            let (voters, learners) = membership(client).await?;
            if voters.contains(&node_id) {
                return Err(Error::FailedPrecondition(format!(
                    "node {node_id} is already a voter"
                )));
            }
            if !learners.contains(&node_id) {
                return Err(Error::FailedPrecondition(format!(
                    "node {node_id} is not a learner; add it first with `lockctl cluster add-learner {node_id} ADDR`"
                )));
            }
            let mut new_voters = voters.clone();
            new_voters.push(node_id);
            new_voters.sort();
            let index = client.change_membership(new_voters.clone(), false).await?;
            out.print(json!({"voters": new_voters, "log_index": index}), || {
                format!(
                    "node {node_id} promoted; voters are now {new_voters:?} (log index {index})"
                )
            });
        }
        ClusterCmd::Remove { node_id } => {
            let (voters, learners) = membership(client).await?;
            let index = if voters.contains(&node_id) {
                let remaining: Vec<u64> =
                    voters.iter().copied().filter(|id| *id != node_id).collect();
                if remaining.is_empty() {
                    return Err(Error::FailedPrecondition(
                        "cannot remove the last voter".into(),
                    ));
                }
                client.change_membership(remaining, false).await?
            } else if learners.contains(&node_id) {
                client.remove_learners(vec![node_id]).await?
            } else {
                return Err(Error::NotFound(format!("node {node_id} is not a member")));
            };
            out.print(json!({"removed": node_id, "log_index": index}), || {
                format!("node {node_id} removed (log index {index}); stop its tetherd and delete its data directory")
            });
        }
        ClusterCmd::Snapshot => {
            let index = client.snapshot().await?;
            out.print(json!({"snapshot_index": index}), || {
                format!("snapshot at log index {index}")
            });
        }
        ClusterCmd::ExportSnapshot { file } => {
            let (index, data) = client.export_snapshot().await?;
            // Written aside, synced, then renamed and the directory
            // synced: a half-written backup never takes the name of a good
            // one, and one reported written survives a power cut (LazyFS
            // found it empty after one).
            let partial = file.with_extension("partial");
            write_durably(&partial, &file, &data).map_err(|e| {
                tether_client::Error::InvalidArgument(format!(
                    "cannot write {}: {e}",
                    file.display()
                ))
            })?;
            out.print(
                json!({"snapshot_index": index, "bytes": data.len(), "file": file.display().to_string()}),
                || {
                    format!(
                        "snapshot at log index {index}: {} bytes written to {}",
                        data.len(),
                        file.display()
                    )
                },
            );
        }
    }
    Ok(())
}

/// Writes `data` to `partial`, syncs it, renames it to `file` and syncs
/// the directory.
fn write_durably(
    partial: &std::path::Path,
    file: &std::path::Path,
    data: &[u8],
) -> std::io::Result<()> {
    let mut out = std::fs::File::create(partial)?;
    std::io::Write::write_all(&mut out, data)?;
    out.sync_all()?;
    drop(out);
    std::fs::rename(partial, file)?;
    let dir = match file.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => std::path::Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// (voters, learners) as the leader sees them.
pub(crate) async fn membership(client: &Client) -> Result<(Vec<u64>, Vec<u64>), Error> {
    let status = client.leader_status().await?;
    let voters = status
        .members
        .iter()
        .filter(|m| m.voter)
        .map(|m| m.node_id)
        .collect();
    let learners = status
        .members
        .iter()
        .filter(|m| !m.voter)
        .map(|m| m.node_id)
        .collect();
    Ok((voters, learners))
}

/// For "no replica could serve": what each endpoint says, so the operator
/// sees at once whether the cluster lacks a quorum or the endpoints are wrong.
pub(crate) async fn explain_unavailable(client: &Client) -> String {
    let mut reachable = 0;
    let mut lines = Vec::new();
    for addr in client.endpoints() {
        match client.status_of(addr).await {
            Ok(s) => {
                reachable += 1;
                let leader = if s.leader_id == 0 {
                    "no leader".to_string()
                } else {
                    format!("leader {}", s.leader_id)
                };
                lines.push(format!(
                    "{addr}: node {} {} term {} ({leader})",
                    s.node_id, s.role, s.term
                ));
            }
            Err(_) => lines.push(format!("{addr}: unreachable")),
        }
    }
    format!(
        "no leader yet — {reachable}/{} endpoints reachable: {}",
        client.endpoints().len(),
        lines.join("; ")
    )
}

pub(crate) async fn cluster_status(client: &Client, out: &Out) -> Result<(), Error> {
    let mut rows = Vec::new();
    let mut reachable = 0;
    let mut members = Vec::new();
    let mut leader = None;
    for addr in client.endpoints() {
        match client.status_of(addr).await {
            Ok(status) => {
                reachable += 1;
                if status.leader_id != 0 {
                    leader = Some((status.leader_id, status.leader_addr.clone()));
                }
                if members.is_empty() {
                    members = status.members.clone();
                }
                rows.push(json!({
                    "endpoint": addr, "node_id": status.node_id, "role": status.role,
                    "leader_id": status.leader_id, "term": status.term,
                    "last_log_index": status.last_log_index, "applied_index": status.applied_index,
                    "snapshot_index": status.snapshot_index, "locks": status.lock_count,
                    "cluster_id": status.cluster_id,
                }));
            }
            Err(err) => rows.push(json!({"endpoint": addr, "error": err.to_string()})),
        }
    }
    if reachable == 0 {
        return Err(Error::Unavailable(format!(
            "no endpoint answered ({}); is tetherd running? (--endpoints / TETHER_ENDPOINTS)",
            client.endpoints().join(",")
        )));
    }
    let members_json: Vec<Value> = members
        .iter()
        .map(|m| json!({"node_id": m.node_id, "addr": m.addr, "voter": m.voter, "matched_index": m.matched_index}))
        .collect();
    let value =
        json!({"endpoints": rows, "members": members_json, "leader": leader.as_ref().map(|l| l.0)});
    out.print(value, || {
        let mut text = String::new();
        text.push_str(&format!("{:<22} {:>4} {:<10} {:>6} {:>6} {:>10} {:>10} {:>6} {:<16}\n", "ENDPOINT", "ID", "ROLE", "LEADER", "TERM", "LAST_LOG", "APPLIED", "LOCKS", "CLUSTER"));
        for row in &rows {
            if let Some(err) = row.get("error") {
                text.push_str(&format!("{:<22} unreachable: {}\n", row["endpoint"].as_str().unwrap_or(""), err.as_str().unwrap_or("")));
            } else {
                text.push_str(&format!(
                    "{:<22} {:>4} {:<10} {:>6} {:>6} {:>10} {:>10} {:>6} {:<16}\n",
                    row["endpoint"].as_str().unwrap_or(""), row["node_id"].to_string(), row["role"].as_str().unwrap_or(""),
                    row["leader_id"].to_string(), row["term"].to_string(), row["last_log_index"].to_string(),
                    row["applied_index"].to_string(), row["locks"].to_string(),
                    row["cluster_id"].as_str().filter(|id| !id.is_empty()).unwrap_or("-")
                ));
            }
        }
        text.push_str("\nMEMBERS\n");
        for m in &members {
            text.push_str(&format!("  node {} at {} ({}), matched index {}\n", m.node_id, m.addr, if m.voter { "voter" } else { "learner" }, m.matched_index));
        }
        match &leader {
            Some((id, addr)) => text.push_str(&format!("\nleader: node {id} at {addr}\n")),
            None => text.push_str(&format!(
                "\nno leader yet — {reachable}/{} endpoints reachable; a majority of voters must be up\n",
                client.endpoints().len()
            )),
        }
        text
    });
    Ok(())
}

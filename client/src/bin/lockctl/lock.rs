//! `lockctl lock`: acquire (waiting in the queue), release, holder, get,
//! list, force-release.

use super::*;

/// `lockctl lock ...`.
pub(crate) async fn command(client: &Client, out: &Out, cmd: LockCmd) -> Result<(), Error> {
    match cmd {
        LockCmd::Acquire {
            lock,
            pod_uid,
            pod,
            payload,
            payload_file,
            wait,
            lease,
        } => {
            let key = parse_lock_key(&lock)?;
            let pod = parse_pod(&pod_uid, &pod)?;
            let payload = match (payload, payload_file) {
                (Some(text), _) => text.into_bytes(),
                (None, Some(path)) => std::fs::read(&path).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "cannot read --payload-file {}: {e}",
                        path.display()
                    ))
                })?,
                (None, None) => Vec::new(),
            };
            let table = out.format == Format::Table;
            let hold = client
                .acquire_with_progress(&key, &pod, payload, wait, lease, |progress| {
                    if let (AcquireProgress::Queued(position), true) = (progress, table) {
                        eprintln!(
                            "queued for {lock} at position {position}; waiting up to {}",
                            humantime::format_duration(wait)
                        );
                    }
                })
                .await?;
            out.print(hold_json(&hold), || hold.token.to_string());
        }
        LockCmd::Release {
            lock,
            pod_uid,
            token,
            outcome,
        } => {
            let key = parse_lock_key(&lock)?;
            let outcome = match outcome {
                OutcomeArg::Allocated => Outcome::Allocated,
                OutcomeArg::Failed => Outcome::Failed,
            };
            let next = client.release(&key, &pod_uid, token, outcome).await?;
            out.print(
                json!({"released": true, "next_holder": next.as_ref().map(hold_json)}),
                || match &next {
                    Some(hold) => format!(
                        "released; granted to {} with token {}",
                        pod_label(&hold.pod),
                        hold.token
                    ),
                    None => "released".to_string(),
                },
            );
        }
        LockCmd::Holder { lock } => {
            let key = parse_lock_key(&lock)?;
            let hold = client.holder(&key).await?;
            out.print(
                json!({"lock": lock, "holder": hold.as_ref().map(hold_json)}),
                || match &hold {
                    Some(h) => format!(
                        "{lock} held by {} token {} payload {}",
                        pod_label(&h.pod),
                        h.token,
                        payload_json(&h.payload)
                    ),
                    None => format!("{lock} is free"),
                },
            );
        }
        LockCmd::Get { lock } => {
            let key = parse_lock_key(&lock)?;
            let state = client.get(&key).await?;
            out.print(lock_json(&state), || {
                lock_table(std::slice::from_ref(&state))
            });
        }
        LockCmd::List { scope } => {
            let locks = client.list(&scope).await?;
            out.print(Value::Array(locks.iter().map(lock_json).collect()), || {
                lock_table(&locks)
            });
        }
        LockCmd::ForceRelease {
            lock,
            reason,
            operator,
        } => {
            let key = parse_lock_key(&lock)?;
            let reply = client.force_release(&key, &operator, &reason).await?;
            out.print(
                json!({"released": reply.released.as_ref().map(hold_json), "next_holder": reply.next_holder.as_ref().map(hold_json)}),
                || match (&reply.released, &reply.next_holder) {
                    (None, _) => format!("{lock} was already free"),
                    (Some(h), None) => format!("force-released {lock} from {} (token {})", pod_label(&h.pod), h.token),
                    (Some(h), Some(n)) => format!(
                        "force-released {lock} from {} (token {}); granted to {} with token {}",
                        pod_label(&h.pod), h.token, pod_label(&n.pod), n.token
                    ),
                },
            );
        }
    }
    Ok(())
}

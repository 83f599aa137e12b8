//! `lockctl watch` and `lockctl history`: the event stream and a key's
//! retained events.

use super::*;

/// `lockctl watch`: events as they are applied, until `count` or Ctrl-C.
pub(crate) async fn watch(
    client: &Client,
    out: &Out,
    from: Option<u64>,
    kinds: Vec<String>,
    prefix: String,
    count: Option<usize>,
) -> Result<(), Error> {
    let start = from.map(|index| pb::Revision { index, sub: 0 });
    let mut watch = client.watch(start, kinds, &prefix).await?;
    let mut shown = 0;
    while count.is_none_or(|n| shown < n) {
        let batch = tokio::select! {
            batch = watch.next() => batch?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        match batch {
            WatchUpdate::Events(events) => {
                for event in events.iter().take(count.map_or(usize::MAX, |n| n - shown)) {
                    out.print(event_json(event), || event_line(event));
                    shown += 1;
                }
            }
            WatchUpdate::Relist {
                resume_at,
                oldest_retained,
            } => eprintln!(
                "lockctl: events before log index {oldest_retained} are no longer retained; \
                         some were missed. Continuing from {}.{} (re-list what you need)",
                resume_at.index, resume_at.sub
            ),
        }
    }
    Ok(())
}

/// `lockctl history`: a key's retained events.
pub(crate) async fn history(
    client: &Client,
    out: &Out,
    key: String,
    since: Option<Duration>,
    limit: u32,
) -> Result<(), Error> {
    let since_ms = since.map_or(0, |d| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        now.saturating_sub(d).as_millis() as u64
    });
    let reply = client.history(&key, since_ms, limit).await?;
    let oldest = reply.oldest_retained.map_or(0, |r| r.index);
    out.print(
                json!({"events": reply.events.iter().map(event_json).collect::<Vec<_>>(), "oldest_retained": oldest}),
                || {
                    let mut text: String = reply.events.iter().map(|e| event_line(e) + "\n").collect();
                    if reply.events.is_empty() {
                        text.push_str(&format!("no events for {key}"));
                    }
                    if oldest > 0 {
                        text.push_str(&format!("(history before log index {oldest} is no longer retained)\n"));
                    }
                    text
                },
            );
    Ok(())
}

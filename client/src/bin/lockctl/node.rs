//! `lockctl node`: report and list nodes.

use super::*;

pub(crate) async fn command(client: &Client, out: &Out, cmd: NodeCmd) -> Result<(), Error> {
    match cmd {
        NodeCmd::Report {
            name,
            state,
            labels,
            uid,
            unschedulable,
        } => {
            let state = match state {
                NodeStateArg::Joined => pb::NodeState::NodeJoined,
                NodeStateArg::Ready => pb::NodeState::NodeReady,
                NodeStateArg::NotReady => pb::NodeState::NodeNotReady,
                NodeStateArg::Gone => pb::NodeState::NodeGone,
            };
            let request = pb::ReportNodeRequest {
                name: name.clone(),
                uid,
                state: state as i32,
                set_labels: !labels.is_empty(),
                labels: labels_map(&labels)?,
                unschedulable,
                ..Default::default()
            };
            let reply = client.report_node(request).await?;
            out.print(
                json!({"changed": reply.changed, "pins_released": reply.pins_released, "locks_released": reply.locks_released}),
                || match (reply.changed, reply.pins_released + reply.locks_released) {
                    (false, _) => format!("node {name}: no change"),
                    (true, 0) => format!("node {name} reported"),
                    (true, _) => format!(
                        "node {name} gone: {} pins and {} locks released",
                        reply.pins_released, reply.locks_released
                    ),
                },
            );
        }
        NodeCmd::List { all } => {
            let nodes = client.list_nodes(all).await?;
            let rows: Vec<Value> = nodes
                .iter()
                .map(|n| json!({"name": n.name, "uid": n.uid, "ready": n.ready, "unschedulable": n.unschedulable, "labels": n.labels, "gone_at_ms": n.gone_at_ms}))
                .collect();
            out.print(Value::Array(rows), || {
                let mut text = format!(
                    "{:<28} {:<10} {:<14} {}\n",
                    "NODE", "READY", "SCHEDULABLE", "LABELS"
                );
                for n in &nodes {
                    let mut labels: Vec<String> =
                        n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    labels.sort();
                    let ready = if n.gone_at_ms > 0 {
                        "gone"
                    } else if n.ready {
                        "yes"
                    } else {
                        "no"
                    };
                    let schedulable = if n.unschedulable { "cordoned" } else { "yes" };
                    text.push_str(&format!(
                        "{:<28} {:<10} {:<14} {}\n",
                        n.name,
                        ready,
                        schedulable,
                        labels.join(",")
                    ));
                }
                text
            });
        }
    }
    Ok(())
}

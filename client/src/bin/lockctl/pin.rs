//! `lockctl pin`: assign, set, release, get and list pins.

use super::*;

pub(crate) async fn command(client: &Client, out: &Out, cmd: PinCmd) -> Result<(), Error> {
    match cmd {
        PinCmd::Assign {
            pin,
            candidates,
            pod_uid,
            lifetime,
            labels,
            require,
            require_anti,
            prefer,
            prefer_anti,
        } => {
            let key = parse_pin_key(&pin)?;
            let affinity = pb::Affinity {
                required: require
                    .iter()
                    .map(|t| parse_term(t))
                    .collect::<Result<_, _>>()?,
                required_anti: require_anti
                    .iter()
                    .map(|t| parse_term(t))
                    .collect::<Result<_, _>>()?,
                preferred: prefer
                    .iter()
                    .map(|t| parse_weighted_term(t))
                    .collect::<Result<_, _>>()?,
                preferred_anti: prefer_anti
                    .iter()
                    .map(|t| parse_weighted_term(t))
                    .collect::<Result<_, _>>()?,
            };
            let reply = client
                .assign(
                    &key,
                    candidates,
                    &pod_uid,
                    lifetime,
                    labels_map(&labels)?,
                    affinity,
                )
                .await?;
            let pinned = reply.pin.unwrap_or_default();
            let mut value = pin_json(&pinned);
            value["created"] = json!(reply.created);
            out.print(value, || {
                format!(
                    "{pin} -> {}{}",
                    pinned.node,
                    if reply.created { "" } else { " (existing pin)" }
                )
            });
        }
        PinCmd::Release { pin, reason } => {
            let key = parse_pin_key(&pin)?;
            let released = client.release_pin(&key, &reason).await?;
            out.print(
                json!({"released": released.as_ref().map(pin_json)}),
                || match &released {
                    Some(p) => format!("released {pin} (was on {})", p.node),
                    None => format!("{pin} was not pinned"),
                },
            );
        }
        PinCmd::Get { pin } => {
            let key = parse_pin_key(&pin)?;
            match client.get_pin(&key).await? {
                Some(p) => out.print(pin_json(&p), || pin_table(std::slice::from_ref(&p))),
                None => return Err(Error::NotFound(format!("{pin} is not pinned"))),
            }
        }
        PinCmd::List { set, node } => {
            let pins = client.list_pins(&set, &node).await?;
            out.print(Value::Array(pins.iter().map(pin_json).collect()), || {
                pin_table(&pins)
            });
        }
    }
    Ok(())
}

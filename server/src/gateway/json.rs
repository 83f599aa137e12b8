//! The proto3 JSON mapping of the `tether.v1` messages, as gRPC-gateway and
//! etcd's JSON API use it: lowerCamelCase field names, 64-bit integers as
//! strings, enums by name, bytes in base64, fields at their default left
//! out. prost-reflect does the mapping from the descriptors `tether-proto`
//! keeps, so the JSON bodies and the gRPC messages have one schema.

use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, SerializeOptions};

/// The `tether.v1` descriptors, decoded once.
pub fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(tether_proto::FILE_DESCRIPTOR_SET)
            .expect("tether-proto's build script wrote a valid descriptor set")
    })
}

/// The descriptor of message type `T`.
fn descriptor<T: prost::Name>() -> prost_reflect::MessageDescriptor {
    pool()
        .get_message_by_name(&T::full_name())
        .expect("every generated message is in the descriptor set")
}

/// A request body as message `T`. An empty body is the default message.
/// Unknown fields, wrong types and trailing text are refused with what is
/// wrong, naming the message.
pub fn decode<T: prost::Message + prost::Name + Default>(body: &[u8]) -> Result<T, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let refused = |why: String| format!("the body is not a {} in JSON: {why}", T::full_name());
    let mut reader = serde_json::Deserializer::from_slice(body);
    let options = DeserializeOptions::new().deny_unknown_fields(true);
    // The path of the field a failure happened at, e.g. `key.scope`.
    let mut track = serde_path_to_error::Track::new();
    let tracked = serde_path_to_error::Deserializer::new(&mut reader, &mut track);
    let message = DynamicMessage::deserialize_with_options(descriptor::<T>(), tracked, &options)
        .map_err(|err| match track.path().to_string().as_str() {
            "" | "." => refused(err.to_string()),
            path => refused(format!("{path}: {err}")),
        })?;
    reader.end().map_err(|err| refused(err.to_string()))?;
    message
        .transcode_to::<T>()
        .map_err(|err| refused(err.to_string()))
}

/// `message` as a JSON value.
pub fn encode<T: prost::Message + prost::Name>(message: &T) -> serde_json::Value {
    let dynamic = DynamicMessage::decode(descriptor::<T>(), message.encode_to_vec().as_slice())
        .expect("a message prost encoded decodes under its own descriptor");
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &SerializeOptions::new())
        .expect("a decoded message serializes to JSON")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_proto as pb;

    #[test]
    fn sixty_four_bit_integers_are_strings_and_names_are_lower_camel_case() {
        let response = pb::ReleaseRequest {
            key: Some(pb::LockKey {
                scope: "gpu-bind".into(),
                name: "node-a".into(),
            }),
            pod_uid: "uid-1".into(),
            token: u64::MAX,
            ..Default::default()
        };
        let json = encode(&response);
        assert_eq!(json["podUid"], "uid-1");
        assert_eq!(json["token"], u64::MAX.to_string());
        assert_eq!(json["key"]["scope"], "gpu-bind");
        // Fields at their default are left out.
        assert!(json.get("requestId").is_none(), "{json}");
        let back: pb::ReleaseRequest = decode(json.to_string().as_bytes()).unwrap();
        assert_eq!(back, response);
    }

    #[test]
    fn numbers_are_taken_for_sixty_four_bit_fields_too_and_the_empty_body_is_the_default() {
        let parsed: pb::ReleaseRequest = decode(br#"{"token": 7, "pod_uid": "u"}"#).unwrap();
        assert_eq!(parsed.token, 7);
        assert_eq!(parsed.pod_uid, "u", "the proto field name is accepted too");
        let empty: pb::StatusRequest = decode(b"  \n").unwrap();
        assert_eq!(empty, pb::StatusRequest::default());
    }

    #[test]
    fn bad_bodies_are_refused_with_what_is_wrong() {
        let unknown = decode::<pb::ReleaseRequest>(br#"{"tokn": "1"}"#).unwrap_err();
        assert!(unknown.contains("tether.v1.ReleaseRequest"), "{unknown}");
        assert!(unknown.contains("tokn"), "{unknown}");
        let wrong_type = decode::<pb::ReleaseRequest>(br#"{"token": "seven"}"#).unwrap_err();
        assert!(wrong_type.contains("token: "), "{wrong_type}");
        let nested = decode::<pb::ReleaseRequest>(br#"{"key": {"scope": 7}}"#).unwrap_err();
        assert!(nested.contains("key.scope: "), "{nested}");
        let trailing = decode::<pb::ReleaseRequest>(br#"{} {}"#).unwrap_err();
        assert!(trailing.contains("trailing"), "{trailing}");
        let not_json = decode::<pb::ReleaseRequest>(b"token=1").unwrap_err();
        assert!(not_json.contains("JSON"), "{not_json}");
    }
}

//! The OpenAPI 3.1 document of the HTTP/JSON API (`GET /openapi.json`),
//! made from the route table and the `tether.v1` descriptors: a path per
//! route (`operationId` = the gRPC method, e.g. `LockService.Acquire`), a
//! schema per message and enum as the proto3 JSON mapping writes them, the
//! error body, and the two ways to authenticate.

use std::collections::BTreeMap;

use prost_reflect::{Cardinality, EnumDescriptor, FieldDescriptor, Kind, MessageDescriptor};
use serde_json::{Value, json};

use super::{Route, Shape, json as codec};

/// The document for `routes`.
pub fn document(routes: &[Route]) -> Value {
    let mut schemas = BTreeMap::new();
    let mut paths = serde_json::Map::new();
    for route in routes {
        let input = message(&route.input);
        let output = message(&route.output);
        describe_message(&input, &mut schemas);
        describe_message(&output, &mut schemas);
        let success = match route.shape {
            Shape::Unary => json!({
                "description": format!("The {}.", output.name()),
                "content": { "application/json": { "schema": reference(output.full_name()) } },
            }),
            Shape::Stream => json!({
                "description": format!(
                    "Newline-delimited JSON: a line `{{\"result\": {}}}` per response; if the \
                     call fails on the way, a last line `{{\"error\": Error}}`.",
                    output.name()
                ),
                "content": { "application/x-ndjson": { "schema": {
                    "type": "object",
                    "properties": {
                        "result": reference(output.full_name()),
                        "error": { "$ref": "#/components/schemas/Error" },
                    },
                } } },
            }),
        };
        let operation = json!({
            "operationId": route.operation_id(),
            "tags": [route.service],
            "requestBody": {
                "description": format!(
                    "The {} in its proto3 JSON mapping; an empty body is the message with \
                     every field at its default.",
                    input.name()
                ),
                "required": false,
                "content": { "application/json": { "schema": reference(input.full_name()) } },
            },
            "responses": {
                "200": success,
                "default": {
                    "description": "Refused or failed: the HTTP status of the gRPC code.",
                    "content": { "application/json": {
                        "schema": { "$ref": "#/components/schemas/Error" }
                    } },
                },
            },
        });
        paths.insert(route.path(), json!({ "post": operation }));
    }
    schemas.insert(
        "Error".to_string(),
        json!({
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {
                    "type": "string",
                    "description": "The gRPC status code's name, e.g. UNAVAILABLE.",
                },
                "message": { "type": "string" },
            },
        }),
    );
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Tether",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Tether's gRPC API (package tether.v1) over HTTP with JSON bodies: \
                every method is POST /v1/{service}/{method}. Answers carry x-tether-node-id; \
                a follower refuses writes with 503 UNAVAILABLE and x-tether-leader-id.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": { "type": "http", "scheme": "bearer",
                    "description": "A token from tetherd's --auth-tokens file." },
                "mutualTLS": { "type": "mutualTLS",
                    "description": "A client certificate from the CA of --tls-dir." },
            },
        },
        "security": [ { "bearer": [] }, { "mutualTLS": [] } ],
    })
}

fn message(full_name: &str) -> MessageDescriptor {
    codec::pool()
        .get_message_by_name(full_name)
        .unwrap_or_else(|| panic!("{full_name} is not in the descriptor set"))
}

fn reference(full_name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{full_name}") })
}

/// Adds the schema of `message` and of every message and enum it uses.
fn describe_message(message: &MessageDescriptor, schemas: &mut BTreeMap<String, Value>) {
    if schemas.contains_key(message.full_name()) {
        return;
    }
    // Placed first: a message that contains itself stops here.
    schemas.insert(message.full_name().to_string(), Value::Null);
    let mut properties = serde_json::Map::new();
    for field in message.fields() {
        properties.insert(field.json_name().to_string(), field_schema(&field, schemas));
    }
    schemas.insert(
        message.full_name().to_string(),
        json!({
            "type": "object",
            "properties": properties,
            "additionalProperties": false,
        }),
    );
}

fn describe_enum(descriptor: &EnumDescriptor, schemas: &mut BTreeMap<String, Value>) {
    let names: Vec<String> = descriptor.values().map(|v| v.name().to_string()).collect();
    schemas
        .entry(descriptor.full_name().to_string())
        .or_insert_with(|| json!({ "type": "string", "enum": names }));
}

fn field_schema(field: &FieldDescriptor, schemas: &mut BTreeMap<String, Value>) -> Value {
    if field.is_map() {
        let Kind::Message(entry) = field.kind() else {
            unreachable!("a map field's kind is its entry message")
        };
        let value = entry.map_entry_value_field();
        return json!({
            "type": "object",
            "additionalProperties": kind_schema(&value.kind(), schemas),
        });
    }
    let single = kind_schema(&field.kind(), schemas);
    if field.cardinality() == Cardinality::Repeated {
        json!({ "type": "array", "items": single })
    } else {
        single
    }
}

fn kind_schema(kind: &Kind, schemas: &mut BTreeMap<String, Value>) -> Value {
    match kind {
        Kind::Double | Kind::Float => json!({ "type": "number" }),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            json!({ "type": "integer", "format": "int32" })
        }
        Kind::Uint32 | Kind::Fixed32 => json!({ "type": "integer", "format": "uint32" }),
        // proto3 JSON writes 64-bit integers as strings (and reads both).
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
            json!({ "type": "string", "format": "int64" })
        }
        Kind::Uint64 | Kind::Fixed64 => json!({ "type": "string", "format": "uint64" }),
        Kind::Bool => json!({ "type": "boolean" }),
        Kind::String => json!({ "type": "string" }),
        Kind::Bytes => json!({ "type": "string", "contentEncoding": "base64" }),
        Kind::Message(message) => {
            describe_message(message, schemas);
            reference(message.full_name())
        }
        Kind::Enum(descriptor) => {
            describe_enum(descriptor, schemas);
            reference(descriptor.full_name())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `$ref` in the document names a schema it holds, and every
    /// route is a path with its operationId.
    #[test]
    fn the_document_holds_every_route_and_every_schema_it_refers_to() {
        let routes = super::super::routes();
        let document = document(&routes);
        for route in &routes {
            let operation = &document["paths"][route.path()]["post"];
            assert_eq!(operation["operationId"], route.operation_id());
        }
        assert_eq!(document["paths"].as_object().unwrap().len(), routes.len());
        let mut references = Vec::new();
        collect_references(&document, &mut references);
        assert!(!references.is_empty());
        for reference in references {
            let name = reference
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{reference} points outside the schemas"));
            let schema = &document["components"]["schemas"][name];
            assert!(schema.is_object(), "{reference} names no schema");
        }
        let release = &document["components"]["schemas"]["tether.v1.ReleaseRequest"];
        assert_eq!(release["properties"]["podUid"]["type"], "string");
        assert_eq!(release["properties"]["token"]["format"], "uint64");
        assert_eq!(
            release["properties"]["outcome"]["$ref"],
            "#/components/schemas/tether.v1.Outcome"
        );
    }

    fn collect_references(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("$ref", Value::String(target)) => out.push(target.clone()),
                        _ => collect_references(value, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| collect_references(v, out)),
            _ => {}
        }
    }
}

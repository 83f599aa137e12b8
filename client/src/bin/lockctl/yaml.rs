//! A small YAML writer for `-o yaml`: JSON values rendered as block YAML.

use serde_json::Value;

/// Whether a string must be quoted to stay a string in YAML.
fn needs_quotes(s: &str) -> bool {
    s.is_empty()
        || s.trim() != s
        || s.parse::<f64>().is_ok()
        || matches!(
            s.to_ascii_lowercase().as_str(),
            "true" | "false" | "yes" | "no" | "null" | "~" | "on" | "off"
        )
        || s.starts_with([
            '-', '?', ':', '[', ']', '{', '}', '#', '&', '*', '!', '|', '>', '\'', '"', '%', '@',
            '`', ',',
        ])
        || s.contains(": ")
        || s.contains(" #")
        || s.contains('\n')
}

fn scalar(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) if needs_quotes(s) => serde_json::to_string(s).expect("strings serialize"),
        Value::String(s) => s.clone(),
        Value::Array(_) | Value::Object(_) => unreachable!("not a scalar"),
    }
}

fn is_empty_collection(value: &Value) -> bool {
    matches!(value, Value::Array(a) if a.is_empty())
        || matches!(value, Value::Object(o) if o.is_empty())
}

fn write(value: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                let key = if needs_quotes(key) {
                    serde_json::to_string(key).expect("strings serialize")
                } else {
                    key.clone()
                };
                match v {
                    Value::Array(_) | Value::Object(_) if !is_empty_collection(v) => {
                        out.push_str(&format!("{pad}{key}:\n"));
                        write(v, indent + 2, out);
                    }
                    Value::Array(_) => out.push_str(&format!("{pad}{key}: []\n")),
                    Value::Object(_) => out.push_str(&format!("{pad}{key}: {{}}\n")),
                    _ => out.push_str(&format!("{pad}{key}: {}\n", scalar(v))),
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                match item {
                    Value::Object(_) | Value::Array(_) if !is_empty_collection(item) => {
                        let mut nested = String::new();
                        write(item, indent + 2, &mut nested);
                        // "- " takes the place of the first line's indent.
                        let nested = nested.trim_start_matches(' ');
                        out.push_str(&format!("{pad}- {nested}"));
                    }
                    Value::Array(_) => out.push_str(&format!("{pad}- []\n")),
                    Value::Object(_) => out.push_str(&format!("{pad}- {{}}\n")),
                    _ => out.push_str(&format!("{pad}- {}\n", scalar(item))),
                }
            }
        }
        _ => out.push_str(&format!("{pad}{}\n", scalar(value))),
    }
}

/// Renders a JSON value as a YAML document.
pub fn to_yaml(value: &Value) -> String {
    match value {
        Value::Array(a) if a.is_empty() => "[]\n".into(),
        Value::Object(o) if o.is_empty() => "{}\n".into(),
        _ => {
            let mut out = String::new();
            write(value, 0, &mut out);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_nested_maps_lists_and_quotes_ambiguous_strings() {
        let value = json!({"lock": "gpu-bind/node-1", "holder": {"token": 3, "payload": "true"}, "waiters": [{"pod": "a"}, {"pod": "b"}], "empty": []});
        assert_eq!(
            to_yaml(&value),
            "empty: []\nholder:\n  payload: \"true\"\n  token: 3\nlock: gpu-bind/node-1\nwaiters:\n  - pod: a\n  - pod: b\n"
        );
    }
}

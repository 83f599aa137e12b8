//! Compiles `tether/v1/*.proto` with protox (pure Rust, no protoc binary) and
//! generates prost messages and tonic clients/servers.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "common", "lock", "lease", "pin", "node", "watch", "cluster", "raft",
    ]
    .map(|name| format!("tether/v1/{name}.proto"));
    for file in &files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(&files, ["."])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}

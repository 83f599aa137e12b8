//! Compiles `tether/v1/*.proto` with protox (pure Rust, no protoc binary) and
//! generates prost messages (each naming its protobuf type, `prost::Name`)
//! and tonic clients/servers. The compiled descriptors are kept too
//! (`tether.v1.bin` in `OUT_DIR`): the HTTP/JSON gateway maps JSON to and
//! from the messages with them and describes its routes from them.

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "common", "lock", "lease", "pin", "node", "watch", "cluster", "raft",
    ]
    .map(|name| format!("tether/v1/{name}.proto"));
    for file in &files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(&files, ["."])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("tether.v1.bin"), descriptors.encode_to_vec())?;
    let mut config = prost_build::Config::new();
    config.enable_type_names();
    tonic_prost_build::configure().compile_fds_with_config(descriptors, config)?;
    Ok(())
}

//! Compiles the kubelet device-plugin API (`proto/deviceplugin.proto`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/deviceplugin.proto");
    let descriptors = protox::compile(["deviceplugin.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}

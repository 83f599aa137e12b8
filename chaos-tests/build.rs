//! Compiles the subset of etcd's API the benchmark talks to.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for file in [
        "proto/etcd_lease.proto",
        "proto/etcd_lock.proto",
        "proto/etcd_kv.proto",
    ] {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(
        ["etcd_lease.proto", "etcd_lock.proto", "etcd_kv.proto"],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}

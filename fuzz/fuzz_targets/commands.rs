//! libFuzzer entry point of the `commands` target (see `tether_server::fuzzing`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tether_server::fuzzing::commands(data);
});

//! A process's CPU time and memory from Linux `/proc`, as the benchmarks
//! report them for the replicas, etcd's members and the bench itself.

/// Linux reports `utime` and `stime` in clock ticks of 1/100 s (USER_HZ,
/// fixed at 100 in the kernel's ABI on the platforms this runs on).
const TICKS_PER_SECOND: f64 = 100.0;

/// User plus system CPU seconds of a process, all its threads.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces:
    // count fields from the last ')'. utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

/// Resident and peak resident memory of a process, in MiB.
pub fn memory_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<f64>().ok())
            .map(|kib| kib / 1024.0)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let pid = std::process::id();
        // Burn CPU until at least one 1/100 s tick is counted. Spinning a
        // fixed wall time was not enough on a loaded 2-core machine (a
        // fresh clone's `./dev test` on 2026-12-06 counted none after
        // 30 ms): the thread was not running for most of it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut x = 0u64;
        let mut cpu = 0.0;
        while cpu <= 0.0 && std::time::Instant::now() < deadline {
            for _ in 0..1_000_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            cpu = cpu_seconds(pid).unwrap();
        }
        assert!(x != 1);
        assert!(cpu > 0.0, "no CPU time counted in 30 s of spinning");
        let (rss, peak) = memory_mib(pid).unwrap();
        assert!(rss > 0.0 && peak >= rss, "{rss} {peak}");
    }
}

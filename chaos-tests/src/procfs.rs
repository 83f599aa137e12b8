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
        // Burn a little CPU so the count is above zero at 1/100 s ticks.
        let started = std::time::Instant::now();
        let mut x = 0u64;
        while started.elapsed() < std::time::Duration::from_millis(30) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        assert!(x != 1);
        assert!(cpu_seconds(pid).unwrap() > 0.0);
        let (rss, peak) = memory_mib(pid).unwrap();
        assert!(rss > 0.0 && peak >= rss, "{rss} {peak}");
    }
}

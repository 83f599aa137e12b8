//! `tether-fuzz`: a mutation fuzzer on stable Rust for the targets in
//! `tether_server::fuzzing`, bounded by time and executions so CI can run
//! it. Inputs start from the corpus in `fuzz/corpus/<target>/` (shared with
//! the cargo-fuzz targets in `fuzz/`) and are mutated with a seeded
//! generator; a panicking input is saved and the run fails.
//!
//! ```text
//! tether-fuzz --time 20s                # every target, 20 s each
//! tether-fuzz --target commands --time 1h --seed 7
//! tether-fuzz --replay fuzz/artifacts/request/crash-1a2b3c
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tether_server::fuzzing::{TARGETS, XorShift, run, seed_inputs};

#[derive(Parser, Debug)]
#[command(
    name = "tether-fuzz",
    about = "Mutation fuzzing of Tether's input handling"
)]
struct Args {
    /// Target to run (request, stored, commands); all when not given.
    #[arg(long)]
    target: Option<String>,

    /// Time per target.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    time: Duration,

    /// Most executions per target (0 = until the time is up).
    #[arg(long, default_value_t = 0)]
    runs: u64,

    /// Seed of the mutations (printed; the same seed replays the same run).
    #[arg(long)]
    seed: Option<u64>,

    /// Corpus root: inputs in `<dir>/<target>/`.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus"))]
    corpus: PathBuf,

    /// Where panicking inputs are written: `<dir>/<target>/crash-<hash>`.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/artifacts"))]
    artifacts: PathBuf,

    /// Write the built-in seed inputs into the corpus directory and exit.
    #[arg(long)]
    write_seeds: bool,

    /// Run one input file through --target (default: the directory name
    /// above the file) and exit.
    #[arg(long)]
    replay: Option<PathBuf>,
}

const INTERESTING: [u8; 8] = [0, 1, 0x7f, 0x80, 0xff, 0x0a, 0x12, 0x1a];
const MAX_LEN: usize = 4096;

/// One to eight edits of an input: bit flips, byte sets, inserts,
/// deletions, duplications and splices with another pool entry.
fn mutate(rng: &mut XorShift, input: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.index(8) {
        let len = out.len();
        match rng.index(7) {
            0 if len > 0 => {
                let i = rng.index(len);
                out[i] ^= 1 << rng.index(8);
            }
            1 if len > 0 => {
                let i = rng.index(len);
                out[i] = if rng.index(2) == 0 {
                    INTERESTING[rng.index(INTERESTING.len())]
                } else {
                    rng.next_u64() as u8
                };
            }
            2 => {
                let i = rng.index(len + 1);
                let n = 1 + rng.index(8);
                for _ in 0..n {
                    out.insert(i, rng.next_u64() as u8);
                }
            }
            3 if len > 1 => {
                let i = rng.index(len);
                let n = 1 + rng.index((len - i).min(16));
                out.drain(i..i + n);
            }
            4 if len > 1 => {
                let i = rng.index(len);
                let n = 1 + rng.index((len - i).min(32));
                let chunk: Vec<u8> = out[i..i + n].to_vec();
                let at = rng.index(out.len() + 1);
                out.splice(at..at, chunk);
            }
            5 if !pool.is_empty() => {
                let other = &pool[rng.index(pool.len())];
                if !other.is_empty() {
                    let from = rng.index(other.len());
                    let n = 1 + rng.index(other.len() - from);
                    let at = rng.index(out.len() + 1);
                    out.truncate(at);
                    out.extend_from_slice(&other[from..from + n]);
                }
            }
            _ => out.push(rng.next_u64() as u8),
        }
    }
    out.truncate(MAX_LEN);
    out
}

fn load_corpus(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    files.sort();
    files
        .iter()
        .filter_map(|path| std::fs::read(path).ok())
        .collect()
}

/// FNV-1a: stable across runs, so artifact names are too.
fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Runs `target` on `data`, catching a panic; `Ok(true)` when the input
/// was well-formed.
fn attempt(target: &str, data: &[u8]) -> Result<bool, String> {
    std::panic::catch_unwind(|| run(target, data).unwrap_or(false)).map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".to_string())
    })
}

struct Outcome {
    executions: u64,
    well_formed: u64,
    pool: usize,
    crash: Option<PathBuf>,
}

fn fuzz(target: &str, args: &Args, seed: u64) -> Outcome {
    let mut corpus = seed_inputs(target);
    corpus.extend(load_corpus(&args.corpus.join(target)));
    let mut pool: Vec<Vec<u8>> = corpus.clone();
    if pool.is_empty() {
        pool.push(Vec::new());
    }
    let mut seen: HashSet<u64> = pool.iter().map(|p| hash(p)).collect();
    let mut rng = XorShift(seed.max(1));
    let started = Instant::now();
    let mut executions = 0u64;
    let mut well_formed = 0u64;
    // The corpus itself first, then mutations.
    let mut queue: Vec<Vec<u8>> = corpus;
    loop {
        if started.elapsed() >= args.time || (args.runs > 0 && executions >= args.runs) {
            break;
        }
        let input = match queue.pop() {
            Some(input) => input,
            None => {
                let base = &pool[rng.index(pool.len())];
                mutate(&mut rng, base, &pool)
            }
        };
        executions += 1;
        let accepted = match attempt(target, &input) {
            Ok(accepted) => accepted,
            Err(message) => {
                let dir = args.artifacts.join(target);
                let path = dir.join(format!("crash-{:016x}", hash(&input)));
                let _ = std::fs::create_dir_all(&dir);
                let _ = std::fs::write(&path, &input);
                eprintln!("tether-fuzz: {target}: panic after {executions} executions: {message}");
                eprintln!("tether-fuzz: input saved to {}", path.display());
                return Outcome {
                    executions,
                    well_formed,
                    pool: pool.len(),
                    crash: Some(path),
                };
            }
        };
        // A cheap stand-in for coverage: keep a bounded sample of new
        // well-formed inputs, so mutations compound on what gets past the
        // decoders.
        if accepted {
            well_formed += 1;
            if pool.len() < 4096 && rng.index(16) == 0 && seen.insert(hash(&input)) {
                pool.push(input);
            }
        }
    }
    Outcome {
        executions,
        well_formed,
        pool: pool.len(),
        crash: None,
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The panics are the findings: report them once, ourselves.
    std::panic::set_hook(Box::new(|_| {}));
    if let Some(path) = &args.replay {
        let target = args.target.clone().or_else(|| {
            path.parent()
                .and_then(|p| p.file_name())
                .and_then(|n| n.to_str())
                .map(str::to_string)
        });
        let Some(target) = target.filter(|t| TARGETS.contains(&t.as_str())) else {
            eprintln!(
                "tether-fuzz: say which target with --target ({})",
                TARGETS.join(", ")
            );
            return ExitCode::from(2);
        };
        let data = match std::fs::read(path) {
            Ok(data) => data,
            Err(err) => {
                eprintln!("tether-fuzz: cannot read {}: {err}", path.display());
                return ExitCode::from(2);
            }
        };
        return match attempt(&target, &data) {
            Ok(_) => {
                println!("tether-fuzz: {target}: {} passes", path.display());
                ExitCode::SUCCESS
            }
            Err(message) => {
                eprintln!(
                    "tether-fuzz: {target}: {} panics: {message}",
                    path.display()
                );
                ExitCode::FAILURE
            }
        };
    }
    if args.write_seeds {
        for target in TARGETS {
            let dir = args.corpus.join(target);
            if let Err(err) = std::fs::create_dir_all(&dir) {
                eprintln!("tether-fuzz: cannot create {}: {err}", dir.display());
                return ExitCode::FAILURE;
            }
            for input in seed_inputs(target) {
                let path = dir.join(format!("seed-{:016x}", hash(&input)));
                if let Err(err) = std::fs::write(&path, &input) {
                    eprintln!("tether-fuzz: cannot write {}: {err}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            println!("tether-fuzz: wrote the {target} seeds to {}", dir.display());
        }
        return ExitCode::SUCCESS;
    }
    let targets: Vec<&str> = match &args.target {
        Some(t) if TARGETS.contains(&t.as_str()) => vec![t.as_str()],
        Some(t) => {
            eprintln!(
                "tether-fuzz: unknown target {t:?}; targets: {}",
                TARGETS.join(", ")
            );
            return ExitCode::from(2);
        }
        None => TARGETS.to_vec(),
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    println!(
        "tether-fuzz: seed {seed} (replay with --seed {seed}), {:?} per target{}, corpus {}",
        args.time,
        if args.runs > 0 {
            format!(" or {} executions", args.runs)
        } else {
            String::new()
        },
        args.corpus.display()
    );
    let mut failed = false;
    for target in targets {
        let started = Instant::now();
        let outcome = fuzz(target, &args, seed);
        println!(
            "tether-fuzz: {target}: {} executions ({} well-formed) in {:.1} s ({:.0}/s), pool {}, {}",
            outcome.executions,
            outcome.well_formed,
            started.elapsed().as_secs_f64(),
            outcome.executions as f64 / started.elapsed().as_secs_f64().max(1e-9),
            outcome.pool,
            match &outcome.crash {
                Some(path) => format!("PANIC saved to {}", path.display()),
                None => "no panic".to_string(),
            }
        );
        failed |= outcome.crash.is_some();
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

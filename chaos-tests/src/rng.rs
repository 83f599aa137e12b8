//! Seeded randomness for schedules and workloads: ChaCha8 (`rand_chacha`)
//! seeded from the run's seed, so the same seed gives the same choices on
//! any machine and any build of `rand`. The methods name what the chaos code
//! asks for (a fork per part, a range, a percentage, a pick).

use rand::{Rng as _, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Seeded pseudo-random numbers; not for anything secret.
#[derive(Debug, Clone)]
pub struct Rng {
    inner: ChaCha8Rng,
}

impl Rng {
    /// A generator whose whole sequence follows from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            inner: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// An independent generator for a sub-part (a client, a fault), so adding
    /// choices in one part does not shift the others.
    pub fn fork(&mut self, salt: u64) -> Rng {
        Rng::new(self.next_u64() ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.inner.random_range(0..n.max(1))
    }

    /// Uniform in `low..=high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        self.inner.random_range(low..=high.max(low))
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN: [u64; 2] = [4974497100320965851, 10382371524257301112];

    #[test]
    fn same_seed_same_sequence_and_bounds_hold() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let x = a.between(3, 5);
            assert!((3..=5).contains(&x));
            b.between(3, 5);
            assert!(a.below(4) < 4);
            b.below(4);
        }
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
        let (mut c, mut d) = (Rng::new(9), Rng::new(9));
        assert_eq!(c.fork(1).next_u64(), d.fork(1).next_u64());
        assert_ne!(
            Rng::new(9).fork(1).next_u64(),
            Rng::new(9).fork(2).next_u64()
        );
    }

    /// A seed names one stream for good: this value is ChaCha8's, which
    /// rand_chacha keeps stable across versions, so a seed a failing run
    /// printed replays on a later build. A different generator, or a change
    /// in how the seed is expanded, fails here.
    #[test]
    fn a_seed_names_the_same_stream_on_every_build() {
        let mut rng = Rng::new(1035166);
        let first = [rng.next_u64(), rng.next_u64()];
        assert_eq!(first, GOLDEN);
    }
}

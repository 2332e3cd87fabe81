//! SplitMix64: the one statistical generator of the project, for what needs reproducibility,
//! not secrecy (initial weights, shuffling, partitioning). Secrets use the OS generator.

/// A SplitMix64 stream (Steele, Lea and Flood): any seed works, streams are well mixed.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw from `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform index below `n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.unit() * n as f64) as usize % n.max(1)
    }

    /// Shuffles in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }

    /// Keeps `n` of `items` drawn uniformly without replacement, in draw order (a partial
    /// Fisher–Yates shuffle); all of them when there are no more than `n`.
    pub fn choose<T>(&mut self, items: &mut Vec<T>, n: usize) {
        for i in 0..n.min(items.len()) {
            let j = i + self.below(items.len() - i);
            items.swap(i, j);
        }
        items.truncate(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choose_keeps_n_distinct_items_the_same_for_the_same_seed() {
        let drawn = |seed| {
            let mut items: Vec<u32> = (0..50).collect();
            SplitMix64(seed).choose(&mut items, 7);
            items
        };
        let a = drawn(3);
        assert_eq!(a.len(), 7);
        let mut distinct = a.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 7);
        assert!(a.iter().all(|&x| x < 50));
        assert_eq!(a, drawn(3));
        assert_ne!(a, drawn(4));
        let mut few = vec![1, 2];
        SplitMix64(1).choose(&mut few, 5);
        few.sort_unstable();
        assert_eq!(few, [1, 2], "no more than there are");
    }
}

//! Shape buckets of steps a device captures once and replays (CUDA graphs): a step's longest context, rounded so
//! one captured split plan holds for many tokens.

/// The context a graphed step's split plan is made for: `n` rounded up to a multiple of max(256, n's power of two
/// / 8): a bucket spans 256 tokens up to 2K and an eighth of the next power of two past it, so at most 16 buckets
/// up to 8K and at most a quarter more context than the step has (the extra splits are empty for every row).
pub fn ctx_bucket(n: usize) -> usize {
    let n = n.max(1);
    let g = (n.next_power_of_two() / 8).max(256);
    n.div_ceil(g) * g
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets cover their context, are their own bucket, waste under a bucket's step, and number 16 up to 8K.
    #[test]
    fn buckets_cover_and_stay_put() {
        for n in 1..20_000 {
            let b = ctx_bucket(n);
            assert!(b >= n, "{n} -> {b}");
            assert!(b - n < 256.max(n.next_power_of_two() / 8), "{n} -> {b}");
            assert_eq!(ctx_bucket(b), b, "a bucket is its own bucket ({n} -> {b})");
        }
        assert_eq!(ctx_bucket(1), 256);
        assert_eq!(ctx_bucket(256), 256);
        assert_eq!(ctx_bucket(257), 512);
        assert_eq!(ctx_bucket(4097), 4096 + 1024);
        let distinct: std::collections::BTreeSet<usize> = (1..=8192).map(ctx_bucket).collect();
        assert!(distinct.len() == 16, "{} graphs per shape up to 8K", distinct.len());
    }
}

//! FNV-1a (64-bit): the content hash behind `Harness::version()` and every prompt block's hash. Not
//! cryptographic; it only has to change whenever content changes and stay the same across runs and machines.

const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

#[derive(Debug, Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Fnv64(OFFSET)
    }
}

impl Fnv64 {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn update(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(PRIME);
        }
        self
    }

    pub fn finish(&self) -> u64 {
        self.0
    }

    /// 16 lowercase hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// The 16-hex-digit FNV-1a hash of `bytes`.
pub fn hash_hex(bytes: &[u8]) -> String {
    Fnv64::new().update(bytes).hex()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_published_vectors() {
        assert_eq!(Fnv64::new().update(b"").finish(), 0xcbf29ce484222325);
        assert_eq!(Fnv64::new().update(b"a").finish(), 0xaf63dc4c8601ec8c);
        assert_eq!(Fnv64::new().update(b"foobar").finish(), 0x85944171f73967e8);
    }

    #[test]
    fn hash_is_incremental() {
        let mut h = Fnv64::new();
        h.update(b"foo").update(b"bar");
        assert_eq!(h.hex(), hash_hex(b"foobar"));
    }
}

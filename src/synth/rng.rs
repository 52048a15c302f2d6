//! The project's one deterministic random generator: SplitMix64, counter-based, seeded per
//! (seed, name, block) so generated values are the same on every machine and thread count.
//! The checkpoint writer draws weights from it; tests draw their inputs from it.

/// SplitMix64 (Steele, Lea & Flood 2014): a 64-bit counter through a mixing function.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Approximately standard normal (Irwin–Hall of four 16-bit uniforms, rescaled): one draw
    /// per value, what the checkpoint writer uses.
    pub fn normal(&mut self) -> f32 {
        let r = self.next_u64();
        let s: u32 = (0..4).map(|i| ((r >> (16 * i)) & 0xFFFF) as u32).sum();
        let u = (s as f32 + 2.0) / 65536.0; // sum of 4 U(0,1), mean 2, variance 1/3
        (u - 2.0) * 3f32.sqrt()
    }
    /// Standard normal by Box–Muller (exact tails; the tests' inputs).
    pub fn gaussian(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f32::consts::PI * v).cos()
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// `n` standard normal values times `scale`, rounded to bf16, so a GPU backend that stores
    /// them in bf16 and the f32 CPU reference see identical inputs.
    pub fn bf16_normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| half::bf16::from_f32(self.gaussian() * scale).to_f32()).collect()
    }
    /// Uniform in (0, 1), 24 bits.
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
}

/// The seed of the values named `name` under the checkpoint seed `seed` (FNV-1a over the name,
/// mixed with the seed).
pub fn name_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

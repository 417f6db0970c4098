//! Money as people read it. Amounts travel and are kept as integer
//! micro-MLX (1 MLX = 1,000,000 micro-MLX); every side prints them the same
//! way, as MLX with six decimals.

/// Micro-MLX in one MLX.
pub const MICRO_PER_MLX: i64 = 1_000_000;

/// `micro` micro-MLX as MLX with six decimals (`-1.250000`).
pub fn mlx(micro: i64) -> String {
    let sign = if micro < 0 { "-" } else { "" };
    let m = micro.unsigned_abs();
    let per = MICRO_PER_MLX.unsigned_abs();
    format!("{sign}{}.{:06}", m / per, m % per)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_print_as_mlx_with_six_decimals() {
        assert_eq!(mlx(0), "0.000000");
        assert_eq!(mlx(1), "0.000001");
        assert_eq!(mlx(1_250_000), "1.250000");
        assert_eq!(mlx(-1_250_000), "-1.250000");
        assert_eq!(mlx(i64::MIN), "-9223372036854.775808");
    }
}

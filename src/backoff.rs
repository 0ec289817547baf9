//! Capped exponential backoff with jitter, for a sink that is down and for a row that keeps failing.

use std::time::Duration;

/// Delay before try number `failures + 1`: `floor * 2^(failures-1)` capped at `cap`, then "equal
/// jitter" (a random point in the upper half) so many relays do not retry in lockstep. A server's
/// Retry-After raises the delay to at least that, still clamped to `cap`.
pub fn delay(failures: u32, floor: Duration, cap: Duration, retry_after: Option<Duration>, unit_random: f64) -> Duration {
    let cap = cap.max(floor);
    let exp = floor.saturating_mul(1u32 << failures.saturating_sub(1).min(30));
    let base = exp.min(cap);
    let jittered = base.mul_f64(0.5 + 0.5 * unit_random.clamp(0.0, 1.0));
    match retry_after {
        Some(ra) => jittered.max(ra.min(cap)),
        None => jittered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn doubles_from_the_floor_up_to_the_cap() {
        let d = |n| delay(n, 100 * MS, 1000 * MS, None, 1.0);
        assert_eq!([d(1), d(2), d(3), d(4), d(5), d(40)], [100 * MS, 200 * MS, 400 * MS, 800 * MS, 1000 * MS, 1000 * MS]);
    }

    #[test]
    fn jitter_stays_in_the_upper_half() {
        assert_eq!(delay(3, 100 * MS, 10_000 * MS, None, 0.0), 200 * MS);
        assert_eq!(delay(3, 100 * MS, 10_000 * MS, None, 0.5), 300 * MS);
    }

    #[test]
    fn retry_after_is_a_minimum_clamped_to_the_cap() {
        assert_eq!(delay(1, 100 * MS, 5000 * MS, Some(2000 * MS), 0.0), 2000 * MS);
        assert_eq!(delay(1, 100 * MS, 1000 * MS, Some(2000 * MS), 0.0), 1000 * MS);
        assert_eq!(delay(9, 100 * MS, 5000 * MS, Some(10 * MS), 1.0), 5000 * MS);
    }
}

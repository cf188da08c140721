//! Durations as settings give them: whole milliseconds (`5000`) or
//! human-readable spans (`72h`, `90s`, `1h 30m`), always positive, so a
//! setting that would mean "never" or "at once" by accident is refused with
//! a message saying what was expected.

use std::time::Duration;

/// A positive number of milliseconds.
pub fn parse_millis(raw: &str) -> Result<Duration, String> {
    match raw.parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err("expected a positive number of milliseconds".into()),
    }
}

/// A positive duration such as `72h`, `90s` or `1h 30m`.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    match humantime::parse_duration(raw) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("expected a positive duration".into()),
        Err(e) => Err(format!("expected a duration such as 72h, 90m or 30s: {e}")),
    }
}

/// A positive duration in whole seconds, such as `1d` or `6h`.
pub fn parse_span(raw: &str) -> Result<Duration, String> {
    let span = parse_duration(raw)?;
    if span.subsec_nanos() != 0 {
        return Err("expected whole seconds".into());
    }
    Ok(span)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_fractions_are_refused_where_they_would_mislead() {
        assert_eq!(parse_millis("250"), Ok(Duration::from_millis(250)));
        assert!(parse_millis("0").is_err());
        assert!(parse_duration("0s").is_err());
        assert_eq!(parse_span("6h"), Ok(Duration::from_secs(6 * 3600)));
        assert!(parse_span("1500ms").is_err());
    }
}

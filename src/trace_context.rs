//! W3C Trace Context values a writer gives its edits (`feature_outbox.traceparent`, `.tracestate`):
//! checked when set, against the grammar of W3C Trace Context Level 1, sections 3.2 and 3.3, and
//! read by the outbox columns' defaults, so that every edit records the values in effect.

use pgrx::prelude::*;

/// The default of `outbox.traceparent`: feature_outbox.traceparent in effect; NULL when it is empty.
/// A C function rather than an expression over current_setting: a default is parsed again for
/// every INSERT that is planned anew, and that expression cost a bare INSERT 13 % more instructions.
#[pg_extern(stable, parallel_safe)]
fn _traceparent() -> Option<String> {
    Some(crate::settings::string(&crate::settings::TRACEPARENT)).filter(|v| !v.is_empty())
}

/// The default of `outbox.tracestate`: feature_outbox.tracestate in effect, only beside a traceparent
/// (W3C: a tracestate without one is discarded); NULL otherwise.
#[pg_extern(stable, parallel_safe)]
fn _tracestate() -> Option<String> {
    _traceparent()?;
    Some(crate::settings::string(&crate::settings::TRACESTATE)).filter(|v| !v.is_empty())
}

/// At most this many list-members in a tracestate (W3C Trace Context, 3.3.1.1).
const TRACESTATE_MAX_MEMBERS: usize = 32;

fn lower_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Checks a `traceparent` value: `version-trace_id-parent_id-flags`, lowercase hex, 2-32-16-2
/// digits; version `ff` is invalid, version `00` has exactly these four fields (a later version may
/// add fields after a `-`), and neither id may be all zeros. The empty string is "no trace".
pub fn check_traceparent(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Ok(());
    }
    let fields: Vec<&str> = value.splitn(5, '-').collect();
    let wrong = |what: &str| Err(format!("{what} (W3C Trace Context: 00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>, lowercase)."));
    if fields.len() < 4 {
        return wrong(&format!("traceparent has {} of its 4 dash-separated fields", fields.len()));
    }
    let (version, trace_id, parent_id, flags) = (fields[0], fields[1], fields[2], fields[3]);
    for (name, field, len) in [("version", version, 2), ("trace-id", trace_id, 32), ("parent-id", parent_id, 16), ("flags", flags, 2)] {
        if field.len() != len || !lower_hex(field) {
            return wrong(&format!("{name} \"{field}\" is not {len} lowercase hex digits"));
        }
    }
    if version == "ff" {
        return wrong("version ff is invalid");
    }
    if version == "00" && fields.len() > 4 {
        return wrong("version 00 has exactly four fields");
    }
    if trace_id.bytes().all(|b| b == b'0') {
        return wrong("trace-id is all zeros");
    }
    if parent_id.bytes().all(|b| b == b'0') {
        return wrong("parent-id is all zeros");
    }
    Ok(())
}

/// A tracestate key: `lcalpha 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/")`, or
/// `tenant@system` with a tenant of 1-241 and a system of 1-14 such characters, the tenant starting
/// with a letter or digit and the system with a letter.
fn valid_key(key: &str) -> bool {
    let rest_ok = |s: &str| s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/".contains(&b));
    match key.split_once('@') {
        None => {
            key.len() <= 256 && key.as_bytes().first().is_some_and(|b| b.is_ascii_lowercase()) && rest_ok(&key[1..])
        }
        Some((tenant, system)) => {
            (1..=241).contains(&tenant.len())
                && tenant.as_bytes()[0].is_ascii_alphanumeric()
                && !tenant.as_bytes()[0].is_ascii_uppercase()
                && rest_ok(&tenant[1..])
                && (1..=14).contains(&system.len())
                && system.as_bytes()[0].is_ascii_lowercase()
                && rest_ok(&system[1..])
        }
    }
}

/// A tracestate value: 1-256 printable ASCII characters other than `,` and `=`, spaces allowed
/// except at the end.
fn valid_value(value: &str) -> bool {
    (1..=256).contains(&value.len())
        && value.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
        && !value.ends_with(' ')
}

/// Checks a `tracestate` value: comma-separated `key=value` list-members (empty members and spaces
/// or tabs around them allowed), at most 32, no key twice. The empty string is "none".
pub fn check_tracestate(value: &str) -> Result<(), String> {
    let mut keys: Vec<&str> = Vec::new();
    for member in value.split(',').map(|m| m.trim_matches([' ', '\t'])).filter(|m| !m.is_empty()) {
        let Some((key, val)) = member.split_once('=') else {
            return Err(format!("list-member \"{member}\" is not key=value (W3C Trace Context, tracestate)."));
        };
        if !valid_key(key) {
            return Err(format!(
                "key \"{key}\" is not a tracestate key: a lowercase letter, then up to 255 of a-z, 0-9, _, -, *, /; or tenant@system."
            ));
        }
        if !valid_value(val) {
            return Err(format!(
                "the value of \"{key}\" is not 1 to 256 printable ASCII characters without , or = and not ending in a space."
            ));
        }
        if keys.contains(&key) {
            return Err(format!("key \"{key}\" appears twice; a tracestate key is unique."));
        }
        keys.push(key);
    }
    if keys.len() > TRACESTATE_MAX_MEMBERS {
        return Err(format!("{} list-members; tracestate holds at most {TRACESTATE_MAX_MEMBERS}.", keys.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_follows_the_w3c_grammar() {
        // The specification's own example, and an unsampled one.
        assert_eq!(check_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), Ok(()));
        assert_eq!(check_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"), Ok(()));
        assert_eq!(check_traceparent(""), Ok(()));
        // A later version may carry more fields.
        assert_eq!(check_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever"), Ok(()));
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", // uppercase
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(check_traceparent(bad).is_err(), "{bad:?}");
        }
        assert!(check_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01").unwrap_err().contains("trace-id is all zeros"));
    }

    #[test]
    fn tracestate_follows_the_w3c_grammar() {
        for good in ["", "congo=t61rcWkgMzE", "k=v ", "k= v", "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE", "a@b=x y", " ,k=v,\t", "t-1*/_@sys=v"] {
            assert_eq!(check_tracestate(good), Ok(()), "{good:?}");
        }
        let many = (0..33).map(|i| format!("k{i}=v")).collect::<Vec<_>>().join(",");
        let long_value = format!("k={}", "v".repeat(257));
        for bad in ["novalue", "Upper=v", "1abc=v", "k=", "k=a=b", "k=v,k=w", "k=\u{e9}", "@s=v", "t@=v", &many, &long_value] {
            assert!(check_tracestate(bad).is_err(), "{bad:?}");
        }
    }
}

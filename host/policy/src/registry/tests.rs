//! Unit tests of the policy registry.
use super::*;

#[test]
fn rfc3339_known_points() {
    assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
    let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
    assert_eq!(rfc3339(t), "2023-11-14T22:13:20Z");
    let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(951_782_400); // 2000-02-29
    assert_eq!(rfc3339(t), "2000-02-29T00:00:00Z");
}

#[test]
fn names() {
    assert!(validate_name("native-cost_v1.2").is_ok());
    for bad in ["", ".hidden", "a/b", "sp ace", "rollback", &"x".repeat(65)] {
        assert!(validate_name(bad).is_err(), "{bad:?}");
    }
}

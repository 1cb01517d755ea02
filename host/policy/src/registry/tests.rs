//! Unit tests of the policy registry.
use super::*;

#[test]
fn names() {
    assert!(validate_name("native-cost_v1.2").is_ok());
    for bad in ["", ".hidden", "a/b", "sp ace", "rollback", &"x".repeat(65)] {
        assert!(validate_name(bad).is_err(), "{bad:?}");
    }
}

//! The fast reader of `/v1/route` and `/v1/overlap` bodies (`prompt_json`).
//!
//! Asserts: (1) whatever the fast path accepts, serde_json reads to the same body (it must never
//! accept what serde refuses, nor read other numbers); (2) `parse_prompt_body` (fast path with
//! fallback) answers exactly as the ordinary path, value or error.
#![no_main]

use kvroute_server::http::dto::RouteBody;
use kvroute_server::http::error::parse_json_object;
use kvroute_server::http::prompt_json::{fast_parse, parse_prompt_body};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let slow = parse_json_object::<RouteBody>(data);
    if let Some(fast) = fast_parse::<RouteBody>(data) {
        match &slow {
            Ok(s) => assert_eq!(
                format!("{s:?}"),
                format!("{fast:?}"),
                "fast path read differently"
            ),
            Err(e) => panic!("fast path accepted a body serde refuses: {e:?}"),
        }
    }
    let mixed = parse_prompt_body::<RouteBody>(data);
    assert_eq!(
        format!("{slow:?}"),
        format!("{mixed:?}"),
        "parse_prompt_body differs from serde"
    );
});

//! The fast reader of `/v1/route` and `/v1/overlap` bodies (`prompt_json`).
//!
//! Asserts: (1) whatever the fast path accepts, serde_json reads to the same body (it must never
//! accept what serde refuses, nor read other numbers); (2) `parse_prompt_body` (fast path with
//! fallback) answers exactly as the ordinary path, value or error; (3) the token-array reader gives
//! the same answer with its 64-byte SSE2 blocks and with the scalar loop alone.
#![no_main]

use kvroute_server::http::dto::RouteBody;
use kvroute_server::http::error::parse_json_object;
use kvroute_server::http::prompt_json::{fast_parse, parse_prompt_body, parse_token_array};
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

    // The array reader on its own, from every `[` in the first few hundred bytes.
    for (i, _) in data
        .iter()
        .enumerate()
        .take(512)
        .filter(|(_, &b)| b == b'[')
    {
        let with_blocks = parse_token_array(&data[i..], true);
        let scalar = parse_token_array(&data[i..], false);
        assert_eq!(
            with_blocks, scalar,
            "block and scalar readers disagree at {i}"
        );
    }
});

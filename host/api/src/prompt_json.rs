//! A fast path for the large fields of a routing body: the prompt's `tokens` or `block_hashes`.
//!
//! A 4,096-token prompt is ~25 KB of JSON integers (its 256 block hashes ~5 KB), and serde_json
//! spends most of a route's parse time on them (one visitor call, whitespace skip and
//! overflow-checked loop per element). Since the arrays are nothing but unsigned integers, a
//! dedicated loop that reads up to 8 digits at a time reads them about 3x faster
//! (`cargo bench -p kvroute-host --bench route_body`).
//!
//! The fast path never decides what a body *means* on its own: it walks the top-level members,
//! reads the first `"tokens"` and `"block_hashes"` values if (and only if) they are plain arrays of
//! integers that fit (`u32`, `u64`), and hands serde_json the same body with those arrays replaced
//! by `null`. serde then checks everything else exactly as before (unknown and duplicate fields,
//! types, both or neither prompt form, trailing bytes), and the arrays are put back. Whenever
//! anything is unusual — a key spelled with escapes, a number that is negative, fractional, has a
//! leading zero or does not fit, a body serde rejects — the fast path gives up and the body is
//! parsed by the ordinary path, so every error keeps its code, message and field. `tests` compares
//! both paths on valid and hostile bodies.

use std::ops::Range;

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use super::error::{json_body, parse_json_object, ApiError};

/// Extractor for a JSON body with a prompt: like `ApiJson`, with the prompt fast path.
pub struct PromptJson<T>(pub T);

impl<T: PromptBody, S: Send + Sync> FromRequest<S> for PromptJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        parse_prompt_body(&json_body(req, state).await?).map(PromptJson)
    }
}

/// A request body with the optional prompt fields `tokens` and `block_hashes`.
pub trait PromptBody: DeserializeOwned {
    /// The body's `tokens` field.
    fn tokens_mut(&mut self) -> &mut Option<Vec<u32>>;
    /// The body's `block_hashes` field.
    fn block_hashes_mut(&mut self) -> &mut Option<Vec<u64>>;
}

/// Parses a JSON object body whose prompt arrays (if any) are read by the fast path.
pub fn parse_prompt_body<T: PromptBody>(bytes: &[u8]) -> Result<T, ApiError> {
    match fast_parse(bytes) {
        Some(body) => Ok(body),
        None => parse_json_object(bytes),
    }
}

/// The prompt arrays found in a body, with where they were.
#[derive(Default)]
struct Found {
    tokens: Option<(Vec<u32>, Range<usize>)>,
    block_hashes: Option<(Vec<u64>, Range<usize>)>,
}

/// The fast path alone: `Some` only when it read the body itself, `None` where
/// [`parse_prompt_body`] would hand the body to the ordinary path. Public for the fuzz target and
/// property tests, which check that whatever it accepts serde_json reads the same way.
#[doc(hidden)]
pub fn fast_parse<T: PromptBody>(bytes: &[u8]) -> Option<T> {
    let found = scan_members(bytes)?;
    let mut spans: Vec<Range<usize>> = [
        found.tokens.as_ref().map(|t| t.1.clone()),
        found.block_hashes.as_ref().map(|h| h.1.clone()),
    ]
    .into_iter()
    .flatten()
    .collect();
    if spans.is_empty() {
        return None;
    }
    spans.sort_by_key(|r| r.start);
    let mut rest =
        Vec::with_capacity(bytes.len() - spans.iter().map(|r| r.len()).sum::<usize>() + 8);
    let mut at = 0;
    for r in &spans {
        rest.extend_from_slice(&bytes[at..r.start]);
        rest.extend_from_slice(b"null");
        at = r.end;
    }
    rest.extend_from_slice(&bytes[at..]);
    let mut body: T = serde_json::from_slice(&rest).ok()?;
    // The members now read `null`, so serde left both fields empty; never guess otherwise.
    if body.tokens_mut().is_some() || body.block_hashes_mut().is_some() {
        return None;
    }
    *body.tokens_mut() = found.tokens.map(|t| t.0);
    *body.block_hashes_mut() = found.block_hashes.map(|h| h.0);
    Some(body)
}

#[inline]
fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && is_ws(b[i]) {
        i += 1;
    }
    i
}

/// Index just past the closing quote of the string starting at `b[i] == '"'`.
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    debug_assert_eq!(b[i], b'"');
    i += 1;
    loop {
        match *b.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// Index just past the value starting at `b[i]` (which is not whitespace). Only finds the value's
/// end; whether it is valid JSON is serde's business.
fn skip_value(b: &[u8], mut i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            loop {
                match *b.get(i)? {
                    b'"' => {
                        i = skip_string(b, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            while i < b.len() && !matches!(b[i], b',' | b'}' | b']') && !is_ws(b[i]) {
                i += 1;
            }
            Some(i)
        }
    }
}

/// Walks the members of the top-level object and reads the first `tokens` and `block_hashes`
/// arrays. `None` when the body is not an object, a key uses escapes, an array is not a plain
/// array of integers that fit, or the scan meets anything it does not expect.
fn scan_members(b: &[u8]) -> Option<Found> {
    let mut found = Found::default();
    let mut i = skip_ws(b, 0);
    if *b.get(i)? != b'{' {
        return None;
    }
    i = skip_ws(b, i + 1);
    if *b.get(i)? == b'}' {
        return Some(found);
    }
    loop {
        if *b.get(i)? != b'"' {
            return None;
        }
        let key_start = i + 1;
        let key_end = skip_string(b, i)?;
        let name = &b[key_start..key_end - 1];
        if name.contains(&b'\\') {
            // An escaped key might spell one of ours: leave it to serde.
            return None;
        }
        i = skip_ws(b, key_end);
        if *b.get(i)? != b':' {
            return None;
        }
        i = skip_ws(b, i + 1);
        if name == b"tokens" && found.tokens.is_none() {
            let (v, len) = parse_int_array::<u32>(&b[i..], 10)?;
            found.tokens = Some((v, i..i + len));
            i += len;
        } else if name == b"block_hashes" && found.block_hashes.is_none() {
            let (v, len) = parse_int_array::<u64>(&b[i..], 20)?;
            found.block_hashes = Some((v, i..i + len));
            i += len;
        } else {
            i = skip_value(b, i)?;
        }
        i = skip_ws(b, i);
        match *b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b'}' => return Some(found),
            _ => return None,
        }
    }
}

/// Reads the array `[n, n, ...]` of JSON integers of at most `max_digits` digits that fit in `T`
/// at the start of `b`, and how many bytes it took. `None` for anything else (including numbers
/// JSON forbids, such as `01`), so that serde reports it. This is the hot part of parsing a
/// routing body.
fn parse_int_array<T: TryFrom<u64>>(b: &[u8], max_digits: usize) -> Option<(Vec<T>, usize)> {
    if b.first() != Some(&b'[') {
        return None;
    }
    // `b` runs to the end of the body, so its length only bounds the count (each integer takes at
    // least two bytes with its separator): start with room for a typical prompt and let bigger
    // ones grow; `done` gives back what a short array left unused, since the vector lives as long
    // as the request does.
    let mut out = Vec::with_capacity((b.len() / 2 + 1).min(8192));
    let done = |mut out: Vec<T>| {
        if out.capacity() > 2 * out.len() + 64 {
            out.shrink_to_fit();
        }
        out
    };
    let mut i = skip_ws(b, 1);
    if b.get(i) == Some(&b']') {
        return Some((done(out), i + 1));
    }
    loop {
        let (v, len) = read_integer(b, i, max_digits)?;
        out.push(T::try_from(v).ok()?);
        i += len;
        // A comma right after the number (what every encoder writes) without a call; anything
        // else through the general whitespace skip.
        match b.get(i) {
            Some(b',') => {
                i += 1;
                if b.get(i).is_some_and(|&c| is_ws(c)) {
                    i = skip_ws(b, i);
                }
            }
            _ => {
                i = skip_ws(b, i);
                match *b.get(i)? {
                    b',' => i = skip_ws(b, i + 1),
                    b']' => return Some((done(out), i + 1)),
                    _ => return None,
                }
            }
        }
    }
}

/// The JSON unsigned integer at `b[i..]` and its length in bytes; `None` when there is no digit
/// there, the number has a leading zero, more than `max_digits` digits or does not fit in `u64`.
#[inline(always)]
fn read_integer(b: &[u8], i: usize, max_digits: usize) -> Option<(u64, usize)> {
    // The common case, every token id of today's vocabularies: up to 7 digits, read in one load.
    // Inlined into the array loop; longer numbers and the end of the body take the call below.
    if let Some(chunk) = b.get(i..i + 8) {
        let (t, n) = swar_digits(chunk);
        if n < 8 {
            if n == 0 || n > max_digits || (n > 1 && b[i] == b'0') {
                return None;
            }
            // The first byte is the most significant digit: move the `n` digits to the top bytes,
            // zeros (leading zeros) below.
            return Some((eight_digits(t << (8 * (8 - n))), n));
        }
    }
    read_long_integer(b, i, max_digits)
}

/// The eight bytes of `chunk` with the ASCII digits turned into their values, and how many
/// leading bytes are digits. Digits become 0..=9 and any other byte >= 10; then the high bit is set
/// in every byte >= 10 (a carry only leaves a byte that is already set).
#[inline(always)]
fn swar_digits(chunk: &[u8]) -> (u64, usize) {
    let t = ascii_values(chunk, 0);
    (t, (non_digits(t).trailing_zeros() / 8) as usize)
}

/// The eight bytes at `b[at..]` with the ASCII digits turned into their values 0..=9 (any other
/// byte becomes >= 10).
#[inline(always)]
fn ascii_values(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x) ^ 0x3030_3030_3030_3030
}

/// The high bit set in each byte of `t` (from [`ascii_values`]) that is not a digit. The addition
/// touches the low seven bits only, so no byte carries into the next and every byte is judged
/// on its own.
#[inline(always)]
fn non_digits(t: u64) -> u64 {
    (((t & 0x7f7f_7f7f_7f7f_7f7f).wrapping_add(0x7676_7676_7676_7676)) | t) & 0x8080_8080_8080_8080
}

/// [`read_integer`] for numbers of 8 digits or more (block hashes) and for the last bytes of a
/// body.
#[inline(never)]
fn read_long_integer(b: &[u8], i: usize, max_digits: usize) -> Option<(u64, usize)> {
    let leading_zero = |n: usize| n > 1 && b[i] == b'0';
    // 8 digits at a time, then byte by byte.
    let mut v: u64 = 0;
    let mut j = i;
    while let Some(chunk) = b.get(j..j + 8) {
        let (t, n) = swar_digits(chunk);
        if n < 8 {
            break;
        }
        v = v.checked_mul(100_000_000)?.checked_add(eight_digits(t))?;
        j += 8;
        if j - i > max_digits {
            return None;
        }
    }
    while let Some(&c) = b.get(j) {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(d))?;
        j += 1;
        if j - i > max_digits {
            return None;
        }
    }
    let n = j - i;
    (n > 0 && !leading_zero(n)).then_some((v, n))
}

/// The number whose 8 decimal digits (values 0..=9, most significant in the lowest byte) `t`
/// holds.
#[inline]
fn eight_digits(t: u64) -> u64 {
    let t = t.wrapping_mul(10).wrapping_add(t >> 8);
    let lo = (t & 0x0000_00FF_0000_00FF).wrapping_mul(100 + (1_000_000 << 32));
    let hi = ((t >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32));
    lo.wrapping_add(hi) >> 32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dto::{OverlapBody, RouteBody};

    /// Both paths agree: the same value, or the fast path stood aside and the ordinary path ran.
    fn same_as_serde(body: &str) {
        let slow = parse_json_object::<RouteBody>(body.as_bytes());
        let fast = parse_prompt_body::<RouteBody>(body.as_bytes());
        match (&slow, &fast) {
            (Ok(a), Ok(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}"), "body: {body}"),
            (Err(a), Err(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}"), "body: {body}"),
            _ => panic!("paths disagree on {body}: {slow:?} vs {fast:?}"),
        }
    }

    /// `read_integer` (at most `max_digits`) on 200,000 pseudo-random integers of 1 to
    /// `max_digits` digits (xorshift from `seed`), each followed by every one of `tails`.
    fn reads_random_integers(seed: u64, max_digits: u32, tails: &[&[u8]]) {
        let mut x = seed;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let digits = 1 + (x % u64::from(max_digits)) as u32;
            let v = match 10u64.checked_pow(digits) {
                Some(p) => x.rotate_right(8) % p,
                None => x,
            };
            for tail in tails {
                let mut s = v.to_string().into_bytes();
                let len = s.len();
                s.extend_from_slice(tail);
                assert_eq!(
                    read_integer(&s, 0, max_digits as usize),
                    Some((v, len)),
                    "{v} then {tail:?}"
                );
            }
        }
    }

    #[test]
    fn reads_integers_of_every_length_like_the_slow_loop() {
        let tails: [&[u8]; 5] = [b",", b"]", b" ", b", 17, 3]", b"\n"];
        reads_random_integers(0x2545_f491_4f6c_dd1d, 10, &tails);
        assert_eq!(
            read_integer(b"4294967295,", 0, 10),
            Some((4_294_967_295, 10))
        );
        assert_eq!(read_integer(b"12345678901,", 0, 10), None);
        assert_eq!(read_integer(b"007, 1, 2, 3", 0, 10), None);
        assert_eq!(read_integer(b"0, 1, 2, 3", 0, 10), Some((0, 1)));
        assert_eq!(read_integer(b", 1, 2, 3", 0, 10), None);
    }

    #[test]
    fn reads_u64_of_every_length_whatever_follows() {
        // Tails shorter and longer than 8 bytes, with digits after the separator.
        let tails: [&[u8]; 6] = [b"", b"]", b"]}", b", 1234567", b", 12345678901234]}", b"x9"];
        reads_random_integers(0x9e37_79b9_7f4a_7c15, 20, &tails);
        for tail in [&b""[..], b",", b", 1, 2, 3, 4, 5"] {
            let with = |n: &str| [n.as_bytes(), tail].concat();
            assert_eq!(
                read_integer(&with("18446744073709551615"), 0, 20),
                Some((u64::MAX, 20))
            );
            assert_eq!(read_integer(&with("18446744073709551616"), 0, 20), None);
            assert_eq!(read_integer(&with("99999999999999999999"), 0, 20), None);
            assert_eq!(read_integer(&with("100000000000000000000"), 0, 20), None);
            assert_eq!(read_integer(&with("0123456789012"), 0, 20), None);
            assert_eq!(read_integer(&with("123456789012"), 0, 11), None);
            assert_eq!(
                read_integer(&with("123456789012"), 0, 12),
                Some((123_456_789_012, 12))
            );
        }
    }

    #[test]
    fn reads_integer_arrays() {
        let read = |b: &[u8]| parse_int_array::<u32>(b, 10).map(|(v, _)| v);
        assert_eq!(parse_int_array::<u32>(b"[]", 10), Some((vec![], 2)));
        assert_eq!(parse_int_array::<u32>(b"[ \n ], 7", 10), Some((vec![], 5)));
        assert_eq!(read(b"[0]"), Some(vec![0]));
        assert_eq!(read(b"[0, 10, 100]"), Some(vec![0, 10, 100]));
        assert_eq!(
            parse_int_array::<u32>(b"[ 1 ,2,\t3 , 4294967295 ]}", 10),
            Some((vec![1, 2, 3, u32::MAX], 24))
        );
        for bad in [
            &b"[4294967296]"[..],
            b"[99999999999999999999]",
            b"[01]",
            b"[-1]",
            b"[1.0]",
            b"[1e3]",
            b"[1,]",
            b"[,1]",
            b"[1 2]",
            b"[\"1\"]",
            b"[null]",
            b"[1",
            b"1]",
            b"",
        ] {
            assert_eq!(
                parse_int_array::<u32>(bad, 10),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// xorshift64: the tests' pseudo-random stream.
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// A random array of integers of `1..=max_len` digits, with separators drawn from `seps`,
    /// and now and then a defect from `defects` in place of a number.
    fn random_array(x: &mut u64, max_len: u64, seps: &[&str], defects: &[&str]) -> String {
        let count = next(x) % 300;
        let mut out = String::from("[");
        for k in 0..count {
            if k > 0 {
                out.push_str(seps[(next(x) % seps.len() as u64) as usize]);
            }
            if !defects.is_empty() && next(x).is_multiple_of(97) {
                out.push_str(defects[(next(x) % defects.len() as u64) as usize]);
                continue;
            }
            let len = 1 + next(x) % max_len;
            let v = next(x);
            let v = match 10u64.checked_pow(len as u32) {
                Some(p) => v % p,
                None => v,
            };
            out.push_str(&v.to_string());
        }
        out.push(']');
        out
    }

    /// The array reader reads exactly what serde reads, for long arrays, compact or spaced, with
    /// and without defects.
    fn arrays_read_like_serde<T>(max_digits: usize, max_len: u64, seed: u64)
    where
        T: TryFrom<u64> + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let seps: [&[&str]; 4] = [
            &[","],
            &[", "],
            &[",", ", "],
            &[",", ", ", " , ", ",\n", ",  "],
        ];
        let defects = [
            "01",
            "00",
            "-1",
            "1.5",
            "1e3",
            "",
            "18446744073709551616",
            "4294967296",
            "1 2",
            "\"7\"",
            "null",
            "99999999999999999999",
            "123456789012345678901",
        ];
        let mut x = seed;
        let mut taken = 0;
        for round in 0..3_000 {
            let with_defects: &[&str] = if round % 3 == 0 { &defects } else { &[] };
            let array = random_array(&mut x, max_len, seps[round % seps.len()], with_defects);
            let body = format!("{array}, \"z\": 1}}");
            let ours = parse_int_array::<T>(body.as_bytes(), max_digits);
            let theirs = serde_json::from_str::<Vec<T>>(&array).ok();
            match (&ours, theirs) {
                (Some((v, len)), Some(w)) => {
                    assert_eq!((v, *len), (&w, array.len()), "{array}");
                    taken += 1;
                }
                (None, None) => {}
                (ours, theirs) => panic!("{array}: fast path {ours:?}, serde {theirs:?}"),
            }
        }
        assert!(taken > 1_000, "only {taken} arrays were valid");
    }

    #[test]
    fn token_arrays_read_like_serde() {
        arrays_read_like_serde::<u32>(10, 7, 0x2545_f491_4f6c_dd1d);
        // Tokens of 8 and 9 digits: numbers longer than one load.
        arrays_read_like_serde::<u32>(10, 9, 0x0bad_5eed_0bad_5eed);
    }

    #[test]
    fn hash_arrays_read_like_serde() {
        arrays_read_like_serde::<u64>(20, 20, 0x9e37_79b9_7f4a_7c15);
        arrays_read_like_serde::<u64>(20, 20, 0x1357_9bdf_2468_ace0);
    }

    #[test]
    fn long_bodies_agree_with_serde_on_every_byte_flip() {
        // Long arrays of both kinds, so that flips land inside numbers, separators and keys.
        let tokens: Vec<String> = (0..40u32)
            .map(|t| (t * 7919 % 131_072).to_string())
            .collect();
        let hashes: Vec<String> = (0..12u64)
            .map(|h| (h.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (h % 4 * 9)).to_string())
            .collect();
        for body in [
            format!(r#"{{"tokens": [{}], "book": false}}"#, tokens.join(",")),
            format!(r#"{{"tokens": [{}], "book": false}}"#, tokens.join(", ")),
            format!(
                r#"{{"block_hashes": [{}], "session_id": "s"}}"#,
                hashes.join(",")
            ),
        ] {
            for i in 0..body.len() {
                for repl in *b", 09-].\n" {
                    let mut bytes = body.as_bytes().to_vec();
                    bytes[i] = repl;
                    same_as_serde(std::str::from_utf8(&bytes).unwrap());
                }
            }
        }
    }

    #[test]
    fn finds_the_top_level_members_only() {
        let b = br#" { "a": {"tokens": [9]}, "s": "x\"tokens\":[8]", "tokens" : [1,2] , "z": 1}"#;
        let f = scan_members(b).unwrap();
        let (v, r) = f.tokens.unwrap();
        assert_eq!((v, &b[r]), (vec![1, 2], &b"[1,2]"[..]));
        assert!(f.block_hashes.is_none());
        let b = br#"{"block_hashes": [18446744073709551615, 0, 7]}"#;
        let (v, _) = scan_members(b).unwrap().block_hashes.unwrap();
        assert_eq!(v, vec![u64::MAX, 0, 7]);
        assert!(scan_members(br#"{"block_hashes": [18446744073709551616]}"#).is_none());
        assert!(scan_members(br#"{"tok\u0065ns": [1]}"#).is_none());
        assert!(scan_members(br#"[{"tokens": [1]}]"#).is_none());
        assert!(scan_members(br#"{"a": 1}"#).unwrap().tokens.is_none());
    }

    #[test]
    fn agrees_with_serde_on_valid_and_hostile_bodies() {
        let long: Vec<String> = (0..5000u32).map(|t| (t * 7919).to_string()).collect();
        let long = format!(r#"{{"request_id": "r1", "tokens": [{}]}}"#, long.join(","));
        let bodies = [
            r#"{"tokens": [1, 2, 3]}"#,
            r#"{"tokens": []}"#,
            r#"{"request_id": "a\"b", "tokens": [1], "temperature": 0.5, "session_id": "s"}"#,
            r#"{"routing_constraints": {"preferred_taints": {"tokens": 0.5}}, "tokens": [7]}"#,
            r#"{"tokens": [1], "tokens": [2]}"#,
            r#"{"tokens": [1], "tok\u0065ns": [2]}"#,
            r#"{"tok\u0065ns": [2]}"#,
            r#"{"tokens": [1], "block_hashes": [2]}"#,
            r#"{"block_hashes": [2], "tokens": [1]}"#,
            r#"{"block_hashes": [12345678901234567890, 1, 0]}"#,
            r#"{"block_hashes": [18446744073709551615]}"#,
            r#"{"block_hashes": [18446744073709551616]}"#,
            r#"{"block_hashes": [123456789012345678901]}"#,
            r#"{"block_hashes": [-1]}"#,
            r#"{"block_hashes": [], "session_id": "s"}"#,
            r#"{"block_hashes": [1], "block_hashes": [2]}"#,
            r#"{"request_id": "r", "block_hashes": [5, 6], "book": false, "explain": true}"#,
            r#"{}"#,
            r#"{"session_id": "s"}"#,
            r#"{"tokens": [1], "unknown": true}"#,
            r#"{"tokens": [1], "temperature": "hot"}"#,
            r#"{"tokens": [-1]}"#,
            r#"{"tokens": [4294967296]}"#,
            r#"{"tokens": [1.5]}"#,
            r#"{"tokens": [01]}"#,
            r#"{"tokens": [1,]}"#,
            r#"{"tokens": "1,2"}"#,
            r#"{"tokens": null}"#,
            r#"{"tokens": [1, 2]"#,
            r#"{"tokens": [1, 2]} trailing"#,
            r#"{"tokens": [1, 2]}}"#,
            r#"{"request_id": "x[1]", "tokens": [1]"#,
            r#"{"request_id": "unterminated, "tokens": [1]}"#,
            r#"{"a" "tokens": [1]}"#,
            r#"{, "tokens": [1]}"#,
            r#"{"request_id": 5, "tokens": [3]}"#,
            r#"[{"tokens": [1]}]"#,
            r#"  {"tokens":[1,2,3]}  "#,
            &long,
        ];
        for body in bodies {
            same_as_serde(body);
        }
    }

    #[test]
    fn agrees_with_serde_on_every_truncation_and_byte_flip() {
        for body in [
            r#"{"request_id": "q\\1", "tokens": [10, 0, 4294967295], "session_id": "s", "book": false}"#,
            r#"{"block_hashes": [10, 0, 18446744073709551615, 123456789], "temperature": 0.5}"#,
        ] {
            for cut in 0..=body.len() {
                if body.is_char_boundary(cut) {
                    same_as_serde(&body[..cut]);
                }
            }
            for i in 0..body.len() {
                for repl in *b"\"[],{}\\-09 x" {
                    let mut bytes = body.as_bytes().to_vec();
                    bytes[i] = repl;
                    same_as_serde(std::str::from_utf8(&bytes).unwrap());
                }
            }
        }
    }

    #[test]
    fn takes_the_fast_path_on_ordinary_bodies() {
        let tokens: Vec<String> = (0..4096u32)
            .map(|t| (t * 37 % 151_936).to_string())
            .collect();
        let body = format!(
            r#"{{"request_id": "bench-1", "tokens": [{}], "session_id": "s-42", "temperature": 0.0}}"#,
            tokens.join(", ")
        );
        let fast: RouteBody = fast_parse(body.as_bytes()).expect("no fallback");
        assert_eq!(fast.tokens.as_ref().map(Vec::len), Some(4096));
        assert_eq!(fast.session_id.as_deref(), Some("s-42"));
    }

    #[test]
    fn a_short_array_in_a_long_body_keeps_little_memory() {
        let body = format!(
            r#"{{"block_hashes": [1], "request_id": "{}"}}"#,
            "x".repeat(1 << 20)
        );
        let (v, _) = parse_int_array::<u64>(&body.as_bytes()[17..], 20).unwrap();
        assert_eq!(v, vec![1]);
        assert!(v.capacity() <= 66, "capacity {}", v.capacity());
    }

    #[test]
    fn fills_overlap_bodies_too() {
        let b: OverlapBody = parse_prompt_body(br#"{"tokens": [5, 6], "lora_name": "l"}"#).unwrap();
        assert_eq!(b.tokens, Some(vec![5, 6]));
        assert_eq!(b.lora_name.as_deref(), Some("l"));
    }

    /// What the fuzz target `prompt_json` asserts, on one body: whatever the fast path accepts
    /// serde reads the same; with the fallback the answer is serde's, value or error.
    fn check_like_the_fuzz_target(body: &[u8]) {
        let slow = parse_json_object::<RouteBody>(body);
        if let Some(fast) = fast_parse::<RouteBody>(body) {
            let slow = slow
                .as_ref()
                .expect("the fast path accepted what serde refuses");
            assert_eq!(format!("{slow:?}"), format!("{fast:?}"));
        }
        let mixed = parse_prompt_body::<RouteBody>(body);
        assert_eq!(format!("{slow:?}"), format!("{mixed:?}"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 400,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Bodies with long token arrays (so the block path runs), written compact or with
        /// `, `, then a few bytes overwritten, inserted or cut.
        #[test]
        fn mutated_bodies_read_like_serde(
            tokens in proptest::collection::vec(
                proptest::prop_oneof![0u32..100_000, proptest::prelude::any::<u32>()], 0..120),
            spaced in proptest::prelude::any::<bool>(),
            edits in proptest::collection::vec(
                (proptest::prelude::any::<proptest::sample::Index>(),
                 proptest::sample::select(b"0123456789, []{}\"-.e\t".to_vec()),
                 0u8..3),
                0..4),
        ) {
            let sep = if spaced { ", " } else { "," };
            let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
            let mut body = format!(r#"{{"tokens": [{}], "request_id": "r"}}"#, list.join(sep))
                .into_bytes();
            for (at, byte, op) in edits {
                let i = at.index(body.len());
                match op {
                    0 => body[i] = byte,
                    1 => body.insert(i, byte),
                    _ => body.truncate(i.max(1)),
                }
            }
            check_like_the_fuzz_target(&body);
        }
    }
}

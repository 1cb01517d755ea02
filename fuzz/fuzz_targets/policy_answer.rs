//! The check of a policy's answer (`kvroute_policy::check_answer`, what every decision runs before
//! the router uses an answer): arbitrary costs or picks, candidate counts and roles.
//!
//! Asserts: an accepted answer has exactly one finite cost per candidate or a pick in range (and
//! only where picks are allowed), returned unchanged; a refused one has the reason the contract
//! names for it and a message.
#![no_main]

use kvroute_policy::{check_answer, FallbackReason, Outcome, RawAnswer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let n = usize::from(u16::from_le_bytes([data[0], data[1]]) % 300);
    let allow_pick = data[2] & 1 == 1;
    let rest = &data[4..];
    let answer = if data[3] & 1 == 1 {
        let mut b = [0u8; 4];
        let k = rest.len().min(4);
        b[..k].copy_from_slice(&rest[..k]);
        RawAnswer::Pick(u32::from_le_bytes(b))
    } else {
        RawAnswer::Costs(
            rest.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    };
    match (check_answer(answer.clone(), n, allow_pick), answer) {
        (Ok(Outcome::Costs(got)), RawAnswer::Costs(sent)) => {
            assert_eq!(got.len(), n);
            assert!(got.iter().all(|c| c.is_finite()));
            assert!(got
                .iter()
                .zip(&sent)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        (Ok(Outcome::Pick(i)), RawAnswer::Pick(sent)) => {
            assert!(allow_pick && i < n && i == sent as usize);
        }
        (Ok(other), sent) => panic!("{sent:?} came back as {other:?}"),
        (Err((reason, message)), sent) => {
            assert!(!message.is_empty());
            let expected = match sent {
                RawAnswer::Costs(c) if c.len() != n => FallbackReason::InvalidLength,
                RawAnswer::Costs(_) => FallbackReason::NonFinite,
                RawAnswer::Pick(_) if !allow_pick => FallbackReason::UnexpectedPick,
                RawAnswer::Pick(_) => FallbackReason::PickOutOfRange,
            };
            assert_eq!(reason, expected, "{message}");
        }
    }
});

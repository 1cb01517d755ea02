//! A stage's answer, from the guest's memory to a checked [`Answer`]: the host lifts the WIT
//! `decision` itself ([`RawDecision`], [`BoundedCosts`]) so that a `costs` list is copied out of the
//! guest only when its length is the number of candidates, then [`validate`] checks it (length,
//! finite costs, a pick in range and allowed). [`check_answer`] is the same check, public for the
//! fuzz target and the property tests.

use std::cell::Cell;

use wasmtime::component::__internal::{CanonicalAbiInfo, InstanceType, InterfaceType, LiftContext};
use wasmtime::component::{ComponentType, Lift, WasmList};

use super::error::FallbackReason;
use super::failure::Failure;

/// A validated answer of one stage.
#[derive(Debug)]
pub(crate) enum Answer {
    Costs(Vec<f64>),
    Pick(usize),
}

thread_local! {
    /// The number of candidates of the decision being lifted on this thread (see
    /// [`BoundedCosts`]): lifting runs synchronously inside the call, on the caller's thread.
    pub(crate) static EXPECTED_COSTS: Cell<usize> = const { Cell::new(0) };
}

/// A `costs` list as the host lifts it: copied out of the guest only when its length is the
/// number of candidates. The guest's claimed length is read first (the list's pointer and length,
/// checked against the bounds of its memory), so an oversize answer (millions of entries) costs
/// what a wrong length of one costs, instead of a copy of everything the guest could allocate.
#[derive(Debug)]
pub(crate) enum BoundedCosts {
    Fits(Vec<f64>),
    /// The length the guest claimed.
    WrongLength(usize),
}

// SAFETY: every item delegates to `Vec<f64>`, the type of `list<f64>`: same lowered form, same
// ABI, same type check.
unsafe impl ComponentType for BoundedCosts {
    type Lower = <Vec<f64> as ComponentType>::Lower;
    const ABI: CanonicalAbiInfo = <Vec<f64> as ComponentType>::ABI;
    fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
        <Vec<f64> as ComponentType>::typecheck(ty, types)
    }
}

// SAFETY: lifting reads the (pointer, length) pair as `WasmList` does (bounds-checked), and the
// elements through `Vec<f64>`'s own lift only when the length is the expected one.
unsafe impl Lift for BoundedCosts {
    fn linear_lift_from_flat(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        src: &Self::Lower,
    ) -> wasmtime::Result<Self> {
        let claimed = <WasmList<f64> as Lift>::linear_lift_from_flat(cx, ty, src)?.len();
        if claimed != EXPECTED_COSTS.get() {
            return Ok(BoundedCosts::WrongLength(claimed));
        }
        <Vec<f64> as Lift>::linear_lift_from_flat(cx, ty, src).map(BoundedCosts::Fits)
    }

    fn linear_lift_from_memory(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        bytes: &[u8],
    ) -> wasmtime::Result<Self> {
        let claimed = <WasmList<f64> as Lift>::linear_lift_from_memory(cx, ty, bytes)?.len();
        if claimed != EXPECTED_COSTS.get() {
            return Ok(BoundedCosts::WrongLength(claimed));
        }
        <Vec<f64> as Lift>::linear_lift_from_memory(cx, ty, bytes).map(BoundedCosts::Fits)
    }
}

/// WIT `decision` as the host lifts it (see [`BoundedCosts`]).
#[derive(ComponentType, Lift, Debug)]
#[component(variant)]
pub(crate) enum RawDecision {
    #[component(name = "costs")]
    Costs(BoundedCosts),
    #[component(name = "pick")]
    Pick(u32),
}

/// Whether every cost is finite: its exponent bits are not all ones (NaN and the infinities
/// have them all set). Integer compares folded over the whole slice, with no early exit.
fn all_finite(costs: &[f64]) -> bool {
    const EXPONENT: u64 = 0x7ff0_0000_0000_0000;
    costs
        .iter()
        .fold(true, |ok, c| ok & (c.to_bits() & EXPONENT != EXPONENT))
}

/// Checks an answer against the number of candidates.
pub(crate) fn validate(
    decision: RawDecision,
    n: usize,
    allow_pick: bool,
) -> Result<Answer, Failure> {
    match decision {
        RawDecision::Costs(BoundedCosts::WrongLength(len)) => Err(Failure::new(
            FallbackReason::InvalidLength,
            format!("answered {len} costs for {n} candidates"),
        )),
        RawDecision::Costs(BoundedCosts::Fits(costs)) => {
            if costs.len() != n {
                return Err(Failure::new(
                    FallbackReason::InvalidLength,
                    format!("answered {} costs for {n} candidates", costs.len()),
                ));
            }
            // Every cost finite, checked without an exit per cost (a fold the compiler can keep
            // branch-free); which one is not is looked for only when one is not.
            if !all_finite(&costs) {
                let i = costs.iter().position(|c| !c.is_finite()).unwrap_or(0);
                return Err(Failure::new(
                    FallbackReason::NonFinite,
                    format!("cost of candidate {i} is {}", costs[i]),
                ));
            }
            Ok(Answer::Costs(costs))
        }
        RawDecision::Pick(i) => {
            if !allow_pick {
                return Err(Failure::new(
                    FallbackReason::UnexpectedPick,
                    "a scorer stage answered a pick; pipeline stages must answer costs",
                ));
            }
            let i = i as usize;
            if i >= n {
                return Err(Failure::new(
                    FallbackReason::PickOutOfRange,
                    format!("picked {i} of {n} candidates"),
                ));
            }
            Ok(Answer::Pick(i))
        }
    }
}

/// A policy's answer as it comes out of the component (the WIT `decision`), for
/// [`check_answer`].
#[derive(Clone, Debug, PartialEq)]
pub enum RawAnswer {
    Costs(Vec<f64>),
    Pick(u32),
}

/// Checks an answer exactly as every decision does before the router uses it: `candidates` costs,
/// all finite, or (only where `allow_pick`: a single policy or a pipeline's selector, not a scorer
/// stage) a pick below `candidates`. `Err` is the fallback reason and the message recorded for it.
/// Public so that the fuzz target and property tests reach the one check the runtime uses.
pub fn check_answer(
    answer: RawAnswer,
    candidates: usize,
    allow_pick: bool,
) -> Result<super::Outcome, (FallbackReason, String)> {
    let decision = match answer {
        RawAnswer::Costs(c) => RawDecision::Costs(BoundedCosts::Fits(c)),
        RawAnswer::Pick(i) => RawDecision::Pick(i),
    };
    match validate(decision, candidates, allow_pick) {
        Ok(Answer::Costs(c)) => Ok(super::Outcome::Costs(c)),
        Ok(Answer::Pick(i)) => Ok(super::Outcome::Pick(i)),
        Err(f) => Err((f.reason, f.detail.to_string())),
    }
}

#[cfg(test)]
mod answer_tests {
    use super::*;
    use crate::Outcome;
    use proptest::prelude::*;

    fn any_cost() -> impl Strategy<Value = f64> {
        prop_oneof![
            -1e6f64..1e6,
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
            Just(f64::MAX),
            any::<f64>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

        /// What the fuzz target `policy_answer` asserts: an accepted answer is exactly one finite
        /// cost per candidate, unchanged, or a pick in range where picks are allowed; a refused
        /// one carries the reason the contract names and a message.
        #[test]
        fn answers_are_accepted_only_when_usable(
            costs in proptest::collection::vec(any_cost(), 0..12),
            pick in prop_oneof![0u32..16, any::<u32>()],
            is_pick in any::<bool>(),
            n in 0usize..12,
            allow_pick in any::<bool>(),
        ) {
            let answer = if is_pick { RawAnswer::Pick(pick) } else { RawAnswer::Costs(costs.clone()) };
            let expected = match &answer {
                RawAnswer::Costs(c) if c.len() != n => Err(FallbackReason::InvalidLength),
                RawAnswer::Costs(c) if c.iter().any(|c| !c.is_finite()) => Err(FallbackReason::NonFinite),
                RawAnswer::Costs(c) => Ok(Outcome::Costs(c.clone())),
                RawAnswer::Pick(_) if !allow_pick => Err(FallbackReason::UnexpectedPick),
                RawAnswer::Pick(i) if *i as usize >= n => Err(FallbackReason::PickOutOfRange),
                RawAnswer::Pick(i) => Ok(Outcome::Pick(*i as usize)),
            };
            match check_answer(answer, n, allow_pick) {
                Ok(got) => prop_assert_eq!(Ok(got), expected),
                Err((reason, message)) => {
                    prop_assert!(!message.is_empty());
                    prop_assert_eq!(Err(reason), expected.map(|_| ()));
                }
            }
        }
    }
}

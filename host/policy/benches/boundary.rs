//! What a component call costs on this host, part by part: the floor under every Wasm policy
//! decision, whatever the policy does.
//!
//! `cargo bench -p kvroute-policy --bench boundary -- --warm-up-time 1 --measurement-time 3`
//!
//! The probe component (`plugins/testing/boundary-probe`) does no work, so each row is the price
//! of a call's *shape* on the policy engine (`kvroute_policy::engine_config`): one entry
//! into the guest; one list argument (each list or string argument is one more call into the
//! guest's allocator); a list result (lifted, then freed by a post-return call); the three column
//! lists of `decide`; and `decide`'s whole shape. Beside them, in the same run, the full decision
//! path (`PolicyRegistry::decide` with `native-cost` passing the host's base costs through) and
//! the native path, so BENCHMARKS.md can say how much of a small decision is the boundary itself.
//! Sizes are those of an 8-candidate decision; the packed shape and the two decision paths also
//! run at 64 candidates (rows suffixed `/64`).

#[path = "../../../tests/support/plugins.rs"]
mod support;

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute_core::cost::{fill_base_costs, native_costs, pick, CostWeights};
use kvroute_policy::{engine_config, Outcome, PolicyRegistry, PolicyRuntimeConfig};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use wasmtime::component::{Component, Linker};
use wasmtime::{Engine, Store};

wasmtime::component::bindgen!({
    path: "../../plugins/testing/boundary-probe/wit",
    world: "boundary-probe",
});

const CANDIDATES: usize = 8;

fn boundary(c: &mut Criterion) {
    let engine = Engine::new(&engine_config(&PolicyRuntimeConfig::default())).expect("engine");
    let bytes = support::plugin_bytes("kvroute-test-boundary-probe");
    let component = Component::new(&engine, &bytes).expect("compile the probe");
    let mut linker: Linker<()> = Linker::new(&engine);
    linker
        .define_unknown_imports_as_traps(&component)
        .expect("link");
    let mut store = Store::new(&engine, ());
    // No ticker runs here: a deadline far away, as a policy call's is when it does not overrun.
    store.set_epoch_deadline(u64::MAX / 2);
    let probe = BoundaryProbe::instantiate(&mut store, &component, &linker).expect("instantiate");
    let probe = probe.kvroute_boundary_probe_probe();

    // The sizes of an 8-candidate decision with 2 taints per candidate and 2 preferred taints.
    let n = CANDIDATES;
    let u64s: Vec<u64> = (0..4 * n as u64).collect();
    let u32s: Vec<u32> = (0..(8 * n + 1 + 2 * n + 2) as u32).collect();
    let f64s: Vec<f64> = (0..n + 2).map(|i| i as f64).collect();

    let mut group = c.benchmark_group("boundary");
    group.bench_function("nop", |b| {
        b.iter(|| probe.call_nop(&mut store).expect("nop"));
    });
    group.bench_function("take_list", |b| {
        b.iter(|| black_box(probe.call_take_list(&mut store, &f64s).expect("take")));
    });
    group.bench_function("echo_list", |b| {
        b.iter(|| black_box(probe.call_echo_list(&mut store, &f64s).expect("echo")));
    });
    group.bench_function("take_columns", |b| {
        b.iter(|| {
            black_box(
                probe
                    .call_take_columns(&mut store, &u64s, &u32s, &f64s)
                    .expect("columns"),
            )
        });
    });
    group.bench_function("decide_shape", |b| {
        b.iter(|| {
            black_box(
                probe
                    .call_decide_shape(
                        &mut store,
                        "req-000001",
                        "",
                        4096,
                        256,
                        1.0,
                        0,
                        0.0,
                        1,
                        &u64s,
                        &u32s,
                        &f64s,
                    )
                    .expect("decide shape"),
            )
        });
    });

    // The same decision as one list (the shape of `kvroute:policy@0.9.0`): the count, then as
    // many words as `host/policy/src/wire.rs` packs for the decision beside it (its taints, 2
    // preferred taints, its request id). Beside it, the native path and the policy runtime
    // with `native-cost` trusting the host's base costs (the boundary plus the runtime's
    // bookkeeping), at 8 and at 64 candidates: `decide_packed` plus `native_decision` is what a
    // decision would cost with no bookkeeping and a guest as fast as native code.
    let reg = PolicyRegistry::new(PolicyRuntimeConfig::default()).expect("policy runtime");
    reg.load(
        "native-cost",
        &support::plugin_bytes("kvroute-plugin-native-cost"),
        Some(r#"{"use_base_cost": true}"#),
        true,
    )
    .expect("load native-cost");
    let taints = support::taint_table(1, 4);
    let weights = CostWeights::default();
    for n in [CANDIDATES, 64] {
        let mut rng = SmallRng::seed_from_u64(n as u64);
        let (mut req, mut cols) = support::random_decision(&mut rng, n, 4);
        req.preferred_taints = vec![(0, 0.5), (2, -0.3)];
        let (t, p, id_bytes) = (cols.taint_ids.len(), 2, req.request_id.len());
        let words = 3 + 7 * n + p + (10 * n + 1 + t + p).div_ceil(2) + id_bytes.div_ceil(8);
        let packed: Vec<u64> = std::iter::once(n as u64).chain(1..words as u64).collect();
        let suffix = if n == CANDIDATES {
            String::new()
        } else {
            format!("/{n}")
        };
        group.bench_function(format!("decide_packed{suffix}"), |b| {
            b.iter(|| {
                black_box(
                    probe
                        .call_decide_packed(&mut store, 4096, 0, 1.0, 0, 0.0, 1, &packed)
                        .expect("decide packed"),
                )
            });
        });
        let mut costs = Vec::with_capacity(n);
        group.bench_function(format!("native_decision{suffix}"), |b| {
            b.iter(|| {
                fill_base_costs(&req, &mut cols, &weights);
                native_costs(&req, &cols, &mut costs);
                black_box(pick(&costs, req.temperature, &mut rng))
            })
        });
        group.bench_function(format!("policy_decision_passthrough{suffix}"), |b| {
            b.iter(|| {
                fill_base_costs(&req, &mut cols, &weights);
                match reg.decide(&req, &cols, &taints).outcome {
                    Outcome::Costs(c) => black_box(pick(&c, req.temperature, &mut rng)),
                    other => panic!("the bench policy must answer costs: {other:?}"),
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, boundary);
criterion_main!(benches);

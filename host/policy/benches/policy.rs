//! Policy runtime benchmarks: the native decision path vs the same cost as a Wasm component, swap
//! latency, and the first decision after a swap vs steady state.
//!
//! `cargo bench -p kvroute-policy --bench policy -- --warm-up-time 1 --measurement-time 3`
//!
//! The Wasm component is `plugins/native-cost` (built here for wasm32-wasip2, release), which
//! recomputes SPEC §7's cost from the columns, preferred taints included — the same work as the
//! native path, so the difference is the cost of the component boundary. `decision/default` and
//! `decision/dynamo` are the embedded built-ins. `shadow/{off,on}` is what a running shadow costs
//! the deciding thread (issue 37: at most 1 µs at the p50).

#[path = "../../../tests/support/plugins.rs"]
mod support;

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvroute_core::cost::{fill_base_costs, native_costs, pick, CostWeights};
use kvroute_policy::{Outcome, PolicyRegistry, PolicyRuntimeConfig};
use rand::rngs::SmallRng;
use rand::SeedableRng;

const NATIVE: &str = "kvroute-plugin-native-cost";

fn registry() -> PolicyRegistry {
    PolicyRegistry::new(PolicyRuntimeConfig::default()).expect("policy runtime")
}

/// One decision by `reg` as the router makes it: the native cost only for a policy that reads it
/// (interface 0.10.0; `native-cost` recomputes it, `default` prices candidates itself), then the
/// pick.
fn wasm_decision(
    reg: &PolicyRegistry,
    req: &kvroute_core::PolicyRequest,
    cols: &mut kvroute_core::CandidateColumns,
    weights: &CostWeights,
    taints: &kvroute_policy::TaintTable,
    rng: &mut SmallRng,
) -> Option<usize> {
    if reg.reads_base_cost() {
        fill_base_costs(req, cols, weights);
    } else {
        cols.base_cost.clear();
    }
    match reg.decide(req, cols, taints).outcome {
        Outcome::Costs(c) => black_box(pick(&c, req.temperature, rng)),
        Outcome::Pick(i) => Some(i),
        Outcome::Fallback(r) => panic!("fallback in bench: {r}"),
        Outcome::NeedsBaseCost => panic!("base cost asked for after reads_base_cost"),
    }
}

fn decision_path(c: &mut Criterion) {
    let bytes = support::plugin_bytes(NATIVE);
    let reg = registry();
    reg.load("native-cost", &bytes, None, true)
        .expect("load native-cost");
    // The same component trusting the host's base costs (it only applies the preferred taints):
    // mostly the boundary.
    let passthrough = registry();
    passthrough
        .load(
            "native-cost",
            &bytes,
            Some(r#"{"use_base_cost": true}"#),
            true,
        )
        .expect("load native-cost passthrough");
    // The two built-ins as `kvroute serve` embeds them: the latency-priced default and Dynamo's
    // cost (issue 22's goal: the default within 1.5x of `dynamo` at 64 candidates).
    let builtin = |name: &str, bytes: &[u8]| {
        let r = registry();
        r.load(name, bytes, None, true)
            .unwrap_or_else(|e| panic!("load {name}: {e}"));
        r
    };
    let default = builtin("default", kvroute_policy::DEFAULT_POLICY_WASM);
    let dynamo = builtin("dynamo", kvroute_policy::DYNAMO_POLICY_WASM);
    let taints = support::taint_table(1, 4);
    let weights = CostWeights::default();
    let mut group = c.benchmark_group("decision");
    for n in [8usize, 64, 1024] {
        let mut rng = SmallRng::seed_from_u64(n as u64);
        let (mut req, mut cols) = support::random_decision(&mut rng, n, 4);
        req.preferred_taints = vec![(0, 0.5), (2, -0.3)];
        let mut costs = Vec::with_capacity(n);
        group.bench_with_input(BenchmarkId::new("native", n), &n, |b, _| {
            b.iter(|| {
                fill_base_costs(&req, &mut cols, &weights);
                native_costs(&req, &cols, &mut costs);
                black_box(pick(&costs, req.temperature, &mut rng))
            })
        });
        for (label, reg) in [
            ("wasm", &reg),
            ("wasm-passthrough", &passthrough),
            ("default", &default),
            ("dynamo", &dynamo),
        ] {
            group.bench_with_input(BenchmarkId::new(label, n), &n, |b, _| {
                b.iter(|| wasm_decision(reg, &req, &mut cols, &weights, &taints, &mut rng))
            });
        }
    }
    group.finish();
}

/// `bytes` (a component) with a custom section `kvroute-bench` holding `n` appended: a valid
/// component with a different digest.
fn with_custom_section(bytes: &[u8], n: u64) -> Vec<u8> {
    let name = b"kvroute-bench";
    let payload = n.to_le_bytes();
    let size = 1 + name.len() + payload.len();
    let mut out = bytes.to_vec();
    out.push(0); // custom section id
    out.push(size as u8); // LEB128, < 128
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(&payload);
    out
}

fn swap(c: &mut Criterion) {
    let bytes = support::plugin_bytes(NATIVE);
    eprintln!("swap: component {NATIVE} is {} bytes", bytes.len());
    let reg = registry();
    reg.load("a", &bytes, None, true).expect("load");
    let mut group = c.benchmark_group("swap");
    group.sample_size(10);
    // Bytes in → active: check, compile, configure, self-test, warm, flip. Each iteration loads
    // different bytes (a custom section with a counter appended), so nothing is cached.
    let mut counter = 0u64;
    group.bench_function(format!("load_activate_new_{}KB", bytes.len() / 1000), |b| {
        b.iter_with_setup(
            || {
                counter += 1;
                with_custom_section(&bytes, counter)
            },
            |fresh| reg.load("a", &fresh, None, true).expect("load"),
        )
    });
    // The same bytes again (e.g. a re-upload): the compiled component is reused.
    group.bench_function("reload_same_bytes", |b| {
        b.iter(|| reg.load("a", &bytes, None, true).expect("load"))
    });
    // A new configuration: no compile; configure, self-test, warm, flip.
    let mut flip = false;
    group.bench_function("reconfigure", |b| {
        b.iter(|| {
            flip = !flip;
            let cfg = if flip {
                r#"{"use_base_cost":true}"#
            } else {
                "{}"
            };
            reg.configure("a", cfg).expect("configure")
        })
    });
    group.bench_function("activate_existing", |b| {
        reg.load("b", &bytes, None, false).expect("load b");
        let mut flip = false;
        b.iter(|| {
            flip = !flip;
            reg.activate(if flip { "b" } else { "a" })
                .expect("activate")
        })
    });
    group.finish();
}

fn first_decision_after_swap(c: &mut Criterion) {
    let bytes = support::plugin_bytes(NATIVE);
    let reg = registry();
    reg.load("a", &bytes, None, true).expect("load");
    let taints = support::taint_table(1, 4);
    let mut rng = SmallRng::seed_from_u64(64);
    let (req, cols) = support::random_decision(&mut rng, 64, 4);
    // Let the registry see the router's taint table, as it would in service.
    reg.decide(&req, &cols, &taints);
    let mut group = c.benchmark_group("after_swap_64");
    group.sample_size(10);
    group.bench_function("steady_state", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                black_box(reg.decide(&req, &cols, &taints));
                total += t.elapsed();
            }
            total
        })
    });
    let mut flip = false;
    group.bench_function("first_decision", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                flip = !flip;
                let cfg = if flip {
                    r#"{"use_base_cost":true}"#
                } else {
                    "{}"
                };
                reg.configure("a", cfg).expect("configure");
                let t = Instant::now();
                let d = reg.decide(&req, &cols, &taints);
                total += t.elapsed();
                assert!(!d.is_fallback());
            }
            total
        })
    });
    group.finish();
}

/// The built-in default active and a copy of it loaded as `shadowed`, shadowing it at `sample` 1
/// when `on`.
fn shadow_registry(on: bool) -> PolicyRegistry {
    let reg = registry();
    reg.load("default", kvroute_policy::DEFAULT_POLICY_WASM, None, true)
        .expect("load default");
    reg.load("shadowed", kvroute_policy::DEFAULT_POLICY_WASM, None, false)
        .expect("load the shadowed copy");
    if on {
        let spec = kvroute_policy::ShadowSpec {
            version: None,
            sample: 1.0,
        };
        reg.start_shadow("shadowed", &spec).expect("shadow");
    }
    reg
}

/// Waits until the shadow thread has evaluated every copy queued (dropped ones are never queued).
fn drain_shadow(reg: &PolicyRegistry) {
    while reg
        .shadow_report("shadowed")
        .is_some_and(|r| r.evaluated < r.queued)
    {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// What a shadow costs the deciding thread: the same decision (the built-in default active) with
/// no shadow and with the default shadowed under another name at `sample` 1 (every decision
/// copied to the queue). Between batches of 512 decisions (never timed) the bench waits for the
/// shadow thread to empty the queue, so every timed decision takes the enqueue path, never the
/// cheaper drop of a full queue.
fn shadow(c: &mut Criterion) {
    let taints = support::taint_table(1, 4);
    let mut group = c.benchmark_group("shadow");
    for n in [8usize, 64] {
        let mut rng = SmallRng::seed_from_u64(n as u64);
        let (req, cols) = support::random_decision(&mut rng, n, 4);
        for on in [false, true] {
            let reg = shadow_registry(on);
            let drained = || drain_shadow(&reg);
            let label = if on { "on" } else { "off" };
            group.bench_with_input(BenchmarkId::new(label, n), &n, |b, _| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    let mut left = iters;
                    while left > 0 {
                        let batch = left.min(512);
                        let t = Instant::now();
                        for _ in 0..batch {
                            black_box(reg.decide(&req, &cols, &taints));
                        }
                        total += t.elapsed();
                        left -= batch;
                        drained();
                    }
                    total
                })
            });
            if let Some(r) = reg.shadow_report("shadowed") {
                assert_eq!(
                    r.dropped, 0,
                    "the timed decisions all took the enqueue path"
                );
                eprintln!(
                    "shadow/{n}: {} decisions queued, {} evaluated, {} dropped, agreement {:.3}",
                    r.queued, r.evaluated, r.dropped, r.agreement_rate
                );
            }
        }
    }
    group.finish();
}

/// Keeps the other core busy until `stop`: deciding on `registry` (the shadow's work without its
/// queue), or spinning on arithmetic alone (`None`).
fn busy_neighbour(
    registry: Option<&PolicyRegistry>,
    stop: &AtomicBool,
    req: &kvroute_core::PolicyRequest,
    cols: &kvroute_core::CandidateColumns,
    taints: &kvroute_policy::TaintTable,
) {
    let mut x = 0u64;
    while !stop.load(Relaxed) {
        match registry {
            Some(r) => {
                black_box(r.decide(req, cols, taints));
            }
            None => {
                for _ in 0..1000 {
                    x = black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
                }
            }
        }
    }
}

/// What a running shadow adds to a decision's p50 on the calling thread, measured so that the
/// machine's drift cancels out: one registry with the shadow off and one with it on, in one
/// process, alternating rounds of 512 decisions (the order flips every round), every decision
/// timed, the shadow queue drained between rounds; prints the p50 over all of each and the median
/// per-round difference. Criterion's separate `shadow/off` and `shadow/on` runs drift apart by
/// more than the figure on a busy 2-core machine. Runs only with `KVROUTE_SHADOW_AB=ROUNDS`
/// (e.g. 300): `KVROUTE_SHADOW_AB=300 cargo bench -p kvroute-policy --bench policy -- nomatch`.
/// With `KVROUTE_SHADOW_AB_NEIGHBOUR=decide` (or `spin`) the off arm's rounds run beside a thread
/// that keeps the other core busy deciding on a registry of its own (or with arithmetic alone):
/// what a busy other core costs the deciding thread without any copy or queue, to tell that part
/// of the shadow's cost from the copy's.
fn shadow_ab(_c: &mut Criterion) {
    let Ok(rounds) = std::env::var("KVROUTE_SHADOW_AB") else {
        return;
    };
    let rounds: usize = rounds.parse().unwrap_or(200);
    let taints = support::taint_table(1, 4);
    for n in [8usize, 64] {
        let mut rng = SmallRng::seed_from_u64(n as u64);
        let (req, cols) = support::random_decision(&mut rng, n, 4);
        let regs = [shadow_registry(false), shadow_registry(true)];
        // KVROUTE_SHADOW_AB_NEIGHBOUR=spin|decide: the off arm runs beside a busy other core.
        let neighbour: Option<Option<PolicyRegistry>> =
            match std::env::var("KVROUTE_SHADOW_AB_NEIGHBOUR").as_deref() {
                Ok("spin") => Some(None),
                Ok("decide") => Some(Some(shadow_registry(false))),
                _ => None,
            };
        let drained = drain_shadow;
        let mut all: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        let mut round_means: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut times = vec![0u32; 512];
        for r in 0..rounds + 20 {
            let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
            for k in order {
                let reg = &regs[k];
                let stop = AtomicBool::new(false);
                let total = std::thread::scope(|s| {
                    if let (0, Some(nb)) = (k, &neighbour) {
                        let (stop, req, cols, taints) = (&stop, &req, &cols, &taints);
                        s.spawn(move || busy_neighbour(nb.as_ref(), stop, req, cols, taints));
                    }
                    let t0 = Instant::now();
                    for slot in times.iter_mut() {
                        let t = Instant::now();
                        black_box(reg.decide(&req, &cols, &taints));
                        *slot = t.elapsed().as_nanos() as u32;
                    }
                    let total = t0.elapsed().as_nanos() as f64 / 512.0;
                    stop.store(true, Relaxed);
                    total
                });
                drained(reg);
                if r >= 20 {
                    all[k].extend_from_slice(&times);
                    round_means[k].push(total);
                }
            }
        }
        let med = |v: &mut Vec<u32>| {
            v.sort_unstable();
            v[v.len() / 2] as f64
        };
        let (p_off, p_on) = (med(&mut all[0]), med(&mut all[1]));
        let mut diffs: Vec<f64> = round_means[0]
            .iter()
            .zip(&round_means[1])
            .map(|(a, b)| b - a)
            .collect();
        diffs.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mut offm = round_means[0].clone();
        offm.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mut onm = round_means[1].clone();
        onm.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let r = regs[1].shadow_report("shadowed").unwrap();
        println!(
            "AB n={n} p50 off {:.3} on {:.3} diff {:.3} us | round-mean median off {:.3} on {:.3} median diff {:.3} us | dropped {}",
            p_off / 1000.0,
            p_on / 1000.0,
            (p_on - p_off) / 1000.0,
            offm[offm.len() / 2] / 1000.0,
            onm[onm.len() / 2] / 1000.0,
            diffs[diffs.len() / 2] / 1000.0,
            r.dropped
        );
    }
}

/// Instruction counting (under `valgrind --tool=callgrind`, which counts instructions whatever
/// the machine is doing): `KVROUTE_DECISIONS=KIND:N:COUNT` (KIND `native` or `wasm`) runs COUNT
/// decisions over N candidates and nothing else; two counts' difference is the per-decision cost.
fn decision_count(_c: &mut Criterion) {
    let Ok(spec) = std::env::var("KVROUTE_DECISIONS") else {
        return;
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let (kind, n, count): (&str, usize, usize) = (
        parts[0],
        parts[1].parse().expect("N"),
        parts[2].parse().expect("COUNT"),
    );
    let mut rng = SmallRng::seed_from_u64(n as u64);
    let (mut req, mut cols) = support::random_decision(&mut rng, n, 4);
    req.preferred_taints = vec![(0, 0.5), (2, -0.3)];
    let taints = support::taint_table(1, 4);
    let weights = CostWeights::default();
    let mut costs = Vec::with_capacity(n);
    if kind == "native" {
        for _ in 0..count {
            fill_base_costs(&req, &mut cols, &weights);
            native_costs(&req, &cols, &mut costs);
            black_box(pick(&costs, req.temperature, &mut rng));
        }
        return;
    }
    // Few pooled instances: valgrind cannot reserve the default pool's address space; and a
    // deadline that a decision run under valgrind (~50x slower) still meets.
    let reg = PolicyRegistry::new(PolicyRuntimeConfig {
        max_instances: 2,
        instances_per_stage: 1,
        deadline_us: 1_000_000,
        ..PolicyRuntimeConfig::default()
    })
    .expect("policy runtime");
    reg.load("native-cost", &support::plugin_bytes(NATIVE), None, true)
        .expect("load native-cost");
    for _ in 0..count {
        wasm_decision(&reg, &req, &mut cols, &weights, &taints, &mut rng);
    }
}

criterion_group!(
    benches,
    decision_count,
    decision_path,
    swap,
    first_decision_after_swap,
    shadow,
    shadow_ab
);
criterion_main!(benches);

//! A `decide` call taken apart (issue 33): what each part of a Wasm decision costs on this host,
//! measured side by side in one run.
//!
//! `cargo bench -p kvroute-policy --bench parts -- --warm-up-time 1 --measurement-time 3`
//!
//! - `nop`: one entry into a guest (the boundary probe), nothing moved;
//! - `raw/N`: `decide` on the `native-cost` component (passing the host's base costs through,
//!   so its own work is a few loads and stores per candidate) called straight through wasmtime
//!   with the lists already packed: lowering, the allocator calls, the guest, lifting and the
//!   post-return call, nothing of the runtime;
//! - `registry/N`: the same component through `PolicyRegistry::decide` (packing, instance
//!   checkout, deadline arming, validation, statistics): the difference with `raw/N` is the
//!   runtime's own host-side work.

#[path = "../../../tests/support/plugins.rs"]
mod support;

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvroute_policy::{engine_config, PolicyRegistry, PolicyRuntimeConfig};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use wasmtime::component::{Component, Linker};
use wasmtime::{Engine, Store};

mod policy {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "policy-plugin",
        ownership: Borrowing { duplicate_if_necessary: true },
    });
}
mod probe {
    wasmtime::component::bindgen!({
        path: "../../plugins/testing/boundary-probe/wit",
        world: "boundary-probe",
    });
}

use policy::kvroute::policy::types::{HostContext, Request, RequestFlags};

fn parts(c: &mut Criterion) {
    let mut config = engine_config(&PolicyRuntimeConfig::default());
    if std::env::var_os("KVROUTE_BENCH_PERFMAP").is_some() {
        // Names the guest's compiled functions for `perf report`.
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    let engine = Engine::new(&config).expect("engine");
    let mut group = c.benchmark_group("parts");

    let probe_bytes = support::plugin_bytes("kvroute-test-boundary-probe");
    let component = Component::new(&engine, &probe_bytes).expect("compile the probe");
    let mut linker: Linker<()> = Linker::new(&engine);
    linker
        .define_unknown_imports_as_traps(&component)
        .expect("link");
    let mut pstore = Store::new(&engine, ());
    pstore.set_epoch_deadline(u64::MAX / 2);
    let p = probe::BoundaryProbe::instantiate(&mut pstore, &component, &linker).expect("probe");
    let p = p.kvroute_boundary_probe_probe();
    group.bench_function("nop", |b| b.iter(|| p.call_nop(&mut pstore).expect("nop")));

    let bytes = support::plugin_bytes("kvroute-plugin-native-cost");
    let component = Component::new(&engine, &bytes).expect("compile native-cost");
    let mut linker: Linker<()> = Linker::new(&engine);
    linker
        .define_unknown_imports_as_traps(&component)
        .expect("link");
    let mut store = Store::new(&engine, ());
    store.set_epoch_deadline(u64::MAX / 2);
    let plugin = policy::PolicyPlugin::instantiate(&mut store, &component, &linker).expect("inst");
    let api = plugin.kvroute_policy_policy();
    api.call_configure(&mut store, r#"{"use_base_cost": true}"#)
        .expect("configure")
        .expect("accepted");
    let names: Vec<String> = (0..4).map(|i| format!("taint-{i}")).collect();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    api.call_set_context(
        &mut store,
        HostContext {
            version: 1,
            block_size: 16,
            taint_names: &name_refs,
        },
    )
    .expect("set-context");

    let reg = PolicyRegistry::new(PolicyRuntimeConfig::default()).expect("runtime");
    reg.load(
        "native-cost",
        &bytes,
        Some(r#"{"use_base_cost": true}"#),
        true,
    )
    .expect("load");
    let taints = support::taint_table(1, 4);

    for n in [8usize, 64, 1024] {
        let mut rng = SmallRng::seed_from_u64(n as u64);
        let (mut req, cols) = support::random_decision(&mut rng, n, 4);
        req.preferred_taints = vec![(0, 0.5), (2, -0.3)];
        // The packed list as `wire.rs` builds it (`decision-data`).
        let pair = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
        let p = req.preferred_taints.len();
        let rid = req.request_id.as_bytes();
        let mut words = vec![
            pair(n as u32, cols.taint_ids.len() as u32),
            pair(p as u32, rid.len() as u32),
            0,
        ];
        for col in [
            &cols.worker_id,
            &cols.active_prefill_tokens,
            &cols.active_decode_blocks,
            &cols.total_kv_blocks,
        ] {
            words.extend_from_slice(col);
        }
        words.extend(cols.base_cost.iter().map(|x| x.to_bits()));
        words.resize(words.len() + 2 * n, 0);
        words.extend(
            req.preferred_taints
                .iter()
                .map(|&(_, w)| f64::from(w).to_bits()),
        );
        let mut u32s = Vec::new();
        for col in [
            &cols.dp_rank,
            &cols.device_overlap,
            &cols.host_overlap,
            &cols.disk_overlap,
            &cols.active_requests,
            &cols.active_prompt_blocks,
            &cols.max_num_batched_tokens,
        ] {
            u32s.extend_from_slice(col);
        }
        u32s.resize(u32s.len() + 2 * n, 0);
        u32s.extend_from_slice(&cols.taint_offsets);
        u32s.extend_from_slice(&cols.taint_ids);
        u32s.extend(req.preferred_taints.iter().map(|&(id, _)| id));
        words.extend(
            u32s.chunks(2)
                .map(|h| pair(h[0], h.get(1).copied().unwrap_or(0))),
        );
        words.extend(rid.chunks(8).map(|b| {
            let mut w = [0u8; 8];
            w[..b.len()].copy_from_slice(b);
            u64::from_le_bytes(w)
        }));
        group.bench_with_input(BenchmarkId::new("raw", n), &n, |b, _| {
            b.iter(|| {
                let r = Request {
                    prompt_tokens: req.prompt_tokens,
                    flags: RequestFlags::empty(),
                    priority: 0.0,
                    expected_output_tokens: 0,
                    temperature: 0.0,
                    now_ms: req.now_ms,
                };
                black_box(api.call_decide(&mut store, r, &words).expect("decide"))
            })
        });
        group.bench_with_input(BenchmarkId::new("registry", n), &n, |b, _| {
            b.iter(|| black_box(reg.decide(&req, &cols, &taints)))
        });
    }
    group.finish();
}

criterion_group!(benches, parts);
criterion_main!(benches);

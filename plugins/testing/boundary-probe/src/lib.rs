//! `boundary-probe`: the component behind `host/policy/benches/boundary.rs`. Every export does as little
//! as its signature allows, so a bench row is the price of the call's shape on the host: entering
//! the guest, copying arguments in (each list or string is one call into the guest's allocator
//! first), lifting a result and the post-return call that frees it.

wit_bindgen::generate!({
    path: "wit",
    world: "boundary-probe",
});

use exports::kvroute::boundary_probe::probe::Guest;

struct Probe;

impl Guest for Probe {
    fn nop() {}

    fn take_list(a: Vec<f64>) -> u32 {
        a.len() as u32
    }

    fn echo_list(a: Vec<f64>) -> Vec<f64> {
        a
    }

    fn take_columns(a: Vec<u64>, b: Vec<u32>, c: Vec<f64>) -> u32 {
        (a.len() + b.len() + c.len()) as u32
    }

    #[allow(clippy::too_many_arguments)]
    fn decide_shape(
        request_id: String,
        session_id: String,
        _prompt_tokens: u32,
        _request_blocks: u32,
        _priority: f64,
        _expected_output_tokens: u32,
        _temperature: f64,
        _now_ms: u64,
        a: Vec<u64>,
        b: Vec<u32>,
        mut c: Vec<f64>,
    ) -> Vec<f64> {
        // As many costs as candidates (`a` holds four columns), as `decide` answers.
        c.truncate(a.len() / 4);
        let _ = (request_id, session_id, b);
        c
    }

    fn decide_packed(
        _prompt_tokens: u32,
        _flags: u32,
        _priority: f64,
        _expected_output_tokens: u32,
        _temperature: f64,
        _now_ms: u64,
        data: Vec<u64>,
    ) -> Vec<f64> {
        // As many costs as candidates: the first word holds the count.
        let n = data.first().copied().unwrap_or(0) as usize;
        data.iter().skip(1).take(n).map(|&w| w as f64).collect()
    }
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(Probe);

//! Test-only component: exports an interface named like the policy interface but with other
//! functions, so the host must refuse it as "wrong world".

wit_bindgen::generate!({
    inline: "
        package kvroute:policy@0.10.0;

        interface policy {
            score: func(n: u32) -> u32;
        }

        world wrong {
            export policy;
        }
    ",
    world: "wrong",
});

struct Wrong;

impl exports::kvroute::policy::policy::Guest for Wrong {
    fn score(n: u32) -> u32 {
        n
    }
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(Wrong);

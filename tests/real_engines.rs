//! Parity with real engines: the real-vLLM suite (`real_engine.rs`) as a test binary of its own.
//!
//! Why not a module of `tests/tests.rs` like every other area: two real vLLM servers take most of
//! the machine's CPU while they start and serve, and the other areas hold timing bounds (deadlines,
//! propagation within milliseconds) that a 2-core machine meets only when nothing else is that
//! busy. Cargo runs test binaries one after another, so this binary's engines (started once for
//! it, stopped when it exits) never run beside those tests. It shares `support/` with them.

mod support;

mod real_engine;

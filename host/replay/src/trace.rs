//! Trace loaders: Mooncake JSONL, Azure LLM inference CSV, and a plain JSONL of token prompts.
//!
//! Every loader produces the same thing, a [`Trace`]: requests sorted by arrival, each with its
//! prompt as token ids (what `POST /v1/route` receives) and its output length. See the module docs
//! of [`crate::replay`] for how each format is turned into tokens.

use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens one Mooncake hash id stands for.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;
/// Vocabulary the synthetic token ids are drawn from.
pub const DEFAULT_VOCAB: u32 = 50_000;

/// The input formats `kvroute replay` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// Guess from the file: `.csv` is Azure; a JSONL line with `hash_ids` is Mooncake, one with
    /// `tokens` is a token trace.
    Auto,
    /// Mooncake FAST'25: `{"timestamp", "input_length", "output_length", "hash_ids"}` per line.
    Mooncake,
    /// Azure LLM inference 2023: CSV `TIMESTAMP,ContextTokens,GeneratedTokens`.
    Azure,
    /// `{"timestamp_ms", "tokens": [...], "output_length"}` per line.
    Tokens,
}

impl TraceFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            TraceFormat::Auto => "auto",
            TraceFormat::Mooncake => "mooncake",
            TraceFormat::Azure => "azure",
            TraceFormat::Tokens => "tokens",
        }
    }
}

/// How prefix sharing is synthesized for traces that carry only lengths (Azure).
///
/// Request `i` with `C` context tokens picks system prompt `p` from a pool of `prompts` with a
/// Zipf(`zipf_s`) law (rank `k` has probability ∝ `1/k^s`), takes the first
/// `floor(shared_frac × C)` tokens of that system prompt, and fills the rest with tokens unique to
/// the request. Two requests with the same system prompt therefore share
/// `min(shared_a, shared_b)` leading tokens. Draws come from a `SmallRng` seeded with `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefixSynthesis {
    pub prompts: u32,
    pub zipf_s: f64,
    pub shared_frac: f64,
    pub vocab: u32,
    pub seed: u64,
}

impl Default for PrefixSynthesis {
    fn default() -> Self {
        Self {
            prompts: 64,
            zipf_s: 1.0,
            shared_frac: 0.5,
            vocab: DEFAULT_VOCAB,
            seed: 0,
        }
    }
}

/// Options of [`load`].
#[derive(Clone, Debug, PartialEq)]
pub struct LoadOptions {
    pub format: TraceFormat,
    /// Keep only the first N requests of the file (in file order).
    pub max_requests: Option<usize>,
    /// Arrival times are divided by this (2.0 = twice the request rate).
    pub speedup: f64,
    /// Used for Azure traces (and its `seed` for nothing else).
    pub synthesis: PrefixSynthesis,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            format: TraceFormat::Auto,
            max_requests: None,
            speedup: 1.0,
            synthesis: PrefixSynthesis::default(),
        }
    }
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Milliseconds since the first request of the trace (after `speedup`).
    pub arrival_ms: f64,
    pub tokens: Vec<u32>,
    /// Output tokens to generate (at least 1).
    pub output_len: u32,
}

/// A loaded trace.
#[derive(Clone, Debug)]
pub struct Trace {
    /// File name (or a label for in-memory traces).
    pub name: String,
    pub format: TraceFormat,
    /// Sorted by `arrival_ms` (ties keep file order).
    pub requests: Vec<TraceRequest>,
    /// The prefix-sharing parameters, when they were synthesized.
    pub synthesis: Option<PrefixSynthesis>,
    /// An agentic workload's sessions and dependencies ([`crate::flows`], built by
    /// [`crate::agents`]): requests then start when those they wait for have finished, not at
    /// `arrival_ms`.
    pub agents: Option<crate::flows::AgentFlows>,
}

impl Trace {
    /// A trace from requests built in memory (tests, tools). Sorts them by arrival.
    pub fn from_requests(name: impl Into<String>, mut requests: Vec<TraceRequest>) -> Self {
        requests.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
        Self {
            name: name.into(),
            format: TraceFormat::Tokens,
            requests,
            synthesis: None,
            agents: None,
        }
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.tokens.len() as u64).sum()
    }
}

/// Loads a trace file.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Trace> {
    if !(opts.speedup.is_finite() && opts.speedup > 0.0) {
        bail!("--speedup must be a positive number, got {}", opts.speedup);
    }
    let format = match opts.format {
        TraceFormat::Auto => detect(path)?,
        f => f,
    };
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let reader = BufReader::new(file);
    let mut requests = match format {
        TraceFormat::Mooncake => load_mooncake(reader, opts.max_requests)?,
        TraceFormat::Azure => load_azure(reader, opts.max_requests, &opts.synthesis)?,
        TraceFormat::Tokens => load_tokens(reader, opts.max_requests)?,
        TraceFormat::Auto => unreachable!("resolved above"),
    };
    if requests.is_empty() {
        bail!("{} holds no requests", path.display());
    }
    // Relative to the first arrival, compressed by the speed-up.
    let t0 = requests
        .iter()
        .map(|r| r.arrival_ms)
        .fold(f64::INFINITY, f64::min);
    for r in &mut requests {
        r.arrival_ms = (r.arrival_ms - t0) / opts.speedup;
    }
    requests.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    Ok(Trace {
        name,
        format,
        requests,
        synthesis: (format == TraceFormat::Azure).then_some(opts.synthesis),
        agents: None,
    })
}

fn detect(path: &Path) -> Result<TraceFormat> {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"))
    {
        return Ok(TraceFormat::Azure);
    }
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    for line in BufReader::new(file).lines() {
        let line = line.with_context(|| format!("cannot read {}", path.display()))?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with("TIMESTAMP") {
            return Ok(TraceFormat::Azure);
        }
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| {
            format!(
                "{}: the first line is neither JSON nor an Azure CSV header; pass --format",
                path.display()
            )
        })?;
        if v.get("hash_ids").is_some() {
            return Ok(TraceFormat::Mooncake);
        }
        if v.get("tokens").is_some() {
            return Ok(TraceFormat::Tokens);
        }
        bail!(
            "{}: cannot tell the trace format (no `hash_ids` or `tokens` field); pass --format",
            path.display()
        );
    }
    bail!("{} is empty", path.display())
}

/// Token `pos` (0..512) of the block a Mooncake hash id stands for. A deterministic function of
/// `(id, pos)` only, so equal ids give equal blocks and distinct ids give (almost surely) distinct
/// 64-token sub-blocks.
#[inline]
pub fn mooncake_token(hash_id: u64, pos: u32) -> u32 {
    let mut buf = [0u8; 12];
    buf[..8].copy_from_slice(&hash_id.to_le_bytes());
    buf[8..].copy_from_slice(&pos.to_le_bytes());
    (xxh3_64_with_seed(&buf, 0x6d6f_6f6e_6361_6b65) % u64::from(DEFAULT_VOCAB)) as u32
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

fn load_mooncake(reader: impl BufRead, max: Option<usize>) -> Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    // Most ids repeat (that is the point of the trace): expand each one once.
    let mut expanded: rustc_hash::FxHashMap<u64, usize> = rustc_hash::FxHashMap::default();
    let mut arena: Vec<u32> = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        if max.is_some_and(|m| out.len() >= m) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let l: MooncakeLine =
            serde_json::from_str(&line).with_context(|| format!("line {}", n + 1))?;
        let covered = l.hash_ids.len() as u64 * MOONCAKE_BLOCK_TOKENS as u64;
        if l.input_length == 0 || l.input_length > covered {
            bail!(
                "line {}: input_length {} is not covered by {} hash ids of {} tokens",
                n + 1,
                l.input_length,
                l.hash_ids.len(),
                MOONCAKE_BLOCK_TOKENS
            );
        }
        let len = l.input_length as usize;
        let mut tokens = Vec::with_capacity(len);
        for &id in &l.hash_ids {
            let at = *expanded.entry(id).or_insert_with(|| {
                let at = arena.len();
                arena.extend((0..MOONCAKE_BLOCK_TOKENS as u32).map(|pos| mooncake_token(id, pos)));
                at
            });
            let take = (len - tokens.len()).min(MOONCAKE_BLOCK_TOKENS);
            tokens.extend_from_slice(&arena[at..at + take]);
        }
        out.push(TraceRequest {
            arrival_ms: l.timestamp,
            tokens,
            output_len: l.output_length.clamp(1, u64::from(u32::MAX)) as u32,
        });
    }
    Ok(out)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensLine {
    timestamp_ms: f64,
    tokens: Vec<u32>,
    output_length: u32,
}

fn load_tokens(reader: impl BufRead, max: Option<usize>) -> Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        if max.is_some_and(|m| out.len() >= m) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let l: TokensLine =
            serde_json::from_str(&line).with_context(|| format!("line {}", n + 1))?;
        if l.tokens.is_empty() {
            bail!("line {}: empty prompt", n + 1);
        }
        if !l.timestamp_ms.is_finite() {
            bail!("line {}: timestamp_ms is not a finite number", n + 1);
        }
        out.push(TraceRequest {
            arrival_ms: l.timestamp_ms,
            tokens: l.tokens,
            output_len: l.output_length.max(1),
        });
    }
    Ok(out)
}

/// Parses `2023-11-16 18:17:03.9799600` into milliseconds since the Unix epoch.
fn parse_azure_timestamp(s: &str) -> Option<f64> {
    let s = s.trim();
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-');
    let y: i64 = d.next()?.parse().ok()?;
    let m: i64 = d.next()?.parse().ok()?;
    let day: i64 = d.next()?.parse().ok()?;
    let mut t = time.split(':');
    let hh: f64 = t.next()?.parse().ok()?;
    let mm: f64 = t.next()?.parse().ok()?;
    let ss: f64 = t.next()?.parse().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days as f64 * 86_400.0) + hh * 3600.0 + mm * 60.0 + ss) * 1000.0)
}

/// Token `pos` of system prompt `p` or of request `i`'s own part: a deterministic function of the
/// seed, the owner and the position.
#[inline]
fn synth_token(seed: u64, owner: u64, pos: u32, vocab: u32) -> u32 {
    let mut buf = [0u8; 12];
    buf[..8].copy_from_slice(&owner.to_le_bytes());
    buf[8..].copy_from_slice(&pos.to_le_bytes());
    (xxh3_64_with_seed(&buf, seed) % u64::from(vocab.max(1))) as u32
}

/// Cumulative Zipf(s) weights over ranks 1..=n.
fn zipf_cdf(n: u32, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = (1..=n.max(1))
        .map(|k| {
            acc += 1.0 / f64::from(k).powf(s);
            acc
        })
        .collect();
    for c in &mut cdf {
        *c /= acc;
    }
    cdf
}

fn load_azure(
    reader: impl BufRead,
    max: Option<usize>,
    synth: &PrefixSynthesis,
) -> Result<Vec<TraceRequest>> {
    if synth.prompts == 0 || !(synth.zipf_s.is_finite() && synth.zipf_s >= 0.0) {
        bail!("prefix synthesis needs at least one system prompt and a finite Zipf exponent >= 0");
    }
    if !(0.0..=1.0).contains(&synth.shared_frac) {
        bail!("the shared prefix fraction must be within [0, 1]");
    }
    let cdf = zipf_cdf(synth.prompts, synth.zipf_s);
    let mut rng = SmallRng::seed_from_u64(synth.seed);
    // Distinct hash seeds for system prompts and per-request parts.
    let sys_seed = synth.seed ^ 0x5359_5354_454d_0001;
    let own_seed = synth.seed ^ 0x4f57_4e00_0000_0002;
    let mut out = Vec::new();
    let mut lines = reader.lines().enumerate();
    let mut header_seen = false;
    for (n, line) in &mut lines {
        if max.is_some_and(|m| out.len() >= m) {
            break;
        }
        let line = line?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if !header_seen {
            header_seen = true;
            if line.starts_with("TIMESTAMP") {
                continue;
            }
        }
        let mut f = line.split(',');
        let (Some(ts), Some(ctx), Some(gen)) = (f.next(), f.next(), f.next()) else {
            bail!(
                "line {}: expected TIMESTAMP,ContextTokens,GeneratedTokens",
                n + 1
            );
        };
        let arrival = parse_azure_timestamp(ts)
            .ok_or_else(|| anyhow!("line {}: bad timestamp {ts:?}", n + 1))?;
        let ctx: u32 = ctx
            .trim()
            .parse()
            .with_context(|| format!("line {}: ContextTokens", n + 1))?;
        let gen: u32 = gen
            .trim()
            .parse()
            .with_context(|| format!("line {}: GeneratedTokens", n + 1))?;
        let ctx = ctx.max(1);
        let u: f64 = rng.gen();
        let p = cdf.partition_point(|&c| c < u).min(cdf.len() - 1) as u64;
        let shared = ((synth.shared_frac * f64::from(ctx)).floor() as u32).min(ctx);
        let i = out.len() as u64;
        let mut tokens = Vec::with_capacity(ctx as usize);
        tokens.extend((0..shared).map(|pos| synth_token(sys_seed, p, pos, synth.vocab)));
        tokens.extend((shared..ctx).map(|pos| synth_token(own_seed, i, pos, synth.vocab)));
        out.push(TraceRequest {
            arrival_ms: arrival,
            tokens,
            output_len: gen.max(1),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_timestamps_parse_across_midnight() {
        let a = parse_azure_timestamp("2023-11-16 23:59:59.5000000").unwrap();
        let b = parse_azure_timestamp("2023-11-17 00:00:00.2500000").unwrap();
        assert!((b - a - 750.0).abs() < 1e-3);
        // 1970-01-01 is day 0.
        assert_eq!(parse_azure_timestamp("1970-01-01 00:00:01.0"), Some(1000.0));
        assert!(parse_azure_timestamp("garbage").is_none());
    }

    #[test]
    fn mooncake_expansion_is_deterministic_and_partial() {
        let line =
            r#"{"timestamp": 5, "input_length": 600, "output_length": 0, "hash_ids": [7, 9]}"#;
        let r = load_mooncake(line.as_bytes(), None).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].tokens.len(), 600);
        assert_eq!(r[0].output_len, 1);
        assert_eq!(r[0].tokens[0], mooncake_token(7, 0));
        assert_eq!(r[0].tokens[512], mooncake_token(9, 0));
        // Not one repeated token.
        let distinct: std::collections::HashSet<_> = r[0].tokens[..64].iter().collect();
        assert!(distinct.len() > 32);
    }

    #[test]
    fn azure_synthesis_shares_prefixes() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                   2023-11-16 18:17:03.0000000,1000,10\n\
                   2023-11-16 18:17:04.0000000,800,5\n";
        let synth = PrefixSynthesis {
            prompts: 1,
            ..Default::default()
        };
        let r = load_azure(csv.as_bytes(), None, &synth).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].tokens.len(), r[1].tokens.len()), (1000, 800));
        // One system prompt: both share min(500, 400) tokens, then differ.
        assert_eq!(r[0].tokens[..400], r[1].tokens[..400]);
        assert_ne!(r[0].tokens[400..420], r[1].tokens[400..420]);
        assert!((r[1].arrival_ms - r[0].arrival_ms - 1000.0).abs() < 1e-6);
    }

    #[test]
    fn zipf_cdf_is_monotone_and_normalised() {
        let c = zipf_cdf(10, 1.0);
        assert!((c[9] - 1.0).abs() < 1e-12);
        assert!(c.windows(2).all(|w| w[0] < w[1]));
        assert!(c[0] > 0.3, "rank 1 of Zipf(1) over 10 has p ≈ 0.34");
    }
}

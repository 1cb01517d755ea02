//! Text a plugin hands the host, bounded: a log line, a `configure` error, the last error line
//! quoted in a failure. Longer text is cut to [`MAX_PLUGIN_TEXT`] bytes and says how long it was.
//!
//! A log line is also bounded *before* it leaves the guest: [`BoundedText`] lifts a WIT `string`
//! by reading its pointer and length (checked against the guest's memory) and then decoding at
//! most [`MAX_PLUGIN_TEXT`] code units of it, so a plugin that logs a line of megabytes costs the
//! host what a line of a kilobyte costs, not a copy of the whole line per call (the same technique
//! as `answer.rs`'s bounded `costs`).

use wasmtime::component::__internal::wasmtime_environ::component::StringEncoding;
use wasmtime::component::__internal::{CanonicalAbiInfo, InstanceType, InterfaceType, LiftContext};
use wasmtime::component::{ComponentType, Lift, WasmStr};
use wasmtime::ValRaw;

/// Longest text a plugin hands the host that is kept: a log line, a `configure` error, the last
/// error line quoted in a failure. Longer text is cut at a character boundary and says so.
pub(crate) const MAX_PLUGIN_TEXT: usize = 1024;

/// `text` cut to at most [`MAX_PLUGIN_TEXT`] bytes at a character boundary; a cut says how long
/// the original was. Control characters (a forged log line's newline) become spaces.
pub(crate) fn bounded_text(text: &str) -> String {
    bounded(text, text.len())
}

/// `start` (the start of a text of `total` bytes) cut as [`bounded_text`] cuts.
fn bounded(start: &str, total: usize) -> String {
    let mut cut = start.len().min(MAX_PLUGIN_TEXT);
    while !start.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out: String = start[..cut]
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if cut < total {
        out.push_str(&format!("... (cut: {total} bytes in all)"));
    }
    out
}

/// A WIT `string` argument as the host lifts it: at most [`MAX_PLUGIN_TEXT`] bytes of it are read
/// out of the guest, then cut as [`bounded_text`] cuts. The rest is never read (nor validated as
/// UTF-8: the host does not look at it).
#[derive(Debug)]
pub(crate) struct BoundedText(pub(crate) String);

// SAFETY: the type, lowered form and ABI of a `string`, as `WasmStr` declares them.
unsafe impl ComponentType for BoundedText {
    type Lower = [ValRaw; 2];
    const ABI: CanonicalAbiInfo = <WasmStr as ComponentType>::ABI;
    fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
        <WasmStr as ComponentType>::typecheck(ty, types)
    }
}

// SAFETY: the (pointer, length) pair is lifted by `WasmStr` first, which checks alignment and
// that the whole string lies within the guest's memory; only then is a prefix of it read.
unsafe impl Lift for BoundedText {
    fn linear_lift_from_flat(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        src: &Self::Lower,
    ) -> wasmtime::Result<Self> {
        <WasmStr as Lift>::linear_lift_from_flat(cx, ty, src)?;
        let (ptr, len) = (src[0].get_u32() as usize, src[1].get_u32() as usize);
        lift_start(cx, ptr, len).map(BoundedText)
    }

    fn linear_lift_from_memory(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        bytes: &[u8],
    ) -> wasmtime::Result<Self> {
        <WasmStr as Lift>::linear_lift_from_memory(cx, ty, bytes)?;
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        lift_start(cx, word(0) as usize, word(4) as usize).map(BoundedText)
    }
}

/// The component model's tag of a compact-UTF-16 string stored as UTF-16.
const UTF16_TAG: usize = 1 << 31;

/// Decodes at most [`MAX_PLUGIN_TEXT`] code units of the string at `ptr` (`len` code units, in
/// the component's string encoding; already checked to lie within memory) and bounds it.
fn lift_start(cx: &LiftContext<'_>, ptr: usize, len: usize) -> wasmtime::Result<String> {
    let memory = cx.memory();
    match cx.options().string_encoding {
        StringEncoding::Utf8 => {
            let start = &memory[ptr..][..len.min(MAX_PLUGIN_TEXT)];
            let text = match std::str::from_utf8(start) {
                Ok(s) => s,
                // The cut split a character: up to it.
                Err(e) if start.len() < len && e.error_len().is_none() => {
                    std::str::from_utf8(&start[..e.valid_up_to()])?
                }
                Err(e) => return Err(e.into()),
            };
            Ok(bounded(text, len))
        }
        StringEncoding::Utf16 => utf16_start(memory, ptr, len),
        StringEncoding::CompactUtf16 if len & UTF16_TAG != 0 => {
            utf16_start(memory, ptr, len ^ UTF16_TAG)
        }
        StringEncoding::CompactUtf16 => {
            let start: String = memory[ptr..][..len.min(MAX_PLUGIN_TEXT)]
                .iter()
                .map(|&b| char::from(b))
                .collect();
            Ok(bounded(&start, len))
        }
    }
}

/// The first [`MAX_PLUGIN_TEXT`] code units of a UTF-16 string of `len` units, bounded (its
/// length said in the guest's bytes).
fn utf16_start(memory: &[u8], ptr: usize, len: usize) -> wasmtime::Result<String> {
    let units = len.min(MAX_PLUGIN_TEXT);
    let mut start = String::new();
    let code_units = memory[ptr..][..units * 2]
        .as_chunks::<2>()
        .0
        .iter()
        .map(|&c| u16::from_le_bytes(c));
    for c in char::decode_utf16(code_units) {
        match c {
            Ok(c) => start.push(c),
            // The cut split a surrogate pair.
            Err(_) if units < len => break,
            Err(e) => return Err(e.into()),
        }
    }
    // Bounded by bytes of the UTF-8 text; the total is the guest's, in bytes.
    let total = if units < len { len * 2 } else { start.len() };
    Ok(bounded(&start, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_at_a_character_and_says_its_length() {
        let text = "é".repeat(1000); // 2,000 bytes
        let cut = bounded_text(&text);
        assert!(cut.starts_with(&"é".repeat(512)));
        assert!(cut.ends_with("... (cut: 2000 bytes in all)"), "{cut}");
        assert_eq!(bounded_text("short\nline"), "short line");
    }

    #[test]
    fn a_start_cut_inside_the_kept_bytes_still_reports_the_whole() {
        // What lift_start hands `bounded` for a line of a million bytes: its first kilobyte.
        let start = "x".repeat(MAX_PLUGIN_TEXT);
        assert_eq!(
            bounded(&start, 1_000_000),
            format!("{start}... (cut: 1000000 bytes in all)")
        );
        assert_eq!(bounded(&start, MAX_PLUGIN_TEXT), start);
    }

    #[test]
    fn utf16_text_is_decoded_up_to_the_bound() {
        let text: Vec<u8> = "ab\u{1F600}"
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect();
        assert_eq!(utf16_start(&text, 0, 4).unwrap(), "ab\u{1F600}");
        // Cut inside the pair (as a longer string would be): the half is dropped.
        let mut long = [b'a', 0].repeat(MAX_PLUGIN_TEXT - 1);
        long.extend_from_slice(&text[4..]);
        let got = utf16_start(&long, 0, MAX_PLUGIN_TEXT + 1).unwrap();
        assert!(got.starts_with(&"a".repeat(MAX_PLUGIN_TEXT - 1)), "{got}");
        assert!(!got.contains('\u{1F600}'));
    }
}

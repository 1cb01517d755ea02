//! The decoder's guard against deep nesting: an iterative walk over MessagePack values that never
//! recurses, used only when rmp-serde refuses a payload for its depth.
//!
//! rmp-serde reads a value recursively and stops at its depth limit
//! ([`crate::decode::MAX_NESTING`]) with `DepthLimitExceeded` rather than overflow the stack. A
//! payload that is well-formed but that deep is not necessarily bad: a future field the decoder ignores
//! may nest deeply, and an event nested that deep is one malformed event, not a malformed batch.
//! So the decoder reads it again after [`cap_depth`] has replaced every container nested deeper
//! than [`crate::decode::CAPPED_NESTING`] by `nil`. The decoder interprets nothing below the fifth
//! level (batch, events, event, field, Eagle pair), so the capped payload decodes to exactly what
//! the original means, within rmp-serde's limit.
//!
//! Everything here is bounds-checked, consumes at least one byte per item (so it terminates), and
//! fails a container that claims more items than bytes remain before going further.

use rmp::Marker;

/// The input is not well-formed MessagePack (truncated, reserved marker, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Malformed;

/// One item's encoding: a scalar (with its bytes) or a container header (its items follow).
enum Item {
    /// A whole scalar, string, binary or extension: `len` bytes from the marker on.
    Scalar { len: usize },
    /// An array or map header of `len` bytes, followed by `items` values (a map's keys and
    /// values counted apart).
    Container { len: usize, items: u64 },
}

/// A cursor over a MessagePack buffer that steps over whole values without recursion.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The `n`-byte big-endian length at `at`.
    fn len_at(&self, at: usize, n: usize) -> Result<usize, Malformed> {
        let bytes = self.buf.get(at..at + n).ok_or(Malformed)?;
        Ok(bytes.iter().fold(0usize, |v, &b| v << 8 | usize::from(b)))
    }

    /// The encoding of the item at the cursor, checked to fit in the buffer; does not move.
    fn item(&self) -> Result<Item, Malformed> {
        let at = self.pos;
        let &m = self.buf.get(at).ok_or(Malformed)?;
        let scalar = |len: usize| Ok(Item::Scalar { len });
        // Header bytes, then payload bytes read from an `n`-byte length after the marker.
        let sized = |extra: usize, n: usize| -> Result<Item, Malformed> {
            let data = self.len_at(at + 1, n)?;
            Ok(Item::Scalar {
                len: 1 + extra + n + data,
            })
        };
        let container = |len: usize, items: u64| Ok(Item::Container { len, items });
        let item = match Marker::from_u8(m) {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                scalar(1)
            }
            Marker::U8 | Marker::I8 => scalar(2),
            Marker::U16 | Marker::I16 => scalar(3),
            Marker::U32 | Marker::I32 | Marker::F32 => scalar(5),
            Marker::U64 | Marker::I64 | Marker::F64 => scalar(9),
            Marker::FixStr(n) => scalar(1 + n as usize),
            Marker::Str8 | Marker::Bin8 => sized(0, 1),
            Marker::Str16 | Marker::Bin16 => sized(0, 2),
            Marker::Str32 | Marker::Bin32 => sized(0, 4),
            // Extensions: a type byte after the length.
            Marker::FixExt1 => scalar(3),
            Marker::FixExt2 => scalar(4),
            Marker::FixExt4 => scalar(6),
            Marker::FixExt8 => scalar(10),
            Marker::FixExt16 => scalar(18),
            Marker::Ext8 => sized(1, 1),
            Marker::Ext16 => sized(1, 2),
            Marker::Ext32 => sized(1, 4),
            Marker::FixArray(n) => container(1, u64::from(n)),
            Marker::Array16 => container(3, self.len_at(at + 1, 2)? as u64),
            Marker::Array32 => container(5, self.len_at(at + 1, 4)? as u64),
            Marker::FixMap(n) => container(1, 2 * u64::from(n)),
            Marker::Map16 => container(3, 2 * self.len_at(at + 1, 2)? as u64),
            Marker::Map32 => container(5, 2 * self.len_at(at + 1, 4)? as u64),
            Marker::Reserved => Err(Malformed),
        }?;
        let len = match item {
            Item::Scalar { len } | Item::Container { len, .. } => len,
        };
        if len > self.remaining() {
            return Err(Malformed);
        }
        Ok(item)
    }

    /// Steps over one item (a container's header only) and returns the items it opens.
    fn step(&mut self) -> Result<u64, Malformed> {
        match self.item()? {
            Item::Scalar { len } => {
                self.pos += len;
                Ok(0)
            }
            Item::Container { len, items } => {
                self.pos += len;
                // Every item needs at least one more byte: fail fast on absurd headers.
                if items > self.remaining() as u64 {
                    return Err(Malformed);
                }
                Ok(items)
            }
        }
    }

    /// Skips one complete value, containers included. Iterative: nesting depth costs nothing.
    pub fn skip(&mut self) -> Result<(), Malformed> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending = pending - 1 + self.step()?;
            if pending > self.remaining() as u64 {
                return Err(Malformed);
            }
        }
        Ok(())
    }
}

/// A copy of `payload` in which every container nested inside `max` others is replaced by `nil`
/// (one byte); everything else, trailing bytes included, is copied as it is. `Err` when the
/// payload's first value is not well-formed.
pub fn cap_depth(payload: &[u8], max: usize) -> Result<Vec<u8>, Malformed> {
    let mut out = Vec::with_capacity(payload.len());
    let mut rd = Reader::new(payload);
    // Items still to read in each open container, outermost first (at most `max` entries).
    let mut open: Vec<u64> = Vec::with_capacity(max);
    let mut started = false;
    loop {
        while open.last() == Some(&0) {
            open.pop();
        }
        match open.last_mut() {
            Some(left) => *left -= 1,
            None if started => break,
            None => started = true,
        }
        let start = rd.pos;
        match rd.item()? {
            Item::Container { .. } if open.len() >= max => {
                rd.skip()?;
                out.push(0xc0);
            }
            _ => {
                let items = rd.step()?;
                out.extend_from_slice(&payload[start..rd.pos]);
                if items > 0 {
                    open.push(items);
                }
            }
        }
    }
    out.extend_from_slice(&payload[rd.pos..]);
    Ok(out)
}

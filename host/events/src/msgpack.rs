//! A bounds-checked, zero-copy MessagePack cursor: the decoder reads each value's head (kind and
//! length) and borrows strings and binaries from the payload, never allocating for what it skips.

use rmp::Marker;

/// The input is not well-formed MessagePack (truncated, reserved marker, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Malformed;

/// One MessagePack item: a scalar with its value, or the header of a container (its items follow).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    /// Any non-negative integer.
    UInt(u64),
    /// A negative integer.
    Int(i64),
    F32(f32),
    F64(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(usize),
    Map(usize),
}

/// A cursor over a MessagePack buffer.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The marker of the next item, without consuming it.
    pub(crate) fn peek_marker(&self) -> Option<Marker> {
        self.buf.get(self.pos).map(|&b| Marker::from_u8(b))
    }

    /// A token id (`0..=u32::MAX`), with a fast path for the common encodings.
    #[inline]
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self.pos.checked_add(n).ok_or(Malformed)?;
        let s = self.buf.get(self.pos..end).ok_or(Malformed)?;
        self.pos = end;
        Ok(s)
    }

    #[inline]
    pub(crate) fn be<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    #[inline]
    pub(crate) fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.be::<1>()?[0])
    }

    #[inline]
    pub(crate) fn len16(&mut self) -> Result<usize, Malformed> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }

    #[inline]
    pub(crate) fn len32(&mut self) -> Result<usize, Malformed> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    /// Reads the next item (for a container, only its header).
    #[inline]
    pub fn item(&mut self) -> Result<Head<'a>, Malformed> {
        let m = self.u8()?;
        Ok(match Marker::from_u8(m) {
            Marker::FixPos(v) => Head::UInt(u64::from(v)),
            Marker::FixNeg(v) => Head::Int(i64::from(v)),
            Marker::Null => Head::Nil,
            Marker::True => Head::Bool(true),
            Marker::False => Head::Bool(false),
            Marker::U8 => Head::UInt(u64::from(self.u8()?)),
            Marker::U16 => Head::UInt(u64::from(u16::from_be_bytes(self.be()?))),
            Marker::U32 => Head::UInt(u64::from(u32::from_be_bytes(self.be()?))),
            Marker::U64 => Head::UInt(u64::from_be_bytes(self.be()?)),
            Marker::I8 => int(i64::from(i8::from_be_bytes(self.be()?))),
            Marker::I16 => int(i64::from(i16::from_be_bytes(self.be()?))),
            Marker::I32 => int(i64::from(i32::from_be_bytes(self.be()?))),
            Marker::I64 => int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Head::F32(f32::from_be_bytes(self.be()?)),
            Marker::F64 => Head::F64(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => Head::Str(self.take(n as usize)?),
            Marker::Str8 => {
                let n = self.u8()? as usize;
                Head::Str(self.take(n)?)
            }
            Marker::Str16 => {
                let n = self.len16()?;
                Head::Str(self.take(n)?)
            }
            Marker::Str32 => {
                let n = self.len32()?;
                Head::Str(self.take(n)?)
            }
            Marker::Bin8 => {
                let n = self.u8()? as usize;
                Head::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = self.len16()?;
                Head::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.len32()?;
                Head::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => Head::Array(n as usize),
            Marker::Array16 => Head::Array(self.len16()?),
            Marker::Array32 => Head::Array(self.len32()?),
            Marker::FixMap(n) => Head::Map(n as usize),
            Marker::Map16 => Head::Map(self.len16()?),
            Marker::Map32 => Head::Map(self.len32()?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.u8()? as usize;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.len16()?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len32()?;
                self.ext(n)?
            }
            Marker::Reserved => return Err(Malformed),
        })
    }

    pub(crate) fn ext(&mut self, n: usize) -> Result<Head<'a>, Malformed> {
        self.take(1)?; // type byte
        self.take(n)?;
        Ok(Head::Ext)
    }

    /// Skips one complete value, containers included. Iterative: nesting depth costs nothing.
    pub fn skip(&mut self) -> Result<(), Malformed> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            match self.item()? {
                Head::Array(n) => pending += n as u64,
                Head::Map(n) => pending += 2 * n as u64,
                _ => {}
            }
            // Every pending item needs at least one more byte: fail fast on absurd headers.
            if pending > (self.buf.len() - self.pos) as u64 {
                return Err(Malformed);
            }
        }
        Ok(())
    }

    /// Reads one complete map key: its bytes when it is a string, `None` for any other value.
    pub fn key(&mut self) -> Result<Option<&'a [u8]>, Malformed> {
        let raw = self.raw_value()?;
        Ok(match Reader::new(raw).item()? {
            Head::Str(k) => Some(k),
            _ => None,
        })
    }

    /// Skips one complete value and returns its bytes.
    pub fn raw_value(&mut self) -> Result<&'a [u8], Malformed> {
        let start = self.pos;
        self.skip()?;
        Ok(&self.buf[start..self.pos])
    }
}

#[inline]
fn int(v: i64) -> Head<'static> {
    if v >= 0 {
        Head::UInt(v as u64)
    } else {
        Head::Int(v)
    }
}

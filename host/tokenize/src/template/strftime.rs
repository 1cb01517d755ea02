//! `strftime_now(format)`: templates (Llama 3.x, Mistral's) write today's date into the system
//! prompt. The time is UTC; the directives are C's that templates use, with glibc's `-` flag
//! (`%-d`) to drop padding. The date is part of the prompt, so it is part of the tokens: two
//! requests on either side of midnight share no prefix past it, on the engine as here.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Error, ErrorKind};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

#[cfg(test)]
thread_local! {
    /// A fixed "now" for this thread's renderings (seconds since the epoch), so tests can hold
    /// templates that print the date against vectors recorded with the same frozen clock.
    pub(crate) static FIXED_NOW: std::cell::Cell<Option<i64>> = const { std::cell::Cell::new(None) };
}

thread_local! {
    /// How many times this thread's renderings read the clock: a prompt rendered without reading
    /// it depends on the request alone (the tokenizer cache keeps only those).
    static CLOCK_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// This thread's clock reads so far (see `CLOCK_READS`).
pub(crate) fn clock_reads() -> u64 {
    CLOCK_READS.with(std::cell::Cell::get)
}

pub(super) fn strftime_now(format: String) -> Result<String, Error> {
    CLOCK_READS.with(|n| n.set(n.get() + 1));
    #[cfg(test)]
    if let Some(now) = FIXED_NOW.with(std::cell::Cell::get) {
        return strftime(&format, now);
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    strftime(&format, now.as_secs() as i64)
}

/// `format` applied to `secs` seconds after the Unix epoch, in UTC.
pub(crate) fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    let days = secs.div_euclid(86_400);
    let in_day = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (in_day / 3600, in_day / 60 % 60, in_day % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next();
        let pad = directive != Some('-');
        if !pad {
            directive = chars.next();
        }
        let number = |out: &mut String, n: i64, width: usize| {
            if pad {
                out.push_str(&format!("{n:0width$}"));
            } else {
                out.push_str(&n.to_string());
            }
        };
        match directive {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => number(&mut out, year.rem_euclid(100), 2),
            Some('m') => number(&mut out, month, 2),
            Some('d') => number(&mut out, day, 2),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => number(&mut out, hour, 2),
            Some('I') => number(&mut out, hour12, 2),
            Some('M') => number(&mut out, minute, 2),
            Some('S') => number(&mut out, second, 2),
            Some('j') => number(&mut out, day_of_year, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('F') => out.push_str(&format!("{year:04}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month 1-12, day 1-31) of a day number counted from 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

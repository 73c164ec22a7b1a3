//! The parsers' shared piece: integers in a range. What is wrong with a setting's text is a
//! [`ParseError`], a payload of the error type.

use crate::error::{ParseError, ParseErrorKind};

/// Parses a decimal integer in `min..=max` (a leading `+` or `-` allowed, no spaces).
pub(crate) fn int(input: &str, min: i64, max: i64) -> Result<i64, ParseError> {
    let bad = |position| ParseError::new(input, position, ParseErrorKind::Number { min, max });
    let digits = input.strip_prefix(['+', '-']).unwrap_or(input);
    if let Some(i) = digits.find(|c: char| !c.is_ascii_digit()) {
        return Err(bad(input.len() - digits.len() + i));
    }
    match input.parse::<i64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(bad(0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_in_range_and_the_position_of_the_first_bad_character() {
        assert_eq!(int("7", 0, 7), Ok(7));
        assert_eq!(int("+3", 0, 7), Ok(3));
        assert_eq!(int("-1", -1, 7), Ok(-1));
        let e = int("8", 0, 7).unwrap_err();
        assert_eq!((e.position, e.kind), (0, ParseErrorKind::Number { min: 0, max: 7 }));
        assert_eq!(int("1x", 0, 7).unwrap_err().position, 1);
        assert_eq!(int("-x", -1, 7).unwrap_err().position, 1);
        assert_eq!(int(" 1", 0, 7).unwrap_err().position, 0);
        assert_eq!(int("", 0, 7).unwrap_err().position, 0);
        assert_eq!(int("99999999999999999999", 0, 7).unwrap_err().position, 0);
        assert_eq!(
            int("1x", 0, 7).unwrap_err().to_string(),
            "\"1x\": not an integer from 0 to 7 at position 1"
        );
    }
}

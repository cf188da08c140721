//! Account identifiers, in one normal form: upper case, no spaces; an IBAN
//! (two letters, two check digits, up to 30 letters and digits) must carry
//! valid check digits (ISO 13616, mod 97). Payments, client account lists
//! and the permission check all hold and compare this form only.

/// The normal form of `raw`, or why it is not an account identifier.
pub fn normal_account(raw: &str) -> Result<String, &'static str> {
    let normal: String = raw.chars().filter(|c| *c != ' ').collect::<String>().to_ascii_uppercase();
    if !(1..=34).contains(&normal.len()) || !normal.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err("must be 1-34 letters and digits (an IBAN or account number)");
    }
    if looks_like_iban(&normal) && !iban_checks(&normal) {
        return Err("looks like an IBAN but its check digits are wrong");
    }
    Ok(normal)
}

fn looks_like_iban(s: &str) -> bool {
    let b = s.as_bytes();
    (15..=34).contains(&b.len()) && b[..2].iter().all(u8::is_ascii_uppercase) && b[2..4].iter().all(u8::is_ascii_digit)
}

/// ISO 7064 mod 97-10 over the IBAN rearranged (country and check digits last).
fn iban_checks(iban: &str) -> bool {
    let rearranged = iban[4..].bytes().chain(iban[..4].bytes());
    let remainder = rearranged.fold(0_u32, |r, b| {
        let value = if b.is_ascii_digit() { u32::from(b - b'0') } else { u32::from(b - b'A') + 10 };
        if value >= 10 { (r * 100 + value) % 97 } else { (r * 10 + value) % 97 }
    });
    remainder == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_have_one_normal_form_and_ibans_valid_check_digits() {
        assert_eq!(normal_account("de89 3704 0044 0532 0130 00").unwrap(), "DE89370400440532013000");
        assert_eq!(normal_account("FR1420041010050500013M02606").unwrap(), "FR1420041010050500013M02606");
        assert_eq!(normal_account("gb29 nwbk 6016 1331 9268 19").unwrap(), "GB29NWBK60161331926819");
        assert!(normal_account("DE88370400440532013000").is_err(), "one check digit off");
        assert_eq!(normal_account("12345678").unwrap(), "12345678", "a plain account number");
        assert!(normal_account("").is_err() && normal_account("DE89-3704").is_err());
    }
}

//! `PaymentRequest`: the body of `POST /v1/payments`, parsed and validated.
//! Untrusted JSON becomes this type or a list of field errors; nothing in
//! between reaches the engine.

use serde::{Deserialize, Serialize};

/// Every field error found, so a client can fix them all at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaymentRequest {
    /// Integer minor units (cents), so no amount is ever rounded.
    pub amount_minor: i64,
    /// ISO 4217 alphabetic code.
    pub currency: String,
    pub debtor_account: String,
    pub creditor_account: String,
    /// ISO 20022 end-to-end reference: travels with the instruction to the
    /// rail and is how an unknown outcome is looked up.
    pub end_to_end_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remittance_info: Option<String>,
}

/// Largest amount accepted: 10^15 minor units, far above any real payment,
/// far below where arithmetic on sums could overflow.
pub(super) const MAX_AMOUNT_MINOR: i64 = 1_000_000_000_000_000;

impl PaymentRequest {
    /// Parses a JSON value (already known to be well-formed JSON). Only an
    /// object with exactly the documented fields is a payment: serde would
    /// also read a struct from an array, in field order, and a `null`
    /// remittance would hash differently from one left out.
    pub fn parse(value: serde_json::Value) -> Result<Self, Vec<FieldError>> {
        let Some(object) = value.as_object() else {
            return Err(vec![FieldError { field: "body", message: "must be a JSON object".into() }]);
        };
        if object.get("remittance_info").is_some_and(serde_json::Value::is_null) {
            let message = "must be a string; leave the field out for none".into();
            return Err(vec![FieldError { field: "remittance_info", message }]);
        }
        let mut request: PaymentRequest =
            serde_json::from_value(value).map_err(|e| vec![FieldError { field: "body", message: e.to_string() }])?;
        let mut errors = Vec::new();
        for (field, account) in
            [("debtor_account", &mut request.debtor_account), ("creditor_account", &mut request.creditor_account)]
        {
            match super::normal_account(account) {
                Ok(normal) => *account = normal,
                Err(message) => errors.push(FieldError { field, message: message.to_owned() }),
            }
        }
        errors.extend(request.field_errors());
        if errors.is_empty() { Ok(request) } else { Err(errors) }
    }

    fn field_errors(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let mut check = |ok: bool, field: &'static str, message: &str| {
            if !ok {
                errors.push(FieldError { field, message: message.to_owned() });
            }
        };
        check(
            self.amount_minor > 0 && self.amount_minor <= MAX_AMOUNT_MINOR,
            "amount_minor",
            "must be a whole number of minor units, greater than 0 and at most 10^15",
        );
        check(is_currency(&self.currency), "currency", "must be an ISO 4217 currency code such as EUR");
        check(
            is_reference(&self.end_to_end_id),
            "end_to_end_id",
            "must be 1-35 characters without control or invisible format characters (ISO 20022 Max35Text)",
        );
        if let Some(info) = &self.remittance_info {
            check(
                is_text(info, 0, 140),
                "remittance_info",
                "must be at most 140 characters without control or invisible format characters",
            );
        }
        errors
    }
}

/// An ISO 20022 end-to-end reference (Max35Text): 1-35 characters, none a
/// control character (so never a NUL, which PostgreSQL cannot store).
pub fn is_reference(s: &str) -> bool {
    is_text(s, 1, 35)
}

/// Text of `min` to `max` characters with none that hides or reorders what
/// a person reads: no control character, no format character (bidi
/// overrides, zero-width characters, soft hyphens: general category Cf), no
/// line or paragraph separator (U+2028, U+2029).
pub(super) fn is_text(s: &str, min: usize, max: usize) -> bool {
    use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};
    let hidden = |c: char| {
        c.is_control()
            || matches!(
                c.general_category(),
                GeneralCategory::Format | GeneralCategory::LineSeparator | GeneralCategory::ParagraphSeparator
            )
    };
    (min..=max).contains(&s.chars().count()) && !s.chars().any(hidden)
}

fn is_currency(code: &str) -> bool {
    code.len() == 3 && ISO_4217.split(' ').any(|c| c == code)
}

/// Active ISO 4217 alphabetic codes.
const ISO_4217: &str = "AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD \
BTN BWP BYN BZD CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD FKP GBP GEL GHS GIP \
GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS KHR KMF KPW KRW KWD KYD KZT LAK LBP \
LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK \
PHP PKR PLN PYG QAR RON RSD RUB RWF SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS TMT TND \
TOP TRY TTD TWD TZS UAH UGX USD UYU UZS VED VES VND VUV WST XAF XCD XCG XOF XPF YER ZAR ZMW ZWG";

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn valid() -> serde_json::Value {
        json!({"amount_minor": 1250, "currency": "EUR", "debtor_account": "DE89370400440532013000",
               "creditor_account": "FR1420041010050500013M02606", "end_to_end_id": "INV-2026-0001",
               "remittance_info": "invoice 1"})
    }

    #[test]
    fn text_that_hides_or_reorders_what_a_person_reads_is_refused() {
        for hidden in
            ["\u{202E}lanigiro", "pay\u{200B}ee", "line\u{2028}break", "para\u{2029}", "\u{FEFF}bom", "soft\u{AD}"]
        {
            let mut v = valid();
            v["remittance_info"] = json!(hidden);
            let errors = PaymentRequest::parse(v).unwrap_err();
            assert_eq!(errors.iter().map(|e| e.field).collect::<Vec<_>>(), ["remittance_info"], "{hidden:?}");
            let mut v = valid();
            v["end_to_end_id"] = json!(hidden);
            assert_eq!(PaymentRequest::parse(v).unwrap_err()[0].field, "end_to_end_id", "{hidden:?}");
        }
        let mut v = valid();
        v["remittance_info"] = json!("Überweisung für Rechnung 42, ünd €");
        assert!(PaymentRequest::parse(v).is_ok(), "letters and symbols of any script are fine");
    }

    #[test]
    fn accepts_a_valid_payment() {
        let p = PaymentRequest::parse(valid()).unwrap();
        assert_eq!((p.amount_minor, p.currency.as_str()), (1250, "EUR"));
    }

    #[test]
    fn reports_every_bad_field() {
        let mut v = valid();
        v["amount_minor"] = json!(0);
        v["currency"] = json!("EURO");
        v["end_to_end_id"] = json!("x".repeat(36));
        let fields: Vec<_> = PaymentRequest::parse(v).unwrap_err().into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["amount_minor", "currency", "end_to_end_id"]);
    }

    #[test]
    fn rejects_wrong_types_unknown_fields_and_fractions() {
        for (field, bad) in [("amount_minor", json!(12.5)), ("amount_minor", json!("1250")), ("surprise", json!(1))] {
            let mut v = valid();
            v[field] = bad;
            assert!(PaymentRequest::parse(v).is_err(), "{field}");
        }
        let mut v = valid();
        v.as_object_mut().unwrap().remove("creditor_account");
        assert!(PaymentRequest::parse(v).is_err());
    }

    #[test]
    fn only_an_object_is_a_payment_and_null_is_not_a_remittance() {
        let array = json!([1250, "EUR", "DE89370400440532013000", "FR1420041010050500013M02606", "E2E", "x"]);
        assert_eq!(PaymentRequest::parse(array).unwrap_err()[0].field, "body");
        let mut v = valid();
        v["remittance_info"] = serde_json::Value::Null;
        assert_eq!(PaymentRequest::parse(v).unwrap_err()[0].field, "remittance_info");
        let mut v = valid();
        v["end_to_end_id"] = json!("a\u{0}b");
        assert_eq!(PaymentRequest::parse(v).unwrap_err()[0].field, "end_to_end_id");
        assert!(!is_reference("") && !is_reference(&"x".repeat(36)) && is_reference(&"x".repeat(35)));
    }
}

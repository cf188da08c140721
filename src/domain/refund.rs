//! A refund as a client asks for it: how much of a payment to give back,
//! and why. The payment it refunds is named by the path, not the body.

use serde::{Deserialize, Serialize};

use super::FieldError;
use super::payment::is_text;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefundRequest {
    pub amount_minor: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl RefundRequest {
    /// Validates a JSON body, reporting every bad field at once. Whether
    /// the amount fits what is left of the payment is the balance's to say.
    pub fn parse(value: serde_json::Value) -> Result<Self, Vec<FieldError>> {
        let Some(object) = value.as_object() else {
            return Err(vec![FieldError { field: "body", message: "must be a JSON object".into() }]);
        };
        if object.get("reason").is_some_and(serde_json::Value::is_null) {
            let message = "must be a string; leave the field out for none".into();
            return Err(vec![FieldError { field: "reason", message }]);
        }
        let request: RefundRequest =
            serde_json::from_value(value).map_err(|e| vec![FieldError { field: "body", message: e.to_string() }])?;
        let mut errors = Vec::new();
        if !(request.amount_minor > 0 && request.amount_minor <= super::payment::MAX_AMOUNT_MINOR) {
            let message = "must be a whole number of minor units, greater than 0 and at most 10^15".into();
            errors.push(FieldError { field: "amount_minor", message });
        }
        if request.reason.as_deref().is_some_and(|reason| !is_text(reason, 1, 140)) {
            let message = "must be 1-140 characters without control or invisible format characters".into();
            errors.push(FieldError { field: "reason", message });
        }
        if errors.is_empty() { Ok(request) } else { Err(errors) }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_refund_names_an_amount_and_perhaps_a_reason() {
        let refund = RefundRequest::parse(json!({"amount_minor": 500, "reason": "damaged"})).unwrap();
        assert_eq!((refund.amount_minor, refund.reason.as_deref()), (500, Some("damaged")));
        assert!(RefundRequest::parse(json!({"amount_minor": 500})).unwrap().reason.is_none());
    }

    #[test]
    fn every_bad_field_is_reported() {
        let errors = RefundRequest::parse(json!({"amount_minor": 0, "reason": "a\u{202E}b"})).unwrap_err();
        assert_eq!(errors.iter().map(|e| e.field).collect::<Vec<_>>(), ["amount_minor", "reason"]);
        assert_eq!(RefundRequest::parse(json!({"amount_minor": 1, "reason": null})).unwrap_err()[0].field, "reason");
        assert_eq!(RefundRequest::parse(json!({"amount_minor": 1, "payment": "x"})).unwrap_err()[0].field, "body");
        assert_eq!(RefundRequest::parse(json!([1])).unwrap_err()[0].field, "body");
    }
}

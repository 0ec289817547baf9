//! Errors for bad input, independent of Postgres so the parsers can be unit-tested without a server.
//! `edit.rs` turns them into `ereport(ERROR)` with the SQLSTATE below.

/// The class-22 SQLSTATEs that bad input maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// 22P02 invalid_text_representation: malformed GeoJSON.
    InvalidText,
    /// 22023 invalid_parameter_value: well-formed but unusable (empty, SRID, Z/M, curves, NaN, invalid).
    InvalidParameter,
    /// 22003 numeric_value_out_of_range: longitude/latitude outside the EPSG:4326 range.
    OutOfRange,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError {
    pub code: Code,
    pub message: String,
    pub hint: Option<String>,
}

impl InputError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        InputError { code, message: message.into(), hint: None }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

impl std::fmt::Display for InputError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for InputError {}

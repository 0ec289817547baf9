//! GUCs. Every setting is `feature_outbox.<name>`; the README lists them with context and default.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};

/// What `edit_feature` does with a well-formed geometry that fails `ST_IsValid`.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum InvalidGeometry {
    #[name = c"accept"]
    Accept,
    #[name = c"repair"]
    Repair,
    #[name = c"reject"]
    Reject,
}

pub static H3_RESOLUTION: GucSetting<i32> = GucSetting::<i32>::new(8);
pub static INVALID_GEOMETRY: GucSetting<InvalidGeometry> = GucSetting::<InvalidGeometry>::new(InvalidGeometry::Accept);

/// Defines the settings every backend needs (edit_feature's). Called from `_PG_init`.
pub fn init() {
    GucRegistry::define_int_guc(
        c"feature_outbox.h3_resolution",
        c"H3 resolution (0-15) of the routing key that edit_feature computes.",
        c"Resolution 8 cells average 0.74 km². Changing it affects new outbox rows only.",
        &H3_RESOLUTION,
        0,
        15,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_enum_guc(
        c"feature_outbox.invalid_geometry",
        c"What edit_feature does with an invalid polygon: accept, repair (ST_MakeValid) or reject.",
        c"The routing point is taken from a made-valid copy under every policy.",
        &INVALID_GEOMETRY,
        GucContext::Suset,
        GucFlags::default(),
    );
}

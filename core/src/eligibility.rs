//! Device eligibility: the conditions a device reports at check-in (charging, battery level,
//! unmetered network, idle, app version, free storage) and a plan's requirements on them, so
//! that training runs only where it costs the user nothing they would notice.
//!
//! A device that reports nothing meets no requirement: a plan that asks for charging devices
//! gets only devices that say they are charging. The coordinator applies the requirements at
//! check-in; the task carries them, and the client SDK checks them again against the device's
//! conditions of that moment before it trains (a phone unplugged after its check-in does not
//! train).

use serde::{Deserialize, Serialize};

/// What a device says about its conditions when it checks in; every field is optional.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceAttributes {
    /// On external power.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charging: Option<bool>,
    /// Battery charge, percent (0 to 100; a larger value meets no requirement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub battery_percent: Option<u8>,
    /// On an unmetered network (Wi-Fi, Ethernet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmetered_network: Option<bool>,
    /// Not in use (screen off, no foreground work).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<bool>,
    /// The embedding app's version, dotted numbers (`4.12.1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_version: Option<String>,
    /// Free storage, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_storage_bytes: Option<u64>,
}

/// A plan's requirements on the devices it trains with; the default requires nothing.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Eligibility {
    /// Only devices that say they are charging.
    #[serde(default)]
    pub charging: bool,
    /// Only devices whose battery is at least this full, percent (at most 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_battery_percent: Option<u8>,
    /// Only devices that say they are on an unmetered network.
    #[serde(default)]
    pub unmetered_network: bool,
    /// Only devices that say they are idle.
    #[serde(default)]
    pub idle: bool,
    /// Only devices whose app is at least this version (dotted numbers; missing parts count
    /// as 0, so `4.12` is `4.12.0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_app_version: Option<String>,
    /// Only devices with at least this much free storage, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_free_storage_bytes: Option<u64>,
}

/// Longest app version string a device or plan may give.
const MAX_VERSION_LEN: usize = 64;

/// A dotted version as numbers (`"4.12.1"` → `[4, 12, 1]`), or `None` if it is not one.
pub fn parse_version(text: &str) -> Option<Vec<u64>> {
    if text.is_empty() || text.len() > MAX_VERSION_LEN {
        return None;
    }
    text.split('.').map(|part| part.parse::<u64>().ok()).collect()
}

/// `a >= b` for parsed versions, missing parts counting as 0.
fn at_least(a: &[u64], b: &[u64]) -> bool {
    let n = a.len().max(b.len());
    let part = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
    (0..n).map(|i| part(a, i).cmp(&part(b, i))).find(|o| o.is_ne()).is_none_or(|o| o.is_gt())
}

impl Eligibility {
    /// Whether these requirements are well formed; `Err` names what is not.
    pub fn check(&self) -> Result<(), String> {
        if let Some(v) = self.min_app_version.as_ref().filter(|v| v.len() > 64) {
            return Err(format!("min_app_version of {} bytes is over the limit of 64", v.len()));
        }
        if let Some(v) = &self.min_app_version
            && parse_version(v).is_none()
        {
            return Err(format!(
                "min_app_version {v:?} is not a dotted version of numbers (like 4.12.1)"
            ));
        }
        match self.min_battery_percent {
            Some(p) if p > 100 => Err(format!("min_battery_percent {p} is over 100")),
            _ => Ok(()),
        }
    }

    /// Whether this requires anything.
    pub fn is_open(&self) -> bool {
        *self == Self::default()
    }

    /// Whether a device with `attributes` qualifies. An attribute the device did not report
    /// does not meet a requirement on it, nor does an app version that does not parse.
    pub fn admits(&self, attributes: &DeviceAttributes) -> bool {
        self.unmet(attributes).is_empty()
    }

    /// The requirements a device with `attributes` does not meet, named as in the plan
    /// (`charging`, `min_battery_percent`, ...); empty when it qualifies.
    pub fn unmet(&self, attributes: &DeviceAttributes) -> Vec<&'static str> {
        let flag = |required: bool, reported: Option<bool>| !required || reported == Some(true);
        let version_ok = match &self.min_app_version {
            None => true,
            Some(min) => match (
                attributes.app_version.as_deref().and_then(parse_version),
                parse_version(min),
            ) {
                (Some(have), Some(min)) => at_least(&have, &min),
                _ => false,
            },
        };
        let storage_ok = self
            .min_free_storage_bytes
            .is_none_or(|min| attributes.free_storage_bytes.is_some_and(|free| free >= min));
        let battery_ok = self.min_battery_percent.is_none_or(|min| {
            attributes.battery_percent.is_some_and(|level| level >= min && level <= 100)
        });
        [
            (flag(self.charging, attributes.charging), "charging"),
            (battery_ok, "min_battery_percent"),
            (flag(self.unmetered_network, attributes.unmetered_network), "unmetered_network"),
            (flag(self.idle, attributes.idle), "idle"),
            (version_ok, "min_app_version"),
            (storage_ok, "min_free_storage_bytes"),
        ]
        .into_iter()
        .filter_map(|(met, name)| (!met).then_some(name))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(charging: Option<bool>, version: Option<&str>) -> DeviceAttributes {
        DeviceAttributes {
            charging,
            battery_percent: Some(80),
            unmetered_network: Some(true),
            idle: None,
            app_version: version.map(str::to_owned),
            free_storage_bytes: Some(1 << 30),
        }
    }

    #[test]
    fn no_requirement_admits_every_device_even_one_that_reports_nothing() {
        let open = Eligibility::default();
        assert!(open.is_open());
        assert!(open.admits(&DeviceAttributes::default()));
        assert!(open.admits(&device(Some(false), Some("x"))));
    }

    #[test]
    fn a_requirement_is_met_only_by_a_device_that_reports_it() {
        let charging = Eligibility { charging: true, ..Default::default() };
        assert!(charging.admits(&device(Some(true), None)));
        assert!(!charging.admits(&device(Some(false), None)));
        assert!(!charging.admits(&device(None, None)), "unreported is not charging");
        let idle = Eligibility { idle: true, ..Default::default() };
        assert!(!idle.admits(&device(Some(true), None)));
        let storage = Eligibility { min_free_storage_bytes: Some(2 << 30), ..Default::default() };
        assert!(!storage.admits(&device(None, None)));
        let storage = Eligibility { min_free_storage_bytes: Some(1 << 30), ..Default::default() };
        assert!(storage.admits(&device(None, None)));
        let unmetered = Eligibility { unmetered_network: true, ..Default::default() };
        assert!(unmetered.admits(&device(None, None)));
        assert!(!unmetered.admits(&DeviceAttributes::default()));
    }

    #[test]
    fn a_battery_requirement_needs_a_reported_level_at_least_as_full() {
        let half = Eligibility { min_battery_percent: Some(50), ..Default::default() };
        assert!(half.check().is_ok());
        assert!(half.admits(&device(None, None)), "80 % meets 50 %");
        for (level, ok) in [(Some(50), true), (Some(49), false), (None, false), (Some(101), false)]
        {
            let attributes = DeviceAttributes { battery_percent: level, ..device(None, None) };
            assert_eq!(half.admits(&attributes), ok, "{level:?}");
        }
        let over = Eligibility { min_battery_percent: Some(101), ..Default::default() };
        assert!(over.check().unwrap_err().contains("101"));
    }

    #[test]
    fn unmet_requirements_are_named_as_in_the_plan() {
        let plan = Eligibility {
            charging: true,
            min_battery_percent: Some(90),
            unmetered_network: true,
            ..Default::default()
        };
        let unplugged = DeviceAttributes { charging: Some(false), ..device(None, None) };
        assert_eq!(plan.unmet(&unplugged), ["charging", "min_battery_percent"]);
        let ready =
            DeviceAttributes { charging: Some(true), battery_percent: Some(95), ..unplugged };
        assert!(plan.unmet(&ready).is_empty() && plan.admits(&ready));
    }

    #[test]
    fn app_versions_compare_as_numbers_with_missing_parts_as_zero() {
        let min = Eligibility { min_app_version: Some("4.12".into()), ..Default::default() };
        for (have, ok) in [
            ("4.12", true),
            ("4.12.0", true),
            ("4.12.1", true),
            ("4.9.9", false),
            ("4.100", true),
            ("5", true),
            ("4", false),
            ("4.12-beta", false),
            ("", false),
        ] {
            assert_eq!(min.admits(&device(None, Some(have))), ok, "{have}");
        }
        assert!(!min.admits(&device(None, None)));
        assert!(min.check().is_ok());
        let bad = Eligibility { min_app_version: Some("four".into()), ..Default::default() };
        assert!(bad.check().unwrap_err().contains("four"));
        assert_eq!(parse_version(&"1.".repeat(40)), None, "too long");
    }
}

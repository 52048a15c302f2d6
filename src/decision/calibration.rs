//! Temperature calibration files (imajev `calibration.json`, schema 1.0, 1.1 and 1.2).
//!
//! One positive temperature per decision type × option-count bucket; schema 1.1 adds additive
//! offsets on the unknown logit (applied to text-only requests), schema 1.2 adds photo-only
//! temperatures (requests with images and an empty state). A bucket the file lacks leaves the
//! probabilities uncalibrated (T = 1, no `calibration_version`).

use super::prompt::ScoredKind;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub version: String,
    pub schema: String,
    pub temperatures: BTreeMap<String, f64>,
    pub unknown_offsets: BTreeMap<String, f64>,
    pub photo_only_temperatures: BTreeMap<String, f64>,
}

#[derive(Deserialize)]
struct File {
    schema_version: String,
    calibration_version: serde_json::Value,
    temperatures: BTreeMap<String, f64>,
    counts: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    unknown_offsets: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    photo_only_temperatures: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    photo_only_counts: Option<BTreeMap<String, serde_json::Value>>,
}

/// `2`, `3-5`, `6-10`, `11-25`, `26-254` (the last label covers 26..255).
pub fn bucket(option_count: usize) -> Option<&'static str> {
    match option_count {
        2 => Some("2"),
        3..=5 => Some("3-5"),
        6..=10 => Some("6-10"),
        11..=25 => Some("11-25"),
        26..=255 => Some("26-254"),
        _ => None,
    }
}

pub fn key(kind: ScoredKind, option_count: usize) -> Option<String> {
    bucket(option_count).map(|b| format!("{}:{b}", kind.calibration_name()))
}

fn check_temps(name: &str, t: &BTreeMap<String, f64>) -> Result<()> {
    for (k, v) in t {
        if !v.is_finite() || *v <= 0.0 {
            bail!("{name}[{k:?}] = {v} is not a finite positive temperature");
        }
    }
    Ok(())
}

impl Calibration {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json(&text).with_context(|| format!("calibration file {}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let f: File = serde_json::from_str(text)?;
        if !matches!(f.schema_version.as_str(), "1.0" | "1.1" | "1.2") {
            bail!("unsupported schema_version {:?} (supported: 1.0, 1.1, 1.2)", f.schema_version);
        }
        let version = match &f.calibration_version {
            serde_json::Value::String(s) if !s.is_empty() => s.clone(),
            serde_json::Value::Null => bail!("calibration_version is missing"),
            other => other.to_string().trim_matches('"').to_string(),
        };
        if version.is_empty() {
            bail!("calibration_version must be a non-empty string");
        }
        check_temps("temperatures", &f.temperatures)?;
        let tk: Vec<&String> = f.temperatures.keys().collect();
        let ck: Vec<&String> = f.counts.keys().collect();
        if tk != ck {
            bail!("temperature and count buckets must match");
        }
        for (k, v) in &f.counts {
            if v.as_u64().is_none_or(|n| n < 1) {
                bail!("counts[{k:?}] must be a positive integer");
            }
        }
        let offsets = f.unknown_offsets.unwrap_or_default();
        for (k, v) in &offsets {
            if !f.temperatures.contains_key(k) {
                bail!("unknown_offsets names bucket {k:?}, which has no temperature");
            }
            if !v.is_finite() {
                bail!("unknown_offsets[{k:?}] is not finite");
            }
        }
        let photo = f.photo_only_temperatures.unwrap_or_default();
        check_temps("photo_only_temperatures", &photo)?;
        if let Some(pc) = &f.photo_only_counts {
            if pc.keys().collect::<Vec<_>>() != photo.keys().collect::<Vec<_>>() {
                bail!("photo-only temperature and count buckets must match");
            }
        }
        Ok(Calibration {
            version,
            schema: f.schema_version,
            temperatures: f.temperatures,
            unknown_offsets: offsets,
            photo_only_temperatures: photo,
        })
    }

    /// The temperature for a scored question; the photo-only table wins when it has the bucket.
    pub fn temperature(&self, kind: ScoredKind, option_count: usize, photo_only: bool) -> Option<f64> {
        let k = key(kind, option_count)?;
        if photo_only {
            if let Some(t) = self.photo_only_temperatures.get(&k) {
                return Some(*t);
            }
        }
        self.temperatures.get(&k).copied()
    }

    pub fn unknown_offset(&self, kind: ScoredKind, option_count: usize) -> f64 {
        key(kind, option_count).and_then(|k| self.unknown_offsets.get(&k).copied()).unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_phase3_file_and_schema_1_2() {
        let buckets = ["2", "3-5", "6-10", "11-25", "26-254"];
        let mut temps = serde_json::Map::new();
        let mut counts = serde_json::Map::new();
        for t in ["boolean", "choice", "ordinal"] {
            for b in buckets {
                temps.insert(format!("{t}:{b}"), serde_json::json!(1.3051569717552742));
                counts.insert(format!("{t}:{b}"), serde_json::json!(150));
            }
        }
        let doc = serde_json::json!({"schema_version": "1.0", "calibration_version": "p3-r2-s000291-authored",
            "temperatures": temps, "counts": counts, "fit": {"nll": 0.61}});
        let c = Calibration::from_json(&doc.to_string()).unwrap();
        assert_eq!(c.temperature(ScoredKind::Choice, 255, false), Some(1.3051569717552742));
        assert_eq!(c.temperature(ScoredKind::Boolean, 2, true), Some(1.3051569717552742));
        let doc = serde_json::json!({"schema_version": "1.2", "calibration_version": "m",
            "temperatures": {"boolean:2": 1.5}, "counts": {"boolean:2": 3},
            "photo_only_temperatures": {"boolean:2": 1.028}, "photo_only_counts": {"boolean:2": 823}});
        let c = Calibration::from_json(&doc.to_string()).unwrap();
        assert_eq!(c.temperature(ScoredKind::Boolean, 2, true), Some(1.028));
        assert_eq!(c.temperature(ScoredKind::Boolean, 2, false), Some(1.5));
        assert_eq!(c.temperature(ScoredKind::Choice, 2, true), None);
        assert!(Calibration::from_json(
            r#"{"schema_version": "2.0", "calibration_version": "x", "temperatures": {}, "counts": {}}"#
        )
        .is_err());
        assert!(Calibration::from_json(r#"{"schema_version": "1.0", "calibration_version": "x", "temperatures": {"boolean:2": -1}, "counts": {"boolean:2": 1}}"#).is_err());
    }
}

//! The result of `verify`: one row per check and file, printed as a table whose last line says
//! whether the release may be served and, if not, which files are wrong.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    Failed,
    /// A file that exists but whose hash no lock states (verify without a lock).
    NotPinned,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Failed => "FAIL",
            Status::NotPinned => "unpinned",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `lock`, `sha256`, `config`, `tensors`, `lora`, `codebook` or `calibration`.
    pub check: &'static str,
    /// `<folder>/<file>` (the folder as named on the command line).
    pub file: String,
    pub status: Status,
    pub detail: String,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub rows: Vec<Row>,
}

impl Report {
    pub fn push(
        &mut self,
        check: &'static str,
        file: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
    ) {
        self.rows.push(Row { check, file: file.into(), status, detail: detail.into() });
    }

    pub fn passed(&self) -> bool {
        self.rows.iter().all(|r| r.status != Status::Failed)
    }

    pub fn failures(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| r.status == Status::Failed)
    }

    /// True when no row was checked against a lock (verify ran without one).
    pub fn unpinned(&self) -> bool {
        self.rows.iter().any(|r| r.status == Status::NotPinned)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w_check = self.rows.iter().map(|r| r.check.len()).max().unwrap_or(0).max("CHECK".len());
        let w_file = self.rows.iter().map(|r| r.file.chars().count()).max().unwrap_or(0).max("FILE".len());
        let w_status = "unpinned".len();
        writeln!(f, "{:<w_check$}  {:<w_file$}  {:<w_status$}  DETAIL", "CHECK", "FILE", "RESULT")?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<w_check$}  {:<w_file$}  {:<w_status$}  {}",
                r.check,
                r.file,
                r.status.label(),
                r.detail
            )?;
        }
        let failed: Vec<&Row> = self.failures().collect();
        if failed.is_empty() {
            write!(f, "verify: {} checks passed", self.rows.len())?;
            if self.unpinned() {
                write!(f, "; file hashes NOT checked (no lock: `imajev-serve verify --pin` writes one from a trusted download)")?;
            }
            writeln!(f)
        } else {
            let mut files: Vec<&str> = Vec::new();
            for r in &failed {
                if !files.contains(&r.file.as_str()) {
                    files.push(&r.file);
                }
            }
            writeln!(
                f,
                "verify: REFUSED: {} of {} checks failed: {}",
                failed.len(),
                self.rows.len(),
                files.join(", ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_aligns_and_the_last_line_names_the_failed_files() {
        let mut r = Report::default();
        r.push("sha256", "m/config.json", Status::Ok, "matches the lock");
        r.push(
            "tensors",
            "a/decision_readout.safetensors",
            Status::Failed,
            "weight: shape [255, 64], manifest [256, 64]",
        );
        let text = r.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0].find("FILE"), lines[1].find("m/config.json"));
        assert_eq!(lines[1].find("ok"), lines[2].find("FAIL"));
        assert_eq!(lines[3], "verify: REFUSED: 1 of 2 checks failed: a/decision_readout.safetensors");
        assert!(!r.passed());
    }
}

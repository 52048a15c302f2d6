//! From readout logits to a scored question's outcome: single-pass softmax with imajev's token-id tie
//! break, or the mean of log-softmax over rotations; then optional temperature calibration.
//! All in f64 and in the same operation order as the Python reference, so only the engine's
//! logits can make the two differ.

use super::calibration::Calibration;
use super::prompt::{ScoredKind, ScoredPlan};

/// One scored question's result over its candidates (unknown last).
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Candidate keys, unknown last.
    pub keys: Vec<String>,
    /// Probabilities over all candidates (after calibration when it applied).
    pub scores: Vec<f64>,
    /// Raw readout logits (one pass) or averaged log-probabilities (rotations).
    pub raw_logits: Vec<f64>,
    /// Index of the selected candidate.
    pub selected: usize,
    pub calibration_version: Option<String>,
}

impl Outcome {
    pub fn abstained(&self) -> bool {
        self.selected == self.keys.len() - 1
    }
    pub fn unknown(&self) -> f64 {
        *self.scores.last().expect("candidates")
    }
}

fn softmax(logits: &[f64], temperature: f64) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|v| v / temperature).collect();
    let top = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scaled.iter().map(|v| (v - top).exp()).collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|v| v / total).collect()
}

/// `max(range(n), key=(logit, −tie))`: the first index with the largest (logit, −tie).
fn argmax_by(logits: &[f64], tie: impl Fn(usize) -> i64) -> usize {
    let mut best = 0;
    for i in 1..logits.len() {
        let (a, b) = (logits[i], logits[best]);
        if a > b || (a == b && -tie(i) > -tie(best)) {
            best = i;
        }
    }
    best
}

/// The outcome of a scored question from its passes' readout logits (`per_pass[i]` follows
/// `plan.passes[i]`; each has at least `candidates` values — extra readout rows are ignored).
pub fn combine(plan: &ScoredPlan, per_pass: &[Vec<f32>]) -> Outcome {
    let keys: Vec<String> = plan.question.candidates.iter().map(|c| c.0.clone()).collect();
    let n = keys.len();
    if per_pass.len() == 1 {
        // A single pass keeps the raw logits and breaks exact ties by the lowest vocabulary id.
        let logits: Vec<f64> = per_pass[0][..n].iter().map(|&x| x as f64).collect();
        let top = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = logits.iter().map(|x| (x - top).exp()).collect();
        let sum: f64 = exps.iter().sum();
        let scores = exps.iter().map(|e| e / sum).collect();
        let tokens = &plan.code_tokens;
        let selected = argmax_by(&logits, |i| tokens[i] as i64);
        return Outcome { keys, scores, raw_logits: logits, selected, calibration_version: None };
    }
    let mut totals = vec![0f64; n];
    for (pass, logits) in plan.passes.iter().zip(per_pass) {
        let l: Vec<f64> = logits[..n].iter().map(|&x| x as f64).collect();
        let top = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let norm = top + l.iter().map(|x| (x - top).exp()).sum::<f64>().ln();
        for (p, v) in l.iter().enumerate() {
            totals[(p + pass.offset) % n] += v - norm;
        }
    }
    let k = per_pass.len() as f64;
    let avg: Vec<f64> = totals.iter().map(|t| t / k).collect();
    let top = avg.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = avg.iter().map(|x| (x - top).exp()).collect();
    let sum: f64 = exps.iter().sum();
    let scores = exps.iter().map(|e| e / sum).collect();
    let selected = argmax_by(&avg, |i| i as i64);
    Outcome { keys, scores, raw_logits: avg, selected, calibration_version: None }
}

/// Applies temperature calibration (and, for text-only requests, an unknown-logit offset).
pub fn calibrate(
    o: Outcome,
    kind: ScoredKind,
    cal: &Calibration,
    has_images: bool,
    photo_only: bool,
) -> Outcome {
    let options = o.keys.len() - 1;
    let temperature = cal.temperature(kind, options, photo_only);
    let offset = if has_images { 0.0 } else { cal.unknown_offset(kind, options) };
    let n = o.raw_logits.len();
    let values: Vec<f64> =
        o.raw_logits.iter().enumerate().map(|(i, v)| v + if i == n - 1 { offset } else { 0.0 }).collect();
    let scores = softmax(&values, temperature.unwrap_or(1.0));
    let mut selected = o.selected;
    if offset != 0.0 {
        // The offset can move the argmax: re-derive it (first maximum wins, as Python's max).
        let top = argmax_by(&scores, |i| i as i64);
        if top != selected && scores[top] > scores[selected] {
            selected = top;
        }
    }
    Outcome {
        keys: o.keys,
        scores,
        raw_logits: o.raw_logits,
        selected,
        calibration_version: temperature.map(|_| cal.version.clone()),
    }
}

/// Probabilities over the real answers without the unknown mass (uniform if it is all unknown),
/// and the unknown probability.
pub fn known(o: &Outcome) -> (Vec<f64>, f64) {
    let n = o.scores.len() - 1;
    let total: f64 = o.scores[..n].iter().sum();
    let known = o.scores[..n].iter().map(|v| if total > 0.0 { v / total } else { 1.0 / n as f64 }).collect();
    (known, o.scores[n])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::prompt::{PassPlan, ScoredQuestion, UNKNOWN_KEY};

    fn plan(offsets: &[usize], n: usize) -> ScoredPlan {
        let mut candidates: Vec<(String, String)> =
            (0..n - 1).map(|i| (format!("o{i}"), format!("o{i}"))).collect();
        candidates.push((UNKNOWN_KEY.into(), "unknown".into()));
        ScoredPlan {
            question: ScoredQuestion { kind: ScoredKind::Choice, text: "q".into(), candidates, owner: 0 },
            common: vec![],
            passes: offsets.iter().map(|&o| PassPlan { offset: o, suffix: vec![1] }).collect(),
            code_tokens: (0..n as u32).map(|i| 100 - i).collect(),
        }
    }

    #[test]
    fn rotation_average_undoes_the_rotation() {
        // Logits that prefer position 0 in every pass cancel out; a candidate preference survives.
        let p = plan(&[0, 1, 2], 3);
        let cand = [2.0f32, 0.0, 0.0];
        let passes: Vec<Vec<f32>> = p
            .passes
            .iter()
            .map(|pp| {
                (0..3).map(|pos| cand[(pos + pp.offset) % 3] + if pos == 0 { 1.0 } else { 0.0 }).collect()
            })
            .collect();
        let o = combine(&p, &passes);
        assert_eq!(o.selected, 0);
        assert!((o.scores[1] - o.scores[2]).abs() < 1e-12);
    }

    #[test]
    fn single_pass_ties_go_to_the_lowest_token_id() {
        let p = plan(&[0], 3);
        let o = combine(&p, &[vec![1.0, 1.0, 0.0]]);
        // code tokens are 100, 99, 98: the second candidate has the lower id.
        assert_eq!(o.selected, 1);
        let p = plan(&[0, 1, 2], 3);
        let o = combine(&p, &[vec![1.0, 1.0, 1.0], vec![1.0, 1.0, 1.0], vec![1.0, 1.0, 1.0]]);
        assert_eq!(o.selected, 0);
    }
}

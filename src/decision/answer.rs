//! Answers in the public shapes: imajev's (noul = P(true) + ½·P(unknown); choice/score over the
//! real options; confidence = concentration × (1 − unknown); `unknown_probability`, `abstained`,
//! `calibration_version`) or TypeSafe's (the same numbers with imajev's extra fields prefixed
//! `x_`, and TypeSafe's confidence formulas). [`tallies`] says what each answer counts for in the
//! metrics (type, abstained, unknown probabilities), from the same outcomes.

use super::outcome::{known, Outcome};
use super::prompt::ScoredQuestion;
use super::request::{ContractMode, DecisionRequest, QuestionKind};
use serde_json::{json, Map, Value};

/// imajev's confidence: `max(0, (n·p_max − 1)/(n − 1))`, 1 when n < 2.
pub fn concentration(p: &[f64]) -> f64 {
    let n = p.len();
    if n < 2 {
        return 1.0;
    }
    let max = p.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    ((n as f64 * max - 1.0) / (n as f64 - 1.0)).max(0.0)
}

/// TypeSafe's choice confidence `(max − 1/n)/(1 − 1/n)`.
pub fn typesafe_choice_confidence(p: &[f64]) -> f64 {
    let n = p.len() as f64;
    if p.len() <= 1 {
        return 1.0;
    }
    let max = p.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    (max - 1.0 / n) / (1.0 - 1.0 / n)
}

/// TypeSafe's score confidence `max(0, 1 − Σ pᵢ·|i − k| / D)`, k the (first) mode,
/// `D = (1/n)·Σ|i − (n−1)/2|`.
pub fn typesafe_score_confidence(p: &[f64]) -> f64 {
    let n = p.len();
    if n <= 1 {
        return 1.0;
    }
    let mut k = 0;
    for i in 1..n {
        if p[i] > p[k] {
            k = i;
        }
    }
    let spread: f64 = p.iter().enumerate().map(|(i, v)| v * (i as f64 - k as f64).abs()).sum();
    let d: f64 = (0..n).map(|i| (i as f64 - (n as f64 - 1.0) / 2.0).abs()).sum::<f64>() / n as f64;
    (1.0 - spread / d).max(0.0)
}

fn first_max(p: &[f64]) -> usize {
    let mut k = 0;
    for i in 1..p.len() {
        if p[i] > p[k] {
            k = i;
        }
    }
    k
}

struct Extras {
    mode: ContractMode,
}

impl Extras {
    fn name(&self, base: &str) -> String {
        match self.mode {
            ContractMode::Imajev => base.to_string(),
            ContractMode::Typesafe => format!("x_{base}"),
        }
    }

    fn common(&self, m: &mut Map<String, Value>, o: &Outcome, unknown: f64) {
        m.insert(self.name("unknown_probability"), json!(unknown));
        m.insert(self.name("abstained"), json!(o.abstained()));
        if let Some(v) = &o.calibration_version {
            m.insert(self.name("calibration_version"), json!(v));
        }
    }
}

/// What one answered question counts for in the metrics: its type, whether it abstained (a
/// multi: every label abstained, as its answer says) and the unknown probability of each scored
/// question behind it (one; a multi has one per label).
#[derive(Debug, Clone, PartialEq)]
pub struct Tally {
    pub kind: &'static str,
    pub abstained: bool,
    pub unknowns: Vec<f64>,
}

/// One [`Tally`] per question of `req`, in request order, from the outcomes the answers are
/// built from.
pub fn tallies(req: &DecisionRequest, outcomes: &[Outcome]) -> Vec<Tally> {
    let mut next = 0; // index into outcomes
    req.questions
        .iter()
        .map(|q| {
            let scored = match &q.kind {
                QuestionKind::Multi { labels, .. } => labels.len(),
                _ => 1,
            };
            let own = &outcomes[next..next + scored];
            next += scored;
            Tally {
                kind: q.kind.type_name(),
                abstained: own.iter().all(Outcome::abstained),
                unknowns: own.iter().map(Outcome::unknown).collect(),
            }
        })
        .collect()
}

/// The `answers` object: one entry per question, in request order.
pub fn answers(
    req: &DecisionRequest,
    scored: &[ScoredQuestion],
    outcomes: &[Outcome],
    mode: ContractMode,
) -> Map<String, Value> {
    let ex = Extras { mode };
    let mut out = Map::new();
    let mut next = 0; // index into scored/outcomes
    for (qi, q) in req.questions.iter().enumerate() {
        let mut a = Map::new();
        match &q.kind {
            QuestionKind::Noul { .. } => {
                let o = &outcomes[next];
                next += 1;
                let unknown = o.unknown();
                a.insert("type".into(), json!("noul"));
                a.insert("noul".into(), json!(o.scores[0] + 0.5 * unknown));
                ex.common(&mut a, o, unknown);
            }
            QuestionKind::Choice { options, .. } => {
                let o = &outcomes[next];
                next += 1;
                let (p, unknown) = known(o);
                let selected = if o.abstained() { first_max(&p) } else { o.selected };
                let confidence = match mode {
                    ContractMode::Imajev => concentration(&p) * (1.0 - unknown),
                    ContractMode::Typesafe => typesafe_choice_confidence(&p),
                };
                let probs: Map<String, Value> =
                    options.iter().zip(&p).map(|((v, _), x)| (v.clone(), json!(x))).collect();
                a.insert("type".into(), json!("choice"));
                a.insert("choice".into(), json!(options[selected].0));
                a.insert("probabilities".into(), Value::Object(probs));
                a.insert("confidence".into(), json!(confidence));
                ex.common(&mut a, o, unknown);
            }
            QuestionKind::Score { levels, .. } => {
                let o = &outcomes[next];
                next += 1;
                let (p, unknown) = known(o);
                let score: f64 = p.iter().enumerate().map(|(i, v)| i as f64 * v).sum();
                let confidence = match mode {
                    ContractMode::Imajev => concentration(&p) * (1.0 - unknown),
                    ContractMode::Typesafe => typesafe_score_confidence(&p),
                };
                let legend: Map<String, Value> =
                    levels.iter().enumerate().map(|(i, d)| (i.to_string(), json!(d))).collect();
                let probs: Map<String, Value> =
                    p.iter().enumerate().map(|(i, x)| (i.to_string(), json!(x))).collect();
                a.insert("type".into(), json!("score"));
                a.insert("score".into(), json!(score));
                a.insert("legend".into(), Value::Object(legend));
                a.insert("probabilities".into(), Value::Object(probs));
                a.insert("confidence".into(), json!(confidence));
                ex.common(&mut a, o, unknown);
            }
            QuestionKind::Multi { labels, threshold, .. } => {
                let mut probs = Map::new();
                let mut unknowns = Map::new();
                let mut selected = Vec::new();
                let mut all_abstained = true;
                for (label, _) in labels {
                    let o = &outcomes[next];
                    debug_assert_eq!(scored[next].owner, qi);
                    next += 1;
                    let unknown = o.unknown();
                    let p = o.scores[0] + 0.5 * unknown;
                    if p > threshold + 1e-9 {
                        selected.push(json!(label));
                    }
                    probs.insert(label.clone(), json!(p));
                    unknowns.insert(label.clone(), json!(unknown));
                    all_abstained &= o.abstained();
                }
                a.insert("type".into(), json!("multi"));
                a.insert("labels".into(), Value::Array(selected));
                a.insert("probabilities".into(), Value::Object(probs));
                a.insert("threshold".into(), json!(threshold));
                a.insert(ex.name("unknown_probabilities"), Value::Object(unknowns));
                a.insert(ex.name("abstained"), json!(all_abstained));
            }
        }
        out.insert(q.id.clone(), Value::Object(a));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidence_formulas_match_the_docs() {
        // TypeSafe docs: {0.88, 0.12, 0.0} → 0.82; score {0, .95, .05} → 0.925.
        assert!((typesafe_choice_confidence(&[0.88, 0.12, 0.0]) - 0.82).abs() < 1e-12);
        assert!((typesafe_score_confidence(&[0.0, 0.95, 0.05]) - 0.925).abs() < 1e-12);
        assert_eq!(concentration(&[0.5, 0.5]), 0.0);
        assert_eq!(concentration(&[1.0, 0.0, 0.0]), 1.0);
        assert!((concentration(&[0.6, 0.3, 0.1]) - 0.4).abs() < 1e-12);
    }

    fn outcome(scores: &[f64], selected: usize) -> Outcome {
        Outcome {
            keys: (0..scores.len()).map(|i| i.to_string()).collect(),
            scores: scores.to_vec(),
            raw_logits: scores.to_vec(),
            selected,
            calibration_version: None,
        }
    }

    #[test]
    fn tallies_follow_the_questions_and_fold_multi_labels() {
        let q = |id: &str, kind: QuestionKind| super::super::Question { id: id.into(), kind };
        let multi = QuestionKind::Multi {
            instructions: "tags".into(),
            labels: vec![("a".into(), None), ("b".into(), None)],
            threshold: 0.5,
        };
        let req = DecisionRequest {
            state: json!("s"),
            questions: vec![
                q("n", QuestionKind::Noul { question: "?".into(), yes: None, no: None }),
                q("m", multi.clone()),
                q("m2", multi),
            ],
            images: vec![],
        };
        let outcomes = [
            outcome(&[0.1, 0.2, 0.7], 2), // noul: unknown selected
            outcome(&[0.6, 0.3, 0.1], 0), // multi m, label a answered
            outcome(&[0.2, 0.2, 0.6], 2), // multi m, label b abstained
            outcome(&[0.1, 0.1, 0.8], 2), // multi m2: both labels abstained
            outcome(&[0.1, 0.2, 0.7], 2),
        ];
        let t = tallies(&req, &outcomes);
        let summary: Vec<(&str, bool, Vec<f64>)> =
            t.into_iter().map(|t| (t.kind, t.abstained, t.unknowns)).collect();
        assert_eq!(
            summary,
            vec![
                ("noul", true, vec![0.7]),
                ("multi", false, vec![0.1, 0.6]),
                ("multi", true, vec![0.8, 0.7])
            ]
        );
        // The same folding as the answers' `abstained`.
        let scored: Vec<ScoredQuestion> = [0, 1, 1, 2, 2]
            .into_iter()
            .map(|owner| ScoredQuestion {
                kind: super::super::prompt::ScoredKind::Boolean,
                text: "q".into(),
                candidates: vec![],
                owner,
            })
            .collect();
        let answers = answers(&req, &scored, &outcomes, ContractMode::Imajev);
        assert_eq!(answers["m"]["abstained"], false);
        assert_eq!(answers["m2"]["abstained"], true);
    }
}

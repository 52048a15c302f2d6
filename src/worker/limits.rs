//! What fits one packed forward: the budget of a forward (`--batch-tokens`, `--batch-sequences`)
//! and the size of a request's tree in it, from the request's plan alone. The engine thread packs
//! requests by these numbers; the engine lays the trees out the same way.

use crate::decision::Plan;

/// How a question's rotations are laid out in a request's one-forward tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum QuestionTree {
    /// Every pass continues the prefix with the question's shared tokens and its own (one level).
    #[default]
    OneLevel,
    /// The question's shared tokens continue the prefix once, and the passes continue them (two
    /// levels: fewer tokens; the mixers run as two calls per layer).
    TwoLevel,
}

/// How passes and requests are grouped into packed forwards.
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Most tokens in one packed forward (all packed requests' trees together).
    pub max_tokens: usize,
    /// Most sequences (segments) in one packed forward. 96 by default: at 12 sequences a
    /// benchmark request, rounds of ~8 requests instead of ~5 under 16 clients, more even (H200:
    /// 61.6 against 59.5 requests/s, p99 296 against 338 ms, `bench/results/h200-budgets-6c89114.json`).
    pub max_sequences: usize,
    /// For a request that runs alone: prefill each question's shared tokens once only when that
    /// saves at least this many tokens overall; below it the extra forward (a fixed cost of
    /// launches on a GPU) costs more than recomputing those tokens in every pass. With
    /// [`QuestionTree::OneLevel`], a request above it also runs alone.
    pub min_shared_tokens: usize,
    /// Inside one forward: one level, or the question's shared tokens as a second.
    pub question_tree: QuestionTree,
    /// A request over the budget with at most this many tokens in its whole tree still runs as one
    /// forward, alone ([`BatchLimits::alone_in_one_forward`]): its passes ride along with its
    /// prefix instead of a second forward over the prefix's state (0: never).
    pub alone_forward_tokens: usize,
    /// Whether the engine thread queues the next packed round while the device still runs the
    /// current one (on engines that launch ahead: the GPU), instead of reading out and answering
    /// first. The same answers; the device no longer idles between rounds. On by default: +1.1% at
    /// 16 clients and +1.7% at 64 on the H100, 1 client unchanged
    /// (`bench/results/h100-budgets-overlap-d9add75.json`).
    pub overlap_rounds: bool,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            max_tokens: 8192,
            max_sequences: 96,
            min_shared_tokens: 1024,
            question_tree: QuestionTree::OneLevel,
            alone_forward_tokens: 0,
            overlap_rounds: true,
        }
    }
}

/// What a request's tree takes in a packed forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TreeSize {
    pub tokens: usize,
    pub sequences: usize,
}

impl std::ops::Add for TreeSize {
    type Output = TreeSize;
    fn add(self, o: TreeSize) -> TreeSize {
        TreeSize { tokens: self.tokens + o.tokens, sequences: self.sequences + o.sequences }
    }
}

impl BatchLimits {
    /// The size of `plan`'s tree in one forward, or `None` when the request runs alone (its tree
    /// is over the limits by itself, it has no passes, or — one level — sharing its questions'
    /// tokens in separate forwards saves enough).
    pub fn one_forward(&self, plan: &Plan) -> Option<TreeSize> {
        self.tree_size(plan).filter(|&size| self.admits(TreeSize::default(), size))
    }

    /// Whether a request that runs alone (not [`BatchLimits::one_forward`]) still runs its prefix
    /// and passes as one forward: its tree is at most [`BatchLimits::alone_forward_tokens`] tokens,
    /// and everything past the prefix fits the budget of one forward as a batch of its passes
    /// would (so the forward holds no more than its prefix's forward and a pass batch together).
    /// Otherwise the prefix runs first and the passes continue it in batches.
    pub fn alone_in_one_forward(&self, plan: &Plan) -> bool {
        self.tree_size(plan).is_some_and(|size| {
            size.tokens <= self.alone_forward_tokens
                && size.tokens - plan.prefix_tokens <= self.max_tokens
                && size.sequences <= self.max_sequences
        })
    }

    /// The size of `plan`'s tree whatever the budget; `None` when it has no passes or (one
    /// level) sharing its questions' tokens in separate forwards saves enough.
    fn tree_size(&self, plan: &Plan) -> Option<TreeSize> {
        let passes = plan.pass_count();
        if passes == 0 {
            return None;
        }
        Some(match self.question_tree {
            QuestionTree::OneLevel => {
                let saved: usize =
                    plan.scored.iter().map(|q| q.common.len() * q.passes.len().saturating_sub(1)).sum();
                if saved >= self.min_shared_tokens {
                    return None;
                }
                let tokens: usize = plan
                    .scored
                    .iter()
                    .map(|q| q.passes.iter().map(|p| q.common.len() + p.suffix.len()).sum::<usize>())
                    .sum();
                TreeSize { tokens: plan.prefix_tokens + tokens, sequences: 1 + passes }
            }
            QuestionTree::TwoLevel => {
                let commons = plan.scored.iter().filter(|q| !q.common.is_empty()).count();
                TreeSize { tokens: plan.processed_tokens, sequences: 1 + commons + passes }
            }
        })
    }

    /// Whether a tree of size `next` fits a forward that already holds `used`.
    pub fn admits(&self, used: TreeSize, next: TreeSize) -> bool {
        let all = used + next;
        all.tokens <= self.max_tokens && all.sequences <= self.max_sequences
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::prompt::{PassPlan, ScoredKind, ScoredPlan, ScoredQuestion};

    /// A 100-token prefix and two questions: 4 passes sharing 20 tokens (suffixes of 5), and one
    /// pass without shared tokens (suffix 7).
    fn plan() -> Plan {
        let q = ScoredQuestion { kind: ScoredKind::Choice, text: "q".into(), candidates: vec![], owner: 0 };
        let scored = |common: usize, passes: usize, suffix: usize| ScoredPlan {
            question: q.clone(),
            common: vec![1; common],
            passes: (0..passes).map(|p| PassPlan { offset: p, suffix: vec![2; suffix] }).collect(),
            code_tokens: vec![],
        };
        Plan {
            prefix: vec![0; 100],
            scored: vec![scored(20, 4, 5), scored(0, 1, 7)],
            prefix_tokens: 100,
            max_pass_tokens: 125,
            processed_tokens: 100 + 20 + 4 * 5 + 7,
        }
    }

    #[test]
    fn tree_sizes_follow_the_question_tree() {
        let one = BatchLimits::default();
        assert_eq!(one.one_forward(&plan()), Some(TreeSize { tokens: 100 + 4 * 25 + 7, sequences: 6 }));
        let two = BatchLimits { question_tree: QuestionTree::TwoLevel, ..one };
        assert_eq!(two.one_forward(&plan()), Some(TreeSize { tokens: 147, sequences: 7 }));
        // One level: sharing 60 tokens in a separate forward beats repeating them when that is
        // at least min_shared_tokens; the request then runs alone. Two levels share them inside.
        assert_eq!(BatchLimits { min_shared_tokens: 60, ..one }.one_forward(&plan()), None);
        assert!(BatchLimits { min_shared_tokens: 60, ..two }.one_forward(&plan()).is_some());
    }

    #[test]
    fn the_budget_bounds_tokens_and_sequences() {
        let l = BatchLimits { max_tokens: 414, max_sequences: 12, ..Default::default() };
        let size = l.one_forward(&plan()).unwrap();
        assert_eq!(size, TreeSize { tokens: 207, sequences: 6 });
        assert!(l.admits(size, size), "two fit exactly");
        assert!(!l.admits(size + size, size), "a third does not");
        assert!(!BatchLimits { max_tokens: 413, ..l }.admits(size, size), "one token over");
        assert!(!BatchLimits { max_sequences: 11, ..l }.admits(size, size), "one sequence over");
        assert_eq!(BatchLimits { max_tokens: 206, ..l }.one_forward(&plan()), None, "alone over the budget");
        let mut empty = plan();
        empty.scored.clear();
        assert_eq!(l.one_forward(&empty), None, "no passes: nothing to pack");
    }

    #[test]
    fn a_request_alone_runs_as_one_forward_only_within_its_bounds() {
        // plan(): 207 tokens, 100 of them the prefix, 6 sequences; one level.
        let alone = BatchLimits {
            max_tokens: 107,
            max_sequences: 6,
            alone_forward_tokens: 207,
            ..Default::default()
        };
        assert_eq!(alone.one_forward(&plan()), None, "over the budget: it runs alone");
        assert!(alone.alone_in_one_forward(&plan()));
        assert!(
            !BatchLimits { alone_forward_tokens: 206, ..alone }.alone_in_one_forward(&plan()),
            "tree too long"
        );
        assert!(!BatchLimits { alone_forward_tokens: 0, ..alone }.alone_in_one_forward(&plan()), "off");
        assert!(
            !BatchLimits { max_tokens: 106, ..alone }.alone_in_one_forward(&plan()),
            "passes over a batch"
        );
        assert!(
            !BatchLimits { max_sequences: 5, ..alone }.alone_in_one_forward(&plan()),
            "too many sequences"
        );
        // Sharing the questions' tokens apart saves enough: prefix first, as before.
        assert!(!BatchLimits { min_shared_tokens: 60, ..alone }.alone_in_one_forward(&plan()));
        // Two levels: the shared tokens are part of the tree (147 tokens, 47 past the prefix).
        let two = BatchLimits {
            question_tree: QuestionTree::TwoLevel,
            max_tokens: 47,
            max_sequences: 7,
            alone_forward_tokens: 147,
            ..Default::default()
        };
        assert!(two.alone_in_one_forward(&plan()));
        assert!(!BatchLimits { max_tokens: 46, ..two }.alone_in_one_forward(&plan()));
    }
}

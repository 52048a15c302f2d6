//! A round of the engine thread — the jobs of one packed forward, or a job that runs alone — as
//! something launched and later finished, so that the thread can prepare and queue the next round
//! while the device still runs this one ([`DecisionEngine::launch_round`]).
//!
//! What a round holds is opaque here: results already known when it was launched (jobs stopped
//! before their forward, jobs that ran alone, engines that run everything at once) and the
//! engine's own handle on what it queued, which only that engine can finish. This layer knows
//! nothing of devices or models.
//!
//! [`DecisionEngine::launch_round`]: super::DecisionEngine::launch_round

use super::{EngineOutput, RunError};
use std::any::Any;

/// One result per job of a round, in the order of its jobs.
pub type RoundResults = Vec<Result<EngineOutput, RunError>>;

/// A launched round whose results are not all collected yet.
pub struct Round {
    /// Per job: its result when known at launch, `None` while its forward is in flight.
    results: Vec<Option<Result<EngineOutput, RunError>>>,
    /// The engine's handle on the forward it queued (`None`: nothing in flight).
    pending: Option<Box<dyn Any>>,
}

impl Round {
    /// A round whose results are all in.
    pub fn done(results: RoundResults) -> Round {
        Round { results: results.into_iter().map(Some).collect(), pending: None }
    }

    /// A round of `results` (`None` for the jobs of the forward `pending` stands for).
    pub fn launched(
        results: Vec<Option<Result<EngineOutput, RunError>>>,
        pending: Option<Box<dyn Any>>,
    ) -> Round {
        Round { results, pending }
    }

    /// The engine's handle, for the engine that launched it.
    pub fn pending(&self) -> Option<&dyn Any> {
        self.pending.as_deref()
    }

    /// The results, those in flight filled in by `finish` from the engine's handle (it fills
    /// the jobs of its forward; any job left without a result gets an engine error).
    pub fn finish(
        self,
        finish: impl FnOnce(Box<dyn Any>, &mut [Option<Result<EngineOutput, RunError>>]),
    ) -> RoundResults {
        let Round { mut results, pending } = self;
        if let Some(p) = pending {
            finish(p, &mut results);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(RunError::Engine(anyhow::anyhow!("the round ended without this job's result")))
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(tag: f32) -> Result<EngineOutput, RunError> {
        Ok(EngineOutput { logits: vec![vec![vec![tag]]], ..Default::default() })
    }

    fn tags(r: RoundResults) -> Vec<Option<f32>> {
        r.into_iter().map(|r| r.ok().map(|o| o.logits[0][0][0])).collect()
    }

    #[test]
    fn a_finished_round_keeps_its_results_in_order() {
        let round = Round::done(vec![out(1.0), out(2.0)]);
        assert!(round.pending().is_none());
        assert_eq!(tags(round.finish(|_, _| panic!("nothing in flight"))), vec![Some(1.0), Some(2.0)]);
    }

    #[test]
    fn the_engine_fills_its_jobs_and_a_forgotten_job_is_an_error_not_a_loss() {
        let round = Round::launched(vec![None, Some(out(2.0)), None], Some(Box::new(7u32)));
        assert_eq!(round.pending().and_then(|p| p.downcast_ref::<u32>()), Some(&7));
        let results = round.finish(|p, slots| {
            assert_eq!(*p.downcast::<u32>().unwrap(), 7);
            slots[0] = Some(out(1.0));
        });
        assert!(matches!(results[2], Err(RunError::Engine(_))));
        assert_eq!(tags(results), vec![Some(1.0), Some(2.0), None]);
    }
}

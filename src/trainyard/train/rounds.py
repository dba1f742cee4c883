"""When the ranks act on a step's votes: at once over the world, or under DiLoCo at the round's outer sync.

The loop asks one object the same questions every step; `EveryStep` and `SiteRounds` answer them. Without DiLoCo
a step's votes span the world and are acted on before it trains. Under DiLoCo they span the site, so an inner step
never waits for another site: a site skips its own non-finite step, a site whose stream ended idles, and the stops
(preemption, ended data, timed save) are agreed right after the outer sync."""

from __future__ import annotations

import enum
from typing import Any

from trainyard.train import events
from trainyard.train import state as loop_state
from trainyard.train import votes as agreement
from trainyard.train.job import Job
from trainyard.train.state import LoopState
from trainyard.train.votes import StepVotes


class Action(enum.Enum):
    TRAIN = "train"
    IDLE = "idle"  # a DiLoCo site whose stream ended waits for the round's sync
    STOP = "stop"


def for_job(job: Job) -> EveryStep | SiteRounds:
    return EveryStep(job) if job.outer is None else SiteRounds(job)


class EveryStep:
    """The world's votes, acted on at every step."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def before_training(self, state: LoopState, votes: StepVotes, position: dict[str, Any]) -> Action:
        """The async save settled, a preemption saved and raised, STOP where the data ended. The window drawn for a
        step that does not train is put back."""
        job = self.job
        job.saves.settle(
            written_everywhere=votes.save_written == job.info.world_size, failed_somewhere=votes.save_failed > 0
        )
        if votes.preempted or votes.data_ended:
            job.sampler.load_state_dict(position)
        if votes.preempted:
            loop_state.stop_for_preemption(job, state)
        if votes.data_ended:
            _emit_data_exhausted(job, state)
            return Action.STOP
        return Action.TRAIN

    def goes_on_untrained(self) -> bool:
        """A skipped step ends here: every rank skipped it."""
        return False

    def tokens(self, votes: StepVotes, trained: bool) -> int:
        return int(votes.real_tokens) if trained else 0

    def close_step(self, step: int, state: LoopState, votes: StepVotes) -> tuple[int, StepVotes]:
        """The step the loop goes on from, and the world's votes: already agreed."""
        return step, votes

    def weights_agree(self, step: int) -> bool:
        return True

    def stops(self, state: LoopState, agreed: StepVotes | None) -> bool:
        return False  # acted on before training


class SiteRounds:
    """DiLoCo: a site's votes tallied over the round, agreed across sites at the outer sync."""

    def __init__(self, job: Job) -> None:
        assert job.outer is not None
        self.job, self.outer = job, job.outer
        self.tally = agreement.RoundTally()

    def before_training(self, state: LoopState, votes: StepVotes, position: dict[str, Any]) -> Action:
        self.tally.stops = self.tally.stops.plus(votes)
        if self.tally.stops.data_ended > 0:
            self.job.sampler.load_state_dict(position)  # this site's stream ended: it waits for the round's sync
            return Action.IDLE
        return Action.TRAIN

    def goes_on_untrained(self) -> bool:
        """A skipped or idle step still counts: the schedule follows the step count, the same on every site."""
        self.job.scheduler.step()
        return True

    def tokens(self, votes: StepVotes, trained: bool) -> int:
        """An estimate (this site's times the sites) until the sync makes it exact."""
        if not trained:
            return 0
        self.tally.trained_tokens += votes.real_tokens
        return int(votes.real_tokens * self.outer.sites)

    def close_step(self, step: int, state: LoopState, votes: StepVotes) -> tuple[int, StepVotes | None]:
        """At a due step, the outer sync, a heal, and the round's votes agreed across sites (None between syncs)."""
        job = self.job
        if not self.outer.due(step):
            return step, None
        job.sink.emit("system", step=step, event="outer_sync",
                      **(self.outer.sync() if job.across is None else job.across.sync(step)))
        step = self._take_heal(state, step)
        agreed = agreement.agree_at_sync(job, self.tally, votes)
        state.tokens += int(agreed.real_tokens - self.outer.sites * self.tally.trained_tokens)
        self.tally = agreement.RoundTally()
        return step, agreed

    def weights_agree(self, step: int) -> bool:
        return self.outer.due(step)  # sites differ until the round's sync

    def stops(self, state: LoopState, agreed: StepVotes | None) -> bool:
        """A preemption or an ended stream on any site, agreed at the sync, stops every site after it (the preemption
        saves and raises); True where the data ended."""
        if agreed is None:
            return False
        if agreed.preempted:
            loop_state.stop_for_preemption(self.job, state)
        if agreed.data_ended:
            _emit_data_exhausted(self.job, state)
        return agreed.data_ended > 0

    def _take_heal(self, state: LoopState, step: int) -> int:
        """Fault-tolerant DiLoCo: a site that healed from a live peer at a sync took its weights, outer and inner
        optimizer state there; here it takes the peer's step, data position (global, so right for every site),
        schedule and random streams, so it trains on as the peer would. The step the loop goes on from."""
        job = self.job
        healed = job.across.healed if job.across is not None else None
        if healed is None:
            return step
        job.sampler.load_state_dict(healed["sampler"])
        job.scheduler.load_state_dict(healed["scheduler"])
        loop_state.set_rng_state(healed["rng"])
        for group, lr in zip(job.optimizer.param_groups, job.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        job.sink.emit("system", step=healed["step"], event="healed", from_step=step,
                      outer_start_norm=job.across.start_norm(), inner_fingerprint=job.across.inner_fingerprint())
        state.step = healed["step"]
        return state.step


def _emit_data_exhausted(job: Job, state: LoopState) -> None:
    job.sink.emit("system", step=state.step, event="data_exhausted", tokens_per_source=events.per_source(job))

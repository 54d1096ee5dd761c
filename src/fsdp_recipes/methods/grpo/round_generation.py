"""Where a round's completions come from (`RoundGeneration.generate`): the policy itself (transformers' engines, its
FSDP2 weights gathered for the pass), or a vLLM server that first gets the policy's weights when they changed
(`train.weight_sync`); with `async_generation`, the server writes the next round while this one trains.

Asynchronous rounds: once round r's completions are in (every rank's: the weight push that follows is a collective,
so no rank's requests are still on the server when it loads), the server gets the current weights if the round to
come would otherwise be sampled by a policy more than `max_staleness` steps older than the one that trains on it, and
round r+1 is sent in a background thread; round r then trains. A failure in the background (the server gone) is
raised at round r+1, on every rank. A checkpoint stores each rank's pending round (`state_dict`), so a resumed run
trains on the completions the stopped one had drawn (exact with `max_staleness` 1)."""

from __future__ import annotations

import concurrent.futures
import threading

from fsdp_recipes.methods.grpo import rollouts
from fsdp_recipes.methods.grpo.tools import Rollout
from fsdp_recipes.train import generation, weight_sync


class RoundGeneration:
    def __init__(self, run, config, task, model, settings: generation.GenerationSettings, *, schedule, total_rounds):
        self.run, self.config, self.task, self.settings = run, config, task, settings
        self.schedule, self.total_rounds = schedule, total_rounds
        self.world, self.rank = run.parallel.data_parallel_size, run.data_parallel_rank
        self.server = run.generation_server
        self.weights = weight_sync.ServerWeights.for_run(run, config)  # None: the policy generates itself
        self.pending: dict | None = None  # the next round, asked for ahead: {"round", "slots", "future"}
        self.restored: dict | None = None  # a checkpoint's pending round, until its round comes
        self.set_up_for_pictures = False
        if config.async_generation:
            schedule.ahead_state = self.state_dict
            self.load_state_dict(dict(schedule.restored_ahead))

    def describe(self, model) -> str:
        backend = generation.describe_backend(self.config.generation_backend)
        if self.server is not None:
            return f"{backend}: {self.server.info.describe()}; {self.config.describe_sampler_correction()}"
        gathered = generation.describe_gathering(model, enabled=self.config.gather_weights_for_generation)
        return f"{backend}; {gathered}"

    def generate(self, model, step: int, round_index: int, attempt: int, slots, watch) -> Rollout:
        """Collective. The completions of this rank's `slots` for `round_index` (`attempt`: dynamic sampling's pass);
        the weight pushes timed as `watch`'s phase weight_sync."""
        task, settings, run = self.task, self.settings, self.run
        if self.server is None:
            pictures = task.data.images is not None  # encoded outside the model's forward: whole weights needed
            if pictures and not self.set_up_for_pictures:
                generation.set_up_for_pictures(model, run.tokenizer.pad_token_id)
                self.set_up_for_pictures = True
            gathered = generation.weights_gathered(
                model,
                enabled=self.config.gather_weights_for_generation or pictures,
                reshard_after_forward=generation.reshard_after_forward(run.accelerator),
            )
            with gathered:
                return task.generate(
                    model, run.tokenizer, slots, round_index, attempt, settings, synced_gpus=self.world > 1,
                    most_pending=run.most_over_ranks,
                )  # fmt: skip
        main = run.accelerator.is_main_process
        with weight_sync.resumable_when_the_server_fails(self.config.output_dir, main_process=main):
            ahead = self._take_ahead(round_index, attempt, slots)
            if ahead is not None:
                rolled = run.on_every_rank(ahead)
            else:
                with watch.phase("weight_sync"):
                    self.weights.push(model, version=step - 1)
                rolled = run.on_every_rank(lambda: self._ask(model, round_index, attempt, slots))
            if self.config.async_generation and attempt == 0 and round_index + 1 < self.total_rounds:
                if self.weights.version is None or step - self.weights.version > self.config.max_staleness:
                    with watch.phase("weight_sync"):  # the next round trains at step + 1: staleness 1
                        self.weights.push(model, version=step - 1)
                self._ask_ahead(model, round_index + 1)
        return rolled

    def _ask(self, model, round_index: int, attempt: int, slots) -> Rollout:
        """No collective: vLLM serves each rank's requests on their own."""
        return self.task.generate(
            model, self.run.tokenizer, slots, round_index, attempt, self.settings, synced_gpus=False,
            most_pending=lambda count: count,
        )  # fmt: skip

    def _ask_ahead(self, model, round_index: int) -> None:
        indices = self.schedule.upcoming_round(round_index)
        slots = rollouts.rank_slots(indices, self.config.num_generations, rank=self.rank, world_size=self.world)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            try:
                future.set_result(self._ask(model, round_index, 0, slots))
            except BaseException as error:  # noqa: BLE001 - raised where the round is taken, on every rank
                future.set_exception(error)

        threading.Thread(target=work, name=f"vllm-round-{round_index}", daemon=True).start()
        self.pending = {"round": round_index, "slots": slots, "future": future}

    def _take_ahead(self, round_index: int, attempt: int, slots):
        """A callable returning the round asked for ahead (or restored from a checkpoint), None when there is none."""
        if attempt:
            return None
        for kept, restored in ((self.pending, False), (self.restored, True)):
            if kept is not None and kept["round"] == round_index:
                if kept["slots"] != [tuple(slot) for slot in slots]:
                    raise RuntimeError(f"round {round_index} was asked for with other slots than it trains on")
                if restored:
                    self.restored = None
                    return lambda: Rollout(**kept["rollout"])
                self.pending = None
                return kept["future"].result
        return None

    def state_dict(self) -> dict:
        """The pending round's completions (waited for), for a checkpoint; empty when there is none, or it failed
        (the failure is raised when its round comes)."""
        if self.pending is None:
            return {}
        try:
            rolled = self.pending["future"].result()
        except Exception:  # noqa: BLE001 - raised again where the round is taken
            return {}
        fields = ("completion_ids", "truncated", "policy_masks", "conversations", "tool_calls", "sampling_log_probs")
        return {
            "round": self.pending["round"],
            "slots": [list(slot) for slot in self.pending["slots"]],
            "rollout": {name: getattr(rolled, name) for name in fields},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("round") is not None:
            state["slots"] = [tuple(slot) for slot in state["slots"]]
            self.restored = state

    def close(self) -> dict:
        """The weight pushes' count and seconds, for the summary; the pushed folder removed."""
        return self.weights.close() if self.weights is not None else {}

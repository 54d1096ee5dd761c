"""An example environment for GRPO's tool-using rollouts (`environment_factory: demo/environments/reversal.py:Reversal`
with the string-reversal prompts, demo/assets/reverse_prompts): one instance per completion. `reset` receives the data
row; the public method `reverse` is the tool the model may call; `get_reward` scores the rollout, here 1.0 when the
model had the tool reverse the very string its answer must be the reversal of."""

from __future__ import annotations


class Reversal:
    def reset(self, prompt, answer: str, **row) -> str | None:
        """Starts a rollout; a returned string would be appended to the prompt's last turn (none here)."""
        self.answer, self.reversed = answer, None
        return None

    def reverse(self, text: str) -> str:
        """Reverses a string.

        Args:
            text: the string to reverse
        """
        self.reversed = text[::-1]
        return self.reversed

    def get_reward(self) -> float:
        return float(self.reversed == self.answer)

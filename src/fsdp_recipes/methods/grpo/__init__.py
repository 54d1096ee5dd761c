"""Online RL (recipes/grpo.py): prompts, rollouts, reward functions, advantages and the clipped policy objective."""

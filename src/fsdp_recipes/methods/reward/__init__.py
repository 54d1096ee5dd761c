"""Reward models (recipes/reward.py): a one-output sequence classifier trained on preference pairs (Bradley-Terry)."""

"""Preference tuning (recipes/dpo.py, recipes/kto.py): paired and unpaired preference data, the DPO loss family
(SimPO, ORPO, ...), KTO's loss, and the frozen reference's log-probabilities."""

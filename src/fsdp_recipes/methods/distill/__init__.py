"""Knowledge distillation (recipes/distill.py): a student trained on a frozen teacher's token distributions."""

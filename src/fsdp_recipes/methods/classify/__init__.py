"""Sequence classification (recipes/classify.py; eval.py scores classifiers): labelled text, the head and its loss."""

"""One package per training method: its data format, objective, settings and metrics. The generic layers below
(`train/`, `data/`, `models/`) know no method; a method uses another only where tests/test_layering.py declares it."""

"""Plain helpers for the tests, by concern (import the module you need: `from helpers.launch import launch`):

paths.py    where things are: the repo, its tokenizer, demo data, the CPU FSDP2 Accelerate config, the recipe scripts
launch.py   real multi-process runs: `accelerate launch` with a timeout that kills the whole process group, launches
            side by side (`concurrently`, `alongside`), a recipe launched with a config of values (`run_launched`)
recipes.py  a recipe's `main` in this process (a run, or the one `error:` line it refuses with), its config written
            as YAML, the values every recipe test starts from, the metrics a run logged
data.py     files the tests make: JSON lines, the tiny Llama's config

The session fixtures are elsewhere: the shared ones (tokenizer, tiny model, chat data) in tests/conftest.py, each
recipe's shared launches in tests/fixtures/<recipe>.py."""

"""`fsdp-recipes ls`: every recipe (`recipes/<name>.py`, with the first line of its docstring) and every config of it
(`recipes/configs/<name>/*.yaml`) as the catalog finds them (fsdp_recipes.tools.catalog): the model, the method (with
"+ images" for a vision-language model trained on rows with pictures), the Accelerate config it is meant for and the
estimated memory per GPU (fsdp_recipes.tools.estimator).
"""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.sizes import short_size
from fsdp_recipes.common.tables import format_table
from fsdp_recipes.tools import topology as topology_lib
from fsdp_recipes.tools.catalog import Catalog


def listing(catalog: Catalog, text: str | None = None) -> list[str]:
    """The lines `fsdp-recipes ls` prints; `text` keeps only recipes and configs whose names contain it."""
    devices = {}
    topologies_file = catalog.root / "accelerate_configs" / "topologies.yaml"
    if topologies_file.is_file():
        devices = {t.file: t.device for t in topology_lib.load_topologies(topologies_file)}
    lines, notes, with_images = [], [], []
    recipes = {recipe.name: recipe.summary for recipe in catalog.recipes()}
    config_folders = {path.name for path in (catalog.root / "recipes" / "configs").glob("*") if path.is_dir()}
    for name in sorted(recipes.keys() | config_folders):
        configs = [c for c in catalog.configs(name) if not text or text in c.key]
        if text and text not in name and not configs:
            continue
        lines += ["", f"{name}  recipes/{name}.py: {recipes.get(name, '(missing: these configs have no recipe)')}"]
        rows = [("config", "model", "method", "accelerate config", "processes", "memory per GPU (estimate)")]
        for config in configs:
            launch = config.launch
            named = launch and launch.accelerate_config
            accelerate_config = Path(launch.accelerate_config).name if named else "-"
            if launch and launch.overrides:
                accelerate_config += " + " + " ".join(f"--{key}" for key in launch.overrides)
            try:
                estimate = catalog.estimate(config)
            except ConfigError as error:
                notes.append(f"{config.key}: {error}")
                rows.append((config.key, str(config.model), config.method, accelerate_config, "?", "? (see below)"))
                continue
            layout, parallel = estimate.layout, estimate.layout.parallel
            on_cpu = devices.get(Path(launch.accelerate_config).name) == "cpu"
            processes = f"{parallel.world_size} CPU" if on_cpu else f"{parallel.world_size} x {config.gpu_memory}"
            split = [f"{layout.num_machines} nodes"] if layout.num_machines > 1 else []
            if parallel.tp > 1:  # the layout, not only the count: each layer split tp ways
                split.append(f"TP {parallel.tp} x FSDP {parallel.shard_size}")
            if parallel.ep > 1:  # a layer's routed experts split ep ways
                split.append(f"EP {parallel.ep}")
            if parallel.sp > 1:  # each row split sp ways by position
                split.append(f"SP {parallel.sp}")
            if split:
                processes += f" ({', '.join(split)})"
            method = config.method
            if estimate.vision and estimate.vision.pictures_per_row:  # a vision-language model on rows with pictures
                method += " + images"
                with_images.append(config.key)
            memory = short_size(estimate.total)
            if not on_cpu:
                memory += " fits" if estimate.fits else f" > {estimate.usable / 2**30:.1f} GiB usable!"
            if estimate.host_state:
                memory += f" + {short_size(sum(estimate.host_state.values()))} host RAM"
            rows.append((config.key, str(config.model), method, accelerate_config, processes, memory))
        if configs:
            lines += format_table(rows).splitlines()
    if not lines:
        return [f"no recipe or config name contains {text!r}"]
    lines += [
        "",
        "Estimates: parameters, gradients, AdamW state, activations of one micro-batch and FSDP buffers on the "
        "most loaded GPU, 10% kept free (docs/memory-estimator.md), with the frozen model copy a recipe keeps "
        "(a DPO reference).",
        "Copy one to adapt it: fsdp-recipes cp RECIPE_OR_CONFIG FOLDER",
    ]
    if with_images:
        lines[-1:-1] = [
            f"Fine-tuning on pictures ('+ images': a vision-language model, 1 picture per row counted; "
            f"docs/vision.md): {', '.join(with_images)}."
        ]
    if notes:
        lines += ["", "Not estimated:"] + [f"  {note}" for note in notes]
    return lines[1:]

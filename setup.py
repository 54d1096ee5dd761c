"""Packages the repository's recipes, configs and demo assets into the wheel, under fsdp_recipes/bundled/, so that
`fsdp-recipes ls` and `fsdp-recipes cp` work after a plain `pip install`, outside a clone. Everything else about the
package is in pyproject.toml. In a checkout (and an editable install) fsdp_recipes.tools.catalog reads the folders in
place; the copies below exist only in built wheels."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# Folder of the repository -> the files of it that go into the wheel, at the same relative path under bundled/.
BUNDLED = {
    "recipes": ["*.py", "configs/*/*"],
    "accelerate_configs": ["*"],
    "demo": ["*.json", "assets/**/*", "chat_templates/*", "tools/*", "environments/*"],
    "benchmarks": ["*.json"],  # model configs named by recipe configs (gpu_check_1b.yaml)
}


class BuildPyWithRecipes(build_py):
    def run(self):
        super().run()
        repo = Path(__file__).resolve().parent
        bundle = Path(self.build_lib) / "fsdp_recipes" / "bundled"
        shutil.rmtree(bundle, ignore_errors=True)  # a build folder left from an earlier build may hold deleted files
        for folder, patterns in BUNDLED.items():
            for pattern in patterns:
                for source in sorted((repo / folder).glob(pattern)):
                    if source.is_file() and "__pycache__" not in source.parts:
                        target = bundle / folder / source.relative_to(repo / folder)
                        self.mkpath(str(target.parent))
                        self.copy_file(str(source), str(target))


setup(cmdclass={"build_py": BuildPyWithRecipes})

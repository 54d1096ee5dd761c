from __future__ import annotations

from fsdp_recipes.common.outputs import output_dir_problem


def test_new_and_empty_folders_are_fine(tmp_path):
    assert output_dir_problem(tmp_path / "a" / "b", overwrite=False) is None
    assert output_dir_problem(tmp_path, overwrite=False) is None  # exists but empty


def test_non_empty_folder_needs_an_explicit_overwrite(tmp_path):
    (tmp_path / "model.safetensors").write_text("x")
    problem = output_dir_problem(tmp_path, overwrite=False)
    assert "not empty" in problem and "model.safetensors" in problem and "--overwrite_output_dir" in problem
    assert output_dir_problem(tmp_path, overwrite=True) is None


def test_a_file_or_an_unwritable_place_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "is a file" in output_dir_problem(tmp_path / "file", overwrite=True)
    assert "cannot be written" in output_dir_problem(tmp_path / "file" / "below", overwrite=True)
    assert "cannot be written" in output_dir_problem("/proc/fsdp-recipes-out", overwrite=False)

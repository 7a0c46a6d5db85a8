"""fasttrain.resume: which setting changes a resume reports (the CLI tests cover refusal and note)."""

import dataclasses

from fasttrain.config import make_config
from fasttrain.resume import changed_settings


def test_changed_settings_names_what_changes_the_numbers_only():
    saved = dataclasses.asdict(make_config(batch_size=8, seed=1, max_steps=100, log_every=10))
    now = make_config(batch_size=4, seed=1, max_steps=300, log_every=5, train_dir="elsewhere")
    assert changed_settings(saved, now) == ["batch_size 8 -> 4"]
    assert changed_settings(saved, make_config(batch_size=8, seed=2, max_steps=100)) == ["seed 1 -> 2"]
    assert changed_settings(None, now) == []  # a checkpoint without its config: nothing to compare
    assert changed_settings({"batch_size": 8}, now) == ["batch_size 8 -> 4"]  # keys it lacks are skipped

"""Building prompt sets prints one line per set built (no tfds bars, banners or log lines)."""

import logging

from absl import logging as absl_logging
from tensorflow_datasets.core.utils import tqdm_utils

from adaflash_jax.data import build_prompt_datasets


def test_one_line_per_set_built_and_nothing_on_reuse(tmp_path, capfd, caplog):
    verbosity, bars = absl_logging.get_verbosity(), tqdm_utils._active
    with caplog.at_level(logging.INFO):
        counts = build_prompt_datasets(tmp_path, ("math",), train_size=16, eval_size=4)
        out, err = capfd.readouterr()
        assert out == ""
        assert err.splitlines() == [err.strip()] and err.startswith("built the math prompt set (16 train, 4 eval)")
        assert not [r for r in caplog.records if r.levelno < logging.ERROR and "tensorflow_datasets" in r.pathname]
        assert build_prompt_datasets(tmp_path, ("math",), train_size=16, eval_size=4) == counts
        assert capfd.readouterr() == ("", "")
    assert (absl_logging.get_verbosity(), tqdm_utils._active) == (verbosity, bars)  # restored

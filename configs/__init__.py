"""Experiment configs: one file per experiment, each exposing `CONFIG` (a TrainConfig).

Load one with `adaflash_jax.training.config.load_config("tiny")` (or a file path);
override fields from the command line with `key=value`.
"""
